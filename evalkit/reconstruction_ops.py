"""KVzip's reconstruction forward as torch functions of tensors: its attention and its score, in one pass.

A reconstruction query reads the layer's held slots (the context) and the reconstruction tokens before it,
which are never stored. Both attentions, and the score's softmax over a subset of them, are partial
attentions over disjoint key sets, each with its rows' log-sum-exp (`flash_ops.attention_with_lse`),
combined exactly (`merge_attention`); the score then needs one matmul over the held keys and a max, never a
probability matrix (`most_probability`).
"""

from __future__ import annotations

import functools

import torch

from evalkit.flash_ops import attention_with_lse

# A block of `most_probability`'s log-probabilities: 4 MiB of float32; timed on 2 cores against 2^19 to 2^23
# (SmolLM2 at 2k: 0.043 s a layer against 0.051 to 0.049), and rows times keys against keys times rows (0.061).
_MAX_ELEMENTS_PER_BLOCK = 1 << 20


def merge_attention(parts):
    """One attention from partial ones over disjoint key sets, [(out [B, H_q, T, D], lse [B, H_q, T]), ...]
    -> (out, lse); every row sees some key in some part."""
    lse = functools.reduce(torch.logaddexp, [part_lse for _, part_lse in parts])
    out = sum(part_out * (part_lse - lse).exp()[..., None].to(part_out.dtype) for part_out, part_lse in parts)
    return out, lse


def most_probability(q, k, lse, scaling) -> torch.Tensor:
    """[B, H_kv, N] float32: per key, the largest probability exp(q.k * scaling - lse) any query of any query
    head of its KV head gives it. q: [B, H_q, T, D], k: [B, H_kv, N, D], lse: [B, H_q, T] (+inf: a row that
    counts for nothing). One matmul per block of rows, the row's -lse riding along as one more dimension."""
    B, H_q, T, D = q.shape
    H_kv, N = k.shape[1], k.shape[2]
    work = torch.promote_types(q.dtype, torch.float32)
    keys = torch.cat([k.to(work), torch.ones(B, H_kv, N, 1, dtype=work, device=k.device)], -1)  # [key, 1]
    keys = keys.transpose(-1, -2).contiguous()  # [B, H_kv, D + 1, N]
    rows = torch.cat([q.to(work) * scaling, -lse[..., None].to(work)], -1).view(B, H_kv, H_q // H_kv * T, D + 1)
    best = torch.full((B, H_kv, N), float("-inf"), dtype=work, device=k.device)
    block = max(1, _MAX_ELEMENTS_PER_BLOCK // max(1, B * H_kv * N))
    for start in range(0, rows.shape[2], block):
        logs = torch.matmul(rows[:, :, start:start + block], keys)  # [B, H_kv, rows, N]: log p
        best = torch.maximum(best, logs.amax(-2))
    return best.exp().float()


def reconstruction_attention(q, q_pos, q_valid, new_k, new_v, k, v, positions, stats, chunk, sinks, scaling,
                             sliding_window=None):
    """A reconstruction forward in one layer: the queries' attention, and KVzip's score of the chunk's slots.

    q: [B, H_q, T, D] the reconstruction tokens' queries at q_pos [B, T] (q_valid False: padding), new_k/new_v
    [B, H_kv, T, D] their keys and values (never stored); k, v [B, H_kv, N, D], positions [B, H_kv, N] (-1
    empty): the layer's held slots, all before the queries; stats [B, H_kv, N] their statistic; chunk [B, 2]
    the chunk's first and end positions.
    Returns out [B, T, H_q, D], what the layer's attention gives (held slots and the new tokens up to the
    query, within the window), and the statistic with each chunk slot's score: the most probability any
    valid query of any query head of its KV head gives it in a softmax over the held sinks before the chunk,
    the chunk and the new tokens up to the query (no window: kvpress's KVzipPress).
    """
    start, end = chunk[:, 0, None, None], chunk[:, 1, None, None]  # [B, 1, 1]
    held = positions >= 0
    scored = held & (((positions >= start) & (positions < end)) | (positions < start.clamp(max=sinks)))
    # The held slots in two parts, each gathered apart: the score's softmax reads the first alone.
    scored_slots, other_slots = _gathered(scored, k, v, positions), _gathered(held & ~scored, k, v, positions)
    # The new tokens among themselves: causal by position, padding unseen; a padding query sees them all (its
    # row counts for nothing, but must not be blind: NaN would reach the next layer's keys). Unpadded and with
    # no window, causal by index is causal by position: the kernel's own causal mask, none built.
    plain = bool(q_valid.all()) and not sliding_window
    causal = None if plain else (q_valid[:, None, None, :] & (q_pos[:, None, None, :] <= q_pos[:, None, :, None])
                                 | ~q_valid[:, None, :, None])  # [B, 1, T, T]
    in_window = causal & (q_pos[:, None, None, :] > q_pos[:, None, :, None] - sliding_window) if sliding_window \
        else causal
    new_part = attention_with_lse(q, new_k, new_v, scaling, in_window, causal=plain)
    scored_part, other_part = (None if slots is None else _held_attention(q, q_pos, slots, scaling, sliding_window)
                               for slots in (scored_slots, other_slots))
    out, _ = merge_attention([part for part in (scored_part, other_part, new_part) if part is not None])
    if scored_slots is None:
        return out.transpose(1, 2), stats
    if sliding_window:  # the score's softmax has no window
        scored_part = _held_attention(q, q_pos, scored_slots, scaling, None)
        new_part = attention_with_lse(q, new_k, new_v, scaling, causal)
    lse = torch.logaddexp(scored_part[1], new_part[1]).masked_fill(~q_valid[:, None, :], float("inf"))
    order, scored_k, _, scored_positions = scored_slots
    in_chunk = (scored_positions >= start) & (scored_positions < end)  # [B, H_kv, W]
    best = torch.where(in_chunk, most_probability(q, scored_k, lse, scaling), stats.gather(2, order))
    return out.transpose(1, 2), stats.scatter(2, order, best)


def _gathered(keep, k, v, positions):
    """The slots in `keep` [B, H_kv, N] first, in slot order, so that the work on them follows their number:
    (their slot indices [B, H_kv, W], k, v [B, H_kv, W, D], positions [B, H_kv, W], -1 past a head's count),
    W the most a head keeps; None when no head keeps any."""
    counts = keep.sum(-1)  # [B, H_kv]
    width = int(counts.max())
    if width == 0:
        return None
    order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices[..., :width]  # kept slots first
    k, v = (x.gather(2, order[..., None].expand(-1, -1, -1, x.shape[-1])) for x in (k, v))
    past_count = torch.arange(width, device=k.device) >= counts[..., None]
    return order, k, v, positions.gather(2, order).masked_fill(past_count, -1)


def _held_attention(q, q_pos, slots, scaling, sliding_window):
    """`attention_with_lse` of the queries over gathered held slots (`_gathered`), within the window."""
    _, k, v, positions = slots
    seen = (positions >= 0)[:, :, None, :]  # [B, H_kv, 1, W]
    if sliding_window:
        seen = seen & (positions[:, :, None, :] > q_pos[:, None, :, None] - sliding_window)
    return attention_with_lse(q, k, v, scaling, seen)
