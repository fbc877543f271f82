"""Policy statistics from attention without an n x n matrix: Triton kernel, launcher, torch reference.

For each slot of each (sequence, KV head): the softmax probability it received, summed over the
counted queries and averaged over the G query heads of the group — H2O's column sums when every
query is counted, SnapKV's / TOVA's window scores when only the last w are. The softmax needs each
query's log-sum-exp over all its keys first; `paged_attention` returns it, so this is the second of
two passes: one program per block of keys recomputes the scores of every query against those keys
and adds up the probabilities. Memory is O(n): no score matrix is ever stored.
Storage and shape vocabulary as in `paged_attention`.
"""

from __future__ import annotations

import torch

from evalkit.kernels.paged_attention import LOG2E, reference_scores
from evalkit.kernels.runtime import INTERPRETED, dot_precision, tl, triton

STATS_LAUNCH = dict(block_m=64, block_n=64, num_warps=4, num_stages=2)  # see paged_attention.DECODE_LAUNCH


@triton.jit
def _attention_stats_kernel(
    Q, K, SLOT_POS, TABLE, HEAD_TOKENS, Q_POS, COUNTED, FIRST_COUNTED, LSE2, STATS,
    scale_log2, inv_group, page_size, sliding_window, T, G, H_KV, HEAD_DIM, max_tokens,
    stride_q_b, stride_q_h, stride_q_t,
    stride_k_slot,
    stride_table_b, stride_table_h,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    bh = tl.program_id(0)  # one (sequence, KV head)
    b = bh // H_KV
    kv = bh % H_KV
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < tl.load(HEAD_TOKENS + bh)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    page = tl.load(TABLE + b * stride_table_b + kv * stride_table_h + n // page_size, mask=n_ok,
                   other=0).to(tl.int64)
    slot = page * page_size + n % page_size
    k_pos = tl.load(SLOT_POS + slot, mask=n_ok, other=-1)  # [N]
    live = k_pos >= 0
    column = tl.zeros([BLOCK_N], tl.float32)
    if tl.max(live.to(tl.int32), 0) > 0:
        k = tl.load(K + slot[:, None] * stride_k_slot + d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0)  # [N, D]
        if UPCAST:
            k = k.to(tl.float32)
        # Rows before the first counted query, and queries before these keys, add nothing. Positions never
        # decrease along T (left padding sits at position 0), so the latter are a prefix: bisect for its end.
        first_pos = tl.min(tl.where(live, k_pos, 1 << 62), 0)
        lo = tl.load(FIRST_COUNTED + b)
        hi = T
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(Q_POS + b * T + mid) < first_pos:
                lo = mid + 1
            else:
                hi = mid
        for row_start in range((lo * G) // BLOCK_M * BLOCK_M, T * G, BLOCK_M):
            rows = row_start + tl.arange(0, BLOCK_M)  # row r = query t * G + group member g
            row_ok = rows < T * G
            t = rows // G
            h = kv * G + rows % G
            q_pos = tl.load(Q_POS + b * T + t, mask=row_ok, other=-1)
            counted = (tl.load(COUNTED + b * T + t, mask=row_ok, other=0) != 0) & row_ok
            q = tl.load(Q + b * stride_q_b + h[:, None] * stride_q_h + t[:, None] * stride_q_t + d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
            if UPCAST:
                q = q.to(tl.float32)
            lse2 = tl.load(LSE2 + (b * H_KV * G + h) * T + t, mask=counted, other=float("inf"))
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [M, N]
            allowed = counted[:, None] & live[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if sliding_window > 0:
                allowed = allowed & (k_pos[None, :] > q_pos[:, None] - sliding_window)
            column += tl.sum(tl.where(allowed, tl.exp2(s - lse2[:, None]), 0.0), 0)
    tl.store(STATS + bh * max_tokens + n, column * inv_group, mask=n < max_tokens)


def attention_stats(q, q_pos, counted, k_slots, slot_pos, table, head_tokens, page_size, scale, lse,
                    sliding_window=0, out=None, launch=None):
    """Each slot's probability summed over the counted queries, averaged over the group.

    q: [B, H_q, T, D]; q_pos: [B, T] int64, non-decreasing along T; counted: [B, T] bool (queries that
    contribute);
    lse: [B, H_q, T] float32 from `paged_attention` on the same inputs; other arguments as there.
    Returns stats: [B, H_kv, P * S] float32 in table order (0 past a head's tokens and in holes).
    """
    B, H_q, T, D = q.shape
    H_kv, P = table.shape[1], table.shape[2]
    G = H_q // H_kv
    assert q.stride(-1) == 1 and k_slots.stride(-1) == 1
    table = table.to(torch.int32).contiguous()
    max_tokens = P * page_size
    if out is None:
        out = torch.empty(B, H_kv, max_tokens, dtype=torch.float32, device=q.device)
    launch = {**STATS_LAUNCH, **(launch or {})}
    block_n = 16 if INTERPRETED else launch["block_n"]
    block_m = 16 if INTERPRETED else min(launch["block_m"], max(16, triton.next_power_of_2(T * G)))
    grid = (B * H_kv, triton.cdiv(max_tokens, block_n))
    _attention_stats_kernel[grid](
        q, k_slots, slot_pos.contiguous(), table, head_tokens.to(torch.int32).contiguous(),
        q_pos.to(torch.int64).contiguous(), counted.to(torch.int8).contiguous(),
        torch.where(counted.any(1), counted.to(torch.int8).argmax(1), T).to(torch.int32), (lse * LOG2E).contiguous(),
        out,
        scale * LOG2E, 1.0 / G, page_size, sliding_window or 0, T, G, H_kv, D, max_tokens,
        q.stride(0), q.stride(1), q.stride(2),
        k_slots.stride(0),
        table.stride(0), table.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)), UPCAST=INTERPRETED,
        PRECISION=dot_precision(q.dtype), num_warps=launch["num_warps"], num_stages=launch["num_stages"],
    )
    return out


def attention_stats_reference(q, q_pos, counted, k_slots, slot_pos, table, head_tokens, page_size, scale,
                              sliding_window=0):
    """Float64 torch twin of `attention_stats`: the full probability matrix, then its column sums."""
    scores, _ = reference_scores(q, q_pos, k_slots, slot_pos, table, head_tokens, page_size, scale, sliding_window)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)  # [B, H_kv, G, T, N]
    probs = probs * counted[:, None, None, :, None]
    return probs.sum(3).mean(2)  # [B, H_kv, N]
