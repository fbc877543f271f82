from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
import weakref
from dataclasses import dataclass, field

import torch

from evalkit.errors import EvalkitError
from evalkit.policies.base import PROMPT, POLICIES, Policy, ScoreInput, arg
from evalkit.policies.query_moments import rotate_half
from evalkit.policies.selection import Granularity

# On-the-fly head scores (kvpress's `duo_attention_on_the_fly`), on text evalkit ships: the first
# CALIBRATION_TOKENS tokens of the first CALIBRATION_TEXTS Paul Graham essays (by file name) that are that long.
CALIBRATION_TEXTS = 4
CALIBRATION_TOKENS = 1024
TEXTS_PER_FORWARD = 2  # calibration texts per forward (all their hidden states are held at once)
QUERY_LENGTH = 500  # kvpress's q_len: the mean query and key repeated at positions 0 .. 499
_SCORES: dict[str, torch.Tensor] = {}  # calibration key -> head scores [L, H_kv], for this process


@dataclass
class DuoAttention(Policy):
    """Retrieval heads keep every token; streaming heads keep `sink_tokens` sinks and the `recent_tokens` most
    recent (kvpress's DuoAttentionPress(on_the_fly_scoring=True): 128 + 256).

    Heads are ranked once per model by an on-the-fly score (`calibrated_head_scores`): the area under the cumulative
    attention of the last of 500 copies of the layer's mean query, over 500 copies of its mean key, RoPE
    applied at positions 0 .. 499; low = the mean query looks at its recent neighbours, and the lowest-scoring
    (layer, KV head) pairs of the whole model stream. How many stream follows the budget (`streaming_heads`),
    per sequence; `layer_caps` records the batch's plan, `score` marks each head's slots with its role
    (1 retrieval, 0 streaming) and `select` keeps, per head, everything or the window.

    `head_compression_ratio` (kvpress's parameter; 0, the default, follows the budget) fixes the count instead:
    round(L x H_kv x ratio) heads stream (Python's round, as kvpress), whatever the budget and the prompt's
    length, in every sequence the budget compresses (budget below the prompt; a prompt no longer than sinks +
    recent is still left whole). The budget then only switches compression on: the mean kept per head is
    what the heads keep, above or below it.
    """

    applies_model_rope = True  # the calibration rotates its mean query and key at positions 0 .. 499
    granularity: Granularity = Granularity.HEAD
    sink_tokens: int = arg(128, 0, PROMPT)
    recent_tokens: int = arg(256, 1, PROMPT)
    head_compression_ratio: float = arg(0.0, 0.0, 1.0)  # > 0: round(L x H_kv x ratio) heads stream, any budget
    description = "retrieval heads keep everything, streaming heads 128 sinks + 256 recent; heads ranked on the fly"
    scorer = "head role from an on-the-fly attention-span score"
    paper = "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads (arXiv:2410.10819)"
    kvpress = "DuoAttentionPress(on_the_fly_scoring=True)"
    differs = (f"heads scored on the first {CALIBRATION_TOKENS} tokens of {CALIBRATION_TEXTS} Paul Graham essays "
               "shipped with evalkit (kvpress: 50 whole BookSum chapters from the hub); the budget sets how many heads "
               "stream, per sequence: the fewest that keep its mean (kvpress: head_compression_ratio, a fixed share; "
               "policy-arg head_compression_ratio does that: round(L x H_kv x ratio) heads, ties in the head scores "
               "to the lower layer and head where kvpress's numpy argsort leaves them unspecified); streaming heads "
               "stay a sliding window while decoding (kvpress compresses the prompt only)")
    arg_aliases = {"sink_size": "sink_tokens", "recent_size": "recent_tokens"}
    not_static = "DuoAttention keeps each head's role's window by its own rule, not `keep_mask`"
    cannot_run_at = {
        Granularity.TOKEN: "DuoAttention gives each KV head its own role; one token set for all heads would undo it",
        Granularity.PAGE: "DuoAttention gives each KV head its own role; pages shared by all heads would undo it",
    }
    head_scores: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)  # [L, H_kv]
    streaming: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)  # [B, L, H_kv]
    prepared_for: weakref.ref | None = field(default=None, init=False, repr=False, compare=False)  # the model

    def check(self) -> None:
        super().check()
        if self.recent_fraction or self.observation_window:
            raise EvalkitError(f"{self.name}: policy-args recent_fraction and observation_window do not apply: "
                               "streaming heads keep sink_size + recent_size tokens")

    def check_fits(self, length: int) -> None:
        window = self.sink_tokens + self.recent_tokens
        if length <= window:
            raise EvalkitError(f"{self.name}: its streaming heads keep {self.sink_tokens} sinks + {self.recent_tokens} "
                               f"recent tokens, a whole --length {length} prompt: nothing to evict; raise --length "
                               f"above {window} or lower policy-arg sink_size / recent_size")
        super().check_fits(length)

    def prepare(self, model, tokenizer=None) -> None:
        if self.prepared_for is None or self.prepared_for() is not model:  # a run's batches share its model
            self.head_scores = calibrated_head_scores(model, tokenizer)
            self.prepared_for = weakref.ref(model)

    def streaming_heads(self, tokens: torch.Tensor, lengths: torch.Tensor, heads: int) -> torch.Tensor:
        """[B] how many of the model's `heads` (layers x KV heads) stream: the fewest that bring the mean kept per
        head down to `tokens` [B], from `lengths` [B]; all of them when even that is more; none when a prompt is
        no longer than sinks + recent (kvpress compresses nothing then). kvpress's own accounting: streaming a
        share s of the heads removes s x (1 - (sinks + recent) / n) of the cache. With `head_compression_ratio`,
        round(heads x ratio) whatever `tokens` (kvpress's n_pruned), still none for such a short prompt."""
        dropped = (lengths - self.sink_tokens - self.recent_tokens).clamp(min=0)  # by one streaming head
        if self.head_compression_ratio > 0:
            return torch.where(dropped > 0, round(heads * self.head_compression_ratio), 0)
        excess = (lengths - tokens).clamp(min=0) * heads  # to drop, over all heads
        count = torch.where(dropped > 0, (excess + dropped - 1) // dropped.clamp(min=1), 0)
        return count.clamp(max=heads)

    def layer_caps(self, tokens: torch.Tensor, lengths: torch.Tensor, num_layers: int) -> torch.Tensor:
        """Records the batch's streaming heads; caps [L, B]: sinks + recent in a layer with a streaming head (the
        cap its streaming heads are evicted to), the whole prompt elsewhere. Retrieval heads keep more than
        their layer's cap: `select` never evicts them."""
        if self.head_scores is None:
            raise RuntimeError(f"{self.name}: prepare(model) first: its heads are ranked on the model")
        L, H = self.head_scores.shape
        if L != num_layers:
            raise RuntimeError(f"{self.name}: head scores of {L} layers, the model has {num_layers}")
        order = torch.argsort(self.head_scores.flatten(), stable=True)  # lowest first; ties: lower layer, head
        rank = torch.empty_like(order).scatter_(0, order, torch.arange(L * H)).view(L, H)
        count = self.streaming_heads(tokens, lengths, L * H)  # [B]
        self.streaming = rank[None] < count[:, None, None]  # [B, L, H]
        window = torch.minimum(lengths, torch.tensor(self.sink_tokens + self.recent_tokens))
        return torch.where(self.streaming.any(-1).T, window, lengths)

    def head_capacity(self, caps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """A sequence with a retrieval head holds its whole prompt in that head."""
        retrieval = ~self.streaming.flatten(1).all(1)  # [B]
        return torch.where(retrieval, lengths, caps.amax(0))

    def score(self, inp: ScoreInput) -> torch.Tensor:
        """1 on every slot of a retrieval head, 0 on a streaming head's: the role `select` reads."""
        retrieval = ~self.streaming[:, inp.layer].to(inp.positions.device)  # [B, H_kv]
        return retrieval[..., None].float().expand(inp.positions.shape)

    def select(self, scores, positions, seen, caps, block_size, recent, span=None) -> torch.Tensor:
        """Every slot of a retrieval head; a streaming head's sinks and its `caps - sink_tokens` most recent
        positions (recent_tokens; while decoding plus the question appended after compression, as every cap).
        At head_page, a streaming head's pages lying wholly within those, and its newest page."""
        retrieval = (scores > 0).any(-1, keepdim=True)  # [rows, H_kv, 1]
        start = (seen - (caps - self.sink_tokens).clamp(min=0))[:, None, None]  # first recent position
        if self.granularity == Granularity.HEAD_PAGE:
            page, S = positions.div(block_size, rounding_mode="floor"), block_size
            window = ((page + 1) * S <= self.sink_tokens) | (page * S >= start) | \
                     (page == (seen[:, None, None] - 1).div(S, rounding_mode="floor"))
        else:
            window = (positions < self.sink_tokens) | (positions >= start)
        return (positions >= 0) & (retrieval | window)


def calibrated_head_scores(model, tokenizer=None) -> torch.Tensor:
    """[L, H_kv] float32: the model's heads scored on the fly, cached per model (weights and calibration text)
    in this process and, for a model loaded from a folder or hub id, under `evalkit.assets.cache_root()`."""
    ids = calibration_ids(model, tokenizer)
    key = _calibration_key(model, ids)
    if key in _SCORES:
        return _SCORES[key]
    path = _cache_path(model, key)
    if path is not None and path.exists():
        scores = torch.tensor(json.loads(path.read_text())["scores"])
    else:
        scores = score_heads(model, ids)
        if path is not None:
            _write(path, {"model": model.config.name_or_path, "texts": len(ids), "tokens": CALIBRATION_TOKENS,
                          "q_len": QUERY_LENGTH, "scores": scores.tolist()})
    _SCORES[key] = scores
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


@functools.lru_cache(maxsize=4)
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


POLICIES.register("duo_attention", lambda: DuoAttention(name="duo_attention"))
