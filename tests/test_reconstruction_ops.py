"""KVzip's reconstruction forward in one pass (evalkit/reconstruction_ops.py), held to naive float64 loops.

The flash path's attention with log-sum-exp equals its torch reference (masks, causal, a row that sees
nothing); partial attentions over disjoint key sets merge into the whole; and `reconstruction_attention`
gives what a reconstruction query's attention over the held slots and the new tokens gives, and each chunk
slot the most probability any valid query gives it in a softmax over the sinks before the chunk, the chunk
and the new tokens — with holes, left padding, several KV heads and a sliding window.
"""

from __future__ import annotations

import math

import pytest
import torch

from evalkit.attention_ops import attention_with_lse, attention_with_lse_reference
from evalkit.reconstruction_ops import merge_attention, reconstruction_attention


@pytest.mark.parametrize("masked", ["none", "causal", "per key", "per query"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_flash_path_gives_its_references_output_and_log_sum_exp(masked, dtype):
    gen = torch.Generator().manual_seed(0)
    B, H_kv, G, T, N, D = 2, 2, 3, 9, 9 if masked == "causal" else 13, 8
    q = torch.randn(B, H_kv * G, T, D, generator=gen, dtype=dtype)
    k, v = (torch.randn(B, H_kv, N, D, generator=gen, dtype=dtype) for _ in range(2))
    allowed = None
    if masked == "per key":
        allowed = torch.rand(B, H_kv, 1, N, generator=gen) > 0.4
        allowed[1, 0] = False  # a head that sees nothing
    elif masked == "per query":
        allowed = torch.rand(B, 1, T, N, generator=gen) > 0.5
        allowed[0, 0, 3] = False
    causal = masked == "causal"
    out, lse = attention_with_lse(q, k, v, 0.3, allowed, causal)
    ref_out, ref_lse = attention_with_lse_reference(q, k, v, 0.3, allowed, causal)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(lse.to(ref_lse.dtype), ref_lse, **tol)
    if allowed is not None:  # blind rows: lse -inf, output 0 (a merge then ignores them)
        blind = ~allowed.any(-1).repeat_interleave(G if allowed.shape[1] > 1 else 1, 1).expand(B, H_kv * G, T)
        assert blind.any() and bool((lse[blind] == -math.inf).all()) and bool((out[blind] == 0).all())
    # the naive softmax, row by row
    for b, h, t in [(0, 0, 0), (1, 5, T - 1), (0, 4, 3)]:
        seen = torch.ones(N, dtype=torch.bool) if allowed is None else allowed[b, h // G if allowed.shape[1] > 1 else 0,
                                                                               t if allowed.shape[2] > 1 else 0]
        if causal:
            seen = torch.arange(N) <= t
        if seen.any():
            logits = (k[b, h // G] @ q[b, h, t]).double()[seen] * 0.3
            assert math.isclose(float(lse[b, h, t]), float(logits.logsumexp(0)), rel_tol=1e-5)


def test_partial_attentions_over_disjoint_keys_merge_into_the_whole():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 6, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 20, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    whole = attention_with_lse(q, k, v, 0.5)
    merged = merge_attention([attention_with_lse(q, k[:, :, :7], v[:, :, :7], 0.5),
                              attention_with_lse(q, k[:, :, 7:], v[:, :, 7:], 0.5)])
    torch.testing.assert_close(merged[0], whole[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged[1], whole[1], rtol=1e-12, atol=1e-12)


def naive_reconstruction(q, q_pos, q_valid, new_k, new_v, k, v, positions, stats, chunk, sinks, scaling, window):
    """Float64 loops: every query's attention over held ∪ new keys (causal, window), and each chunk slot's
    largest probability in the softmax over the sinks before the chunk, the chunk and the new keys (no window)."""
    B, H_q, T, D = q.shape
    H_kv, N = k.shape[1], k.shape[2]
    G = H_q // H_kv
    out = torch.zeros(B, T, H_q, D, dtype=torch.float64)
    best = stats.double().clone()
    for b in range(B):
        first, end = int(chunk[b, 0]), int(chunk[b, 1])
        for h in range(H_kv):
            in_chunk = [(n, int(positions[b, h, n])) for n in range(N) if first <= positions[b, h, n] < end]
            top = {n: 0.0 for n, _ in in_chunk}
            for g in range(G):
                for t in range(T):
                    if not q_valid[b, t]:
                        continue
                    p = int(q_pos[b, t])
                    keys = [(k[b, h, n], v[b, h, n], int(positions[b, h, n]), n) for n in range(N)
                            if positions[b, h, n] >= 0] + \
                           [(new_k[b, h, j], new_v[b, h, j], int(q_pos[b, j]), None) for j in range(T)
                            if q_valid[b, j] and q_pos[b, j] <= p]
                    logits = torch.stack([(q[b, h * G + g, t].double() @ key.double()) * scaling
                                          for key, _, _, _ in keys])
                    near = torch.tensor([window is None or kp > p - window for _, _, kp, _ in keys])
                    probs = torch.softmax(logits.masked_fill(~near, -math.inf), 0)
                    out[b, t, h * G + g] = sum(pr * value.double() for pr, (_, value, _, _) in zip(probs, keys))
                    counted = torch.tensor([n is None or kp < min(first, sinks) or first <= kp < end
                                            for _, _, kp, n in keys])
                    score = torch.softmax(logits.masked_fill(~counted, -math.inf), 0)
                    for (_, _, _, n), pr in zip(keys, score):
                        if n in top:
                            top[n] = max(top[n], float(pr))
            for n, value in top.items():
                best[b, h, n] = value
    return out, best


@pytest.mark.parametrize("case", ["one chunk, template prefix", "a later chunk, holes, padding", "sliding window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reconstruction_attention_matches_naive_loops(case, dtype):
    gen = torch.Generator().manual_seed(2)
    B, H_kv, G, N, T, D = 2, 2, 3, 24, 10, 8
    q = torch.randn(B, H_kv * G, T, D, generator=gen, dtype=dtype)
    new_k, new_v, = (torch.randn(B, H_kv, T, D, generator=gen, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, H_kv, N, D, generator=gen, dtype=dtype) for _ in range(2))
    positions = torch.randperm(N, generator=gen)[None, None].repeat(B, H_kv, 1)  # slots in no particular order
    q_valid = torch.ones(B, T, dtype=torch.bool)
    chunk, sinks, window = torch.tensor([[6, 24], [6, 24]]), 4, None  # positions 4, 5: a template's, unscored
    if case != "one chunk, template prefix":
        positions[0, 1, positions[0, 1] % 5 == 0] = -1  # holes
        positions[1, :, -2:] = -1
        q_valid[1, :3] = False  # left padding
        chunk = torch.tensor([[10, 17], [3, 12]])
    if case == "sliding window":
        window = 12
    q_pos = (N + q_valid.cumsum(1) - 1).masked_fill(~q_valid, 0)
    stats = torch.rand(B, H_kv, N, generator=gen)
    out, scores = reconstruction_attention(q, q_pos, q_valid, new_k, new_v, k, v, positions, stats, chunk, sinks,
                                           0.4, window)
    ref_out, ref_scores = naive_reconstruction(q, q_pos, q_valid, new_k, new_v, k, v, positions, stats, chunk, sinks,
                                               0.4, window)
    rows = q_valid[:, :, None, None].expand_as(out)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out[rows].double(), ref_out[rows], **tol)
    torch.testing.assert_close(scores.double(), ref_scores, **tol)
    assert not torch.equal(scores, stats)  # the chunk was scored; the rest kept its statistic
    outside = ~((positions >= chunk[:, 0, None, None]) & (positions < chunk[:, 1, None, None]))
    assert torch.equal(scores[outside], stats[outside])
