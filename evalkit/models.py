"""Loading a causal LM and its tokenizer: the embedded default, a local folder, or a hub id."""

from __future__ import annotations

from pathlib import Path

import torch

from evalkit.assets import DEFAULT_MODEL, default_model_dir
from evalkit.errors import EvalkitError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def model_source(name: str) -> str:
    """The folder or hub id to load; refuses a path that does not exist."""
    if name == DEFAULT_MODEL:
        return str(default_model_dir())
    path = Path(name).expanduser()
    if path.exists():
        return str(path)
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise EvalkitError(f"model path {name!r} does not exist")
    return name


def load_model(name: str, dtype: str = "auto", device: str = "auto"):
    """(model in eval mode, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = model_source(name)
    target = resolve_device(device)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=resolve_dtype(dtype, target))
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise EvalkitError(f"cannot load model {name!r}: {reason}") from None
    return model.to(target).eval(), tokenizer


def max_positions(model) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)
