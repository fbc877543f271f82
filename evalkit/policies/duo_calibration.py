"""DuoAttention's head scores, calibrated on the fly (kvpress's `duo_attention_on_the_fly`) on text evalkit
ships, and cached per model: in this process, and on disk for a model loaded from a folder or hub id."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile

import torch

from evalkit.errors import EvalkitError
from evalkit.policies.query_moments import rotate_half

# On-the-fly head scores (kvpress's `duo_attention_on_the_fly`), on text evalkit ships: the first
# CALIBRATION_TOKENS tokens of the first CALIBRATION_TEXTS Paul Graham essays (by file name) that are that long.
CALIBRATION_TEXTS = 4
CALIBRATION_TOKENS = 1024
TEXTS_PER_FORWARD = 2  # calibration texts per forward (all their hidden states are held at once)
QUERY_LENGTH = 500  # kvpress's q_len: the mean query and key repeated at positions 0 .. 499
_ON_MODEL = "_evalkit_duo_head_scores"  # the model's own cache: calibration key -> head scores [L, H_kv]


def calibrated_head_scores(model, tokenizer=None) -> torch.Tensor:
    """[L, H_kv] float32: the model's heads scored on the fly, kept on the model object (by weights and
    calibration text: a run's cells share them) and, for a model loaded from a folder or hub id, under
    `evalkit.assets.cache_root()` (a later process reads them back)."""
    ids = calibration_ids(model, tokenizer)
    key = _calibration_key(model, ids)
    kept = model.__dict__.setdefault(_ON_MODEL, {})
    if key in kept:
        return kept[key]
    path = _cache_path(model, key)
    if path is not None and path.exists():
        scores = torch.tensor(json.loads(path.read_text())["scores"])
    else:
        scores = score_heads(model, ids)
        if path is not None:
            _write(path, {"model": model.config.name_or_path, "texts": len(ids), "tokens": CALIBRATION_TOKENS,
                          "q_len": QUERY_LENGTH, "scores": scores.tolist()})
    kept[key] = scores
    return scores


def calibration_ids(model, tokenizer=None) -> list[list[int]]:
    """The token ids of the calibration texts: the model's tokenizer (given, or its folder's), or for a model
    built from a config with no folder (a test's random model) each text's UTF-8 bytes modulo the vocabulary."""
    from evalkit.assets import essays_dir

    length = min(CALIBRATION_TOKENS, getattr(model.config, "max_position_embeddings", None) or CALIBRATION_TOKENS)
    if tokenizer is None and model.config.name_or_path:
        tokenizer = _tokenizer(model.config.name_or_path)
    chosen = []
    for path in sorted(essays_dir().glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        ids = tokenizer(text)["input_ids"] if tokenizer is not None else \
            [b % model.config.vocab_size for b in text.encode("utf-8")]
        if len(ids) >= length:
            chosen.append(ids[:length])
        if len(chosen) == CALIBRATION_TEXTS:
            break
    if not chosen:
        raise EvalkitError(f"duo_attention: no calibration text of {length} tokens in {essays_dir()}")
    return chosen


def score_heads(model, texts: list[list[int]]) -> torch.Tensor:
    """[L, H_kv] float32: the mean over `texts` (equal lengths) of `text_scores`."""
    per_text = [text_scores(model, texts[i:i + TEXTS_PER_FORWARD]) for i in range(0, len(texts), TEXTS_PER_FORWARD)]
    return torch.cat(per_text).mean(0)


def _tokenizer(name: str):
    """The tokenizer of a model's folder or hub id (kvpress loads it from the model's name_or_path too)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise EvalkitError(f"duo_attention calibrates on text: cannot load the tokenizer of {name!r}: "
                           f"{str(error).splitlines()[0]}") from None


@torch.inference_mode()  # no autograd graph: it would hold every layer's activations
def text_scores(model, texts: list[list[int]]) -> torch.Tensor:
    """[n, L, H_kv] float32 per text: each layer's mean query and key before RoPE (over the text's tokens),
    each repeated QUERY_LENGTH times with RoPE at positions 0 .. QUERY_LENGTH - 1; the last query's softmax
    over those keys, its cumulative sum averaged over the positions; the mean over each KV head's query heads."""
    base = _decoder(model)
    config = model.config
    H_q, H_kv = config.num_attention_heads, config.num_key_value_heads
    G = H_q // H_kv
    positions = torch.arange(QUERY_LENGTH, device=model.device)[None]
    with _plain_attention(model):
        hidden = model(torch.tensor(texts, device=model.device), output_hidden_states=True).hidden_states
    scores = []
    for layer_idx, block in enumerate(base.layers):
        attention = block.self_attn
        D = attention.head_dim
        x = block.input_layernorm(hidden[layer_idx])  # hidden_states[l] is the input of layer l
        q = attention.q_proj(x).view(*x.shape[:2], H_q, D)
        k = attention.k_proj(x).view(*x.shape[:2], H_kv, D)
        if getattr(attention, "q_norm", None) is not None:  # Qwen3, Gemma3
            q, k = attention.q_norm(q), attention.k_norm(k)
        cos, sin = (t.float() for t in base.rotary_emb(x, positions))  # [1, QUERY_LENGTH, D]
        q_last = _rotate(q.mean(1).float(), cos[:, -1:], sin[:, -1:])  # [n, H_q, D] at position QUERY_LENGTH - 1
        keys = _rotate(k.mean(1).float()[:, :, None], cos[:, None], sin[:, None])  # [n, H_kv, QUERY_LENGTH, D]
        logits = torch.einsum("nhd,nhtd->nht", q_last, keys.repeat_interleave(G, dim=1)) / D ** 0.5
        area = logits.softmax(-1).cumsum(-1).mean(-1)  # [n, H_q]
        scores.append(area.view(len(texts), H_kv, G).mean(-1).cpu())
    return torch.stack(scores, 1)


def _decoder(model):
    """The model's decoder, with what the calibration reads (Llama, Mistral, Qwen2/3 have it all)."""
    base = getattr(model, "model", model)
    block = next(iter(getattr(base, "layers", [])), None)
    missing = [name for name, owner in (("rotary_emb", base), ("layers", base), ("input_layernorm", block),
                                        ("self_attn", block)) if not hasattr(owner, name)]
    attention = getattr(block, "self_attn", None)
    missing += [name for name in ("q_proj", "k_proj", "head_dim") if not hasattr(attention, name)]
    if missing:
        raise EvalkitError(f"duo_attention scores heads from Llama-style layers; {type(model).__name__} has no "
                           f"{', '.join(missing)}")
    return base


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin  # HF's apply_rotary_pos_emb


@contextlib.contextmanager
def _plain_attention(model):
    """The model's own sdpa attention for the calibration forward (it may run inside `evalkit_attention`)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def _calibration_key(model, texts: list[list[int]]) -> str:
    """A digest of the model's config, a strided sample of every weight, the calibration ids and settings."""
    digest = hashlib.sha256(config_json(model).encode())
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].double().cpu()
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(sample.numpy().tobytes())
    digest.update(json.dumps([texts, QUERY_LENGTH]).encode())
    return digest.hexdigest()[:24]


def config_json(model) -> str:
    config = model.config.to_dict()
    config.pop("_name_or_path", None)
    return json.dumps(config, sort_keys=True, default=str)


def _cache_path(model, key: str):
    """Where a model loaded from a folder or hub id keeps its head scores; None for a model built from a config."""
    return _cache_dir() / f"{key}.json" if model.config.name_or_path else None


def _cache_dir():
    from evalkit.assets import cache_root

    return cache_root() / "duo_attention"


def _write(path, record: dict) -> None:
    """Best effort (a cache): written whole or not at all."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as out:
            json.dump(record, out)
        os.replace(out.name, path)
    except OSError:
        with contextlib.suppress(OSError, NameError):
            os.unlink(out.name)
