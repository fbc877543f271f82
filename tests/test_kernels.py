"""Every Triton kernel against its float64 torch reference, on random paged caches.

On a CPU the kernels run through Triton's interpreter (conftest sets TRITON_INTERPRET=1); on a
GPU the same tests compile them for real. Outputs are poisoned with NaN before each launch, so a
position the kernel forgets to write fails the test.

Seeds: each test case draws its cache from a fixed seed derived from its own id, printed in every
failure message, so a failure replays with the same command. Set EVALKIT_KERNEL_SEED to another
value to draw other caches (the seed in a failure message is then derived from it, and replays
with the same setting).

Error: element by element, |kernel - reference| <= atol + rtol * |reference|
(torch.testing.assert_close), with the reference in float64 on the same (rounded) inputs.
"""

from __future__ import annotations

import math
import os
import zlib

import pytest
import torch

from evalkit.kernels.attention_stats import attention_stats, attention_stats_reference
from evalkit.kernels.paged_attention import paged_attention, paged_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}  # rtol, per element
# atol, per element, for the attention output (values ~ N(0, 1)) and its log-sum-exp. float32: the
# float32 products ("ieee" dots) leave errors near 1e-6. bfloat16: the output's own rounding (2^-9
# relative) sits under rtol; on a GPU the probabilities also enter the P·V product in bfloat16, whose
# rounding can add up to about 2^-9 · sum(p·|v|) where the output cancels to near 0: atol covers that.
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 2e-3}
STATS_ATOL = 1e-5  # statistics are float32 sums of float32 probabilities, whatever the inputs' dtype


def case_seed(request) -> int:
    """A fixed seed for this test case (its id, and EVALKIT_KERNEL_SEED if set), reported on failure."""
    return zlib.crc32(f"{os.environ.get('EVALKIT_KERNEL_SEED', '')}:{request.node.name}".encode()) % 2**31


def replay(seed):
    chosen = os.environ.get("EVALKIT_KERNEL_SEED")
    return f"seed {seed}" + (f" (EVALKIT_KERNEL_SEED={chosen})" if chosen else "")


def assert_close(out, ref, rtol, atol, what, seed):
    assert not torch.isnan(out).any(), f"NaN in kernel {what}, {replay(seed)}"
    torch.testing.assert_close(out.double(), ref.double(), rtol=rtol, atol=atol,
                               msg=lambda message: f"{what}, {replay(seed)}: {message}")


def random_paged_cache(lengths, page_size, head_dim, dtype, hole_fraction=0.2, seed=0):
    """Per-head token counts `lengths` [B, H_kv] -> a shuffled page pool, block tables and slot positions.

    Each head's tokens get increasing random positions; a fraction of them are holes (-1), and the
    last page of a head is filled only up to its length, so lengths need not be multiples of S.
    """
    gen = torch.Generator().manual_seed(seed)
    B, H_kv = lengths.shape
    pages_per_head = (lengths + page_size - 1) // page_size
    P = max(1, int(pages_per_head.max()))
    num_pages = int(pages_per_head.sum()) + 3  # a few never-used pages too
    null_page = num_pages
    page_order = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.full((B, H_kv, P), null_page, dtype=torch.int32)
    slot_pos = torch.full(((num_pages + 1) * page_size,), -1, dtype=torch.int64)
    for b in range(B):
        for h in range(H_kv):
            n = int(lengths[b, h])
            pages = [page_order.pop() for _ in range(int(pages_per_head[b, h]))]
            table[b, h, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
            positions = torch.sort(torch.randperm(4 * n + 8, generator=gen)[:n]).values
            positions[torch.rand(n, generator=gen) < hole_fraction] = -1
            for i in range(n):
                slot_pos[pages[i // page_size] * page_size + i % page_size] = positions[i]
    slots = slot_pos.numel()
    k = torch.randn(slots, head_dim, generator=gen).to(dtype)
    v = torch.randn(slots, head_dim, generator=gen).to(dtype)
    head_tokens = (pages_per_head * page_size).to(torch.int32)
    return k.to(DEVICE), v.to(DEVICE), slot_pos.to(DEVICE), table.to(DEVICE), head_tokens.to(DEVICE)


SHAPES = [  # (B, H_kv, G, lengths-maker, block size)
    (2, 2, 1, "mixed", 16),
    (1, 3, 3, "mixed", 1),
    (2, 1, 4, "mixed", 64),
    (1, 2, 4, "one_and_zero", 16),
]


def head_lengths(kind, B, H_kv, gen):
    if kind == "one_and_zero":  # a head with no token, one with a single token
        lengths = torch.tensor([[0, 1]] * B)[:, :H_kv]
        return lengths
    return torch.randint(1, 150, (B, H_kv), generator=gen)


def make_case(B, H_kv, G, kind, S, T, dtype, seed, head_dim=32):
    gen = torch.Generator().manual_seed(seed)
    lengths = head_lengths(kind, B, H_kv, gen)
    k, v, slot_pos, table, head_tokens = random_paged_cache(lengths, S, head_dim, dtype, seed=seed)
    q = torch.randn(B, H_kv * G, T, head_dim, generator=gen).to(dtype).to(DEVICE)
    top = int(slot_pos.max()) + 1
    # Queries at increasing positions, some before the newest slots (their future is masked).
    start = torch.randint(max(1, top - T - 40), max(2, top - T + 5), (B, 1), generator=gen)
    q_pos = (start + torch.arange(T)).clamp(min=0).to(DEVICE)
    return q, q_pos, k, v, slot_pos, table, head_tokens


@pytest.mark.fast_tier_keeps_one_in(2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}-Hkv{s[1]}-G{s[2]}-{s[3]}-S{s[4]}")
@pytest.mark.parametrize("T, splits, window", [(1, 1, 0), (1, 3, 0), (5, 1, 0), (7, 1, 24)],
                         ids=["decode", "decode-split", "chunk", "chunk-window"])
def test_paged_attention_matches_reference(request, shape, dtype, T, splits, window):
    B, H_kv, G, kind, S = shape
    seed = case_seed(request)
    q, q_pos, k, v, slot_pos, table, head_tokens = make_case(B, H_kv, G, kind, S, T, dtype, seed=seed)
    scale = q.shape[-1] ** -0.5
    out = torch.full((B, T, H_kv * G, q.shape[-1]), float("nan"), dtype=dtype, device=DEVICE)
    out, lse = paged_attention(q, q_pos, k, v, slot_pos, table, head_tokens, S, scale, window,
                               num_splits=splits, out=out)
    ref, ref_lse = paged_attention_reference(q, q_pos, k, v, slot_pos, table, head_tokens, S, scale, window)
    assert_close(out, ref, TOLERANCE[dtype], ATOL[dtype], "output", seed)
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), f"queries that read nothing differ, {replay(seed)}"
    assert (out.transpose(1, 2)[empty] == 0).all(), f"a query that reads nothing must get zeros, {replay(seed)}"
    assert_close(lse[~empty], ref_lse[~empty], TOLERANCE[dtype], ATOL[dtype], "log-sum-exp", seed)


@pytest.mark.fast_tier_keeps_one_in(4)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}-Hkv{s[1]}-G{s[2]}-{s[3]}-S{s[4]}")
@pytest.mark.parametrize("T, counted_last, window", [(1, None, 0), (9, None, 0), (9, 3, 0), (9, None, 30)],
                         ids=["decode", "prefill-all", "last-3-queries", "sliding-window"])
def test_attention_stats_match_reference(request, shape, dtype, T, counted_last, window):
    B, H_kv, G, kind, S = shape
    seed = case_seed(request)
    q, q_pos, k, v, slot_pos, table, head_tokens = make_case(B, H_kv, G, kind, S, T, dtype, seed=seed)
    scale = q.shape[-1] ** -0.5
    counted = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
    if counted_last:
        counted[:, :T - counted_last] = False
    _, lse = paged_attention(q, q_pos, k, v, slot_pos, table, head_tokens, S, scale, window)
    poisoned = torch.full((B, H_kv, table.shape[2] * S), float("nan"), device=DEVICE)
    stats = attention_stats(q, q_pos, counted, k, slot_pos, table, head_tokens, S, scale, lse, window,
                            out=poisoned)
    ref = attention_stats_reference(q, q_pos, counted, k, slot_pos, table, head_tokens, S, scale, window)
    assert_close(stats, ref, TOLERANCE[dtype], STATS_ATOL, "statistics", seed)
    # Each counted query that reads anything spreads probability 1 over its slots.
    readers = (~torch.isinf(lse)).float() * counted[:, None, :]  # [B, H_q, T]
    expected_mass = readers.view(B, H_kv, G, T).sum((2, 3)) / G
    assert_close(stats.sum(-1), expected_mass, TOLERANCE[dtype], 1e-4, "probability mass per head", seed)


def test_long_head_splits_agree_with_one_pass():
    """Flash-decoding's split-and-merge gives the one-pass result on a head of a few hundred tokens."""
    lengths = torch.tensor([[300, 17]])
    k, v, slot_pos, table, head_tokens = random_paged_cache(lengths, 16, 16, torch.float32, seed=3)
    q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    q_pos = torch.full((1, 1), int(slot_pos.max()) + 1, device=DEVICE)
    one, lse_one = paged_attention(q, q_pos, k, v, slot_pos, table, head_tokens, 16, 0.25, num_splits=1)
    many, lse_many = paged_attention(q, q_pos, k, v, slot_pos, table, head_tokens, 16, 0.25, num_splits=7)
    torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_many, lse_one, rtol=1e-5, atol=1e-5)
    assert math.isfinite(float(lse_one.min()))
