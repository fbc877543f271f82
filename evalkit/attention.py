"""The attention function evalkit installs into a transformers model.

Each layer's call appends the new K/V to that layer's storage, reads back every
(sequence, KV head)'s kept slots, attends over them with masks built from the
slots' original positions (holes and the future masked), and hands the
statistics the policy asked for back to the storage. RoPE is applied before
caching, so slot order does not matter.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from evalkit.attention_ops import attention_reference, decode_attention, prompt_attention, statistic_queries, visible
from evalkit.cache import KVCache
from evalkit.kernels import use_triton
from evalkit.policies.query_moments import QueryMoments
from evalkit.reconstruction_ops import reconstruction_attention

ATTENTION_NAME = "evalkit"


@dataclass
class ForwardPlan:
    """Per-forward metadata, built once by the generation loop and read by every layer."""

    cache: KVCache
    positions: torch.Tensor  # [B, T] original positions of the new tokens
    valid: torch.Tensor  # [B, T] False = padding: not stored, not counted in statistics
    collect: str | None = None  # statistic the policy needs: None, "attention" or "window"
    observation_window: int = 0  # queries behind a "window" statistic
    # Decode-time restriction of what a query reads (Quest): (layer, query [B, H_q, D], keys, positions) -> mask.
    attend_filter: Callable | None = None
    attended: torch.Tensor | None = None  # [B] slots read, summed over layers (when filtered)
    available: torch.Tensor | None = None  # [B] live slots, summed over layers (when filtered)
    kernels: str = "auto"  # see evalkit.kernels.use_triton
    record: "PromptRecord | None" = None  # a shared prefill: keep each layer's K/V and statistics, no storage
    # Query moments to add this forward's queries to, with the RoPE (cos, sin) [B, T, D] of its positions.
    moments: "tuple[list[QueryMoments], torch.Tensor, torch.Tensor] | None" = None
    reconstruction: "ReconstructionChunk | None" = None  # a reconstruction forward (KVzip): score, store nothing
    decode_slots: list | None = None  # a static decode step (`loop.static_decode`): each layer's `DecodeSlots`


@dataclass
class ReconstructionChunk:
    """What a reconstruction forward (`loop.reconstruction`) scores: each sequence's chunk of held positions."""

    spans: torch.Tensor  # [B, 2] the chunk's first and end positions ((0, 0): none)
    sinks: int  # the first positions, in every reconstruction query's softmax


@dataclass
class PromptRecord:
    """What a prompt's forward leaves behind when it is shared by many branches (`shared_prefill.SharedPrefill`):
    per layer the K/V the storage would have appended and every statistic in `statistics`."""

    statistics: list[tuple[str, int]]  # (collect, observation window) pairs, e.g. ("attention", 0), ("window", 32)
    layers: dict[int, tuple[torch.Tensor, torch.Tensor, dict]] = field(default_factory=dict)


@dataclass
class JointForwardPlan:
    """One forward shared by several branches decoding together (`loop.joint_decode`): rows `parts[i][0]`
    belong to branch i and attend over its own cache with its own `ForwardPlan`, exactly as that branch's
    own forward would."""

    parts: list[tuple[slice, ForwardPlan]]
    seconds: list[float]  # per branch: time spent in its own attention (and statistics), all layers

    @classmethod
    def of(cls, plans: list[ForwardPlan], rows: list[int]) -> "JointForwardPlan":
        ends = itertools.accumulate(rows)
        return cls([(slice(end - n, end), plan) for end, n, plan in zip(ends, rows, plans)], [0.0] * len(plans))


def _evalkit_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       evalkit_plan: ForwardPlan | None = None, sliding_window=None, **kwargs):
    if evalkit_plan is None:
        raise RuntimeError("the evalkit attention runs only inside evalkit's generation loop")
    plan = evalkit_plan
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if isinstance(plan, JointForwardPlan):
        return _joint_attention(module, query, key, value, plan, scaling, sliding_window), None
    if plan.moments is not None:
        moments, cos, sin = plan.moments
        for each in moments:
            each.add(module.layer_idx, query, plan.positions, plan.valid, cos, sin)
    if plan.record is not None:
        return _recorded_prompt_attention(module.layer_idx, query, key, value, plan, scaling, sliding_window), None
    layer = plan.cache.layers[module.layer_idx]
    if plan.reconstruction is not None:
        return _reconstruction_attention(layer, query, key, value, plan, scaling, sliding_window), None
    if plan.decode_slots is not None:
        return _static_decode_attention(layer, plan.decode_slots[module.layer_idx], query, key, value, plan, scaling,
                                        sliding_window), None
    if query.shape[2] > 1 and not bool(layer.live_counts().any()):
        return _prompt_attention(layer, query, key, value, plan, scaling, sliding_window), None
    if plan.attend_filter is None and use_triton(plan.kernels, query):
        return _kernel_attention(layer, query, key, value, plan, scaling, sliding_window), None
    layer.append(key, value, plan.positions, plan.valid)
    view = layer.read(trim=True)
    # One new token over a packed cache sees every slot: each holds an older token (no window to fall out of).
    k_pos = None if view.all_live and query.shape[2] == 1 and not sliding_window else view.pos
    if plan.attend_filter is not None:
        read = plan.attend_filter(module.layer_idx, query[:, :, -1], view.k, view.pos)
        k_pos = view.pos.masked_fill(~read, -1)
        plan.attended += read.sum((1, 2)).cpu()
        plan.available += (view.pos >= 0).sum((1, 2)).cpu()
    out, stats = attention_reference(query, plan.positions, plan.valid, view.k, view.v, k_pos,
                                     scaling, sliding_window, plan.collect, plan.observation_window)
    if plan.collect is not None:
        store_statistic(layer, view.index, plan.collect, stats, plan.valid)
    return out, None


def _joint_attention(module, query, key, value, joint: JointForwardPlan, scaling, sliding_window):
    """Each branch's rows through its own attention; outputs [B, T, H_q, D] back in row order.

    Outside the joint forward's torch function mode (`joint_decode.BranchwiseLinears`): a branch's attention
    is its own (no row of it meets another branch's in a linear), and the mode's Python call on each of its
    dozens of small operators a layer was about 0.15 of a 19-branch decode step (docs/benchmarks-history.md)."""
    outs = []
    with torch._C.DisableTorchFunction():
        for branch, (rows, plan) in enumerate(joint.parts):
            begun = time.perf_counter()
            outs.append(_evalkit_attention(module, query[rows], key[rows], value[rows], None, scaling,
                                           evalkit_plan=plan, sliding_window=sliding_window)[0])
            joint.seconds[branch] += time.perf_counter() - begun
    return torch.cat(outs)


def _prompt_attention(layer, query, key, value, plan: ForwardPlan, scaling, sliding_window):
    """A layer that holds nothing yet: the prompt attends to itself from the forward's own K/V (on every
    device: SDPA, then the statistic in a second pass), and is then stored."""
    wanted = [statistic_queries(plan.collect, plan.observation_window, plan.positions, plan.valid)] \
        if plan.collect else []
    out, stats = prompt_attention(query, plan.positions, plan.valid, key, value, scaling, sliding_window, wanted,
                                  plan.kernels)
    slots = layer.append(key, value, plan.positions, plan.valid)
    if plan.collect is not None:
        store_statistic(layer, slots, plan.collect, stats[0], plan.valid)
    return out


def _reconstruction_attention(layer, query, key, value, plan: ForwardPlan, scaling, sliding_window):
    """KVzip's reconstruction tokens attend over the held slots and each other, never stored; the chunk's slots
    get their reconstruction scores (`reconstruction_ops.reconstruction_attention`)."""
    view = layer.read(trim=True)
    out, stats = reconstruction_attention(query, plan.positions, plan.valid, key, value, view.k, view.v, view.pos,
                                          view.stats, plan.reconstruction.spans, scaling=scaling,
                                          sinks=plan.reconstruction.sinks, sliding_window=sliding_window)
    layer.set_stats(view.index, stats, rows=plan.valid.any(1))
    return out


def _recorded_prompt_attention(layer_idx, query, key, value, plan: ForwardPlan, scaling, sliding_window):
    """A shared prefill: the same computation as `_prompt_attention`, every statistic asked for, kept in the record."""
    record = plan.record
    wanted = [statistic_queries(collect, observation_window, plan.positions, plan.valid)
              for collect, observation_window in record.statistics]
    out, stats = prompt_attention(query, plan.positions, plan.valid, key, value, scaling, sliding_window, wanted,
                                  plan.kernels)
    record.layers[layer_idx] = (key, value, dict(zip(record.statistics, stats)))
    return out


def store_statistic(layer, slots, collect: str, stats, valid=None) -> None:
    """Hand a statistic over `slots` [B, H_kv, N] to the storage: H2O's sums accumulate, a window replaces in the
    batch rows the forward fed (`valid` [B, T]; None: one query per sequence, every row, nothing read back)."""
    if collect == "attention":
        layer.add_stats(slots, stats)
    elif valid is None:
        layer.stats.index_copy_(0, slots.reshape(-1), stats.reshape(-1).float())
    else:
        layer.set_stats(slots, stats, rows=valid.any(1))


def _kernel_attention(layer, query, key, value, plan: ForwardPlan, scaling, sliding_window):
    """The Triton path: attention straight from the pages, statistics in a second O(n) pass."""
    layer.append(key, value, plan.positions, plan.valid)
    table, page_size, head_tokens = layer.page_table()
    counted = statistic_queries(plan.collect, plan.observation_window, plan.positions, plan.valid) \
        if plan.collect else None
    out, stats = _kernels(layer, query, plan, scaling, sliding_window, (table, head_tokens, page_size), counted)
    if plan.collect:
        store_statistic(layer, layer.slot_index(), plan.collect, stats, plan.valid)
    return out


def _kernels(layer, query, plan: ForwardPlan, scaling, sliding_window, pages: tuple, counted):
    """The Triton kernels over `pages` (page table, tokens per head, page size): the attention output, and the
    statistic over the `counted` queries [B, T] (None: no statistic)."""
    # Triton is optional (CPU installs lack it): the kernels' modules import it, so they load only when one runs.
    from evalkit.kernels.attention_stats import attention_stats
    from evalkit.kernels.paged_attention import paged_attention

    table, head_tokens, page_size = pages
    out, lse = paged_attention(query, plan.positions, layer.k, layer.v, layer.pos, table, head_tokens, page_size,
                               scaling, sliding_window or 0)
    if counted is None:
        return out, None
    return out, attention_stats(query, plan.positions, counted, layer.k, layer.pos, table, head_tokens, page_size,
                                scaling, lse, sliding_window or 0)


def _static_decode_attention(layer, slots, query, key, value, plan: ForwardPlan, scaling, sliding_window):
    """One new token per sequence over a frozen layer's slots (`loop.static_decode`): the same attention and
    statistic as the eager path, with every shape fixed by `slots` and nothing read back to the host."""
    layer.append_static(slots, key, value, plan.positions)
    if use_triton(plan.kernels, query):
        out, stats = _kernels(layer, query, plan, scaling, sliding_window,
                              (slots.table, slots.head_tokens, slots.page_size), plan.valid if plan.collect else None)
        if plan.collect:
            store_statistic(layer, slots.index, plan.collect, stats)
        return out
    B, H_q, _, D = query.shape
    H_kv = slots.index.shape[1]
    k_pos = layer.gather(layer.pos, slots.index)  # [B, H_kv, N]
    k, v = layer.gather_kv(layer.k, slots.index), layer.gather_kv(layer.v, slots.index)
    allowed = visible(plan.positions[:, None, :], k_pos, sliding_window)[:, :, None, :]  # [B, H_kv, 1, N]
    if not plan.collect:
        return decode_attention(query, k, v, scaling, allowed)
    # The statistic's probabilities as `attention_reference` computes them (a group's query heads as rows); the
    # output from them for "attention", from SDPA beside them for "window", as there.
    scores = torch.matmul(query.view(B, H_kv, H_q // H_kv, D), k.transpose(-1, -2)).mul_(scaling)
    probs = torch.softmax(scores.masked_fill_(~allowed, float("-inf")), dim=-1, dtype=torch.float32).to(query.dtype)
    store_statistic(layer, slots.index, plan.collect, probs.float().mean(dim=2))
    if plan.collect == "window":
        return decode_attention(query, k, v, scaling, allowed)
    return torch.matmul(probs, v).view(B, 1, H_q, D)


def _no_mask(*args, **kwargs):
    """Masks come from the slots' positions inside the attention function, not from transformers."""
    return None


@contextlib.contextmanager
def evalkit_attention(model):
    """Route the model's attention through evalkit for the duration of the block."""
    AttentionInterface.register(ATTENTION_NAME, _evalkit_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
