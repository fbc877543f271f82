"""What a scorer sees of one layer (`ScoreInput`), made by the loop (`loop.compression.score_input`) and read by
`Policy.score`; the fields that cost a gather or a copy are made on their first read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from evalkit.policies.query_moments import QueryMoments

# What a scorer may read that costs a gather or a copy: read on first use only (`ScoreInput.sources`).
_READ_ON_DEMAND = frozenset({"keys", "key_norms", "values", "stamps", "queries", "rope", "output_projection"})


@dataclass
class ScoreInput:
    """What a scorer may look at for one layer, per (sequence, KV head) slot; ragged heads padded. The fields
    that cost a gather or a copy are made when the scorer first reads them (from `sources`), as `SlotView`
    gathers its slots, so a scorer declares nothing about what it reads."""

    keys: torch.Tensor | None  # [B, H_kv, N, D] post-RoPE keys
    positions: torch.Tensor  # [B, H_kv, N] original positions, -1 = empty slot
    statistic: torch.Tensor  # [B, H_kv, N] what the attention function collected (`collect_*`; zeros if nothing)
    layer: int
    seed: int
    stat_end: torch.Tensor | None = None  # [B] tokens seen at the last forward that collected the statistic
    key_norms: torch.Tensor | None = None  # [B, H_kv, N] float64 L2 norms of the keys (kept by the storage)
    values: torch.Tensor | None = None  # [B, H_kv, N, D]
    caps: torch.Tensor | None = None  # [B] tokens per KV head this layer keeps (before any reallocation)
    queries: QueryMoments | None = None  # the prompt queries' moments (collected with `reads_query_moments`)
    rope: Callable | None = None  # positions [B, n] -> (cos, sin) [B, n, D] of the model's RoPE (with `queries`)
    output_projection: torch.Tensor | None = None  # [hidden, H_q * D] o_proj weight
    span: int | None = None  # a static decode step's bound on the positions (`loop.static_decode`); None: their max + 1
    # (name, of_values) -> [B, H_kv, N]: `of_values` of each token, kept per stored token (`SlotLayer.per_slot`)
    remembered: Callable[[str, Callable], torch.Tensor] | None = None
    # what the scorer keeps from one call to the next on this layer's cache, and dies with it (None: keep nothing);
    # a scorer must give what it would give without it (LagKV's ranks of unchanged partitions)
    memo: dict | None = None
    # [B, H_kv, N] int64 each slot's token's stamp (`SlotLayer.stamps`): a stamp seen again, in any later call on
    # this layer's cache, is the same token with the same K and V bits (None: no memo)
    stamps: torch.Tensor | None = None
    sources: dict[str, Callable[[], object]] = field(default_factory=dict, repr=False)  # field -> its maker

    def __getattribute__(self, name: str):
        value = object.__getattribute__(self, name)
        if value is None and name in _READ_ON_DEMAND:
            make = object.__getattribute__(self, "sources").pop(name, None)
            if make is not None:
                value = make()
                object.__setattr__(self, name, value)
        return value

    def of_each_value(self, name: str, of_values: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """[B, H_kv, N] `of_values(values [B, H_kv, n, D]) -> [B, H_kv, n]`, a quantity of each token's own value
        row (its KV head may matter), under `name`: where the loop keeps it per stored token, a decode step
        computes it for the new tokens only. `of_values` must give a token the same result whatever tokens
        it is computed with."""
        if self.remembered is None:
            return of_values(self.values)
        return self.remembered(name, of_values)
