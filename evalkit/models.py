"""Loading a causal LM and its tokenizer: an embedded model (the default, or Gemma 3), a local folder, or a hub id;
and the facts about a model the loop reads (its window, its sliding-window layers, its RoPE)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from evalkit.assets import DEFAULT_MODEL, GEMMA3_MODEL, default_model_dir, gemma3_model_dir
from evalkit.errors import EvalkitError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_device(device: str) -> None:
    """Refuse a device torch does not know, or one this machine does not have, before any model loads."""
    if device == "auto":
        return
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError):
        raise EvalkitError(f"unknown device {device!r}; choose from auto, cpu, cuda, cuda:N") from None
    if target.type == "cuda":
        if not torch.cuda.is_available():
            raise EvalkitError(f"device {device!r} asked for, but CUDA is not available to torch {torch.__version__}")
        if target.index is not None and target.index >= torch.cuda.device_count():
            raise EvalkitError(f"device {device!r} asked for, but there are {torch.cuda.device_count()} CUDA devices")
    elif target.type == "mps":
        if not torch.backends.mps.is_available():
            raise EvalkitError(f"device {device!r} asked for, but MPS is not available")
    elif target.type != "cpu":
        raise EvalkitError(f"device {device!r} is not supported; choose from auto, cpu, cuda, cuda:N")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def model_source(name: str) -> str:
    """The folder or hub id to load (an embedded model's folder, made on first use); refuses a path that does not
    exist."""
    embedded = {DEFAULT_MODEL: default_model_dir, GEMMA3_MODEL: gemma3_model_dir}  # looked up now: tests wrap them
    if name in embedded:
        return str(embedded[name]())
    path = Path(name).expanduser()
    if path.exists():
        return str(path)
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise EvalkitError(f"model path {name!r} does not exist")
    return name


@functools.lru_cache(maxsize=None)
def model_config(name: str):
    """The model's transformers config, read without its weights: facts checked before any model loads."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_source(name))
    except (OSError, ValueError) as error:
        raise EvalkitError(f"cannot load model {name!r}: {_first_line(error)}") from None


def max_positions_of(name: str) -> int | None:
    """Positions the model can attend over (None when its config does not say)."""
    return getattr(model_config(name), "max_position_embeddings", None)


def sliding_windows(config) -> list[int | None]:
    """Per layer, the sliding window W the model attends with (a query at position q sees keys in (q - W, q]), or
    None for a global layer: `config.layer_types` names the "sliding_attention" layers (Gemma 3, Qwen2); without
    it every layer slides when `config.sliding_window` is set (Mistral), as transformers' own caches decide."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    return [window if kind == "sliding_attention" and window else None for kind in types]


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def load_model(name: str, dtype: str = "auto", device: str = "auto"):
    """(model in eval mode, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = model_source(name)
    target = resolve_device(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=resolve_dtype(dtype, target))
    except (OSError, ValueError) as error:
        raise EvalkitError(f"cannot load model {name!r}: {_first_line(error)}") from None
    return model.to(target).eval(), tokenizer


def max_positions(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def rope_of(model):
    """positions [B, n] -> (cos, sin) [B, n, head dim]: the model's rotary embedding at any positions."""
    rotary = getattr(model, "model", model).rotary_emb
    probe = torch.empty(0, dtype=model.dtype, device=model.device)
    return lambda positions: rotary(probe, positions)


def output_projection(model, layer: int) -> torch.Tensor:
    """[hidden, H_q * head dim]: the o_proj weight of attention layer `layer`."""
    return getattr(model, "model", model).layers[layer].self_attn.o_proj.weight
