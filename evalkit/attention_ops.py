"""Attention and the policies' statistics as torch functions of tensors: no model, no storage.

`attention_reference` attends new queries over kept slots (the CPU path and the kernels' reference);
`prompt_attention` is a fresh prompt attending to itself, by the route `prefill_route` picks;
`attention_statistics` and `causal_statistics` sum each slot's probabilities over the queries a statistic
counts (H2O's column sums, SnapKV's window). `evalkit.attention` calls them from inside the model.
"""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F

from evalkit.flash_ops import attention_with_lse
from evalkit.kernels import use_triton
# Re-exported for tests/test_reconstruction_ops.py, which imports it from here.
from evalkit.flash_ops import attention_with_lse_reference  # noqa: F401

# Block sizes, chosen by timing them (docs/benchmarks-history.md):
_ELEMENTS_PER_BLOCK = 1 << 23  # a query block's scores: 32 MiB of float32; larger blocks are no faster
_STATISTICS_ELEMENTS = 1 << 20  # a statistics block: 4 MiB of float32, small enough to stay in the core's cache
_STATISTICS_TILE = (128, 512)  # (queries, keys) of a causal statistics tile: 0.8 MiB of scores per KV head
_LOG2_E = 1.4426950408889634


def attention_reference(q, q_pos, q_valid, k, v, k_pos, scaling, sliding_window=None, collect=None, observation_window=0,
                        keys_in_order=False):
    """Attention of new queries over kept slots, in torch; the CPU path and the kernels' reference.

    q: [B, H_q, T, D], q_pos/q_valid: [B, T]; k, v: [B, H_kv, N, D], k_pos: [B, H_kv, N] (-1 = empty), or
    None where every query sees every slot (one new token over a packed cache: `SlotView.all_live`).
    Returns out: [B, T, H_q, D] and, when `collect` is set, stats: [B, H_kv, N] float32 = each slot's
    probability summed over the valid queries ("attention") or over the last `observation_window` valid queries of
    each row ("window"), averaged over the G = H_q / H_kv query heads.
    Queries are processed in blocks so memory stays O(T_block * N), never T * N for long prompts; with
    `keys_in_order` (slot i holds the i-th new token) a block reads only the keys its queries may see
    (`_key_range`).
    """
    B, H_q, T, D = q.shape
    H_kv, N = k.shape[1], k.shape[2]
    G = H_q // H_kv
    # Slot i is the i-th new token only for a prompt's own K/V, whose statistic `attention_statistics` computes.
    assert not keys_in_order or (k_pos is not None and N == T and collect is None), "keys_in_order: a prompt's K/V"
    if collect == "window":  # only the window's queries need probabilities: the rest takes a fast path
        counted = window_queries(q_pos, q_valid, observation_window)
        first = int(counted.any(0).nonzero()[0]) if bool(counted.any()) else T
        out, _ = attention_reference(q, q_pos, q_valid, k, v, k_pos, scaling, sliding_window)
        _, stats = attention_reference(q[:, :, first:], q_pos[:, first:], counted[:, first:], k, v, k_pos,
                                       scaling, sliding_window, "attention")
        return out, stats
    if collect is None:
        out = _unblocked_attention(q, q_pos, q_valid, k, v, k_pos, scaling, sliding_window)
        if out is not None:
            return out, None
    q = q.view(B, H_kv, G, T, D)
    out = torch.empty(B, H_kv, G, T, D, dtype=q.dtype, device=q.device)
    stats = torch.zeros(B, H_kv, N, dtype=torch.float32, device=q.device) if collect else None
    block = max(1, _ELEMENTS_PER_BLOCK // max(1, B * H_q * N))
    all_valid = bool(q_valid.all())  # then every query sees at least itself: it was appended first
    for start in range(0, T, block):
        stop = min(T, start + block)
        first, end = _key_range(start, stop, N, sliding_window) if keys_in_order else (0, N)
        k_block, v_block = k[:, :, first:end], v[:, :, first:end]  # [B, H_kv, n, D]
        allowed = None  # every slot visible
        if k_pos is not None:  # queries [B, 1, 1, t, 1] against slots [B, H_kv, 1, 1, n]
            allowed = visible(q_pos[:, None, None, start:stop, None], k_pos[:, :, None, None, first:end],
                              sliding_window)
            if not all_valid:  # a padding query may see no slot; let it see all rather than produce NaN
                allowed |= ~allowed.any(-1, keepdim=True)
        q_block = q[:, :, :, start:stop]  # [B, H_kv, G, t, D]
        if stats is None:
            out[:, :, :, start:stop] = _block_attention(q_block, k_block, v_block, allowed, scaling)
            continue
        out[:, :, :, start:stop], probs = _block_attention_with_probabilities(q_block, k_block, v_block, allowed,
                                                                              scaling)
        if not all_valid:
            probs = probs * q_valid[:, None, None, start:stop, None]
        stats[..., first:end] += probs.float().sum(dim=3).mean(dim=2)
    return out.view(B, H_q, T, D).transpose(1, 2), stats


def _unblocked_attention(q, q_pos, q_valid, k, v, k_pos, scaling, sliding_window):
    """`attention_reference` without a statistic where one call does it all: a fresh prompt through SDPA's
    causal kernel, one new token through `decode_attention`. out: [B, T, H_q, D], or None where neither
    applies (the query blocks then)."""
    if k_pos is not None and _is_fresh_causal(q_pos, q_valid, k_pos, sliding_window):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2)
    if q.shape[2] != 1:
        return None
    allowed = None if k_pos is None else visible(q_pos[:, None, :], k_pos, sliding_window)  # [B, H_kv, N]
    if allowed is None or bool(allowed.all()):  # no hole, no padding: no mask, the same bits, a faster kernel
        return decode_attention(q, k, v, scaling)
    allowed |= ~allowed.any(-1, keepdim=True)  # a padding query may see no slot: let it see all, not NaN
    return decode_attention(q, k, v, scaling, allowed[:, :, None, :])


def _block_attention(q_block, k_block, v_block, allowed, scaling):
    """One block of queries q_block [B, H_kv, G, t, D] over k_block, v_block [B, H_kv, n, D] through SDPA;
    `allowed` [B, H_kv or 1, 1, t, n] (None: every slot). Returns [B, H_kv, G, t, D]."""
    B, H_kv, G, t, D = q_block.shape
    n = k_block.shape[2]
    mask = None if allowed is None else allowed.expand(B, H_kv, G, t, n).reshape(B, H_kv * G, t, n)
    out = F.scaled_dot_product_attention(q_block.reshape(B, H_kv * G, t, D), k_block, v_block, attn_mask=mask,
                                         scale=scaling, enable_gqa=True)
    return out.view(B, H_kv, G, t, D)


def _block_attention_with_probabilities(q_block, k_block, v_block, allowed, scaling):
    """`_block_attention` with the probabilities it attends with: (out [B, H_kv, G, t, D], probs [B, H_kv, G,
    t, n] in q's dtype)."""
    B, H_kv, G, t, D = q_block.shape
    n = k_block.shape[2]
    # Queries of a group stacked as rows: one matmul per KV head, K and V never repeated.
    scores = torch.matmul(q_block.reshape(B, H_kv, G * t, D), k_block.transpose(-1, -2)).view(B, H_kv, G, t, n)
    scores = scores.mul_(scaling)  # in place: no second score block
    if allowed is not None:
        scores.masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_block.dtype)
    out = torch.matmul(probs.view(B, H_kv, G * t, n), v_block).view(B, H_kv, G, t, D)
    return out, probs


def _key_range(start: int, stop: int, N: int, sliding_window) -> tuple[int, int]:
    """(first, end): the slots that queries start..stop - 1 may read when slot i holds the i-th new token
    (a prompt, padding on the left): none after the block's last query, none a window or more before its
    first. Slots outside are masked anyway: leaving them out changes no probability."""
    first = max(0, start - sliding_window + 1) if sliding_window else 0
    return first, min(N, stop)


def decode_attention(q, k, v, scaling, mask=None):
    """One new token's attention: q [B, H_q, 1, D] over k, v [B, H_kv, N, D]; out [B, 1, H_q, D].
    A KV head's G query heads are the rows of one attention, so K and V are never repeated and one
    mask row [B, H_kv, 1, N] (bool, None: every slot) serves them all."""
    B, H_q, _, D = q.shape
    H_kv = k.shape[1]
    out = F.scaled_dot_product_attention(q.view(B, H_kv, H_q // H_kv, D), k, v, attn_mask=mask, scale=scaling)
    return out.view(B, 1, H_q, D)


def visible(qp, kp, sliding_window):
    """Which slots (positions kp, -1 = empty) queries at positions qp may read, broadcast together."""
    allowed = (kp >= 0) & (kp <= qp)
    if sliding_window:
        allowed &= kp > qp - sliding_window
    return allowed


def window_queries(q_pos, q_valid, observation_window):
    """[B, T] bool: the valid queries among each row's last `observation_window` positions."""
    last = q_pos.masked_fill(~q_valid, -1).amax(1, keepdim=True)  # [B, 1]
    return q_valid & (q_pos > last - observation_window)


def statistic_queries(collect: str, observation_window: int, q_pos, q_valid) -> torch.Tensor:
    """[B, T] bool: the queries whose probabilities make up statistic `collect`."""
    return q_valid if collect == "attention" else window_queries(q_pos, q_valid, observation_window)


def prompt_attention(q, q_pos, q_valid, k, v, scaling, sliding_window=None, counted=(), kernels="auto"):
    """A layer's first tokens attending to themselves (a fresh prefill), straight from the forward's K/V.

    q: [B, H_q, T, D]; k, v: [B, H_kv, T, D], the new tokens in order, padding on the left (q_valid).
    Returns out [B, T, H_q, D] and, for every [B, T] bool mask in `counted`, the statistic
    [B, H_kv, T] float32 of `attention_statistics`, by the route `prefill_route` picks. The output never
    depends on which statistics are asked for, nor on the storage, so a prefill shared by many branches
    equals each branch's own.
    """
    B, H_kv, T = k.shape[0], k.shape[1], k.shape[2]
    k_pos = q_pos.masked_fill(~q_valid, -1)[:, None, :].expand(B, H_kv, T)
    if not _is_fresh_causal(q_pos, q_valid, k_pos, sliding_window):  # padded rows, a window shorter than T
        out, _ = attention_reference(q, q_pos, q_valid, k, v, k_pos, scaling, sliding_window, keys_in_order=True)
        return out, attention_statistics(q, q_pos, k, k_pos, scaling, sliding_window, counted, keys_in_order=True)
    route = prefill_route(q, kernels)
    if route == "sdpa":
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2), attention_statistics(q, q_pos, k, k_pos, scaling, sliding_window, counted,
                                                         keys_in_order=True)
    out, lse = attention_with_lse(q, k, v, scaling, causal=True)
    if route == "flash+kernel":
        return out.transpose(1, 2), [_kernel_statistics(q, q_pos, mask, k, scaling, lse) for mask in counted]
    return out.transpose(1, 2), causal_statistics(q, k, lse, scaling, counted)


PREFILL_ROUTES = ("flash+tiles", "flash+kernel", "sdpa")


def prefill_route(q, kernels: str) -> str:
    """How a fresh, unpadded prompt's attention and statistics are computed; it depends on the device and
    `kernels` only, never on the statistics asked for, so a shared prefill's output is each branch's own
    (`evalkit bench`'s components time the routes, docs/storage-and-kernels.md):
    - "flash+kernel": flash attention, which also returns each row's log-sum-exp, then the Triton
      statistics pass (kernels/attention_stats.py) over the forward's K: O(n) extra memory. Wherever the
      kernels run (CUDA by default; `kernels="triton"` anywhere).
    - "flash+tiles": on a CPU, the same flash attention, then `causal_statistics`' tiles in torch.
    - "sdpa": torch on CUDA (`kernels="torch"`): SDPA, then `attention_statistics` in query blocks.
    Never the chunk kernel (kernels/paged_attention.py with T = n): FlashAttention is several times faster
    (docs/benchmarks.md)."""
    if use_triton(kernels, q):
        return "flash+kernel"
    return "flash+tiles" if q.device.type == "cpu" else "sdpa"


def _kernel_statistics(q, q_pos, counted, k, scaling, lse):
    """`attention_statistics` of an unpadded causal prompt by the Triton statistics pass, reading the forward's
    K [B, H_kv, T, D] as one page of T slots per (sequence, KV head): [B, H_kv, T] float32."""
    from evalkit.kernels.attention_stats import attention_stats

    B, H_kv, T, D = k.shape
    slots = k.reshape(B * H_kv * T, D)
    slot_pos = q_pos[:, None, :].expand(B, H_kv, T).reshape(-1)
    table = torch.arange(B * H_kv, dtype=torch.int32, device=k.device).view(B, H_kv, 1)
    head_tokens = torch.full((B, H_kv), T, dtype=torch.int32, device=k.device)
    return attention_stats(q, q_pos, counted, slots, slot_pos, table, head_tokens, T, scaling, lse)


def causal_statistics(q, k, lse, scaling, counted=()):
    """`attention_statistics` of an unpadded causal prompt, from the attention's own row log-sum-exp
    `lse` [B, H_q, T]: a probability is 2^(log2(e) * (score - lse)), so a tile is one matmul (the
    row's -lse rides along as one more dimension), one exp2 (faster than exp) and one sum,
    never a softmax. Each statistic is computed on its own, in `causal_tiles` that stay in the core's
    cache, cut to the rows its mask counts (SnapKV's window is one short tile).
    q: [B, H_q, T, D], k: [B, H_kv, T, D]; returns one [B, H_kv, T] float32 per mask in `counted`."""
    B, H_q, T, D = q.shape
    H_kv = k.shape[1]
    G = H_q // H_kv
    work = torch.promote_types(q.dtype, torch.float32)  # half precisions upcast; float64 (the oracle) stays
    keys = torch.cat([k.to(work), torch.ones(B, H_kv, T, 1, dtype=work, device=k.device)], -1)
    keys = keys.reshape(B * H_kv, T, D + 1)  # [key, 1]
    stats = []
    for mask in counted:
        total = torch.zeros(B, H_kv, T, dtype=torch.float32, device=q.device)
        for qs, qe, key_ranges in causal_tiles(mask.any(0).nonzero()[:, 0].tolist(), T):
            t = qe - qs
            # A KV head's G query heads as the columns of one matmul: keys [n, D + 1] @ queries [D + 1, G * t],
            # each column [log2(e) * scaling * query, -log2(e) * lse], so that a product is log2(p).
            columns = torch.cat([q[:, :, qs:qe].to(work) * (scaling * _LOG2_E),
                                 lse[:, :, qs:qe, None].to(work) * -_LOG2_E], -1)
            columns = columns.reshape(B * H_kv, G * t, D + 1).transpose(1, 2).contiguous()
            rows_here = mask[:, qs:qe]  # [B, t]
            weight = None if bool(rows_here.all()) else \
                rows_here[:, None, None].expand(B, 1, G, t).reshape(B, 1, G * t, 1).to(work)
            for ks, ke in key_ranges:
                n = ke - ks
                probs = torch.bmm(keys[:, ks:ke], columns)  # [B * H_kv, n, G * t]: log2 of each probability
                after = max(ks, qs + 1)  # keys from here on come after some query of the tile
                if ke > after:
                    future = torch.arange(after, ke, device=q.device)[:, None] > torch.arange(qs, qe, device=q.device)
                    probs.view(-1, n, G, t)[:, after - ks:].masked_fill_(future[:, None, :], float("-inf"))
                probs = probs.exp2_().view(B, H_kv, n, G * t)
                if weight is None:
                    total[..., ks:ke] += probs.sum(-1)
                else:
                    total[..., ks:ke] += torch.matmul(probs, weight).squeeze(-1)
        stats.append(total / G)
    return stats


def causal_tiles(counted_rows: list[int], T: int):
    """The tiles of `causal_statistics` for queries `counted_rows` (ascending) of a T-token prompt:
    (first query, end, [(first key, end), ...]) per tile of `_STATISTICS_TILE` (queries, keys), each
    query tile cut to its counted rows, keys after its last query left out."""
    query_tile, key_tile = _STATISTICS_TILE
    for tile in range(0, T, query_tile):
        first, end = bisect.bisect_left(counted_rows, tile), bisect.bisect_left(counted_rows, tile + query_tile)
        if first == end:
            continue
        qs, qe = counted_rows[first], counted_rows[end - 1] + 1
        yield qs, qe, [(ks, min(qe, ks + key_tile)) for ks in range(0, qe, key_tile)]


def attention_statistics(q, q_pos, k, k_pos, scaling, sliding_window=None, counted=(), keys_in_order=False):
    """For each [B, T] bool mask in `counted`: each slot's probability summed over the mask's queries and
    averaged over the G query heads of its KV head, [B, H_kv, N] float32 (H2O's column sums, SnapKV's window).

    A second pass beside the attention output, in query blocks of O(block * N) memory; a block none of
    the masks counts is skipped, and with `keys_in_order` (slot i holds the i-th new token) a block's
    queries read only the keys they may see (`_key_range`: the causal half, within the window). Block edges are fixed by the shapes
    alone, so a statistic comes out the same whichever others are asked for with it.
    """
    B, H_q, T, D = q.shape
    H_kv, N = k.shape[1], k.shape[2]
    G = H_q // H_kv
    stats = [torch.zeros(B, H_kv, N, dtype=torch.float32, device=q.device) for _ in counted]
    if not counted:
        return stats
    rows = torch.stack(list(counted)).any(0).any(0).tolist()  # [T]: counted by some mask, in some row
    q = q.reshape(B, H_kv, G, T, D)
    block = max(1, _STATISTICS_ELEMENTS // max(1, B * H_q * N))
    for start in range(0, T, block):
        stop = min(T, start + block)
        if not any(rows[start:stop]):
            continue
        first, end = _key_range(start, stop, N, sliding_window) if keys_in_order else (0, N)
        t, n = stop - start, end - first
        # queries [B, 1, 1, t, 1] against slots [B, H_kv, 1, 1, n]
        allowed = visible(q_pos[:, None, None, start:stop, None], k_pos[:, :, None, None, first:end], sliding_window)
        allowed |= ~allowed.any(-1, keepdim=True)  # a padding query sees nothing: let it see all, not NaN
        scores = torch.matmul(q[:, :, :, start:stop].reshape(B, H_kv, G * t, D),
                              k[:, :, first:end].transpose(-1, -2))
        scores = scores.view(B, H_kv, G, t, n).mul_(scaling).masked_fill_(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)  # [B, H_kv, G, t, n]
        for total, mask in zip(stats, counted):
            rows_here = mask[:, start:stop]  # [B, t]
            if bool(rows_here.all()):
                total[..., first:end] += probs.sum(dim=3).mean(dim=2)
            elif bool(rows_here.any()):
                total[..., first:end] += (probs * rows_here[:, None, None, :, None]).sum(dim=3).mean(dim=2)
    return stats


def _is_fresh_causal(q_pos, q_valid, k_pos, sliding_window) -> bool:
    """True when the slots are exactly the new tokens, at consecutive positions, in order: then the
    causal mask by index that SDPA's `is_causal` applies is the mask by position."""
    T = q_pos.shape[1]
    if k_pos.shape[-1] != T or (sliding_window and sliding_window < T) or not bool(q_valid.all()):
        return False
    consecutive = bool((q_pos[:, 1:] - q_pos[:, :-1] == 1).all())
    return consecutive and bool((k_pos == q_pos[:, None, :]).all())
