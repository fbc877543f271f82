"""`select_keep` and `resolve_budget`: hand-computed cases per granularity, then properties.

Shapes: scores / positions / keep are `[B, H_kv, N]` per slot, positions -1 = empty slot.
Hand cases write the expected keep mask literally, with the arithmetic in a comment.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from evalkit.policies.base import resolve_budget
from evalkit.policies.selection import select_keep


def t(rows, dtype=torch.float32):
    return torch.tensor(rows, dtype=dtype)


def ordered_positions(B, H, T):
    return torch.arange(T).expand(B, H, T).clone()


def kept_positions(keep, positions):
    """Per (b, h): the set of positions kept."""
    B, H, _ = keep.shape
    return [[set(positions[b, h][keep[b, h]].tolist()) for h in range(H)] for b in range(B)]


# --- granularity "head" ------------------------------------------------------------------------

SCORES_2H = t([[[1, 9, 3, 8, 2],
                [7, 1, 6, 2, 5]]])  # [B=1, H=2, T=5], positions 0..4


def test_head_keeps_top_k_per_kv_head_and_heads_differ():
    keep = select_keep(SCORES_2H, ordered_positions(1, 2, 5), t([5], torch.long), t([2], torch.long), "head")
    # head 0: top-2 of [1, 9, 3, 8, 2] -> 9 (pos 1), 8 (pos 3)
    # head 1: top-2 of [7, 1, 6, 2, 5] -> 7 (pos 0), 6 (pos 2)
    assert keep.tolist() == [[[False, True, False, True, False],
                              [True, False, True, False, False]]]


def test_head_ties_go_to_the_earlier_position():
    scores = t([[[2, 5, 5, 5, 1]]])
    keep = select_keep(scores, ordered_positions(1, 1, 5), t([5], torch.long), t([2], torch.long), "head")
    # three 5s at positions 1, 2, 3, budget 2 -> the two earliest: 1, 2
    assert keep.tolist() == [[[False, True, True, False, False]]]
    # same scores per position, slots stored in reverse: still positions 1 and 2
    positions = t([[[4, 3, 2, 1, 0]]], torch.long)
    keep = select_keep(scores.flip(-1), positions, t([5], torch.long), t([2], torch.long), "head")
    assert keep.tolist() == [[[False, False, True, True, False]]]


def test_head_protects_sinks_and_the_recent_window():
    scores = t([[[0, 9, 8, 7, 1, 0],
                 [0, 1, 2, 9, 0, 0]]])
    pos, seen = ordered_positions(1, 2, 6), t([6], torch.long)
    # sink 1 -> position 0; recent 2 of seen 6 -> positions 4, 5: 3 protected per head
    keep = select_keep(scores, pos, seen, t([4], torch.long), "head", sink_tokens=1, recent=t([2], torch.long))
    # budget 4 = 3 protected + best other: head 0 -> pos 1 (9); head 1 -> pos 3 (9)
    assert keep.tolist() == [[[True, True, False, False, True, True],
                              [True, False, False, True, True, True]]]
    keep = select_keep(scores, pos, seen, t([3], torch.long), "head", sink_tokens=1, recent=t([2], torch.long))
    # budget 3 = exactly the protected ones, whatever the scores
    assert keep.tolist() == [[[True, False, False, False, True, True],
                              [True, False, False, False, True, True]]]
    keep = select_keep(scores, pos, seen, t([1], torch.long), "head", sink_tokens=1, recent=t([2], torch.long))
    # budget 1 < 3 protected: protected tokens are still all kept, nothing else
    assert keep.tolist() == [[[True, False, False, False, True, True],
                              [True, False, False, False, True, True]]]


# --- granularity "token" -----------------------------------------------------------------------

def test_token_keeps_one_set_ranked_by_the_head_mean():
    keep = select_keep(SCORES_2H, ordered_positions(1, 2, 5), t([5], torch.long), t([3], torch.long), "token")
    # mean over heads: [(1+7)/2, (9+1)/2, (3+6)/2, (8+2)/2, (2+5)/2] = [4, 5, 4.5, 5, 3.5]
    # top-3: 5 (pos 1), 5 (pos 3), 4.5 (pos 2) -> same positions for both heads
    assert keep.tolist() == [[[False, True, True, True, False],
                              [False, True, True, True, False]]]
    keep = select_keep(SCORES_2H, ordered_positions(1, 2, 5), t([5], torch.long), t([1], torch.long), "token")
    # budget 1: the tie 5 (pos 1) vs 5 (pos 3) goes to the earlier position 1
    assert keep.tolist() == [[[False, True, False, False, False],
                              [False, True, False, False, False]]]


def test_token_mean_only_counts_heads_that_hold_the_token():
    # head 0 lost position 1 (slot empty): the mean of position 1 is head 1's score alone
    positions = t([[[0, -1, 2, 3],
                    [0, 1, 2, 3]]], torch.long)
    scores = t([[[4, 100, 4, 1],
                 [4, 3, 1, 4]]])
    # means: pos 0 (4+4)/2 = 4, pos 1 = 3 (head 1 only; the 100 of an empty slot is ignored),
    #        pos 2 (4+1)/2 = 2.5, pos 3 (1+4)/2 = 2.5 -> top-2: pos 0, pos 1
    keep = select_keep(scores, positions, t([4], torch.long), t([2], torch.long), "token")
    assert keep.tolist() == [[[True, False, False, False],
                              [True, True, False, False]]]


def test_token_protects_sinks_and_the_recent_window():
    scores = t([[[0, 9, 8, 7, 1, 0],
                 [0, 1, 2, 9, 0, 0]]])
    # means [0, 5, 5, 8, 0.5, 0]; protected: pos 0 (sink), pos 5 (recent 1)
    # budget 3 -> protected 0, 5 + best other: pos 3 (8)
    keep = select_keep(scores, ordered_positions(1, 2, 6), t([6], torch.long), t([3], torch.long), "token",
                       sink_tokens=1, recent=t([1], torch.long))
    assert keep.tolist() == [[[True, False, False, True, False, True],
                              [True, False, False, True, False, True]]]


# --- granularity "page" ------------------------------------------------------------------------

def test_page_keeps_whole_pages_ranked_by_mean_score():
    scores = t([[[1, 1, 8, 6, 3, 3, 9, 0]]])
    # block 2 -> pages {0,1} {2,3} {4,5} {6,7} with means 1, 7, 3, 4.5
    # rank: page 1 (7, 2 tokens, total 2), page 3 (4.5, total 4), page 2 (3, total 6 > 5: stop)
    keep = select_keep(scores, ordered_positions(1, 1, 8), t([8], torch.long), t([5], torch.long), "page",
                       block_size=2)
    assert keep.tolist() == [[[False, False, True, True, False, False, True, True]]]
    # position 7 (score 0) is kept with its page; 4 and 5 (score 3) are not: no partial pages.
    # "head" with the same budget keeps the 5 best tokens instead:
    keep = select_keep(scores, ordered_positions(1, 1, 8), t([8], torch.long), t([5], torch.long), "head")
    assert keep.tolist() == [[[False, False, True, True, True, True, True, False]]]


def test_page_stops_at_the_first_page_that_does_not_fit():
    # 7 positions, block 2 -> pages {0,1} {2,3} {4,5} {6}; means 5, 9, 1, 2
    scores = t([[[5, 5, 9, 9, 1, 1, 2]]])
    # rank: page 1 (total 2), page 0 (total 4 > 3: stop), page 3 (1 token) is not taken after the stop
    keep = select_keep(scores, ordered_positions(1, 1, 7), t([7], torch.long), t([3], torch.long), "page",
                       block_size=2)
    assert keep.tolist() == [[[False, False, True, True, False, False, False]]]


def test_page_is_shared_by_all_heads_with_the_mean_over_heads_and_tokens():
    # block 2, 2 heads; pages {0,1} {2,3} {4,5}
    scores = t([[[9, 9, 0, 0, 4, 4],
                 [0, 0, 5, 5, 4, 4]]])
    # page means over (head, token): page 0 (9+9+0+0)/4 = 4.5, page 1 (0+0+5+5)/4 = 2.5, page 2 = 4
    # budget 4: page 0 (2), page 2 (4) -> positions 0, 1, 4, 5 in both heads
    keep = select_keep(scores, ordered_positions(1, 2, 6), t([6], torch.long), t([4], torch.long), "page",
                       block_size=2)
    assert keep.tolist() == [[[True, True, False, False, True, True],
                              [True, True, False, False, True, True]]]


def test_page_ties_go_to_the_earlier_page():
    scores = t([[[3, 3, 1, 1, 3, 3]]])  # pages 0 and 2 tie at 3; budget 2 -> page 0
    keep = select_keep(scores, ordered_positions(1, 1, 6), t([6], torch.long), t([2], torch.long), "page",
                       block_size=2)
    assert keep.tolist() == [[[True, True, False, False, False, False]]]


def test_page_protects_sinks_and_the_recent_window_with_their_whole_page():
    scores = t([[[0, 0, 9, 9, 0, 0]]])
    pos, seen = ordered_positions(1, 1, 6), t([6], torch.long)
    # sink 1 protects page 0 (positions 0, 1); recent 1 protects page 2 (positions 4, 5)
    # budget 4: protected pages take 4 tokens; page 1 (mean 9) would make 6 > 4
    keep = select_keep(scores, pos, seen, t([4], torch.long), "page", block_size=2, sink_tokens=1,
                       recent=t([1], torch.long))
    assert keep.tolist() == [[[True, True, False, False, True, True]]]
    # budget 2 < 4 protected tokens: the protected pages are still kept
    keep = select_keep(scores, pos, seen, t([2], torch.long), "page", block_size=2, sink_tokens=1,
                       recent=t([1], torch.long))
    assert keep.tolist() == [[[True, True, False, False, True, True]]]
    # budget 6: everything
    keep = select_keep(scores, pos, seen, t([6], torch.long), "page", block_size=2, sink_tokens=1,
                       recent=t([1], torch.long))
    assert keep.all()


# --- every granularity -------------------------------------------------------------------------

@pytest.mark.parametrize("granularity", ["head", "token", "page"])
def test_budget_at_least_live_keeps_every_live_slot(granularity):
    positions = t([[[0, -1, 2, 3, -1, 5],
                    [-1, 1, 2, -1, 4, 5]]], torch.long)
    scores = torch.randn(1, 2, 6, generator=torch.Generator().manual_seed(0))
    # 4 live per head, 6 distinct positions: "token"/"page" count positions shared by the heads
    for budget in (6, 7, 100):
        keep = select_keep(scores, positions, t([6], torch.long), t([budget], torch.long), granularity,
                           block_size=2)
        assert keep.tolist() == (positions >= 0).tolist()
    if granularity == "head":  # per head, a budget of 4 = its live count is enough
        keep = select_keep(scores, positions, t([6], torch.long), t([4], torch.long), granularity)
        assert keep.tolist() == (positions >= 0).tolist()


@pytest.mark.parametrize("granularity", ["head", "token", "page"])
def test_protected_tokens_survive_a_budget_of_one(granularity):
    scores = t([[[0, 9, 9, 9, 9, 9, 9, 0]]])
    keep = select_keep(scores, ordered_positions(1, 1, 8), t([8], torch.long), t([1], torch.long), granularity,
                       block_size=2, sink_tokens=1, recent=t([1], torch.long))
    assert bool(keep[0, 0, 0]) and bool(keep[0, 0, 7])


def test_per_row_budgets_and_seen():
    scores = t([[[1, 5, 3, 4, 2]],
                [[1, 5, 3, 4, 2]]])
    positions = t([[[0, 1, 2, 3, 4]],
                   [[0, 1, 2, -1, -1]]], torch.long)
    seen = t([5, 3], torch.long)
    keep = select_keep(scores, positions, seen, t([1, 2], torch.long), "head", recent=t([1, 1], torch.long))
    # row 0: recent 1 of 5 -> pos 4 protected; budget 1 is used by it -> only pos 4
    # row 1: recent 1 of 3 -> pos 2 protected; budget 2 -> pos 2 + best other: pos 1 (5)
    assert keep.tolist() == [[[False, False, False, False, True]],
                             [[False, True, True, False, False]]]
    keep = select_keep(scores, positions, seen, t([3, 1], torch.long), "token")
    # row 0: top-3 of [1,5,3,4,2] -> pos 1, 3, 2; row 1: top-1 of [1,5,3] -> pos 1
    assert keep.tolist() == [[[False, True, True, True, False]],
                             [[False, True, False, False, False]]]


def scramble(scores, positions, seed, empty=2, empty_score=1e6):
    """Same tokens, each head's slots in a random order with `empty` empty slots interleaved."""
    B, H, N = scores.shape
    g = torch.Generator().manual_seed(seed)
    width = N + empty
    s = torch.full((B, H, width), empty_score)
    p = torch.full((B, H, width), -1, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            slots = torch.randperm(width, generator=g)[:N]
            s[b, h, slots] = scores[b, h]
            p[b, h, slots] = positions[b, h]
    return s, p


@pytest.mark.parametrize("granularity", ["head", "token", "page"])
@pytest.mark.parametrize("seed", range(5))
def test_storage_order_does_not_change_the_kept_positions(granularity, seed):
    B, H, T = 2, 3, 12
    g = torch.Generator().manual_seed(100 + seed)
    scores = torch.randn(B, H, T, generator=g)
    positions = ordered_positions(B, H, T)
    positions[0, 1, 3] = -1  # a hole left by an earlier eviction
    positions[1, 2, 7] = -1
    seen, budget, recent = t([12, 12], torch.long), t([5, 7], torch.long), t([2, 0], torch.long)
    ordered = select_keep(scores, positions, seen, budget, granularity, block_size=4, sink_tokens=1, recent=recent)
    s, p = scramble(scores, positions, seed)
    scrambled = select_keep(s, p, seen, budget, granularity, block_size=4, sink_tokens=1, recent=recent)
    assert kept_positions(scrambled, p) == kept_positions(ordered, positions)
    assert not scrambled[p < 0].any()  # an empty slot is never kept, whatever its score


@pytest.mark.parametrize("granularity", ["head", "token", "page"])
def test_bf16_scores_select_like_float32(granularity):
    # A scorer working on bf16 keys returns bf16 scores; selection must accept them.
    scores = SCORES_2H.to(torch.bfloat16)
    keep = select_keep(scores, ordered_positions(1, 2, 5), t([5], torch.long), t([2], torch.long), granularity,
                       block_size=1)
    expected = select_keep(SCORES_2H, ordered_positions(1, 2, 5), t([5], torch.long), t([2], torch.long),
                           granularity, block_size=1)
    assert keep.tolist() == expected.tolist()


def test_unknown_granularity_is_an_error():
    with pytest.raises(ValueError, match="granularity"):
        select_keep(SCORES_2H, ordered_positions(1, 2, 5), t([5], torch.long), t([2], torch.long), "layer")


# --- properties --------------------------------------------------------------------------------

@st.composite
def selection_case(draw, distinct=False):
    """Random live sets per head, random scores, scrambled slots; returns everything select_keep needs."""
    B = draw(st.integers(1, 3))
    H = draw(st.integers(1, 3))
    T = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    present = torch.rand(B, H, T, generator=g) < draw(st.floats(0.3, 1.0))
    if distinct:
        scores = torch.randperm(B * H * T, generator=g).float().view(B, H, T)
    else:
        scores = torch.randint(0, 4, (B, H, T), generator=g).float()  # ties on purpose
    positions = torch.where(present, ordered_positions(B, H, T), -1)
    s, p = scramble(scores, positions, seed, empty=draw(st.integers(0, 3)))  # holes stay holes
    seen = torch.full((B,), T, dtype=torch.long)
    budget = torch.tensor(draw(st.lists(st.integers(1, T + 2), min_size=B, max_size=B)))
    return s, p, seen, budget


def n_protected(p, seen, sink, recent):
    return ((p >= 0) & ((p < sink) | (p >= (seen - recent)[:, None, None]))).sum(-1)


@settings(max_examples=200, deadline=None)
@given(selection_case(), st.integers(0, 2), st.integers(0, 2))
def test_head_keeps_min_of_budget_and_live_unless_protection_needs_more(case, sink, recent_n):
    s, p, seen, budget = case
    recent = torch.full_like(seen, recent_n)
    keep = select_keep(s, p, seen, budget, "head", sink_tokens=sink, recent=recent)
    live = (p >= 0).sum(-1)
    prot = n_protected(p, seen, sink, recent)
    expected = torch.maximum(torch.minimum(budget[:, None], live), prot)  # = min(budget, live) if prot <= budget
    assert keep.sum(-1).tolist() == expected.tolist()
    assert not keep[p < 0].any()
    protected_slot = (p >= 0) & ((p < sink) | (p >= (seen - recent)[:, None, None]))
    assert keep[protected_slot].all()


@settings(max_examples=200, deadline=None)
@given(selection_case(distinct=True))
def test_head_without_protection_keeps_the_top_k_scores(case):
    s, p, seen, budget = case
    keep = select_keep(s, p, seen, budget, "head")
    B, H, _ = s.shape
    for b in range(B):
        for h in range(H):
            live = p[b, h] >= 0
            k = min(int(budget[b]), int(live.sum()))
            top = torch.topk(s[b, h][live], k).indices
            assert set(p[b, h][live][top].tolist()) == set(p[b, h][keep[b, h]].tolist())


@settings(max_examples=200, deadline=None)
@given(selection_case(), st.sampled_from([1, 2, 4]), st.integers(0, 2), st.integers(0, 2))
def test_page_keeps_a_union_of_whole_pages_within_budget(case, block, sink, recent_n):
    s, p, seen, budget = case
    recent = torch.full_like(seen, recent_n)
    keep = select_keep(s, p, seen, budget, "page", block_size=block, sink_tokens=sink, recent=recent)
    B, H, _ = s.shape
    assert not keep[p < 0].any()
    for b in range(B):
        held = set(p[b][p[b] >= 0].tolist())
        kept = set(p[b][keep[b]].tolist())
        protected = {x for x in held if x < sink or x >= int(seen[b]) - recent_n}
        for h in range(H):  # a position is kept in every head that holds it, or in none
            held_h = set(p[b, h][p[b, h] >= 0].tolist())
            assert set(p[b, h][keep[b, h]].tolist()) == kept & held_h
        pages = {x // block for x in kept}
        assert kept == {x for x in held if x // block in pages}  # whole pages only
        protected_pages = {x // block for x in protected}
        assert protected_pages <= pages
        protected_tokens = len({x for x in held if x // block in protected_pages})
        assert len(kept) <= max(int(budget[b]), protected_tokens)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_token_masks_are_identical_across_heads(data):
    B, H, T = data.draw(st.integers(1, 3)), data.draw(st.integers(2, 3)), data.draw(st.integers(1, 12))
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    present = (torch.rand(B, 1, T, generator=g) < 0.7).expand(B, H, T)  # every head holds the same tokens
    scores = torch.randint(0, 4, (B, H, T), generator=g).float()
    positions = torch.where(present, ordered_positions(B, H, T), -1)
    s, p = scramble(scores, positions, seed, empty=data.draw(st.integers(0, 3)))  # each head its own order
    seen = torch.full((B,), T, dtype=torch.long)
    budget = torch.tensor(data.draw(st.lists(st.integers(1, T + 2), min_size=B, max_size=B)))
    sink, recent_n = data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))
    keep = select_keep(s, p, seen, budget, "token", sink_tokens=sink, recent=torch.full_like(seen, recent_n))
    kept = kept_positions(keep, p)
    for b in range(B):
        assert all(kept[b][h] == kept[b][0] for h in range(H))
        live = int(present[b, 0].sum())
        prot = sum(1 for x in range(T) if bool(present[b, 0, x]) and (x < sink or x >= T - recent_n))
        assert len(kept[b][0]) == max(min(int(budget[b]), live), prot)


# --- resolve_budget ----------------------------------------------------------------------------

def test_resolve_budget_fraction_rounds_up_and_clamps():
    lengths = t([10, 7, 1, 3], torch.long)
    # 0.5 * [10, 7, 1, 3] = [5, 3.5, 0.5, 1.5] -> ceil [5, 4, 1, 2]
    assert resolve_budget(0.5, lengths).tolist() == [5, 4, 1, 2]
    # 0.01 * 10 = 0.1 -> 1; 0.0 -> 0 -> clamped to at least 1
    assert resolve_budget(0.01, lengths).tolist() == [1, 1, 1, 1]
    assert resolve_budget(0.0, lengths).tolist() == [1, 1, 1, 1]
    assert resolve_budget(0.25, t([8, 9], torch.long)).tolist() == [2, 3]  # 2.0 -> 2, 2.25 -> 3


def test_resolve_budget_one_means_everything():
    lengths = t([10, 7, 1], torch.long)
    assert resolve_budget(1.0, lengths).tolist() == [10, 7, 1]
    assert resolve_budget(1, lengths).tolist() == [10, 7, 1]  # 1 is the fraction 1.0, not one token


def test_resolve_budget_counts_above_one_are_tokens_clamped_to_the_length():
    lengths = t([10, 7, 1], torch.long)
    assert resolve_budget(4, lengths).tolist() == [4, 4, 1]
    assert resolve_budget(8.0, lengths).tolist() == [8, 7, 1]
    assert resolve_budget(2, lengths).tolist() == [2, 2, 1]


@pytest.mark.parametrize("fraction,length,expected", [(0.07, 100, 7), (0.14, 100, 14), (0.28, 100, 28),
                                                      (0.3, 10, 3), (0.7, 10, 7)])
def test_resolve_budget_fraction_of_an_exact_multiple_is_not_rounded_up(fraction, length, expected):
    # 7% of 100 tokens is 7 tokens, not ceil(7.000000000000001) = 8
    assert resolve_budget(fraction, t([length], torch.long)).tolist() == [expected]
