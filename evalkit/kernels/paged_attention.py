"""Paged attention over per-(sequence, KV head) block tables: Triton kernel, launcher, torch reference.

Storage (evalkit/cache/storage.py): K and V are flat slot arrays `[slots, D]`; a page is `S`
consecutive slots; head (b, h) owns the pages `table[b, h, :]` in fill order, its first
`head_tokens[b, h]` table positions are scanned, and `slot_pos[slot]` holds the token's original
position (-1 = empty slot: a hole left by eviction, or padding). A query at position p reads the
slots with 0 <= pos <= p (and pos > p - W under a sliding window W). Heads of one sequence may
hold different numbers of tokens.

One kernel serves both uses:
- decode (T = 1): the head's tokens are cut into splits (flash-decoding), each split writes a
  partial softmax state, a second kernel merges them;
- chunked prefill (T > 1): the chunk's queries against the kept cache, which already holds the
  chunk (appended before attention), so causality within the chunk comes from the positions.
The G = H_q / H_kv query heads of a KV head are stacked as rows of one tile, so a program loads
each page once for the whole group. Shapes: B batch, H_q / H_kv heads, G group, T queries,
D head dim, P pages per head, S slots per page, R = T * G rows per KV head.
"""

from __future__ import annotations

import functools

import torch

from evalkit.kernels.runtime import INTERPRETED, dot_precision, tl, triton

LOG2E = 1.4426950408889634
# Tiles and schedules: the fastest of scripts/bench_kernels.py's sweep on an H200 (docs/benchmarks.md).
DECODE_LAUNCH = dict(block_m=16, block_n=128, num_warps=4, num_stages=4, programs_per_sm=8, skip_future=False)
CHUNK_LAUNCH = dict(block_m=128, block_n=64, num_warps=4, num_stages=2, programs_per_sm=1, skip_future=True)


@triton.jit
def _paged_attention_kernel(
    Q, K, V, SLOT_POS, TABLE, HEAD_TOKENS, Q_POS,
    OUT, LSE2, PART_ACC, PART_M, PART_L,
    scale_log2, page_size, sliding_window, tokens_per_split, T, G, H_KV, HEAD_DIM,
    stride_q_b, stride_q_h, stride_q_t,
    stride_k_slot, stride_v_slot,
    stride_table_b, stride_table_h,
    stride_out_b, stride_out_t, stride_out_h,
    stride_part_row, stride_part_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, SKIP_FUTURE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    bh = tl.program_id(0)  # one (sequence, KV head)
    b = bh // H_KV
    kv = bh % H_KV
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # row r = query t * G + group member g
    split = tl.program_id(2)
    row_ok = rows < T * G
    t = rows // G
    h = kv * G + rows % G  # query head
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q = tl.load(Q + b * stride_q_b + h[:, None] * stride_q_h + t[:, None] * stride_q_t + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = tl.load(Q_POS + b * T + t, mask=row_ok, other=-1)  # [M]
    q_pos_max = tl.max(q_pos, 0)

    n_head = tl.load(HEAD_TOKENS + bh)
    lo = split * tokens_per_split
    hi = tl.minimum(lo + tokens_per_split, n_head)
    table = TABLE + b * stride_table_b + kv * stride_table_h

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of scaled scores (log2 units)
    l = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        page = tl.load(table + n // page_size, mask=n_ok, other=0).to(tl.int64)
        slot = page * page_size + n % page_size
        k_pos = tl.load(SLOT_POS + slot, mask=n_ok, other=-1)  # [N]
        # Chunks skip blocks that are empty or in every query's future (half a fresh prompt's blocks);
        # decode reads every block, and a branch-free loop lets Triton pipeline its loads.
        if (not SKIP_FUTURE) or tl.max(((k_pos >= 0) & (k_pos <= q_pos_max)).to(tl.int32), 0) > 0:
            k = _load_slot_rows(K, slot, stride_k_slot, d, n_ok, d_ok, UPCAST)  # [N, D]
            v = _load_slot_rows(V, slot, stride_v_slot, d, n_ok, d_ok, UPCAST)
            m, l, acc = _online_softmax_step(q, q_pos, k, v, k_pos, m, l, acc, scale_log2, sliding_window, PRECISION)

    if SPLIT:
        part = (bh * T * G + rows) * stride_part_row + split * stride_part_split
        tl.store(PART_M + part, m, mask=row_ok)
        tl.store(PART_L + part, l, mask=row_ok)
        tl.store(PART_ACC + part[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])
    else:
        out_rows = OUT + b * stride_out_b + t[:, None] * stride_out_t + h[:, None] * stride_out_h + d[None, :]
        _store_normalised(out_rows, LSE2 + (b * H_KV * G + h) * T + t, m, l, acc, row_ok, d_ok)


@triton.jit
def _load_slot_rows(ROWS, slot, stride_slot, d, n_ok, d_ok, UPCAST: tl.constexpr):
    """K or V rows [N, D] of the slots `slot` [N]; 0 past the block's tokens (`n_ok`) and the head dim (`d_ok`)."""
    rows = tl.load(ROWS + slot[:, None] * stride_slot + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        rows = rows.to(tl.float32)
    return rows


@triton.jit
def _online_softmax_step(q, q_pos, k, v, k_pos, m, l, acc, scale_log2, sliding_window, PRECISION: tl.constexpr):
    """One block of keys into the rows' running softmax: queries q [M, D] at positions q_pos [M] read keys k and
    values v [N, D] at positions k_pos [N] (-1: empty) where visible. The state, in log2 units: m [M] the
    running max of scaled scores, l [M] the running sum of exp2(score - m), acc [M, D] the values so
    weighted. Returns the new (m, l, acc)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [M, N]
    allowed = (k_pos[None, :] >= 0) & (k_pos[None, :] <= q_pos[:, None])
    if sliding_window > 0:
        allowed = allowed & (k_pos[None, :] > q_pos[:, None] - sliding_window)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing readable yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def _store_normalised(out_rows, lse2_rows, m, l, acc, row_ok, d_ok):
    """A row's final state written out: acc / l [M, D] at `out_rows` in OUT's dtype, its log2-sum-exp
    m + log2(l) [M] at `lse2_rows`; a query that reads nothing gets zeros and lse -inf."""
    nonempty = l > 0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l, 1.0)[:, None], 0.0)
    tl.store(out_rows, out.to(out_rows.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    lse2 = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), float("-inf"))
    tl.store(lse2_rows, lse2, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    OUT, LSE2, PART_ACC, PART_M, PART_L,
    T, G, H_KV, HEAD_DIM, num_splits,
    stride_out_b, stride_out_t, stride_out_h,
    stride_part_row, stride_part_split,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Flash-decoding's reduction: one program per (sequence, query head, query) merges its splits."""
    row = tl.program_id(0)  # (b * H_kv + kv) * T * G + t * G + g
    bh = row // (T * G)
    r = row % (T * G)
    b = bh // H_KV
    t = r // G
    h = (bh % H_KV) * G + r % G
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    part = row * stride_part_row + s * stride_part_split
    m = tl.load(PART_M + part, mask=s_ok, other=float("-inf"))
    l = tl.load(PART_L + part, mask=s_ok, other=0.0)
    acc = tl.load(PART_ACC + part[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
    m_all = tl.max(m, 0)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(m - m_safe)
    l_all = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0)
    nonempty = l_all > 0
    out = tl.where(nonempty, out / tl.where(nonempty, l_all, 1.0), 0.0)
    tl.store(OUT + b * stride_out_b + t * stride_out_t + h * stride_out_h + d, out.to(OUT.dtype.element_ty),
             mask=d < HEAD_DIM)
    lse2 = tl.where(nonempty, m_safe + tl.log2(tl.where(nonempty, l_all, 1.0)), float("-inf"))
    tl.store(LSE2 + (b * H_KV * G + h) * T + t, lse2)


def paged_attention(q, q_pos, k_slots, v_slots, slot_pos, table, head_tokens, page_size, scale,
                    sliding_window=0, num_splits=None, out=None, launch=None):
    """Attention of new queries over a paged cache.

    q: [B, H_q, T, D] (any strides, last dim contiguous); q_pos: [B, T] int64;
    k_slots, v_slots: [slots, D]; slot_pos: [slots] int64 (-1 = empty);
    table: [B, H_kv, P] int32 page ids; head_tokens: [B, H_kv] int32 table positions to scan (<= P * S).
    Returns out: [B, T, H_q, D] in q's dtype and lse: [B, H_q, T] float32 (natural log; -inf where a
    query reads nothing, and then out is 0). `num_splits` > 1 cuts each head's tokens for decode;
    `launch` overrides the tile and schedule (keys of DECODE_LAUNCH), which scripts/bench_kernels.py sweeps.
    """
    B, H_q, T, D = q.shape
    H_kv = table.shape[1]
    G = H_q // H_kv
    assert q.stride(-1) == 1 and k_slots.stride(-1) == 1 and v_slots.stride(-1) == 1
    table = table.to(torch.int32).contiguous()
    head_tokens = head_tokens.to(torch.int32).contiguous()
    q_pos = q_pos.to(torch.int64).contiguous()
    slot_pos = slot_pos.contiguous()
    max_tokens = table.shape[2] * page_size
    launch = {**(DECODE_LAUNCH if T == 1 else CHUNK_LAUNCH), **(launch or {})}
    block_m = max(16, min(launch["block_m"], triton.next_power_of_2(T * G)))  # tl.dot tiles are >= 16
    block_n = 16 if INTERPRETED else launch["block_n"]
    block_d = max(16, triton.next_power_of_2(D))
    rows = T * G
    if num_splits is None:
        num_splits = _decode_splits(B * H_kv * triton.cdiv(rows, block_m), max_tokens, block_n, q.device,
                                    launch["programs_per_sm"])
    tokens_per_split = triton.cdiv(triton.cdiv(max(1, max_tokens), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(max(1, max_tokens), tokens_per_split))
    if out is None:
        out = torch.empty(B, T, H_q, D, dtype=q.dtype, device=q.device)
    lse2 = torch.empty(B, H_q, T, dtype=torch.float32, device=q.device)
    split = num_splits > 1
    # One split writes the output itself: lse2 stands in for the partial states it never touches.
    part_acc, part_m, part_l = _split_states(B * H_kv * rows, num_splits, block_d, q.device) if split else (lse2,) * 3
    grid = (B * H_kv, triton.cdiv(rows, block_m), num_splits)
    _paged_attention_kernel[grid](
        q, k_slots, v_slots, slot_pos, table, head_tokens, q_pos,
        out, lse2, part_acc, part_m, part_l,
        scale * LOG2E, page_size, sliding_window or 0, tokens_per_split, T, G, H_kv, D,
        q.stride(0), q.stride(1), q.stride(2),
        k_slots.stride(0), v_slots.stride(0),
        table.stride(0), table.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        num_splits if split else 0, 1 if split else 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, SPLIT=split, SKIP_FUTURE=launch["skip_future"],
        UPCAST=INTERPRETED, PRECISION=dot_precision(q.dtype), num_warps=launch["num_warps"],
        num_stages=launch["num_stages"],
    )
    if split:
        _merge_splits_kernel[(B * H_kv * rows,)](
            out, lse2, part_acc, part_m, part_l, T, G, H_kv, D, num_splits,
            out.stride(0), out.stride(1), out.stride(2), num_splits, 1,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=block_d,
        )
    return out, lse2 / LOG2E


def _split_states(rows: int, num_splits: int, block_d: int, device) -> tuple[torch.Tensor, ...]:
    """Where flash-decoding's splits leave their partial softmax states for `_merge_splits_kernel`, float32:
    weighted values [R_all, splits, BLOCK_D], running max and sum [R_all, splits] (R_all: every KV head's rows)."""
    part_m = torch.empty(rows, num_splits, dtype=torch.float32, device=device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(rows, num_splits, block_d, dtype=torch.float32, device=device)
    return part_acc, part_m, part_l


def _decode_splits(programs: int, max_tokens: int, block_n: int, device, programs_per_sm: int) -> int:
    """Enough splits for `programs_per_sm` programs on every multiprocessor, each at least 2 blocks of tokens."""
    if device.type != "cuda" or programs == 0:
        return 1
    wanted = triton.cdiv(programs_per_sm * _multiprocessors(device.index or 0), programs)
    return max(1, min(wanted, max_tokens // (2 * block_n), 256))


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def reference_scores(q, q_pos, k_slots, slot_pos, table, head_tokens, page_size, scale, sliding_window=0):
    """The references' shared first step, in float64: each head's slots gathered in table order, scores
    of every query against them, masked (-inf) where a query may not read a slot.
    Returns scores: [B, H_kv, G, T, N] and the gathered slot ids: [B, H_kv, N] (-1 past a head's tokens)."""
    B, H_q, T, D = q.shape
    H_kv, P = table.shape[1], table.shape[2]
    n = torch.arange(P * page_size, device=table.device)
    slot = table.long()[:, :, n // page_size] * page_size + n % page_size  # [B, H_kv, N]
    slot = slot.masked_fill(n >= head_tokens.long()[..., None], -1)
    k_pos = torch.where(slot >= 0, slot_pos[slot.clamp(min=0)], -1)
    k = k_slots[slot.clamp(min=0)].double()  # [B, H_kv, N, D]
    scores = torch.einsum("bkgtd,bknd->bkgtn", q.double().reshape(B, H_kv, H_q // H_kv, T, D), k) * scale
    kp, qp = k_pos[:, :, None, None, :], q_pos[:, None, None, :, None]
    allowed = (kp >= 0) & (kp <= qp)
    if sliding_window:
        allowed &= kp > qp - sliding_window
    return scores.masked_fill(~allowed, float("-inf")), slot


def paged_attention_reference(q, q_pos, k_slots, v_slots, slot_pos, table, head_tokens, page_size, scale,
                              sliding_window=0):
    """Float64 torch twin of `paged_attention`: gather each head's slots, mask, softmax."""
    B, H_q, T, D = q.shape
    scores, slot = reference_scores(q, q_pos, k_slots, slot_pos, table, head_tokens, page_size, scale, sliding_window)
    v = v_slots[slot.clamp(min=0)].double()  # [B, H_kv, N, D]
    lse = torch.logsumexp(scores, -1)  # [B, H_kv, G, T]
    probs = torch.exp(scores - lse.clamp(min=-1e300)[..., None]).nan_to_num(0.0)
    out = torch.einsum("bkgtn,bknd->bkgtd", probs, v).reshape(B, H_q, T, D).transpose(1, 2)
    return out, lse.reshape(B, H_q, T)
