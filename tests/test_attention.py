"""attention_reference against a naive float64 attention, on fresh random inputs.

Every case is built the way the generation loop builds it: each (sequence, KV head) keeps some of
its earlier tokens, the new valid tokens are appended to the slots before attending (padding is
not stored), and the slots come back in scrambled order with holes (-1) interleaved and the
ragged heads padded to a common N. The naive reference loops over (batch row, query head, query)
with KV head h // G and masks a slot unless it is live, not in the query's future and, with a
window W, inside the last W positions. Its statistic is each slot's probability summed over the
valid queries, averaged over the G query heads of the KV head.

The three code paths are all exercised and checked to have been taken: the causal SDPA fast
path (slots exactly the new tokens in order), the masked SDPA path (collect=None otherwise) and
the explicit softmax path (collect="attention"). Inputs are drawn from a fresh seed each run;
failure messages name the seed, and EVALKIT_TEST_SEED=<seed> replays a failure.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, replace

import pytest
import torch

import evalkit.attention_ops as attention_ops
from evalkit.attention_ops import attention_reference

D = 8
RTOL = 1e-4  # fp32 inputs against float64
SCALING = 0.6  # not SDPA's default D ** -0.5, so a dropped `scale=` shows
GROUPS = [1, 3, 4]  # G = H_q / H_kv
HOLE_GARBAGE = 50.0  # holes hold stale, large but finite K/V: a leak through the mask shows


@dataclass
class Rng:
    """A torch generator and the fresh seed it started from, for failure messages."""

    seed: int
    g: torch.Generator

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.g)

    def randperm(self, n):
        return torch.randperm(n, generator=self.g)

    def randint(self, high):
        return int(torch.randint(high, (1,), generator=self.g))


@pytest.fixture
def gen():
    seed = int(os.environ.get("EVALKIT_TEST_SEED", random.SystemRandom().randrange(2**31)))
    return Rng(seed, torch.Generator().manual_seed(seed))


@pytest.fixture
def paths(monkeypatch):
    """Records `_is_fresh_causal`'s verdicts, "fast" or "masked"; with a collect mode the explicit
    path runs without asking it, so nothing is recorded."""
    taken = []
    fresh = attention_ops._is_fresh_causal

    def spy(*args, **kwargs):
        result = fresh(*args, **kwargs)
        taken.append("fast" if result else "masked")
        return result

    monkeypatch.setattr(attention_ops, "_is_fresh_causal", spy)
    return taken


@dataclass
class Case:
    q: torch.Tensor  # [B, H_q, T, D], a transposed view of [B, T, H_q, D] as transformers passes it
    q_pos: torch.Tensor  # [B, T]
    q_valid: torch.Tensor  # [B, T]
    k: torch.Tensor  # [B, H_kv, N, D]
    v: torch.Tensor  # [B, H_kv, N, D]
    k_pos: torch.Tensor  # [B, H_kv, N], -1 = hole
    window: int | None
    seed: int

    def run(self, collect=None):
        return attention_reference(self.q, self.q_pos, self.q_valid, self.k, self.v, self.k_pos,
                                   SCALING, self.window, collect)


def make_queries(gen, B, T, H_q):
    return gen.randn(B, T, H_q, D).transpose(1, 2)


def build_case(gen, *, G, cached, T, pad=None, pad_pos=0, H_kv=2, window=None, holes=2,
               single_live_head=True) -> Case:
    """A scrambled, holed, ragged slot layout after appending T new tokens per row.

    cached[b]: tokens row b fed before (positions 0 .. cached[b]-1), of which each head keeps a
    random subset of its own size; pad[b]: left-padding queries of row b (position `pad_pos`, not
    stored). With `single_live_head`, head (0, 0) kept none of its history, so in decode its only
    live slot is the new token.
    """
    B = len(cached)
    pad = pad or [0] * B
    H_q = G * H_kv
    q_pos = torch.full((B, T), pad_pos, dtype=torch.long)
    q_valid = torch.zeros(B, T, dtype=torch.bool)
    slots = []
    for b in range(B):
        new = torch.arange(cached[b], cached[b] + T - pad[b])
        q_pos[b, pad[b]:] = new
        q_valid[b, pad[b]:] = True
        for h in range(H_kv):
            keep = gen.randint(cached[b] + 1)  # heads differ in how much history they kept
            if single_live_head and b == h == 0:
                keep = 0
            live = torch.cat([gen.randperm(cached[b])[:keep], new])
            slots.append(live.tolist() + [-1] * gen.randint(holes + 1))
    N = max(len(s) for s in slots) + 1  # at least one hole somewhere: the ragged heads are padded
    k_pos = torch.full((B * H_kv, N), -1, dtype=torch.long)
    for i, s in enumerate(slots):
        k_pos[i, gen.randperm(N)[:len(s)]] = torch.tensor(s, dtype=torch.long)
    k_pos = k_pos.view(B, H_kv, N)
    k, v = gen.randn(B, H_kv, N, D), gen.randn(B, H_kv, N, D)
    hole = (k_pos < 0)[..., None]
    k = torch.where(hole, HOLE_GARBAGE * gen.randn(B, H_kv, N, D), k)
    v = torch.where(hole, HOLE_GARBAGE * gen.randn(B, H_kv, N, D), v)
    return Case(make_queries(gen, B, T, H_q), q_pos, q_valid, k, v, k_pos, window, gen.seed)


def fresh_case(gen, *, G, T, starts, H_kv=2, window=None) -> Case:
    """Fresh prefill: the slots are exactly the new tokens, in order, all valid."""
    B = len(starts)
    q_pos = torch.tensor(starts)[:, None] + torch.arange(T)
    k_pos = q_pos[:, None, :].expand(B, H_kv, T).contiguous()
    return Case(make_queries(gen, B, T, G * H_kv), q_pos, torch.ones(B, T, dtype=torch.bool),
                gen.randn(B, H_kv, T, D), gen.randn(B, H_kv, T, D), k_pos, window, gen.seed)


def naive(case: Case):
    """Float64 loop over (b, query head, query): out [B, T, H_q, D], stats [B, H_kv, N]."""
    q, k, v = case.q.double(), case.k.double(), case.v.double()
    B, H_q, T, _ = q.shape
    H_kv, N = k.shape[1], k.shape[2]
    G = H_q // H_kv
    out = torch.zeros(B, T, H_q, D, dtype=torch.float64)
    stats = torch.zeros(B, H_kv, N, dtype=torch.float64)
    for b in range(B):
        for h in range(H_q):
            kv = h // G
            pos = case.k_pos[b, kv]
            for t in range(T):
                p = int(case.q_pos[b, t])
                allowed = (pos >= 0) & (pos <= p)
                if case.window:
                    allowed &= pos > p - case.window
                if not allowed.any():
                    assert not case.q_valid[b, t], "test layout error: a valid query sees no slot"
                    continue  # a padding query's output is unspecified
                scores = (k[b, kv] @ q[b, h, t]) * SCALING
                probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
                out[b, t, h] = probs @ v[b, kv]
                if case.q_valid[b, t]:
                    stats[b, kv] += probs / G
    return out, stats


def check_shapes(case: Case, out, stats, collect):
    B, H_q, T, _ = case.q.shape
    H_kv, N = case.k.shape[1], case.k.shape[2]
    assert out.shape == (B, T, H_q, D) and out.dtype == case.q.dtype
    assert torch.isfinite(out).all(), f"non-finite output (padding queries included), seed={case.seed}"
    if collect is None:
        assert stats is None
    else:
        assert stats.shape == (B, H_kv, N) and stats.dtype == torch.float32
        assert torch.isfinite(stats).all(), f"non-finite statistic, seed={case.seed}"


def assert_rel_close(actual, expected, what, seed, rtol=RTOL):
    """Elementwise |a - e| <= rtol * (|e| + max|e|): relative, with the tensor's scale as floor."""
    assert torch.isfinite(actual).all(), f"{what}: non-finite values, seed={seed}"
    actual, expected = actual.double(), expected.double()
    err = (actual - expected).abs()
    bound = rtol * (expected.abs() + expected.abs().max().clamp_min(1e-30))
    worst = int((err - bound).argmax()) if err.numel() else 0
    assert (err <= bound).all(), (f"{what}: max abs error {err.max().item():.3g} over bound at flat index "
                                  f"{worst} (got {actual.flatten()[worst].item():.6g}, want "
                                  f"{expected.flatten()[worst].item():.6g}), seed={seed}")


def check_against_naive(case: Case, collect):
    out, stats = case.run(collect)
    check_shapes(case, out, stats, collect)
    want_out, want_stats = naive(case)
    valid = case.q_valid
    assert_rel_close(out[valid], want_out[valid], "output of valid queries", case.seed)
    if collect:
        assert_rel_close(stats, want_stats, "statistic", case.seed)
        assert (stats[case.k_pos < 0] == 0).all(), f"holes got probability, seed={case.seed}"
    return out, stats


# -- the fast causal path -------------------------------------------------------------------------


@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("starts", [[0, 0], [0, 5]], ids=["from0", "offset"])
@pytest.mark.parametrize("window", [None, 6, 9], ids=["nowin", "win=T", "win>T"])
def test_fresh_prefill_takes_fast_path(gen, paths, G, starts, window):
    case = fresh_case(gen, G=G, T=6, starts=starts, window=window)
    check_against_naive(case, None)
    assert paths == ["fast"]


@pytest.mark.parametrize("G", GROUPS)
def test_fresh_prefill_with_short_window_is_masked(gen, paths, G):
    case = fresh_case(gen, G=G, T=6, starts=[0, 2], window=3)
    check_against_naive(case, None)
    assert paths == ["masked"]


@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("collect", [None, "attention"])
def test_fresh_prefill_all_paths_agree(gen, paths, G, collect):
    """The fast path against the same slots scrambled (masked or explicit path) and against naive."""
    case = fresh_case(gen, G=G, T=7, starts=[0, 3])
    fast, _ = case.run(None)
    perm = torch.stack([gen.randperm(7) for _ in range(2 * 2)]).view(2, 2, 7)
    scrambled = permute_slots(case, perm)
    out, stats = check_against_naive(scrambled, collect)
    assert paths[0] == "fast" and paths[1:] == ([] if collect else ["masked"])
    assert_rel_close(out, fast, "scrambled against fast path", case.seed)


@pytest.mark.parametrize("G", GROUPS)
def test_fresh_tokens_out_of_order_are_not_fast(gen, paths, G):
    """Slots holding exactly the new tokens, first slot in place but the rest reversed in one head."""
    T = 6
    case = fresh_case(gen, G=G, T=T, starts=[0, 4])
    perm = torch.arange(T).expand(2, 2, T).clone()
    perm[1, 1, 1:] = perm[1, 1, 1:].flip(0)
    check_against_naive(permute_slots(case, perm), None)
    assert paths == ["masked"]


# -- masked and explicit paths on realistic layouts ----------------------------------------------

SCENARIOS = {
    # decode: one new token per row after a history; head (0, 0) holds only that token
    "decode": dict(cached=[9, 5], T=1),
    # chunked prefill: the chunk attends the kept history and causally itself; row 1 left-padded
    "chunk": dict(cached=[6, 3], T=5, pad=[0, 2]),
    # the same without padding: every query valid, yet not the fast path
    "chunk-full": dict(cached=[6, 3], T=4),
    # first prefill with a ragged, padded batch, slots scrambled with holes
    "prefill": dict(cached=[0, 0], T=6, pad=[0, 3]),
    # three rows, the middle one has no history: every head ragged
    "chunk3": dict(cached=[4, 0, 7], T=3, pad=[1, 0, 0]),
}


@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("collect", [None, "attention"])
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("window", [None, 3], ids=["nowin", "win3"])
def test_against_naive(gen, paths, G, collect, scenario, window):
    case = build_case(gen, G=G, window=window, **SCENARIOS[scenario])
    check_against_naive(case, collect)
    assert paths == ([] if collect else ["masked"])


@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("collect", [None, "attention"])
def test_decode_single_live_token(gen, G, collect):
    """A head whose only live slot is the new token: the output is that token's value."""
    case = build_case(gen, G=G, cached=[9, 5], T=1)
    assert int((case.k_pos[0, 0] >= 0).sum()) == 1
    out, stats = check_against_naive(case, collect)
    only = case.k_pos[0, 0] >= 0
    assert_rel_close(out[0, 0, :G], case.v[0, 0, only].expand(G, D), "single-slot head", case.seed)
    if collect:
        assert_rel_close(stats[0, 0, only], torch.ones(1), "single-slot statistic", case.seed)


@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("collect", [None, "attention"])
@pytest.mark.parametrize("pad_pos", [0, -1], ids=["pos0", "sees-nothing"])
def test_padding_queries(gen, G, collect, pad_pos):
    """Padding queries: finite output, no weight in the statistic, no effect on the valid queries.

    Row 1 is all padding; with pad_pos=-1 a padding query sees no slot at all.
    """
    case = build_case(gen, G=G, cached=[5, 4, 6], T=4, pad=[2, 4, 0], pad_pos=pad_pos)
    out, stats = check_against_naive(case, collect)
    if collect:
        assert (stats[1] == 0).all(), f"an all-padding row collected probability, seed={case.seed}"
    pad = ~case.q_valid
    q = case.q.transpose(1, 2).clone()  # [B, T, H_q, D]
    q[pad] = 10 * gen.randn(int(pad.sum()), q.shape[2], D)
    other = replace(case, q=q.transpose(1, 2))
    out2, stats2 = other.run(collect)
    check_shapes(other, out2, stats2, collect)
    assert_rel_close(out2[case.q_valid], out[case.q_valid], "valid output after padding changed", case.seed)
    if collect:
        assert_rel_close(stats2, stats, "statistic after padding changed", case.seed)


@pytest.mark.parametrize("collect", [None, "attention"])
def test_bfloat16_inputs(gen, collect):
    """bf16 in, bf16 out; the statistic stays float32. Loose bound: bf16 keeps 8 bits."""
    case = build_case(gen, G=3, cached=[6, 3], T=4, pad=[0, 1], window=5)
    half = replace(case, q=case.q.bfloat16(), k=case.k.bfloat16(), v=case.v.bfloat16())
    want_out, want_stats = naive(half)  # on the rounded inputs: only the kernel's rounding is judged
    out, stats = half.run(collect)
    check_shapes(half, out, stats, collect)
    valid = case.q_valid
    assert_rel_close(out[valid], want_out[valid], "bf16 output", case.seed, rtol=3e-2)
    if collect:
        assert_rel_close(stats, want_stats, "bf16 statistic", case.seed, rtol=3e-2)


# -- invariances ----------------------------------------------------------------------------------


def permute_slots(case: Case, perm):
    """Slots reordered per (b, h): slot i of the result is slot perm[b, h, i] of `case`."""
    rows = perm[..., None].expand(*perm.shape, D)
    return replace(case, k=case.k.gather(2, rows), v=case.v.gather(2, rows), k_pos=case.k_pos.gather(2, perm))


@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("collect", [None, "attention"])
@pytest.mark.parametrize("window", [None, 3], ids=["nowin", "win3"])
def test_slot_order_does_not_matter(gen, G, collect, window):
    case = build_case(gen, G=G, cached=[6, 3], T=4, pad=[0, 1], window=window)
    out, stats = case.run(collect)
    B, H_kv, N = case.k_pos.shape
    perm = torch.stack([gen.randperm(N) for _ in range(B * H_kv)]).view(B, H_kv, N)
    permuted = permute_slots(case, perm)
    out2, stats2 = permuted.run(collect)
    check_shapes(permuted, out2, stats2, collect)
    valid = case.q_valid
    assert_rel_close(out2[valid], out[valid], "output after permuting slots", case.seed, rtol=1e-5)
    if collect:
        assert_rel_close(stats2, stats.gather(2, perm), "statistic after permuting slots", case.seed,
                         rtol=1e-5)


@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("collect", [None, "attention"])
@pytest.mark.parametrize("block", [1, 2, 3])
def test_query_blocking(gen, monkeypatch, G, collect, block):
    """Several query blocks (the last one partial) give the unblocked result."""
    case = build_case(gen, G=G, cached=[6, 2], T=7, pad=[0, 3], window=4)
    whole, whole_stats = case.run(collect)
    B, H_q = case.q.shape[:2]
    N = case.k.shape[2]
    monkeypatch.setattr(attention_ops, "_ELEMENTS_PER_BLOCK", block * B * H_q * N)  # `block` queries a block
    out, stats = check_against_naive(case, collect)
    valid = case.q_valid
    assert_rel_close(out[valid], whole[valid], "blocked against unblocked output", case.seed, rtol=1e-5)
    if collect:
        assert_rel_close(stats, whole_stats, "blocked against unblocked statistic", case.seed, rtol=1e-5)


@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("pad", [[0, 0], [0, 5]], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("window", [3, 8, 19, 23], ids=["window 3", "window 8", "window = T", "window > T"])
def test_a_prompt_longer_than_its_window_reads_only_the_keys_in_range_and_matches_naive(gen, monkeypatch, G,
                                                                                       pad, window):
    """A sliding-window layer's prompt (Gemma 3): each query block reads only the keys from a window before its
    first query to its last (`_key_range`); output and statistics match naive attention over every key, over
    several query blocks whose key ranges overlap and start past slot 0."""
    T, H_kv, B = 19, 2, 2
    q_pos = torch.arange(T).repeat(B, 1) - torch.tensor(pad)[:, None]
    q_valid = q_pos >= 0
    q_pos = q_pos.clamp_min(0)
    k_pos = q_pos.masked_fill(~q_valid, -1)[:, None, :].expand(B, H_kv, T).contiguous()
    case = Case(make_queries(gen, B, T, G * H_kv), q_pos, q_valid, gen.randn(B, H_kv, T, D),
                gen.randn(B, H_kv, T, D), k_pos, window, gen.seed)
    monkeypatch.setattr(attention_ops, "_ELEMENTS_PER_BLOCK", 4 * B * G * H_kv * T)  # 4 queries a block
    monkeypatch.setattr(attention_ops, "_STATISTICS_ELEMENTS", 3 * B * G * H_kv * T)  # 3 queries a block
    read = []
    key_range = attention_ops._key_range
    monkeypatch.setattr(attention_ops, "_key_range", lambda *a: read.append(key_range(*a)) or read[-1])
    out, (stats,) = attention_ops.prompt_attention(case.q, q_pos, q_valid, case.k, case.v, SCALING, window,
                                                   counted=[q_valid])
    want_out, want_stats = naive(case)
    assert torch.isfinite(out).all(), f"padding queries must not turn into NaN, seed={case.seed}"
    assert_rel_close(out[q_valid], want_out[q_valid], "output of valid queries", case.seed)
    assert_rel_close(stats, want_stats, "statistic", case.seed)
    if window < T or pad[1]:  # otherwise the fresh causal path runs: no key range at all
        assert (max(0, 4 - window + 1), 8) in read, read  # the output's block of queries 4..7
    assert all(end - first <= window - 1 + 4 for first, end in read), read  # at most a window and a block


@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fresh_prompt_attends_bit_for_bit_as_sdpa_with_grouped_heads(gen, G, dtype):
    """The prompt's own attention (the flash kernel, K/V never repeated) is what HF's sdpa attention
    computes, `F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)`, bit for bit."""
    H_kv, T = 2, 37
    q = torch.randn(1, H_kv * G, T, D, generator=gen.g).to(dtype)
    k, v = (torch.randn(1, H_kv, T, D, generator=gen.g).to(dtype) for _ in range(2))
    pos, valid = torch.arange(T)[None], torch.ones(1, T, dtype=torch.bool)
    out, _ = attention_ops.prompt_attention(q, pos, valid, k, v, SCALING, counted=[valid])
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALING, enable_gqa=True)
    assert torch.equal(out, sdpa.transpose(1, 2)), f"seed={gen.seed}"


@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [1, 37, 2048])
def test_a_decode_query_that_sees_every_slot_attends_bit_for_bit_as_with_the_mask(gen, G, dtype, N):
    """Where every slot is visible (a full cache: no hole, no padding) decode attention runs SDPA without a
    mask, faster on CPU; it gives the masked call's bits, which views with holes (the dense layout's
    unused width, an evicted token) still take, so layouts and policies at full budget keep agreeing."""
    H_kv = 2
    q = torch.randn(1, 1, H_kv * G, D, generator=gen.g).to(dtype).transpose(1, 2)
    k, v = (torch.randn(1, H_kv, N, D, generator=gen.g).to(dtype) for _ in range(2))
    k_pos = torch.randperm(N, generator=gen.g).expand(1, H_kv, N)  # any slot order
    out, _ = attention_reference(q, torch.tensor([[N]]), torch.ones(1, 1, dtype=torch.bool), k, v, k_pos, SCALING)
    every = torch.ones(1, H_kv, 1, N, dtype=torch.bool)
    masked = torch.nn.functional.scaled_dot_product_attention(q.reshape(1, H_kv, G, D), k, v, attn_mask=every,
                                                              scale=SCALING)
    assert torch.equal(out, masked.view(1, 1, H_kv * G, D)), f"seed={gen.seed}"
