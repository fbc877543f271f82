"""`keep_mask`, `select_adaptive` and `tokens_for`: hand-computed cases per granularity, then properties.

Shapes: scores / positions / keep are `[B, H_kv, N]` per slot, positions -1 = empty slot.
Hand cases write the expected keep mask literally, with the arithmetic in a comment. The rules are
docs/policies.md's ("Protected tokens and selection"): keep order sinks (ascending), other protected
positions (most recent first), then score (highest first, ties to the earlier position); the first
`budget` are kept, protected tokens included; pages are filled greedily, skipping pages that do not fit.
"""

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from evalkit.policies import GRANULARITIES, PAGE_GRANULARITIES
from evalkit.policies import tokens_for
from evalkit.policies import adakv
from evalkit.policies.adakv import select_adaptive
from evalkit.policies.selection import Granularity, keep_mask


def t(rows, dtype=torch.float32):
    return torch.tensor(rows, dtype=dtype)


def ordered_positions(B, H, T):
    return torch.arange(T).expand(B, H, T).clone()


def kept_positions(keep, positions):
    """Per (b, h): the set of positions kept."""
    B, H, _ = keep.shape
    return [[set(positions[b, h][keep[b, h]].tolist()) for h in range(H)] for b in range(B)]


def test_each_granularity_keeps_what_its_name_says():
    """Shared granularities keep one set for all heads, per-head ones a set each; page granularities keep whole
    pages. Heads that rank opposite ways tell them apart: a granularity added or labelled wrong fails here."""
    T, block = 16, 4
    ranks = torch.arange(T, dtype=torch.float32)
    scores = torch.stack([ranks, ranks.flip(0)])[None]  # [1, 2, 16]: head 0 wants the end, head 1 the start
    scores = scores + 0.5 * (torch.arange(T) % 2)  # and, within a page, odd positions: no page is kept whole
    kept = {g: kept_positions(keep_mask(scores, ordered_positions(1, 2, T), torch.tensor([T]), torch.tensor([6]), g,
                                        page_size=block), ordered_positions(1, 2, T))[0] for g in GRANULARITIES}
    for granularity, (head_0, head_1) in kept.items():
        shared = granularity in ("token", "page")
        assert (head_0 == head_1) == shared, granularity
        for head in (head_0, head_1):
            whole_pages = all(set(range(p - p % block, p - p % block + block)) <= head for p in head)
            assert whole_pages == (granularity in PAGE_GRANULARITIES), (granularity, head)


# --- granularity "head" ------------------------------------------------------------------------

SCORES_2H = t([[[1, 9, 3, 8, 2],
                [7, 1, 6, 2, 5]]])  # [B=1, H=2, T=5], positions 0..4


def test_head_keeps_top_k_per_kv_head_and_heads_differ():
    keep = keep_mask(SCORES_2H, ordered_positions(1, 2, 5), t([5], torch.long), t([2], torch.long), "head")
    # head 0: top-2 of [1, 9, 3, 8, 2] -> 9 (pos 1), 8 (pos 3)
    # head 1: top-2 of [7, 1, 6, 2, 5] -> 7 (pos 0), 6 (pos 2)
    assert keep.tolist() == [[[False, True, False, True, False],
                              [True, False, True, False, False]]]


def test_head_ties_go_to_the_earlier_position():
    scores = t([[[2, 5, 5, 5, 1]]])
    keep = keep_mask(scores, ordered_positions(1, 1, 5), t([5], torch.long), t([2], torch.long), "head")
    # three 5s at positions 1, 2, 3, budget 2 -> the two earliest: 1, 2
    assert keep.tolist() == [[[False, True, True, False, False]]]
    # same scores per position, slots stored in reverse: still positions 1 and 2
    positions = t([[[4, 3, 2, 1, 0]]], torch.long)
    keep = keep_mask(scores.flip(-1), positions, t([5], torch.long), t([2], torch.long), "head")
    assert keep.tolist() == [[[False, False, True, True, False]]]


def test_head_protected_tokens_count_against_the_budget():
    scores = t([[[0, 9, 8, 7, 1, 0],
                 [0, 1, 2, 9, 0, 0]]])
    pos, seen = ordered_positions(1, 2, 6), t([6], torch.long)

    def keep(budget):
        return keep_mask(scores, pos, seen, t([budget], torch.long), "head", sink_tokens=1,
                           recent=t([2], torch.long)).tolist()

    # sink 1 -> position 0; recent 2 of seen 6 -> positions 5, 4. Keep order per head:
    # head 0: 0 (sink), 5, 4 (recent, most recent first), then 1 (9), 2 (8), 3 (7)
    # head 1: 0 (sink), 5, 4, then 3 (9), 2 (2), 1 (1)
    # budget 4 = 3 protected + the best other
    assert keep(4) == [[[True, True, False, False, True, True],
                        [True, False, False, True, True, True]]]
    # budget 3 = exactly the protected ones, whatever the scores
    assert keep(3) == [[[True, False, False, False, True, True],
                        [True, False, False, False, True, True]]]
    # budget 2 < 3 protected: the sink, then the most recent (5); position 4 goes
    assert keep(2) == [[[True, False, False, False, False, True],
                        [True, False, False, False, False, True]]]
    # budget 1: the sink alone
    assert keep(1) == [[[True, False, False, False, False, False],
                        [True, False, False, False, False, False]]]


def test_head_sinks_are_kept_in_ascending_order_before_the_recent_window():
    scores = t([[[5, 5, 5, 0, 0, 0, 0, 0]]])
    # sinks 3 -> positions 0, 1, 2; recent 2 of seen 8 -> 7, 6. Budget 2: sinks 0, 1 (ascending), nothing recent
    keep = keep_mask(scores, ordered_positions(1, 1, 8), t([8], torch.long), t([2], torch.long), "head",
                       sink_tokens=3, recent=t([2], torch.long))
    assert keep.tolist() == [[[True, True, False, False, False, False, False, False]]]
    # budget 4: sinks 0, 1, 2, then the most recent 7
    keep = keep_mask(scores, ordered_positions(1, 1, 8), t([8], torch.long), t([4], torch.long), "head",
                       sink_tokens=3, recent=t([2], torch.long))
    assert keep.tolist() == [[[True, True, True, False, False, False, False, True]]]


# --- granularity "token" -----------------------------------------------------------------------

def test_token_keeps_one_set_ranked_by_the_head_mean():
    keep = keep_mask(SCORES_2H, ordered_positions(1, 2, 5), t([5], torch.long), t([3], torch.long), "token")
    # mean over heads: [(1+7)/2, (9+1)/2, (3+6)/2, (8+2)/2, (2+5)/2] = [4, 5, 4.5, 5, 3.5]
    # top-3: 5 (pos 1), 5 (pos 3), 4.5 (pos 2) -> same positions for both heads
    assert keep.tolist() == [[[False, True, True, True, False],
                              [False, True, True, True, False]]]
    keep = keep_mask(SCORES_2H, ordered_positions(1, 2, 5), t([5], torch.long), t([1], torch.long), "token")
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
    keep = keep_mask(scores, positions, t([4], torch.long), t([2], torch.long), "token")
    assert keep.tolist() == [[[True, False, False, False],
                              [True, True, False, False]]]


def test_token_protected_tokens_count_against_the_budget():
    scores = t([[[0, 9, 8, 7, 1, 0],
                 [0, 1, 2, 9, 0, 0]]])
    pos, seen = ordered_positions(1, 2, 6), t([6], torch.long)
    # means [0, 5, 5, 8, 0.5, 0]; protected: pos 0 (sink), pos 5 (recent 1)
    # budget 3 -> protected 0, 5 + best other: pos 3 (8)
    keep = keep_mask(scores, pos, seen, t([3], torch.long), "token", sink_tokens=1, recent=t([1], torch.long))
    assert keep.tolist() == [[[True, False, False, True, False, True],
                              [True, False, False, True, False, True]]]
    # recent 3 -> protected 0 (sink), then 5, 4, 3 (most recent first); budget 2: sink 0 and 5
    keep = keep_mask(scores, pos, seen, t([2], torch.long), "token", sink_tokens=1, recent=t([3], torch.long))
    assert keep.tolist() == [[[True, False, False, False, False, True],
                              [True, False, False, False, False, True]]]


# --- granularity "page" ------------------------------------------------------------------------

def test_page_keeps_whole_pages_ranked_by_mean_score():
    scores = t([[[1, 1, 8, 6, 3, 3, 9, 0]]])
    # block 2 -> pages {0,1} {2,3} {4,5} {6,7} with means 1, 7, 3, 4.5; seen 8 is a multiple of 2: no page filling
    # greedy, budget 5: page 1 (2 tokens, room 3), page 3 (2, room 1), page 2 (2 > 1: skip), page 0 (skip)
    keep = keep_mask(scores, ordered_positions(1, 1, 8), t([8], torch.long), t([5], torch.long), "page",
                       page_size=2)
    assert keep.tolist() == [[[False, False, True, True, False, False, True, True]]]
    # position 7 (score 0) is kept with its page; 4 and 5 (score 3) are not: no partial pages.
    # "head" with the same budget keeps the 5 best tokens instead:
    keep = keep_mask(scores, ordered_positions(1, 1, 8), t([8], torch.long), t([5], torch.long), "head")
    assert keep.tolist() == [[[False, False, True, True, True, True, True, False]]]


@pytest.mark.parametrize("granularity", PAGE_GRANULARITIES)
def test_page_greedy_skips_a_page_that_does_not_fit_and_takes_a_smaller_one_after_it(granularity):
    # 8 positions, block 2, position 5 empty (evicted earlier): pages {0,1} {2,3} {4} {6,7}
    positions = t([[[0, 1, 2, 3, 4, -1, 6, 7]]], torch.long)
    scores = t([[[5, 5, 9, 9, 2, 100, 1, 1]]])  # the empty slot's 100 is ignored
    # means 5, 9, 2, 1; seen 8 is a multiple of 2: no page being filled
    # budget 3: page 1 (2 tokens, room 1), page 0 (2 > 1: skip), page 2 (1 token fits, room 0), page 3 (skip)
    keep = keep_mask(scores, positions, t([8], torch.long), t([3], torch.long), granularity, page_size=2)
    assert keep.tolist() == [[[False, False, True, True, True, False, False, False]]]


@pytest.mark.parametrize("granularity", PAGE_GRANULARITIES)
def test_page_being_filled_is_protected(granularity):
    # 7 positions, block 2 -> pages {0,1} {2,3} {4,5} {6}; seen 7 is not a multiple of 2: page 3 is being filled
    scores = t([[[5, 5, 9, 9, 1, 1, 2]]])
    # order: page 3 (protected, 1 token), then page 1 (9), page 0 (5), page 2 (1)
    # budget 3: page 3 (room 2), page 1 (room 0), the rest do not fit
    keep = keep_mask(scores, ordered_positions(1, 1, 7), t([7], torch.long), t([3], torch.long), granularity,
                       page_size=2)
    assert keep.tolist() == [[[False, False, True, True, False, False, True]]]
    # budget 2: page 3 (room 1), page 1 (2 > 1: skip), page 0 (skip), page 2 (skip): 1 token = k - (S - 1)
    keep = keep_mask(scores, ordered_positions(1, 1, 7), t([7], torch.long), t([2], torch.long), granularity,
                       page_size=2)
    assert keep.tolist() == [[[False, False, False, False, False, False, True]]]
    # seen 8 (page 3 = {6, 7} complete): nothing is being filled, page 3 ranks by its mean 2
    scores8 = t([[[5, 5, 9, 9, 1, 1, 2, 2]]])
    keep = keep_mask(scores8, ordered_positions(1, 1, 8), t([8], torch.long), t([4], torch.long), granularity,
                       page_size=2)
    # budget 4: page 1 (9), page 0 (5)
    assert keep.tolist() == [[[True, True, True, True, False, False, False, False]]]


def test_page_is_shared_by_all_heads_with_the_mean_over_heads_and_tokens():
    # block 2, 2 heads; pages {0,1} {2,3} {4,5}
    scores = t([[[9, 9, 0, 0, 4, 4],
                 [0, 0, 5, 5, 4, 4]]])
    # page means over (head, token): page 0 (9+9+0+0)/4 = 4.5, page 1 (0+0+5+5)/4 = 2.5, page 2 = 4
    # budget 4: page 0 (room 2), page 2 (room 0) -> positions 0, 1, 4, 5 in both heads
    keep = keep_mask(scores, ordered_positions(1, 2, 6), t([6], torch.long), t([4], torch.long), "page",
                       page_size=2)
    assert keep.tolist() == [[[True, True, False, False, True, True],
                              [True, True, False, False, True, True]]]


def test_page_counts_the_positions_held_by_any_head():
    # block 2; head 0 lost position 3, head 1 lost position 2: page {2,3} still holds 2 distinct positions
    positions = t([[[0, 1, 2, -1, 4, 5],
                    [0, 1, -1, 3, 4, 5]]], torch.long)
    scores = t([[[1, 1, 9, 0, 2, 2],
                 [1, 1, 0, 9, 2, 2]]])
    # means over (head, token) pairs: page 0 (1+1+1+1)/4 = 1, page 1 (9+9)/2 = 9, page 2 2
    # budget 3: page 1 (2 distinct positions, room 1), page 2 (2 > 1: skip), page 0 (skip)
    keep = keep_mask(scores, positions, t([6], torch.long), t([3], torch.long), "page", page_size=2)
    assert keep.tolist() == [[[False, False, True, False, False, False],
                              [False, False, False, True, False, False]]]


def test_page_ties_go_to_the_earlier_page():
    scores = t([[[3, 3, 1, 1, 3, 3]]])  # pages 0 and 2 tie at 3; budget 2 -> page 0
    keep = keep_mask(scores, ordered_positions(1, 1, 6), t([6], torch.long), t([2], torch.long), "page",
                       page_size=2)
    assert keep.tolist() == [[[True, True, False, False, False, False]]]


def test_page_protected_pages_count_against_the_budget():
    scores = t([[[0, 0, 9, 9, 0, 0]]])
    pos, seen = ordered_positions(1, 1, 6), t([6], torch.long)

    def keep(budget):
        return keep_mask(scores, pos, seen, t([budget], torch.long), "page", page_size=2, sink_tokens=1,
                           recent=t([1], torch.long)).tolist()

    # sink 1 protects page 0 (positions 0, 1); recent 1 protects page 2 (positions 4, 5)
    # order: page 0 (sink), page 2 (protected), page 1 (mean 9)
    # budget 4: page 0 (room 2), page 2 (room 0), page 1 (skip)
    assert keep(4) == [[[True, True, False, False, True, True]]]
    # budget 3: page 0 (room 1), page 2 (2 > 1: skip), page 1 (skip): a protected page does not exceed the budget
    assert keep(3) == [[[True, True, False, False, False, False]]]
    assert keep(2) == [[[True, True, False, False, False, False]]]
    assert keep(6) == [[[True] * 6]]


def test_page_protected_pages_most_recent_first():
    scores = t([[[9, 9, 9, 9, 0, 0, 0, 0]]])
    pos, seen = ordered_positions(1, 1, 8), t([8], torch.long)

    def keep(budget):
        return keep_mask(scores, pos, seen, t([budget], torch.long), "page", page_size=2,
                           recent=t([3], torch.long)).tolist()

    # recent 3 of seen 8 -> positions 5, 6, 7: pages 3 ({6,7}) then 2 ({4,5}), most recent first; then 0, 1 (9)
    assert keep(2) == [[[False, False, False, False, False, False, True, True]]]
    assert keep(5) == [[[False, False, False, False, True, True, True, True]]]  # page 0 (2 > 1) skipped
    assert keep(6) == [[[True, True, False, False, True, True, True, True]]]


@pytest.mark.parametrize("granularity", PAGE_GRANULARITIES)
def test_a_recent_window_over_three_pages_can_take_a_small_budget_whole(granularity):
    """The cost of whole pages at a budget of a few pages (docs/granularity.md, token-by-token perplexity): H2O's
    ppl cells at 10 % of 512 tokens keep 52 a head, half of them recent. 26 recent positions of 53 seen touch the
    page being filled (5 tokens) and the two before it: 37 protected tokens leave 15, less than a page, so the
    page of the first positions goes however high it scores; at token granularity it stays (one token leaves)."""
    scores = torch.zeros(1, 2, 53)
    scores[..., :16] = 100.0  # the first page: what attention sinks score
    pos, seen = ordered_positions(1, 2, 53), t([53], torch.long)
    keep = keep_mask(scores, pos, seen, t([52], torch.long), granularity, page_size=16, recent=t([26], torch.long))
    assert kept_positions(keep, pos) == [[set(range(16, 53))] * 2]
    tokens = keep_mask(scores, pos, seen, t([52], torch.long), "token", page_size=16, recent=t([26], torch.long))
    assert kept_positions(tokens, pos) == [[set(range(53)) - {26}] * 2]  # the latest of the tied zeros leaves


# --- granularity "head_page" -------------------------------------------------------------------

def test_head_page_heads_keep_their_own_pages():
    scores = t([[[9, 9, 0, 0, 1, 1],
                 [0, 0, 8, 6, 0, 2]]])
    pos, seen, budget = ordered_positions(1, 2, 6), t([6], torch.long), t([2], torch.long)
    # block 2; head 0's page means 9, 0, 1 -> page 0; head 1's 0, 7, 1 -> page 1
    keep = keep_mask(scores, pos, seen, budget, "head_page", page_size=2)
    assert keep.tolist() == [[[True, True, False, False, False, False],
                              [False, False, True, True, False, False]]]
    # "page" ranks the means over both heads, (9+9+0+0)/4 = 4.5, (0+0+8+6)/4 = 3.5, (1+1+0+2)/4 = 1: page 0 for both
    keep = keep_mask(scores, pos, seen, budget, "page", page_size=2)
    assert keep.tolist() == [[[True, True, False, False, False, False],
                              [True, True, False, False, False, False]]]


def test_head_page_ranks_by_the_heads_own_mean_and_counts_its_own_tokens():
    # head 0 lost position 3: its page {2,3} holds position 2 alone
    positions = t([[[0, 1, 2, -1, 4, 5],
                    [0, 1, 2, 3, 4, 5]]], torch.long)
    scores = t([[[4, 4, 5, 99, 1, 1],
                 [4, 4, 1, 1, 3, 3]]])
    # head 0: page means 4 (2 tokens), 5 (1 token: position 2 alone; 99 is an empty slot), 1 (2 tokens)
    #   budget 3: page 1 (1 token, room 2), page 0 (2, room 0), page 2 (skip) -> 0, 1, 2
    # head 1: page means 4, 1, 3 (2 tokens each)
    #   budget 3: page 0 (room 1), page 2 (2 > 1: skip), page 1 (skip) -> 0, 1
    keep = keep_mask(scores, positions, t([6], torch.long), t([3], torch.long), "head_page", page_size=2)
    assert keep.tolist() == [[[True, True, True, False, False, False],
                              [True, True, False, False, False, False]]]


def test_head_page_being_filled_is_protected_per_head():
    scores = t([[[9, 9, 8, 8, 7, 7, 0],
                 [0, 0, 8, 8, 9, 9, 0]]])
    # block 2, seen 7: page 3 = {6} is being filled; it goes first in every head whatever its score
    # budget 3: head 0 -> page 3 (room 2), page 0 (9, room 0); head 1 -> page 3, page 2 (9)
    keep = keep_mask(scores, ordered_positions(1, 2, 7), t([7], torch.long), t([3], torch.long), "head_page",
                       page_size=2)
    assert keep.tolist() == [[[True, True, False, False, False, False, True],
                              [False, False, False, False, True, True, True]]]
    # "head" at the same budget keeps each head's best 3 tokens, position 6 (score 0) not among them
    keep = keep_mask(scores, ordered_positions(1, 2, 7), t([7], torch.long), t([3], torch.long), "head")
    assert keep.tolist() == [[[True, True, True, False, False, False, False],
                              [False, False, True, False, True, True, False]]]


def test_head_page_budget_below_protected_keeps_the_sinks_then_the_most_recent():
    scores = t([[[0, 0, 9, 9, 0, 0, 0, 0],
                 [0, 0, 0, 0, 9, 9, 0, 0]]])
    pos, seen = ordered_positions(1, 2, 8), t([8], torch.long)

    def keep(budget):
        return keep_mask(scores, pos, seen, t([budget], torch.long), "head_page", page_size=2, sink_tokens=1,
                           recent=t([3], torch.long)).tolist()

    # sink 1 -> page 0; recent 3 of seen 8 -> positions 5, 6, 7 -> pages 3 then 2 (most recent first)
    # order in both heads: page 0, page 3, page 2, then page 1 (head 0: 9; head 1: 0)
    def both(row):
        return [[row, row]]

    assert keep(2) == both([True, True, False, False, False, False, False, False])
    assert keep(4) == both([True, True, False, False, False, False, True, True])
    assert keep(5) == both([True, True, False, False, False, False, True, True])  # page 2 (2 > 1) skipped
    assert keep(6) == both([True, True, False, False, True, True, True, True])
    assert keep(7) == both([True, True, False, False, True, True, True, True])  # page 1 (2 > 1) skipped


def test_page_budget_below_one_page_keeps_no_whole_page():
    # every page holds 2 tokens: a budget of 1 fits none (evalkit refuses such a budget: check_budget)
    scores = t([[[0, 9, 9, 9, 9, 9, 9, 0]]])
    for granularity in PAGE_GRANULARITIES:
        keep = keep_mask(scores, ordered_positions(1, 1, 8), t([8], torch.long), t([1], torch.long), granularity,
                           page_size=2, sink_tokens=1, recent=t([1], torch.long))
        assert not keep.any()


# --- every granularity -------------------------------------------------------------------------

@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_budget_at_least_live_keeps_every_live_slot(granularity):
    positions = t([[[0, -1, 2, 3, -1, 5],
                    [-1, 1, 2, -1, 4, 5]]], torch.long)
    scores = torch.randn(1, 2, 6, generator=torch.Generator().manual_seed(0))
    # 4 live per head, 6 distinct positions: "token"/"page" count positions shared by the heads
    for budget in (6, 7, 100):
        keep = keep_mask(scores, positions, t([6], torch.long), t([budget], torch.long), granularity,
                           page_size=2)
        assert keep.tolist() == (positions >= 0).tolist()
    if granularity in ("head", "head_page"):  # per head, a budget of 4 = its live count is enough
        keep = keep_mask(scores, positions, t([6], torch.long), t([4], torch.long), granularity, page_size=2)
        assert keep.tolist() == (positions >= 0).tolist()


@pytest.mark.parametrize("granularity", ["head", "token"])
def test_a_budget_below_the_protected_tokens_keeps_the_sinks_then_the_most_recent(granularity):
    scores = t([[[0, 9, 9, 9, 9, 9, 9, 0]]])
    pos, seen = ordered_positions(1, 1, 8), t([8], torch.long)
    # sink 1 -> position 0; recent 2 of seen 8 -> 7, 6
    for budget, expected in ((1, [0]), (2, [0, 7]), (3, [0, 6, 7]), (4, [0, 1, 6, 7])):
        keep = keep_mask(scores, pos, seen, t([budget], torch.long), granularity, sink_tokens=1,
                           recent=t([2], torch.long))
        assert pos[keep].tolist() == expected


def test_per_row_budgets_and_seen():
    scores = t([[[1, 5, 3, 4, 2]],
                [[1, 5, 3, 4, 2]]])
    positions = t([[[0, 1, 2, 3, 4]],
                   [[0, 1, 2, -1, -1]]], torch.long)
    seen = t([5, 3], torch.long)
    keep = keep_mask(scores, positions, seen, t([1, 2], torch.long), "head", recent=t([1, 1], torch.long))
    # row 0: recent 1 of 5 -> pos 4 protected; budget 1 is used by it -> only pos 4
    # row 1: recent 1 of 3 -> pos 2 protected; budget 2 -> pos 2 + best other: pos 1 (5)
    assert keep.tolist() == [[[False, False, False, False, True]],
                             [[False, True, True, False, False]]]
    keep = keep_mask(scores, positions, seen, t([3, 1], torch.long), "token")
    # row 0: top-3 of [1,5,3,4,2] -> pos 1, 3, 2; row 1: top-1 of [1,5,3] -> pos 1
    assert keep.tolist() == [[[False, True, True, True, False]],
                             [[False, True, False, False, False]]]
    keep = keep_mask(scores, positions, seen, t([2, 2], torch.long), "page", page_size=2)
    # row 0 (seen 5, page 2 = {4} being filled): page 2 (room 1), page 1 {2,3} mean 3.5 (skip), page 0 (skip)
    # row 1 (seen 3, page 1 = {2} being filled): page 1 (room 1), page 0 {0,1} (skip)
    assert keep.tolist() == [[[False, False, False, False, True]],
                             [[False, False, True, False, False]]]


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


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("seed", range(3))
def test_storage_order_does_not_change_the_kept_positions(granularity, seed):
    B, H, T = 2, 3, 12
    g = torch.Generator().manual_seed(100 + seed)
    scores = torch.randn(B, H, T, generator=g)
    positions = ordered_positions(B, H, T)
    positions[0, 1, 3] = -1  # a hole left by an earlier eviction
    positions[1, 2, 7] = -1
    seen, budget, recent = t([12, 12], torch.long), t([5, 7], torch.long), t([2, 0], torch.long)
    ordered = keep_mask(scores, positions, seen, budget, granularity, page_size=4, sink_tokens=1, recent=recent)
    s, p = scramble(scores, positions, seed)
    scrambled = keep_mask(s, p, seen, budget, granularity, page_size=4, sink_tokens=1, recent=recent)
    assert kept_positions(scrambled, p) == kept_positions(ordered, positions)
    assert not scrambled[p < 0].any()  # an empty slot is never kept, whatever its score


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_bf16_scores_select_like_float32(granularity):
    # A scorer working on bf16 keys returns bf16 scores; selection must accept them.
    scores = SCORES_2H.to(torch.bfloat16)
    keep = keep_mask(scores, ordered_positions(1, 2, 5), t([5], torch.long), t([2], torch.long), granularity,
                       page_size=1)
    expected = keep_mask(SCORES_2H, ordered_positions(1, 2, 5), t([5], torch.long), t([2], torch.long),
                           granularity, page_size=1)
    assert keep.tolist() == expected.tolist()


def test_unknown_granularity_is_an_error():
    with pytest.raises(ValueError, match="granularity"):
        keep_mask(SCORES_2H, ordered_positions(1, 2, 5), t([5], torch.long), t([2], torch.long), "layer")


# --- select_adaptive (Ada-KV) ------------------------------------------------------------------

def test_adaptive_selection_splits_a_layer_budget_across_heads_by_score():
    # Two heads, budget 2 per head -> 4 for the layer; safeguard 0.5 -> each head keeps its best 1 first.
    scores = t([[[9, 8, 7, 0], [1, 0, 0.5, 0.2]]])
    keep = select_adaptive(scores, ordered_positions(1, 2, 4), t([4], torch.long), t([2], torch.long),
                           alpha_safeguard=0.5)
    # forced: head 0 pos 0 (9), head 1 pos 0 (1); the two left go to 8 and 7, both in head 0
    assert keep.int().tolist() == [[[1, 1, 1, 0], [1, 0, 0, 0]]]


def test_adaptive_selection_protected_tokens_stay_within_the_head_budget():
    scores = t([[[9, 9, 9, 0, 0, 0], [0, 0, 0, 0, 0, 0]]])
    # budget 2 per head (layer: 4), recent 3 -> positions 5, 4, 3 protected; each head forces at most 2 of them,
    # the most recent first: 5, 4 in both heads -> the layer's 4 are spent
    keep = select_adaptive(scores, ordered_positions(1, 2, 6), t([6], torch.long), t([2], torch.long),
                           alpha_safeguard=0.2, recent=t([3], torch.long))
    assert keep.int().tolist() == [[[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1]]]
    # budget 3 (layer: 6): each head forces 5, 4, 3 -> 6 spent, head 0's 9s stay out
    keep = select_adaptive(scores, ordered_positions(1, 2, 6), t([6], torch.long), t([3], torch.long),
                           alpha_safeguard=0.2, recent=t([3], torch.long))
    assert keep.int().tolist() == [[[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1]]]


def test_adaptive_selection_ties_go_to_the_lower_head_then_the_earlier_position():
    scores = t([[[5, 5, 0], [5, 5, 0]]])
    # budget 1 per head, alpha 0.5 -> ceil(0.5) = 1 forced each: head 0 pos 0, head 1 pos 0; layer total 2
    keep = select_adaptive(scores, ordered_positions(1, 2, 3), t([3], torch.long), t([1], torch.long),
                           alpha_safeguard=0.5)
    assert keep.int().tolist() == [[[1, 0, 0], [1, 0, 0]]]
    scores = t([[[9, 5, 5], [9, 5, 0]]])
    # budget 2 per head (layer: 4), alpha 0.5 -> 1 forced each: the two 9s; 2 left for three 5s:
    # head 0 pos 1, head 0 pos 2 (lower head first, then earlier position), not head 1 pos 1
    keep = select_adaptive(scores, ordered_positions(1, 2, 3), t([3], torch.long), t([2], torch.long),
                           alpha_safeguard=0.5)
    assert keep.int().tolist() == [[[1, 1, 1], [1, 0, 0]]]


# --- properties --------------------------------------------------------------------------------
#
# Random cases: scores (few levels -> ties, or many), live sets with holes, each head's slots in a random
# storage order with empty slots (scored 1e6, never to be kept), per-row `seen`, budgets, recent counts,
# sinks and block sizes. `reference_keep` is docs/policies.md's rule written as plain loops over positions.

BLOCKS = (1, 2, 4, 16)


@dataclass(frozen=True)
class Page:
    positions: frozenset
    mean: Fraction  # mean score over the (head, token) pairs it holds
    sink: bool  # holds a sink
    protected: bool  # holds a protected position, or is the page being filled

    @property
    def count(self) -> int:
        return len(self.positions)


@dataclass
class Case:
    held: list  # [b][h] {position: integer score}
    seen: list
    budget: list
    recent: list
    block: int
    sinks: int
    width: int  # slots per head (empty ones included)
    storage_seed: int

    @property
    def B(self):
        return len(self.held)

    @property
    def H(self):
        return len(self.held[0])

    def tensors(self, storage_seed=None):
        """(scores, positions) [B, H, N]: each head's tokens in a random slot order, empty slots between."""
        g = torch.Generator().manual_seed(self.storage_seed if storage_seed is None else storage_seed)
        scores = torch.full((self.B, self.H, self.width), 1e6)
        positions = torch.full((self.B, self.H, self.width), -1, dtype=torch.long)
        for b in range(self.B):
            for h in range(self.H):
                tokens = sorted(self.held[b][h].items())
                slots = torch.randperm(self.width, generator=g)[:len(tokens)]
                for slot, (p, score) in zip(slots.tolist(), tokens):
                    positions[b, h, slot], scores[b, h, slot] = p, float(score)
        return scores, positions

    def args(self):
        return torch.tensor(self.seen), torch.tensor(self.budget)

    def kept(self, granularity, storage_seed=None):
        """[b][h] set of positions keep_mask keeps."""
        scores, positions = self.tensors(storage_seed)
        seen, budget = self.args()
        keep = keep_mask(scores, positions, seen, budget, granularity, self.block, self.sinks,
                           torch.tensor(self.recent))
        assert not keep[positions < 0].any()  # an empty slot is never kept, whatever its score
        return kept_positions(keep, positions)

    def is_sink(self, p):
        return p < self.sinks

    def is_protected(self, b, p):
        return p < self.sinks or p >= self.seen[b] - self.recent[b]

    def pages(self, b, heads) -> dict:
        """{page: Page} of row b over the tokens the `heads` hold (all of them for `page`, one for `head_page`)."""
        S, seen = self.block, self.seen[b]
        held = [self.held[b][h] for h in heads]
        positions = set().union(*held)
        filling = (seen - 1) // S if seen % S else None
        out = {}
        for q in sorted({p // S for p in positions}):
            mine = frozenset(p for p in positions if p // S == q)
            pairs = [scores[p] for scores in held for p in mine if p in scores]
            out[q] = Page(mine, Fraction(sum(pairs), len(pairs)), any(self.is_sink(p) for p in mine),
                          any(self.is_protected(b, p) for p in mine) or q == filling)
        return out


def keep_key(unit, sink, protected, score):
    """docs/policies.md's keep order: sinks ascending, other protected most recent first, the rest by score
    (highest first, ties to the earlier unit)."""
    return (0, unit) if sink else (1, -unit) if protected else (2, -score, unit)


def page_key(q, page: Page):
    return keep_key(q, page.sink, page.protected, page.mean)


def greedy(pages: dict, budget: int) -> list:
    """Pages taken walking the keep order, each one whose tokens still fit; the others skipped."""
    room, taken = budget, []
    for q in sorted(pages, key=lambda q: page_key(q, pages[q])):
        if pages[q].count <= room:
            taken.append(q)
            room -= pages[q].count
    return taken


def reference_keep(case: Case, granularity: str) -> list:
    out = []
    for b in range(case.B):
        held, k = case.held[b], case.budget[b]

        def ranked(scores: dict) -> list:
            return sorted(scores, key=lambda p: keep_key(p, case.is_sink(p), case.is_protected(b, p), scores[p]))

        if granularity == "head":
            out.append([set(ranked(scores)[:k]) for scores in held])
        elif granularity == "token":
            union = set().union(*held)
            mean = {p: Fraction(sum(s[p] for s in held if p in s), sum(p in s for s in held)) for p in union}
            kept = set(ranked(mean)[:k])
            out.append([kept & set(s) for s in held])
        elif granularity == "page":
            pages = case.pages(b, range(case.H))
            kept = set().union(*(pages[q].positions for q in greedy(pages, k)))
            out.append([kept & set(s) for s in held])
        else:
            row = []
            for h in range(case.H):
                pages = case.pages(b, [h])
                row.append(set().union(*(pages[q].positions for q in greedy(pages, k))))
            out.append(row)
    return out


@st.composite
def cases(draw, max_len=40, blocks=BLOCKS, max_heads=3):
    B = draw(st.integers(1, 2))
    H = draw(st.integers(1, max_heads))
    block = draw(st.sampled_from(blocks))
    seen = [draw(st.integers(1, max_len)) for _ in range(B)]
    budget = [draw(st.integers(1, s + 2)) for s in seen]
    recent = [draw(st.integers(0, s)) for s in seen]
    sinks = draw(st.integers(0, 3))
    density = draw(st.sampled_from([0.3, 0.7, 0.9, 1.0]))
    levels = draw(st.sampled_from([3, 1000]))  # 3 score levels: many ties; 1000: few
    empty = draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    held = []
    for b in range(B):
        present = torch.rand(H, seen[b], generator=g) < density
        values = torch.randint(0, levels, (H, seen[b]), generator=g)
        held.append([{p: int(values[h, p]) for p in range(seen[b]) if present[h, p]} for h in range(H)])
    return Case(held, seen, budget, recent, block, sinks, max(seen) + empty, seed + 1)


def live_count(case, b, h=None):
    """Distinct positions held in row b (by head h, or by any head)."""
    heads = range(case.H) if h is None else [h]
    return len(set().union(*(case.held[b][x] for x in heads)))


@settings(max_examples=60, deadline=None)
@given(cases())
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_selection_follows_the_rule_book(granularity, case):
    assert case.kept(granularity) == reference_keep(case, granularity)


@settings(max_examples=60, deadline=None)
@given(cases())
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_tokens_kept_per_head_are_within_the_budget_and_fill_it(granularity, case):
    kept = case.kept(granularity)
    S = case.block
    for b in range(case.B):
        k = case.budget[b]
        # (a) every granularity: a (b, head) never holds more than its budget, protected tokens included
        assert all(len(kept[b][h]) <= k for h in range(case.H))
        if granularity == "head":  # exactly min(budget, live) per head
            assert [len(kept[b][h]) for h in range(case.H)] == [min(k, live_count(case, b, h)) for h in range(case.H)]
        elif granularity == "token":  # exactly min(budget, distinct live positions), one set for all heads
            union = set().union(*kept[b])
            assert len(union) == min(k, live_count(case, b))
            assert all(kept[b][h] == union & set(case.held[b][h]) for h in range(case.H))
        else:
            # (b) greedy fill: a page is dropped only when it did not fit in the room left, and the room only
            # shrinks, so at the end every dropped page is larger than the room: kept > k - min(dropped size).
            # Every page holds <= S tokens, hence kept >= k - (S - 1) unless everything was kept.
            units = [(None, set().union(*kept[b]))] if granularity == "page" else list(enumerate(kept[b]))
            for h, kept_unit in units:
                pages = case.pages(b, range(case.H) if h is None else [h])
                n_live = live_count(case, b, h)
                assert len(kept_unit) <= k
                dropped = [pg.count for pg in pages.values() if not pg.positions <= kept_unit]
                if dropped:
                    assert len(kept_unit) > k - min(dropped)
                    assert len(kept_unit) >= k - (S - 1)
                else:
                    assert len(kept_unit) == n_live
                if k >= S:
                    assert len(kept_unit) >= min(n_live, k - (S - 1))


@settings(max_examples=80, deadline=None)
@given(cases())
def test_head_without_protection_keeps_the_top_k_with_ties_to_earlier_positions(case):
    case.sinks, case.recent = 0, [0] * case.B
    kept = case.kept("head")
    for b in range(case.B):
        for h in range(case.H):
            scores = case.held[b][h]
            top = sorted(scores, key=lambda p: (-scores[p], p))[:case.budget[b]]
            assert kept[b][h] == set(top)


@settings(max_examples=60, deadline=None)
@given(cases())
@pytest.mark.parametrize("granularity", PAGE_GRANULARITIES)
def test_pages_kept_rank_above_every_dropped_page_that_would_have_fit(granularity, case):
    kept = case.kept(granularity)
    for b in range(case.B):
        k = case.budget[b]
        units = [(range(case.H), set().union(*kept[b]))] if granularity == "page" else \
            [([h], kept[b][h]) for h in range(case.H)]
        for heads, kept_unit in units:
            pages = case.pages(b, heads)
            taken = {q for q, pg in pages.items() if pg.positions <= kept_unit}
            assert kept_unit == set().union(*(pages[q].positions for q in taken))  # whole pages
            for d in set(pages) - taken:
                # a page no larger than a kept one could have been taken in its place, had it ranked higher
                for u in taken:
                    if pages[d].count <= pages[u].count:
                        assert page_key(u, pages[u]) < page_key(d, pages[d])
                # and it did not fit in the room left by the kept pages ranked before it
                before = sum(pages[u].count for u in taken if page_key(u, pages[u]) < page_key(d, pages[d]))
                assert pages[d].count > k - before


@settings(max_examples=60, deadline=None)
@given(cases())
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_protected_tokens_beyond_the_budget_keep_the_sinks_then_the_most_recent(granularity, case):
    kept = case.kept(granularity)
    for b in range(case.B):
        k = case.budget[b]
        if granularity in ("head", "token"):
            units = [(h, set(case.held[b][h])) for h in range(case.H)] if granularity == "head" else \
                [(None, set().union(*case.held[b]))]
            for h, live in units:
                kept_unit = kept[b][h] if h is not None else set().union(*kept[b])
                sinks = sorted(p for p in live if case.is_sink(p))
                recent = sorted((p for p in live if case.is_protected(b, p) and not case.is_sink(p)), reverse=True)
                protected = sinks + recent
                if len(protected) >= k:  # protection alone fills the budget: the first k of sinks, then recent
                    assert kept_unit == set(protected[:k])
                else:  # every protected token is kept
                    assert set(protected) <= kept_unit
        else:
            for heads, kept_unit in ([(range(case.H), set().union(*kept[b]))] if granularity == "page" else
                                     [([h], kept[b][h]) for h in range(case.H)]):
                pages = case.pages(b, heads)
                protected = {q: pg for q, pg in pages.items() if pg.protected or pg.sink}
                kept_protected = {q for q in protected if protected[q].positions <= kept_unit}
                # protected pages are walked first (sink pages ascending, then most recent first): the ones kept
                # are what the greedy fill takes from them alone, whatever the other pages
                assert kept_protected == set(greedy(protected, k))


@settings(max_examples=40, deadline=None)
@given(cases(), st.integers(0, 2**31 - 1))
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_storage_order_never_changes_the_kept_positions(granularity, case, other_seed):
    assert case.kept(granularity) == case.kept(granularity, storage_seed=other_seed)


@settings(max_examples=80, deadline=None)
@given(cases())
def test_head_page_keeps_whole_position_pages_per_head(case):
    kept = case.kept("head_page")
    S = case.block
    for b in range(case.B):
        for h in range(case.H):
            live = set(case.held[b][h])
            for q in {p // S for p in live}:
                page = {p for p in live if p // S == q}
                assert page <= kept[b][h] or not (page & kept[b][h])


@settings(max_examples=80, deadline=None)
@given(cases())
def test_page_keeps_the_same_whole_pages_in_every_head(case):
    kept = case.kept("page")
    S = case.block
    for b in range(case.B):
        union = set().union(*kept[b])
        held = set().union(*case.held[b])
        assert union == {p for p in held if p // S in {x // S for x in union}}  # whole pages of any head's tokens
        for h in range(case.H):  # a position is kept in every head that holds it, or in none
            assert kept[b][h] == union & set(case.held[b][h])


@settings(max_examples=60, deadline=None)
@given(cases(blocks=(1,)))
def test_one_token_pages_are_tokens_and_per_head_pages_are_heads(case):
    # block 1: a page is a position, it holds one token and nothing is ever being filled
    assert case.kept("page") == case.kept("token")
    assert case.kept("head_page") == case.kept("head")


@settings(max_examples=60, deadline=None)
@given(cases(max_heads=1))
def test_with_one_kv_head_page_and_head_page_agree(case):
    assert case.kept("page") == case.kept("head_page")


@settings(max_examples=80, deadline=None)
@given(cases(), st.sampled_from([0.0, 0.2, 0.5, 1.0]))
def test_adaptive_keeps_the_layer_budget_and_every_heads_floor(case, alpha):
    scores, positions = case.tensors()
    seen, budget = case.args()
    keep = select_adaptive(scores, positions, seen, budget, alpha, case.sinks, torch.tensor(case.recent))
    assert not keep[positions < 0].any()
    kept = kept_positions(keep, positions)
    other_scores, other_positions = case.tensors(storage_seed=case.storage_seed + 7)
    other = select_adaptive(other_scores, other_positions, seen, budget, alpha, case.sinks, torch.tensor(case.recent))
    assert kept_positions(other, other_positions) == kept  # storage order does not matter
    for b in range(case.B):
        k = case.budget[b]
        lives = [live_count(case, b, h) for h in range(case.H)]
        # (g) the layer keeps budget x H_kv in all (or everything, if less is live)
        assert sum(len(s) for s in kept[b]) == min(k * case.H, sum(lives))
        for h in range(case.H):
            assert len(kept[b][h]) >= min(lives[h], math.ceil(alpha * k))
            live = case.held[b][h]
            protected = sorted((p for p in live if case.is_sink(p))) + \
                sorted((p for p in live if case.is_protected(b, p) and not case.is_sink(p)), reverse=True)
            assert set(protected[:k]) <= kept[b][h]  # its protected tokens, in the keep order, at most k

@settings(max_examples=300, deadline=None)
@given(cases(), st.sampled_from([0.0, 0.2, 0.5, 1.0]), st.integers(0, adakv._FEW + 2), st.booleans(), st.booleans())
def test_adaptive_a_few_tokens_over_the_budget_leave_as_the_sorts_decide(case, alpha, over, no_recent, extremes):
    """Ada-KV's decode path (`adakv._drop_the_last_few`: no layer row more than `_FEW` tokens over its budget,
    each pool's last token found by reductions) keeps what the sorts of the whole layer keep: budgets that leave
    each row 0 to `_FEW` + 2 tokens over, score levels that tie (3 levels), and with `extremes` zeros of either
    sign and infinities among the scores. It declines only where the sorts must decide (too many over, protected
    tokens beyond a head's cap, a NaN score)."""
    if no_recent:
        case.recent = [0] * case.B
    case.budget = [max(1, -(-(sum(live_count(case, b, h) for h in range(case.H)) - over) // case.H))
                   for b in range(case.B)]
    scores, positions = case.tensors()
    if extremes:  # the three levels become -0.0 or 0.0, -inf, +inf
        signed_zero = torch.where(torch.rand(scores.shape, generator=torch.Generator().manual_seed(0)) < 0.5, -0.0, 0.0)
        scores = torch.where(scores == 0, signed_zero, torch.where(scores == 1, -torch.inf, torch.inf))
    seen, budget = case.args()
    recent = torch.tensor(case.recent)
    fast = adakv._drop_the_last_few(scores, positions, seen, budget, alpha, case.sinks, recent)
    by_sorting = adakv._select_adaptive_by_sorting(scores, positions, seen, budget, alpha, case.sinks, recent)
    protected_overflow = any(sum(case.is_protected(b, p) for p in case.held[b][h]) > case.budget[b]
                             for b in range(case.B) for h in range(case.H))
    over_budget = max(sum(live_count(case, b, h) for h in range(case.H)) - case.budget[b] * case.H
                      for b in range(case.B))
    assert (fast is None) == (over_budget > adakv._FEW or protected_overflow)
    if fast is not None:
        assert kept_positions(fast, positions) == kept_positions(by_sorting, positions)
    nan_scores = scores.masked_fill(positions >= 0, torch.nan)
    assert not (positions >= 0).any() or adakv._drop_the_last_few(nan_scores, positions, seen, budget, alpha, case.sinks, recent) is None


@settings(max_examples=300, deadline=None)
@given(cases(max_heads=3), st.integers(0, 2), st.booleans(), st.booleans())
def test_kvzip_pooled_selection_keeps_the_protected_and_the_highest_scores_of_any_layer(case, over, no_recent,
                                                                                        extremes):
    """KVzip's budget pooled over layers and heads (`select_across_layers`, which finds the pool's last tokens by a
    k-th smallest score instead of sorting) against the rule written out: every protected token, then the highest
    scores of any layer, head and slot, ties to the lower layer, head and slot. The case's rows are the layers of
    one sequence; budgets from everything kept to a few tokens over (a decode step) to far over (a prompt's
    compression); 3 score levels tie; with `extremes`, signed zeros and infinities."""
    from evalkit.policies.kvzip import select_across_layers

    if no_recent:
        case.recent = [0] * case.B
    scores, positions = case.tensors()  # [L, H, N]: the case's rows as layers
    if extremes:
        signed_zero = torch.where(torch.rand(scores.shape, generator=torch.Generator().manual_seed(0)) < 0.5, -0.0, 0.0)
        scores = torch.where(scores == 0, signed_zero, torch.where(scores == 1, -torch.inf, torch.inf))
    L, H, N = scores.shape
    seen = max(case.seen)
    live_total = int((positions >= 0).sum())
    total_cap = max(L, -(-(live_total - [0, 1, live_total // 2][over]) // H))  # sum over layers of caps x H
    caps = torch.tensor([total_cap // L + (layer < total_cap % L) for layer in range(L)])[:, None]  # [L, 1]
    recent = torch.tensor([min(r, seen) for r in case.recent])[:, None]
    keep = select_across_layers(scores[:, None], positions[:, None], torch.tensor([seen]), caps, case.sinks, recent)
    protected, pool = [], []
    for layer in range(L):
        for h in range(H):
            for slot in range(N):
                p = int(positions[layer, h, slot])
                if p < 0:
                    continue
                if p < case.sinks or p >= seen - int(recent[layer]):
                    protected.append((layer, h, slot))
                else:
                    pool.append((-float(scores[layer, h, slot]), layer, h, slot))
    left = max(0, int(caps.sum()) * H - len(protected))
    expected = set(protected) | {unit[1:] for unit in sorted(pool)[:left]}
    assert {tuple(x) for x in keep[:, 0].nonzero().tolist()} == expected


def test_kvzip_pooled_selection_ranks_a_nan_score_last_as_the_sorts_do():
    from evalkit.policies.kvzip import select_across_layers

    scores = torch.tensor([1.0, torch.nan, 3.0, 2.0]).view(1, 1, 1, 4)  # [L, B, H, N]
    keep = select_across_layers(scores, torch.arange(4).view(1, 1, 1, 4), t([4], torch.long), t([[2]], torch.long))
    assert keep.flatten().tolist() == [False, False, True, True]


# --- tokens_for ----------------------------------------------------------------------------

def test_resolve_budget_fraction_rounds_up_and_clamps():
    lengths = t([10, 7, 1, 3], torch.long)
    # 0.5 * [10, 7, 1, 3] = [5, 3.5, 0.5, 1.5] -> ceil [5, 4, 1, 2]
    assert tokens_for(0.5, lengths).tolist() == [5, 4, 1, 2]
    # 0.01 * 10 = 0.1 -> 1; 0.0 -> 0 -> clamped to at least 1
    assert tokens_for(0.01, lengths).tolist() == [1, 1, 1, 1]
    assert tokens_for(0.0, lengths).tolist() == [1, 1, 1, 1]
    assert tokens_for(0.25, t([8, 9], torch.long)).tolist() == [2, 3]  # 2.0 -> 2, 2.25 -> 3


def test_resolve_budget_one_means_everything():
    lengths = t([10, 7, 1], torch.long)
    assert tokens_for(1.0, lengths).tolist() == [10, 7, 1]
    assert tokens_for(1, lengths).tolist() == [10, 7, 1]  # 1 is the fraction 1.0, not one token


def test_resolve_budget_counts_above_one_are_tokens_clamped_to_the_length():
    lengths = t([10, 7, 1], torch.long)
    assert tokens_for(4, lengths).tolist() == [4, 4, 1]
    assert tokens_for(8.0, lengths).tolist() == [8, 7, 1]
    assert tokens_for(2, lengths).tolist() == [2, 2, 1]


@pytest.mark.parametrize("fraction,length,expected", [(0.07, 100, 7), (0.14, 100, 14), (0.28, 100, 28),
                                                      (0.3, 10, 3), (0.7, 10, 7)])
def test_resolve_budget_fraction_of_an_exact_multiple_is_not_rounded_up(fraction, length, expected):
    # 7% of 100 tokens is 7 tokens, not ceil(7.000000000000001) = 8
    assert tokens_for(fraction, t([length], torch.long)).tolist() == [expected]


@settings(max_examples=80, deadline=None)
@given(cases(), st.integers(0, 1))
def test_head_eviction_of_at_most_one_token_per_head_follows_the_rule_book(case, spare):
    # Decode-time eviction: every head holds at most one token over its budget (keep_mask's fast path).
    case.budget = [max(1, max(live_count(case, b, h) for h in range(case.H)) - spare) for b in range(case.B)]
    assert case.kept("head") == reference_keep(case, "head")


@settings(max_examples=80, deadline=None)
@given(cases(), st.integers(0, 1))
def test_token_eviction_of_at_most_one_token_per_sequence_follows_the_rule_book(case, spare):
    # Decode-time eviction at token granularity: no sequence holds more than one token over its budget (keep_mask
    # drops its last token in the keep order by reductions, `_drop_one_token`, not by sorting).
    case.budget = [max(1, live_count(case, b) - spare) for b in range(case.B)]
    assert case.kept("token") == reference_keep(case, "token")


@settings(max_examples=60, deadline=None)
@given(cases(), st.integers(0, 1), st.integers(0, 5))
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_static_selection_keeps_what_the_general_one_keeps(granularity, case, over, room):
    """`keep_mask(span=...)`, the static decode step's (loop/static_decode.py: every shape fixed by the span,
    nothing read back to the host), against `keep_mask` itself: at page granularities on any case (a fixed
    S + 1 rounds of the greedy fill), at head and token where no head (token: no sequence) holds more than
    `over` <= 1 tokens over its cap, what a decode step leaves."""
    if granularity in (Granularity.HEAD, Granularity.TOKEN):
        per_row = [max(live_count(case, b, h) for h in range(case.H)) if granularity == Granularity.HEAD
                   else live_count(case, b) for b in range(case.B)]
        case = dataclasses.replace(case, budget=[max(1, n - over) for n in per_row])
    scores, positions = case.tensors()
    seen, budget = case.args()
    recent = torch.tensor(case.recent)
    general = keep_mask(scores, positions, seen, budget, granularity, case.block, case.sinks, recent)
    static = keep_mask(scores, positions, seen, budget, granularity, case.block, case.sinks, recent,
                       span=max(case.seen) + room)
    assert kept_positions(static, positions) == kept_positions(general, positions)
