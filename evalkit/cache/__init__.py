"""KV storage: the paged per-head cache and the dense baseline, for every layer of a model."""

from __future__ import annotations

import math

import torch

from evalkit.cache.pool import PagePool, PoolExhausted
from evalkit.cache.layouts import DenseLayer, PagedLayer
from evalkit.cache.storage import SlotLayer, SlotView

LAYOUTS = ("paged", "dense")


def model_kv_shape(config) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a transformers config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim


class KVCache:
    """One storage layer per model layer. Storage only: it never decides what to keep."""

    def __init__(self, layers: list[SlotLayer], layout: str):
        self.layers = layers
        self.layout = layout

    @classmethod
    def create(cls, layout: str, config, batch: int, capacity: int, page_size: int = 16,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               pool_pages: int | None = None) -> "KVCache":
        """`capacity`: most tokens one head must hold at once; sizes each layer's pool or buffer."""
        num_layers, kv_heads, head_dim = model_kv_shape(config)
        if layout == "paged":
            pages = pool_pages or batch * kv_heads * math.ceil(capacity / page_size)
            layers = [PagedLayer(batch, kv_heads, head_dim, pages, page_size, dtype, device)
                      for _ in range(num_layers)]
        elif layout == "dense":
            layers = [DenseLayer(batch, kv_heads, head_dim, capacity, dtype, device) for _ in range(num_layers)]
        else:
            raise ValueError(f"unknown layout {layout!r}")
        return cls(layers, layout)

    def kept_tokens(self) -> torch.Tensor:
        """[L, B, H_kv] tokens held per layer and head."""
        return torch.stack([layer.live_counts() for layer in self.layers])

    def bytes_held(self) -> torch.Tensor:
        """[B] KV bytes allocated per sequence, all layers."""
        return sum(layer.bytes_held() for layer in self.layers)

    def bytes_ideal(self) -> torch.Tensor:
        """[B] KV bytes of the tokens really kept, all layers."""
        return sum(layer.bytes_ideal() for layer in self.layers)

    def storage_bytes(self) -> int:
        """Bytes the storage itself occupies (every slot's K, V, position and statistic, all layers)."""
        return sum(t.nbytes for layer in self.layers for t in (layer.k, layer.v, layer.pos, layer.stats))

    def compact(self) -> None:
        for layer in self.layers:
            layer.compact()


__all__ = ["KVCache", "LAYOUTS", "PagePool", "PoolExhausted", "PagedLayer", "DenseLayer", "SlotLayer",
           "SlotView", "model_kv_shape"]
