"""Each policy's definition pinned on a hand-computed example, and the zoo's shared promises.

The rules are docs/policies.md's. Tests marked "fails on the pre-fix code" were run against the commit
before the definition fixes of issue 14 (a separate worktree) and failed there; they pass now.
"""

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import SHORT_PROMPT_ARGS, tiny_config, tiny_model
from evalkit.errors import EvalkitError
from evalkit.loop import GenerationSettings, Request, generate
from evalkit.policies import (GRANULARITIES, PAGE_GRANULARITIES, POLICIES, ScoreInput, keep_mask, make_policy,
                              policy_args)


def score_input(attention=None, keys=None, positions=None, stat_end=None, layer=0, seed=0):
    attention = torch.as_tensor(attention, dtype=torch.float32) if attention is not None else None
    shaped = next(x for x in (attention, positions, keys[..., 0] if keys is not None else None) if x is not None)
    B, H, N = shaped.shape
    positions = positions if positions is not None else torch.arange(N).expand(B, H, N)
    keys = keys if keys is not None else torch.zeros(B, H, N, 4)
    inp = ScoreInput(keys, positions, attention if attention is not None else torch.zeros(B, H, N), layer, seed)
    inp.key_norms = keys.double().norm(dim=-1)  # what the storage keeps for a scorer that reads them
    # Set after construction (not as a keyword) so that the same test runs on the pre-fix code, which had no
    # stat_end, and fails on its assertion rather than on a TypeError.
    inp.stat_end = torch.as_tensor(stat_end) if stat_end is not None else None
    return inp


def by_slot(by_position, positions):
    return [[[by_position[p] for p in row] for row in rows] for rows in positions.tolist()]


def test_score_input_has_a_stat_end_field():
    fields = {f.name: f for f in dataclasses.fields(ScoreInput)}
    assert "stat_end" in fields and fields["stat_end"].default is None


def test_knorm_scores_keys_by_negative_norm():
    keys = torch.tensor([[[[3.0, 4.0], [0.0, 1.0], [6.0, 8.0], [1.0, 1.0]]]])  # norms 5, 1, 10, 1.41
    scores = make_policy("knorm").score(score_input(keys=keys))
    assert scores[0, 0].tolist() == pytest.approx([-5.0, -1.0, -10.0, -math.sqrt(2)])


# --- SnapKV ------------------------------------------------------------------------------------

def snapkv(window, kernel, pooling="max"):
    policy = make_policy("snapkv")
    # attributes, not --policy-arg, so the test also runs on the pre-fix code
    policy.observation_window, policy.kernel_size, policy.pooling = window, kernel, pooling
    return policy


def test_snapkv_max_pools_the_prefix_over_neighbouring_positions_whatever_the_storage_order():
    # window 2, stat_end 10: prefix = positions 0..7, window = 8, 9 (protected, scored 0)
    positions = torch.tensor([[[3, 0, 9, 1, 2, 8, 7, 6, 5, 4]]])  # stored out of order: pooling follows positions
    attention = by_slot([0, 0, 5, 0, 0, 0, 1, 0, 0, 0], positions)
    scores = snapkv(2, 3).score(score_input(attention, positions=positions, stat_end=[10]))
    pooled = [0, 5, 5, 5, 0, 1, 1, 1, 0, 0]  # max over p-1, p, p+1 within the prefix
    assert (scores * 2).tolist() == by_slot(pooled, positions)  # a mean over the window's 2 queries


def test_snapkv_pooling_does_not_spread_window_attention_onto_the_positions_before_the_window():
    # Definition fix (issue 14, item 5); fails on the pre-fix code, which pooled over the window too and gave
    # position 7 the window's 7 (max) or (1 + 0 + 7) / 3 (avg).
    positions = torch.arange(10).view(1, 1, 10)
    attention = [[[0, 0, 0, 0, 0, 0, 1, 0, 7, 3]]]  # window (stat_end 10, w 2) = positions 8, 9
    scores = 2 * snapkv(2, 3, "max").score(score_input(attention, positions=positions, stat_end=[10]))  # x w: sums
    assert scores.tolist() == [[[0, 0, 0, 0, 0, 1, 1, 1, 0, 0]]]
    # avg pooling, padding and the window counted as zeros: (0 + 1 + 0) / 3 at 5, 6, 7
    scores = 2 * snapkv(2, 3, "avg").score(score_input(attention, positions=positions, stat_end=[10]))
    assert scores.flatten().tolist() == pytest.approx([0, 0, 0, 0, 0, 1 / 3, 1 / 3, 1 / 3, 0, 0])
    # per row: row 1 has seen 8 at its last statistic -> prefix 0..5; position 6 is its window
    attention = [[[0, 0, 0, 0, 0, 0, 1, 0, 7, 3]], [[0, 0, 0, 0, 0, 2, 9, 9, 0, 0]]]
    scores = 2 * snapkv(2, 3).score(score_input(attention, positions=torch.arange(10).expand(2, 1, 10),
                                                stat_end=[10, 8]))
    assert scores.tolist() == [[[0, 0, 0, 0, 0, 1, 1, 1, 0, 0]], [[0, 0, 0, 0, 2, 2, 0, 0, 0, 0]]]


def test_snapkv_protects_its_window_on_top_of_the_recent_share():
    assert make_policy("snapkv").recent_count(torch.tensor([100, 10])).tolist() == [32, 32]
    assert make_policy("snapkv", args={"window": "64"}).recent_count(torch.tensor([100])).tolist() == [64]


# --- PyramidKV ---------------------------------------------------------------------------------

def test_pyramidkv_layer_budgets_by_hand():
    # Definition fix (issue 14, item 2): window w = 32 on top of a pyramid of selected tokens. Fails on the
    # pre-fix code (budget 50, 4 layers: [98, 66, 34, 2] -- the window inside, the total 200 only by luck).
    budgets = torch.tensor([50, 42, 50, 33, 32, 20])
    lengths = torch.tensor([200, 200, 60, 200, 200, 200])
    got = make_policy("pyramidkv").layer_caps(budgets, lengths, 4).T.tolist()
    # k 50, n 200: m = 18, lo = 18 // 20 = 0, hi = 36 <= n - w = 168; 36 - 36 l / 3 = [36, 24, 12, 0] + 32
    assert got[0] == [68, 56, 44, 32]
    # k 42: m = 10, lo 0, hi 20: [20, 13.33, 6.67, 0] floors [20, 13, 6, 0] = 39, one short of 40 -> the
    # largest remainder (.67, layer 2) gets it: [20, 13, 7, 0] + 32
    assert got[1] == [52, 45, 39, 32]
    # k 50, n 60: hi 36 > n - w = 28 -> hi 28, lo 2 * 18 - 28 = 8: [28, 21.33, 14.67, 8] -> [28, 21, 15, 8] + 32;
    # the first layer keeps the whole prompt, the total stays 4 x 50
    assert got[2] == [60, 53, 47, 40]
    # k 33: m = 1, lo 0, hi 2: [2, 1.33, .67, 0] -> [2, 1, 0, 0] + the one short to layer 2 -> [2, 1, 1, 0] + 32
    assert got[3] == [34, 33, 33, 32]
    # k 32, k 20 <= w: no pyramid above the window, SnapKV's uniform budget (as kvpress falls back)
    assert got[4] == [32, 32, 32, 32]
    assert got[5] == [20, 20, 20, 20]


@pytest.mark.parametrize("num_layers", [2, 3, 5, 16, 30, 32])
def test_pyramidkv_layer_budgets_sum_to_the_uniform_total_with_the_window_on_top(num_layers):
    # Fails on the pre-fix code (e.g. n 2048, budget 0.9: the first layer was cut to the prompt, -19 % in all).
    policy = make_policy("pyramidkv")
    w = policy.observation_window
    for n in (40, 100, 333, 2048, 4096):
        lengths = torch.full((7,), n)
        budget = torch.tensor([1, 20, 33, n // 10 + 1, n // 2, math.ceil(0.9 * n), n]).clamp(max=n)
        got = policy.layer_caps(budget, lengths, num_layers)  # [L, B]
        assert got.shape == (num_layers, 7)
        for b in range(7):
            k, col = int(budget[b]), got[:, b].tolist()
            if k <= w:  # fall back to uniform
                assert col == [k] * num_layers
                continue
            assert sum(col) == num_layers * k, (n, k, col)  # exactly the uniform total
            assert all(c >= w for c in col)  # the window on top of every layer's selection
            assert all(c <= n for c in col)  # clamped: the first layer never exceeds the prompt
            assert col == sorted(col, reverse=True)  # a pyramid


def test_pyramidkv_one_layer_is_uniform():
    assert make_policy("pyramidkv").layer_caps(torch.tensor([50]), torch.tensor([200]), 1).tolist() == [[50]]


# --- TOVA --------------------------------------------------------------------------------------

def test_tova_is_one_token_set_per_layer_and_tova_head_the_per_head_variant():
    # Definition fix (issue 14, item 3); fails on the pre-fix code, where `tova` was the per-KV-head variant.
    tova = make_policy("tova")
    assert (tova.name, tova.granularity) == ("tova_token", "token")
    assert make_policy("tova_head").granularity == "head"
    assert make_policy("tova_head_page").granularity == "head_page"
    # heads disagree; `tova` keeps one set: the mean of the last query's attention over the heads
    attention = torch.tensor([[[0.5, 0.1, 0.1, 0.3], [0.1, 0.1, 0.6, 0.2]]])
    positions = torch.arange(4).expand(1, 2, 4)
    scores = tova.score(score_input(attention, positions=positions, stat_end=[4]))
    keep = tova.select(scores, positions, torch.tensor([4]), torch.tensor([2]), 16, torch.tensor([0]))
    # means over heads [0.3, 0.1, 0.35, 0.25] -> positions 2, 0 in both heads
    assert keep.tolist() == [[[True, False, True, False], [True, False, True, False]]]
    per_head = make_policy("tova_head")
    keep = per_head.select(scores, positions, torch.tensor([4]), torch.tensor([2]), 16, torch.tensor([0]))
    assert keep.tolist() == [[[True, False, False, True], [False, False, True, True]]]


# --- Quest -------------------------------------------------------------------------------------

# one KV head, one query head, D = 2, 5 pages of 2 tokens (positions 0..9), block 2; query (1, 1):
QUEST_KEYS = torch.tensor([[[[1.0, 0.0], [2.0, 0.0],      # page 0: min (1, 0) max (2, 0)     -> bound 2 + 0 = 2
                             [0.0, 1.0], [0.0, 3.0],      # page 1: min (0, 1) max (0, 3)     -> 0 + 3 = 3
                             [0.5, 0.0], [0.5, 0.5],      # page 2: min (.5, 0) max (.5, .5)  -> .5 + .5 = 1
                             [-1.0, 0.0], [-1.0, -1.0],   # page 3: min (-1, -1) max (-1, 0)  -> -1 + 0 = -1
                             [-5.0, -5.0], [-5.0, -5.0]]]])  # page 4: the newest, bound -10, read anyway
QUEST_QUERY = torch.tensor([[[1.0, 1.0]]])


def test_quest_attends_the_top_pages_by_key_bounds_and_always_the_newest():
    quest = make_policy("quest")
    positions = torch.arange(10).view(1, 1, 10)
    slots = quest.attended_slots(2, QUEST_QUERY, QUEST_KEYS, positions, torch.tensor([8]), page_size=2)
    # budget 8 -> ceil(8 / 2) = 4 pages: the newest (4) + the best bounds: page 1 (3), page 0 (2), page 2 (1)
    assert slots.int().tolist() == [[[1, 1, 1, 1, 1, 1, 0, 0, 1, 1]]]
    # stored out of order, with an empty slot: the same positions
    perm = torch.tensor([9, 3, 0, 7, 5, 1, 8, 2, 6, 4])
    keys = torch.cat([QUEST_KEYS[:, :, perm], torch.zeros(1, 1, 1, 2)], dim=2)
    stored = torch.cat([perm, torch.tensor([-1])]).view(1, 1, 11)
    slots = quest.attended_slots(2, QUEST_QUERY, keys, stored, torch.tensor([8]), page_size=2)
    assert sorted(stored[slots].tolist()) == [0, 1, 2, 3, 4, 5, 8, 9]


def test_quest_reads_everything_in_layers_0_and_1_and_at_least_3_pages_elsewhere():
    # Definition fix (issue 14, item 4); fails on the pre-fix code, which restricted every layer and read
    # ceil(2 / 2) = 1 page (the newest alone) at this budget.
    quest = make_policy("quest")
    positions = torch.arange(10).view(1, 1, 10)
    for layer in (0, 1):
        slots = quest.attended_slots(layer, QUEST_QUERY, QUEST_KEYS, positions, torch.tensor([2]), page_size=2)
        assert slots.all()
    slots = quest.attended_slots(2, QUEST_QUERY, QUEST_KEYS, positions, torch.tensor([2]), page_size=2)
    # max(3, ceil(2 / 2)) = 3 pages: the newest + page 1 (3) + page 0 (2)
    assert slots.int().tolist() == [[[1, 1, 1, 1, 0, 0, 0, 0, 1, 1]]]
    # empty slots are never read, dense layers included
    positions = torch.tensor([[[0, 1, -1, 3]]])
    slots = quest.attended_slots(0, QUEST_QUERY, QUEST_KEYS[:, :, :4], positions, torch.tensor([1]), page_size=2)
    assert slots.tolist() == [[[True, True, False, True]]]


def test_quest_token_reads_the_same_pages_in_every_kv_head():
    quest = make_policy("quest_token")
    keys = torch.cat([QUEST_KEYS, -QUEST_KEYS], dim=1)  # head 1's bounds disagree with head 0's
    positions = torch.arange(10).expand(1, 2, 10)
    slots = quest.attended_slots(2, torch.tensor([[[1.0, 1.0], [1.0, 1.0]]]), keys, positions, torch.tensor([2]), 2)
    assert slots[0, 0].tolist() == slots[0, 1].tolist()
    assert int(slots[0, 0].sum()) == 6  # 3 pages of 2


# --- random ------------------------------------------------------------------------------------

def test_random_priorities_of_a_sequence_do_not_depend_on_its_batch():
    # Definition fix (issue 14's parity: a sample's tokens must not depend on its batch); fails on the pre-fix
    # code, which drew one priority per (sequence index, head, position) for the batch's longest span.
    policy = make_policy("random")
    alone_positions = torch.arange(10).expand(1, 2, 10)
    alone = policy.score(score_input(positions=alone_positions, layer=3, seed=7))
    # the same sequence as row 1 of a batch of 3, stored out of order with holes, next to a longer sequence
    positions = torch.full((3, 2, 40), -1)
    positions[0] = torch.arange(40)
    perm = torch.tensor([4, 9, 0, 7, 2, 5, 1, 8, 3, 6])
    positions[1, :, 10:20] = perm
    positions[2, :, :5] = torch.arange(5)
    batched = policy.score(score_input(positions=positions, layer=3, seed=7))
    assert batched[1, :, 10:20].tolist() == alone[0, :, perm].tolist()
    assert batched[2, :, :5].tolist() == alone[0, :, :5].tolist()
    # and a token keeps its priority as the sequence grows
    assert batched[0, :, :10].tolist() == alone[0].tolist()
    # another layer or seed draws again; heads differ
    assert policy.score(score_input(positions=alone_positions, layer=4, seed=7)).tolist() != alone.tolist()
    assert policy.score(score_input(positions=alone_positions, layer=3, seed=8)).tolist() != alone.tolist()
    assert alone[0, 0].tolist() != alone[0, 1].tolist()


# --- H2O ---------------------------------------------------------------------------------------

def test_h2o_normalize_divides_by_the_queries_that_could_see_the_token():
    # Definition fix (issue 14, --policy-arg normalize, kvpress's ObservedAttention); fails on the pre-fix
    # code, whose score was the raw accumulated attention.
    policy = make_policy("h2o")
    positions = torch.tensor([[[3, 0, 2, 1]], [[0, 1, 2, -1]]])
    attention = [[[1.0, 6.0, 3.0, 4.0]], [[3.0, 4.0, 2.0, 0.0]]]
    assert policy.score(score_input(attention, positions=positions, stat_end=[4, 3])).tolist() == attention
    policy.normalize = True
    scores = policy.score(score_input(attention, positions=positions, stat_end=[4, 3]))
    # row 0, stat_end 4: position p was seen by 4 - p queries: 1 / 1, 6 / 4, 3 / 2, 4 / 3
    # row 1, stat_end 3: 3 / 3, 4 / 2, 2 / 1 (the empty slot's value does not matter)
    assert scores[0, 0].tolist() == pytest.approx([1.0, 1.5, 1.5, 4 / 3])
    assert scores[1, 0, :3].tolist() == pytest.approx([1.0, 2.0, 2.0])


# --- make_policy, --policy-arg, granularities, budgets ------------------------------------------

def test_policy_args_parse_known_keys_and_aliases():
    snap = make_policy("snapkv", args={"window": "64", "kernel": "5", "pooling": "avg"})  # kvpress's settings
    assert (snap.observation_window, snap.kernel_size, snap.pooling) == (64, 5, "avg")
    snap = make_policy("snapkv", "page", {"observation_window": "16", "kernel_size": "3", "pooling": "max"})
    assert (snap.granularity, snap.observation_window, snap.kernel_size, snap.pooling) == ("page", 16, 3, "max")
    h2o = make_policy("h2o", args={"recent": "0.25", "normalize": "true", "sink_tokens": "4"})
    assert (h2o.recent_fraction, h2o.normalize, h2o.sink_tokens) == (0.25, True, 4)
    for text, value in (("false", False), ("1", True), ("0", False), ("yes", True), ("no", False), ("True", True)):
        assert make_policy("h2o", args={"normalize": text}).normalize is value
    assert make_policy("pyramidkv", args={"beta": "10"}).beta == 10.0
    # the registered preset itself is not changed by args
    assert make_policy("snapkv").observation_window == 32


@pytest.mark.parametrize("name,args,mentions", [
    ("snapkv", {"windw": "64"}, "windw"),  # unknown key
    ("h2o", {"kernel": "5"}, "kernel"),  # a key of another policy
    ("snapkv", {"window": "sixty"}, "window"),  # bad int
    ("snapkv", {"window": "1.5"}, "window"),
    ("snapkv", {"window": "0"}, "window"),
    ("snapkv", {"kernel": "4"}, "kernel"),  # even kernel
    ("snapkv", {"pooling": "foo"}, "pooling"),
    ("h2o", {"recent": "1.5"}, "recent"),  # out of [0, 1]
    ("h2o", {"recent": "nan"}, "recent"),
    ("h2o", {"normalize": "maybe"}, "normalize"),
    ("h2o", {"sink_tokens": "-1"}, "sink_tokens"),
    ("h2o", {"granularity": "page"}, "granularity"),  # not a hyper-parameter
    ("kvzip_head", {"pool_pages": "true"}, "head_page only"),  # pooled already
    ("kvzip_token", {"pool_pages": "true"}, "head_page only"),
    ("kvzip_page", {"pool_pages": "true"}, "head_page only"),
    ("kvzip_head_page", {"pool_pages": "true", "layerwise": "true"}, "contradict"),
])
def test_bad_policy_args_are_one_line_errors(name, args, mentions):
    with pytest.raises(EvalkitError) as error:
        make_policy(name, args=args)
    message = str(error.value)
    assert "\n" not in message and message
    assert mentions in message


def test_granularity_refusals():
    for granularity in ("page", "head_page"):
        with pytest.raises(EvalkitError, match="quest") as error:
            make_policy("quest", granularity)
        assert "\n" not in str(error.value)
    with pytest.raises(EvalkitError, match="head_page"):
        make_policy("adakv_snapkv", "head_page")
    with pytest.raises(EvalkitError, match="granularity"):
        make_policy("h2o", "layer")
    assert make_policy("quest", "token").granularity == "token"
    assert make_policy("adakv_snapkv", "page").granularity == "page"
    # every other policy runs at every granularity; each scorer has its _head_page preset
    for name in ("h2o", "snapkv", "pyramidkv", "knorm", "tova", "random", "streaming_llm"):
        for granularity in GRANULARITIES:
            assert make_policy(name, granularity).granularity == granularity
    for base in ("h2o", "snapkv", "pyramidkv", "knorm", "tova"):
        assert f"{base}_head_page" in POLICIES.names()


def test_adakv_at_token_and_page_is_snapkv():
    g = torch.Generator().manual_seed(3)
    scores, positions = torch.rand(2, 3, 20, generator=g), torch.arange(20).expand(2, 3, 20)
    seen, budget, recent = torch.tensor([20, 20]), torch.tensor([8, 5]), torch.tensor([2, 0])
    for granularity in ("token", "page"):
        ada = make_policy("adakv_snapkv", granularity).select(scores, positions, seen, budget, 4, recent)
        assert ada.tolist() == keep_mask(scores, positions, seen, budget, granularity, 4, 0, recent).tolist()


def test_check_budget_refuses_less_than_one_page_at_page_granularities():
    for granularity in PAGE_GRANULARITIES:
        policy = make_policy("h2o", granularity)
        policy.check_budget(16, 16, 100)  # one page: accepted
        policy.check_budget(0.16, 16, 100)  # 16 tokens
        policy.check_budget(1.0, 16, 10)  # a prompt shorter than a page, kept whole
        for budget, length in ((15, 100), (0.15, 100), (2, 100), (0.5, 10)):  # 15, 15, 2, 5 tokens
            with pytest.raises(EvalkitError, match="16") as error:
                policy.check_budget(budget, 16, length)
            assert "\n" not in str(error.value)
    for granularity in ("head", "token"):  # one token is a valid budget there
        make_policy("h2o", granularity).check_budget(2, 16, 100)
    make_policy("quest").check_budget(2, 16, 100)


# --- published defaults ------------------------------------------------------------------------

# Every hyper-parameter (`policy_args`) of every family at its published value, written out here, never read
# from a policy: a default that moves, or a hyper-parameter added without its value here, fails the test.
_NO_PROTECTION = dict(sink_tokens=0, recent_fraction=0.0, recent_tokens=0, observation_window=0)
_SNAPKV = dict(_NO_PROTECTION, observation_window=32, kernel_size=7, pooling="max")
PUBLISHED_DEFAULTS = {
    "full": _NO_PROTECTION,  # nothing evicted
    "random": _NO_PROTECTION,  # the floor: nothing protected
    "knorm": _NO_PROTECTION,  # Devoto et al. (arXiv:2406.11430); kvpress's KnormPress: no sinks, no window
    # StreamingLLM (arXiv:2309.17453): 4 attention sinks, the rest of the budget the recent window
    # (kvpress's StreamingLLMPress(n_sink=4))
    "streaming_llm": dict(_NO_PROTECTION, sink_tokens=4, recent_fraction=1.0),
    # H2O (arXiv:2306.14048): heavy-hitter and recent budgets equal, half the budget recent; plain sums
    # (normalize=true is kvpress's ObservedAttention, an option)
    "h2o": dict(_NO_PROTECTION, recent_fraction=0.5, normalize=False),
    # TOVA (arXiv:2401.06104): the last query's attention (a window of 1); the newest token kept, as
    # kvpress 0.5.5's TOVAPress pads its score with max + 1
    "tova": dict(_NO_PROTECTION, observation_window=1, recent_tokens=1),
    # SnapKV (arXiv:2404.14469; KVCache-Factory's SnapKV runs): observation window 32, max pooling of width 7
    "snapkv": _SNAPKV,
    # PyramidKV (arXiv:2406.02069; KVCache-Factory's PyramidKVCluster): SnapKV's, beta 20
    "pyramidkv": dict(_SNAPKV, beta=20.0),
    # Quest (arXiv:2406.10774; evaluation/quest_attention.py): layers 0 and 1 dense, at least 3 pages read
    "quest": dict(_NO_PROTECTION, dense_layers=2, min_pages=3),
    # KeyDiff (arXiv:2504.15364; kvpress 0.5.5's KeyDiffPress): no hyper-parameter of its own
    "keydiff": _NO_PROTECTION,
    # LagKV (arXiv:2504.04704; kvpress 0.5.5's LagKVPress): n_sink 4, lag_size 128
    "lagkv": dict(_NO_PROTECTION, sink_tokens=4, lag_size=128),
    # Expected Attention (arXiv:2510.00636; kvpress 0.5.5's ExpectedAttentionPress): n_future_positions 512,
    # n_sink 4, covariance and value norm on, epsilon 0
    "expected_attention": dict(_NO_PROTECTION, sink_tokens=4, n_future_positions=512, use_covariance=True,
                               use_vnorm=True, epsilon=0.0),
    # DuoAttention (arXiv:2410.10819; kvpress 0.5.5's DuoAttentionPress(on_the_fly_scoring=True)): streaming heads
    # keep sink_size 128 + recent_size 256
    "duo_attention": dict(_NO_PROTECTION, sink_tokens=128, recent_tokens=256, head_compression_ratio=0.0),
    # KVzip (arXiv:2505.23416; kvpress 0.5.5's KVzipPress): n_sink 4, chunk_size 2048, the budget pooled over
    # layers and heads (layerwise False); pool_pages is evalkit's (kvpress has no pages): off
    "kvzip": dict(_NO_PROTECTION, sink_tokens=4, chunk_size=2048, layerwise=False, pool_pages=False),
}
_WRAPPED = ("h2o", "snapkv", "tova", "knorm", "keydiff", "lagkv", "expected_attention")
# Ada-KV over any scorer (arXiv:2407.11550; kvpress 0.5.5's AdaKVPress(press), alpha_safeguard=0.20): the
# scorer's, a safeguard of 0.2; `adakv` is `adakv_snapkv`
PUBLISHED_DEFAULTS |= {f"adakv_{s}": dict(PUBLISHED_DEFAULTS[s], alpha_safeguard=0.2) for s in _WRAPPED}
PUBLISHED_DEFAULTS["adakv"] = PUBLISHED_DEFAULTS["adakv_snapkv"]
# CriticalKV over any scorer (arXiv:2502.03805; kvpress 0.5.5's CriticalKVPress(press)): the scorer's, epsilon
# 1e-4, first_stage_ratio 0.5; Expected Attention without its value norm (kvpress warns it should be off)
PUBLISHED_DEFAULTS |= {f"critical_{s}": dict(PUBLISHED_DEFAULTS[s], critical_epsilon=1e-4, first_stage_ratio=0.5,
                                             **({"use_vnorm": False} if s == "expected_attention" else {}))
                       for s in _WRAPPED}
# Names that do not end in their granularity (`<family>_<granularity>` runs at that granularity).
OWN_GRANULARITY = {
    "full": "head", "random": "head", "streaming_llm": "head", "quest": "head",
    "adakv": "head", "h2o": "head", "snapkv": "head", "pyramidkv": "head", "knorm": "head",
    "h2o_block1": "token",  # H2O's block size 1: one set of single tokens for all heads
    "tova": "token",  # TOVA as published: one set per layer, from all heads' attention
    "keydiff": "head", "lagkv": "head", "expected_attention": "head", "kvzip": "head",  # kvpress: per KV head
    "duo_attention": "head",  # a role per KV head: retrieval or streaming
    **{f"adakv_{s}": "head" for s in _WRAPPED},  # Ada-KV reallocates across heads: head granularity
    # CriticalKV corrects each KV head's scores by its own projected values (TOVA's too): per head
    **{f"critical_{s}": "head" for s in _WRAPPED},
}


def every_name():
    """Every registered name and alias."""
    return sorted({*POLICIES.names(), *(a for n in POLICIES.names() for a in POLICIES.aliases_of(n))})


def published_granularity(name: str) -> str | None:
    suffix = next((g for g in sorted(GRANULARITIES, key=len, reverse=True) if name.endswith(f"_{g}")), None)
    return suffix or OWN_GRANULARITY.get(name)


@pytest.mark.parametrize("name", every_name())
def test_every_policy_has_its_published_defaults(name):
    family = next((f for f in sorted(PUBLISHED_DEFAULTS, key=len, reverse=True)
                   if name == f or name.startswith(f + "_")), None)
    if family is None:
        pytest.fail(f"policy {name!r} has no family in PUBLISHED_DEFAULTS (tests/test_policies.py): add its "
                    f"published hyper-parameters, with where they come from")
    policy, expected = make_policy(name), PUBLISHED_DEFAULTS[family]
    got = {key: getattr(policy, key) for key in policy_args(policy)}
    unpinned, gone = sorted(set(got) - set(expected)), sorted(set(expected) - set(got))
    assert not unpinned and not gone, (f"{name}: hyper-parameters without a published value in "
                                       f"PUBLISHED_DEFAULTS[{family!r}]: {unpinned}; pinned but absent: {gone}")
    moved = {key: (got[key], value) for key, value in expected.items()
             if got[key] != value or type(got[key]) is not type(value)}
    assert not moved, f"{name}: defaults moved from their published values, (now, published): {moved}"
    granularity = published_granularity(name)
    assert granularity is not None, f"{name}: add the granularity it runs at to OWN_GRANULARITY"
    assert policy.granularity == granularity, f"{name} runs at {policy.granularity}, not {granularity}"


# --- statistics and the loop -------------------------------------------------------------------

def test_tova_statistic_is_the_last_query_attention_and_snapkv_the_window_sum():
    """Against transformers' eager attention weights on a tiny model (GQA 3)."""
    prompt = torch.randint(3, 128, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    model = tiny_model("llama", kv_heads=2)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(torch.tensor([prompt]), output_attentions=True).attentions
    model.generation_config.eos_token_id = None
    for name, window in (("tova", 1), ("snapkv", 32)):
        stats = {}

        def grab(event, cache):
            if event == "forward" and not stats:
                for li, layer in enumerate(cache.layers):
                    view = layer.read()
                    order = view.pos[0].argsort(-1)[:, -24:]
                    stats[li] = view.stats[0].gather(-1, order)

        generate(model, None, [Request(prompt, [], 2)], GenerationSettings(make_policy(name), budget=0.5),
                 observe=grab)
        for li, weights in enumerate(attentions):  # [1, H_q, T, T]
            expected = weights[0, :, -window:].sum(1).view(2, 3, 24).mean(1)
            torch.testing.assert_close(stats[li], expected, rtol=1e-5, atol=1e-6)


def every_policy_and_granularity():
    """(name, granularity) for every registered policy at every granularity it accepts (each preset's own,
    and every granularity of a policy registered under one name)."""
    combos, names = [], POLICIES.names()
    for name in names:
        policy = make_policy(name)
        if name == "full":
            continue
        if name.endswith(tuple(f"_{g}" for g in GRANULARITIES)):
            combos.append((name, policy.granularity))  # a preset: its own granularity
        else:
            combos += [(name, g) for g in GRANULARITIES if g not in policy.cannot_run_at and f"{name}_{g}" not in names]
    return combos


@functools.lru_cache(maxsize=1)
def gqa3_model():
    model = tiny_model("llama", kv_heads=2)
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("name,granularity", every_policy_and_granularity())
def test_every_policy_runs_at_every_granularity_within_its_budget(name, granularity):
    """A real loop with GQA 3 and a batch of two lengths: tokens kept per (layer, sequence, KV head) after
    prefill are within the budget (Ada-KV: within the layer's budget x H_kv), and page granularities keep at
    least budget - (page_size - 1). Paged and dense agree (all presets: tests/test_generate.py)."""
    model = gqa3_model()
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 23)]
    budget = torch.tensor([12, 7])  # ceil(0.3 x [40, 23])
    policy = make_policy(name, granularity, SHORT_PROMPT_ARGS.get(name))
    kept = {}

    def grab(event, cache):
        if event == "prefill":
            kept["tokens"] = cache.kept_tokens()  # [L, B, H_kv]

    requests = [Request(p[:-5], p[-5:], 3) for p in prompts]
    settings = GenerationSettings(policy, budget=0.3, page_size=4)
    out = generate(model, None, requests, settings, observe=grab)
    assert [len(g.token_ids) for g in out] == [3, 3]
    tokens = kept["tokens"]
    if not policy.evicts:
        assert tokens.tolist() == [[[40] * 2, [23] * 2]] * 2
        assert [g.kept_tokens for g in out] == [40, 23]
        # Quest reads everything in layers 0 and 1, as published: the tiny model has only those two
        assert [g.attended_fraction for g in out] == [1.0, 1.0]
        return
    for b in range(2):
        k = int(budget[b])
        per_head = tokens[:, b]  # [L, H_kv]
        if name.startswith("adakv") and granularity == "head":
            assert per_head.sum(-1).tolist() == [2 * k] * 2
        elif policy.selects_across_layers:  # KVzip: one budget pooled over the layers and heads
            assert int(per_head.sum()) == 2 * 2 * k
        elif name == "duo_attention":  # retrieval heads keep the prompt, streaming heads 1 sink + 3 recent
            assert float(per_head.float().mean()) <= k
        else:
            assert int(per_head.max()) <= k
            if granularity in PAGE_GRANULARITIES:
                assert int(per_head.min()) >= k - 3
            else:
                assert per_head.tolist() == [[k, k]] * 2
        assert out[b].kept_tokens == pytest.approx(float(per_head.float().mean()))


def newest_tokens_evicted(policy, prefill: str, query_aware: bool) -> int:
    """(sequence, layer, KV head) triples that lost their sequence's newest token at a compression (after
    every prefill chunk and decode step), GQA 3, a batch of two lengths at budget 0.2."""
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 23)]
    requests = [Request(p[:-5], p[-5:], 8) for p in prompts]
    newest, lost = {}, []

    def watch(event, cache):
        positions = [layer.read().pos for layer in cache.layers]  # [B, H_kv, N] each
        if event == "forward":  # every token just fed is held: the newest is each sequence's largest position
            newest["at"] = torch.stack([p.flatten(1).amax(1) for p in positions]).amax(0)  # [B]
        elif event == "compressed":
            lost.extend(int((~(p == newest["at"][:, None, None]).any(-1)).sum()) for p in positions)

    settings = GenerationSettings(policy, budget=0.2, page_size=4, prefill=prefill, chunk_size=16,
                                  query_aware=query_aware)
    generate(gqa3_model(), None, requests, settings, observe=watch)
    return sum(lost)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_tova_never_evicts_the_newest_token(granularity):
    """kvpress's TOVAPress pads the last token's score with max + 1, so it is never evicted; `tova` protects
    it too (recent_tokens 1), after every prefill chunk and every decode step. The paper's rule
    (recent_tokens=0) does evict it on this model: the check can fail."""
    for prefill, query_aware in (("full", True), ("chunked", False)):
        assert newest_tokens_evicted(make_policy(f"tova_{granularity}"), prefill, query_aware) == 0
    if granularity == "token":
        paper = make_policy("tova", args={"recent_tokens": "0"})
        assert newest_tokens_evicted(paper, "full", True) > 0


def test_quest_restricts_reads_from_the_third_layer_on():
    config = tiny_config("llama")
    config.num_hidden_layers = 3
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None
    prompt = torch.randint(3, 128, (64,), generator=torch.Generator().manual_seed(4)).tolist()
    out = generate(model, None, [Request(prompt, [], 4)], GenerationSettings(make_policy("quest"), budget=8,
                                                                              page_size=4))
    # layers 0 and 1 read all their slots, layer 2 about max(3, 2) pages of 16: 2/3 < fraction < 1
    assert 2 / 3 < out[0].attended_fraction < 1.0


def test_adakv_heads_keep_different_numbers_of_tokens_and_free_the_pages():
    model = tiny_model("llama", kv_heads=2)
    model.generation_config.eos_token_id = None
    prompt = torch.randint(3, 128, (256,), generator=torch.Generator().manual_seed(1)).tolist()
    counts = {}

    def grab(event, cache):
        if event == "prefill":
            counts["kept"] = cache.kept_tokens()[:, 0]  # [L, H_kv]
            counts["held"] = int(cache.bytes_held()[0])
            counts["ideal"] = int(cache.bytes_ideal()[0])

    generate(model, None, [Request(prompt, [], 2)], GenerationSettings(make_policy("adakv"), budget=0.25,
                                                                        page_size=4), observe=grab)
    kept = counts["kept"]
    assert (kept.sum(-1) == 2 * 64).all()  # the layer total is budget x heads
    assert (kept[:, 0] != kept[:, 1]).any()  # ... split unevenly
    # paged: each head holds ceil(kept / 4) pages, not the largest head's count
    pages = sum(-(-int(k) // 4) for k in kept.flatten())
    assert counts["held"] == pages * 4 * model.config.head_dim * 2 * 4


def test_streaming_llm_keeps_the_sinks_and_the_most_recent_tokens():
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    prompt = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    kept = {}

    def grab(event, cache):
        if event == "prefill":
            kept.update({li: set(layer.read().pos[0, 0].tolist()) - {-1} for li, layer in enumerate(cache.layers)})

    generate(model, None, [Request(prompt, [], 1)], GenerationSettings(make_policy("streaming_llm"), budget=12),
             observe=grab)
    # 12 tokens: sinks 0..3, then the 8 most recent of 40
    assert all(k == {0, 1, 2, 3, *range(32, 40)} for k in kept.values())


def test_a_score_input_gathers_only_what_the_scorer_reads():
    """`ScoreInput.sources`: each field made on its first read, once; a scorer of the statistic alone (H2O) makes
    none, KeyDiff the keys only, LagKV the keys and values."""
    B, H, N, D = 1, 2, 6, 4
    generator = torch.Generator().manual_seed(0)
    tensors = {"keys": torch.randn(B, H, N, D, generator=generator), "values": torch.randn(B, H, N, D, generator=generator),
               "key_norms": torch.rand(B, H, N, generator=generator, dtype=torch.float64)}
    for name, wanted in (("h2o_head", set()), ("keydiff_head", {"keys"}), ("lagkv_head", {"keys", "values"}),
                         ("knorm", {"key_norms"})):
        made = []

        def source(field):
            return lambda: made.append(field) or tensors[field]

        inp = ScoreInput(None, torch.arange(N).expand(B, H, N), torch.rand(B, H, N, generator=generator), 0, 0,
                         torch.tensor([N]), caps=torch.tensor([3]), sources={f: source(f) for f in tensors})
        make_policy(name).score(inp)
        assert set(made) == wanted and len(made) == len(wanted), name
        for field in wanted:  # read again: the same tensor, not made twice
            assert getattr(inp, field) is tensors[field]
        assert len(made) == len(wanted)


# `python THIS OUT evalkit-args...`: the run, recording for each of KeyNorm's selections (layer, KV head, keys held,
# cap, float32 norms tie across the cap, float64 norms tie across it, float32 norms equal to the cap's) into OUT.
# A process of its own, so that MKL's kernels are chosen before it loads.
_KEY_NORM_BOUNDARIES = """
import itertools, json, sys
import torch
import evalkit.policies.knorm as knorm
from evalkit.cli import main

boundaries, score = [], knorm.KeyNorm.score

def recording(self, inp):
    for b, h in itertools.product(range(inp.positions.shape[0]), range(inp.positions.shape[1])):
        held, cap = inp.keys[b, h][inp.positions[b, h] >= 0], int(inp.caps[b])
        f32, f64 = (torch.linalg.vector_norm(held.to(dtype), dim=-1).sort().values
                    for dtype in (torch.float32, torch.float64))
        boundaries.append((inp.layer, h, len(held), cap, bool(f32[cap - 1] == f32[cap]),
                           bool(f64[cap - 1] == f64[cap]), int((f32 == f32[cap - 1]).sum())))
    return score(self, inp)

knorm.KeyNorm.score = recording
out, sys.argv = sys.argv[1], ["evalkit", *sys.argv[2:]]
try:
    main()
finally:
    with open(out, "w") as f:
        json.dump(boundaries, f)
"""


@pytest.mark.model  # the default model on one held-out sample of the parity set
def test_key_norms_tie_in_float32_across_a_cap_on_the_sample_where_kvpress_and_evalkit_differ(tmp_path):
    """docs/fidelity.md: key norm at keep 0.5 answers `niah_single_2-0075` (seed 1) differently in kvpress and
    evalkit. Of that prompt's 90 selections (30 layers × 3 KV heads), exactly one has keys whose float32 norms
    are equal across the cap: layer 0, KV head 1, four keys, 937 of 1,873 kept. kvpress's `topk` on float32
    scores keeps some of them by its own order; their float64 norms, by which evalkit ranks, differ. The keys'
    last bits are those of MKL's AVX2 kernels, which the parity set was measured with: on a CPU with AVX-512 MKL
    takes other kernels, and there no float32 norms tie; the run pins them (`MKL_ENABLE_INSTRUCTIONS=AVX2`)."""
    repo = Path(__file__).resolve().parent.parent
    data = repo / "runs/parity/data/niah_single_2-L2048-n100-seed1.jsonl"
    (line,) = [line for line in data.read_text().splitlines() if '"id": "niah_single_2-0075"' in line]
    sample, driver, out = tmp_path / "sample.jsonl", tmp_path / "record.py", tmp_path / "boundaries.json"
    sample.write_text(line + "\n")
    driver.write_text(_KEY_NORM_BOUNDARIES)
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    done = subprocess.run([sys.executable, str(driver), str(out), "run", "--task", f"jsonl:{sample}", "--format",
                           "kvpress", "--query-agnostic", "--no-decode-eviction", "--policy", "knorm_head",
                           "--budget", "0.5", "--length", "2048", "--seed", "1", "--out", str(tmp_path / "runs"),
                           "--wandb", "off", "--no-baseline"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    boundaries = [tuple(b) for b in json.loads(out.read_text())]
    assert len(boundaries) == 90
    assert [b for b in boundaries if b[4] or b[5]] == [(0, 1, 1873, 937, True, False, 4)]


def test_keydiff_scores_are_torchs_cosine_to_the_mean_unit_key_bit_for_bit():
    """KeyDiff's score, worked out without broadcasting the anchor, equals minus `F.cosine_similarity` of each key
    with the mean of the live keys' `F.normalize` in every bit: 300 random heads of 1 to 3,000 slots, head sizes
    7 to 256, keys of scales 10^-12 to 10^2 (some norms under both functions' eps), zero rows, empty slots or none;
    eagerly and as a static decode step computes it."""
    import torch.nn.functional as F

    policy = make_policy("keydiff_head")
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        batch, heads, slots = 1 + trial % 2, 1 + trial % 3, int(torch.randint(1, 3000, (), generator=generator))
        keys = torch.randn(batch, heads, slots, (64, 7, 128, 256)[trial % 4], generator=generator)
        keys *= 10.0 ** torch.randint(-12, 3, (batch, heads, slots, 1), generator=generator)
        if trial % 5 == 0:
            keys[..., ::3, :] = 0
        positions = torch.randint(-1 if trial % 2 else 0, 5, (batch, heads, slots), generator=generator)
        live = (positions >= 0)[..., None]
        anchor = (F.normalize(keys, dim=-1) * live).sum(2, keepdim=True) / live.sum(2, keepdim=True).clamp(min=1)
        expected = -F.cosine_similarity(keys, anchor, dim=-1)
        for span in (None, 5):  # eager, and a static step's (no host read)
            scores = policy.score(ScoreInput(keys, positions, None, 0, 0, span=span))
            assert torch.equal(scores.view(torch.int32), expected.view(torch.int32)), (trial, span)


def test_lagkv_channel_std_is_torchs_std_bit_for_bit():
    """LagKV's spread over channels, two float64 sums, equals `torch.std` in every bit: 1.3 million rows of 64
    and 256 channels (the default model's and Gemma 3's head sizes), min-max normalised as LagKV normalises
    them (by another partition's range, so some fall outside [0, 1]), channels of scales 10^-2 to 10^2."""
    from evalkit.policies.lagkv import channel_std

    generator = torch.Generator().manual_seed(0)
    for head_dim in (64, 256):
        for _ in range(10):
            magnitude = 10.0 ** torch.randint(-2, 3, (head_dim,), generator=generator)
            scale = torch.rand(head_dim, generator=generator) * magnitude
            x = torch.randn(2, 32768 * 64 // head_dim, head_dim, generator=generator) * scale + scale * 3
            low, high = x[1].amin(0), x[1].amax(0)
            normalised = (x[0] - low) / (high - low)
            assert torch.equal(channel_std(normalised), normalised.std(-1))


@pytest.mark.parametrize("evict", ["its own choice", "anywhere", "none", "rewrite"])
def test_lagkv_decode_steps_reuse_unchanged_partitions_with_the_same_scores(evict, monkeypatch):
    """Decode eviction re-scores LagKV every step. With the memo a layer's cache keeps (`ScoreInput.memo`), holding
    the ranks of the partitions whose tokens have the same stamps as in the last call (`ScoreInput.stamps`,
    `LagKV._ranks`), LagKV scores 40 steps exactly as without it: two heads of 1,100 tokens (4 sinks, lag 128),
    each step a new token written into a freed slot (slots not in position order) after the policy's own
    eviction, a random one, or none (the head grows and its partitions move), or a held token written again with
    another key or value at the same position (a new stamp, as the storage gives every write). With its own
    choice (the lowest score, ties to the later position: the last judged partition's first) a step gathers and
    works out the last two or three judged partitions of seven, where a call without it works out all."""
    from evalkit.policies import lagkv

    generator = torch.Generator().manual_seed(0)
    kv_of, stamp_of = {}, {}  # position -> (key, value), and its write's stamp

    def stamps(positions):
        for p in positions.flatten().tolist():
            stamp_of.setdefault(p, len(stamp_of) + 1000)
        return torch.tensor([stamp_of[p] for p in positions.flatten().tolist()]).view(positions.shape)

    def rows(positions, which):
        for p in positions.flatten().tolist():
            if p not in kv_of:
                kv_of[p] = (torch.randn(64, generator=generator), torch.randn(64, generator=generator))
        return torch.stack([kv_of[p][which] for p in positions.flatten().tolist()]).view(*positions.shape, 64)

    H, N = 2, 1100
    positions = torch.stack([torch.randperm(N, generator=generator) for _ in range(H)])[None]  # slots shuffled
    policy, memo, worked_out, judged = make_policy("lagkv_head"), {}, [0], 0  # memo: what the layer's cache keeps
    spread = lagkv.LagKV._spread
    monkeypatch.setattr(lagkv.LagKV, "_spread", lambda self, parts: (
        worked_out.__setitem__(0, worked_out[0] + len(parts) - 1) or spread(self, parts)))
    for step in range(40):
        inp = score_input(keys=rows(positions, 0), positions=positions.clone(), layer=3)
        inp.values, inp.stamps = rows(positions, 1), stamps(positions)
        counted = worked_out[0]
        fresh = policy.score(inp)  # without the memo: every partition worked out, not counted
        worked_out[0], inp.memo = counted, memo
        scores = policy.score(inp)
        assert torch.equal(scores, fresh)
        judged += 2 * H * ((positions.shape[-1] - 4) // 128 - 1)  # keys' and values' partitions
        newest = N + step
        if evict == "none":
            positions = torch.cat([positions, torch.full((1, H, 1), newest)], -1)
            continue
        if evict == "rewrite":
            position = int(torch.randint(N, (1,), generator=generator))
            key, value = kv_of[position]
            (key if step % 2 else value).copy_(torch.randn(64, generator=generator))  # the key's bits, or the value's
            stamp_of[position] = -step - 1  # written again: a stamp never handed out before
            continue
        for h in range(H):
            if evict == "its own choice":  # the lowest score, ties to the later position
                slot = int(torch.where(scores[0, h] == scores[0, h].min(), positions[0, h], -1).argmax())
            else:
                slot = int(torch.randint(N, (1,), generator=generator))
            positions[0, h, slot] = newest
    if evict == "its own choice":
        assert worked_out[0] < judged / 2


def test_lagkv_under_decode_eviction_gives_the_same_tokens_with_the_cache_kept_memo(monkeypatch):
    """The loop hands LagKV its layer's memo (`ScoreInput.memo`, `SlotLayer.scorer_memo`): a tiny Llama, a
    120-token prompt, lag 8, budget 0.5 and 12 tokens decoded with eviction give the same tokens and keep the same
    tokens in every layer and head with the memo as without it; the prompt's compression
    leaves the memo empty (its partitions all move),
    and the cache holds the ranks for both heads of every layer when decoding ends."""
    from evalkit.policies import lagkv

    model = tiny_model()
    prompt = (torch.arange(120) * 37 % 125 + 3).tolist()

    worked_out = [0]  # partitions worked out (keys' and values')
    spread = lagkv.LagKV._spread
    monkeypatch.setattr(lagkv.LagKV, "_spread", lambda self, parts: (
        worked_out.__setitem__(0, worked_out[0] + len(parts) - 1) or spread(self, parts)))

    def run():
        caches, remembered_after_prefill = [], []
        worked_out[0] = 0

        def observe(event, cache):
            caches.append(cache)
            if event == "prefill":
                remembered_after_prefill.extend(len(layer.scorer_memo) for layer in cache.layers)

        policy = make_policy("lagkv_head", args={"lag_size": "8"})
        out = generate(model, None, [Request(prompt, [], 12)], GenerationSettings(policy, budget=0.5), observe=observe)
        positions = [layer.gather(layer.pos, layer.slot_index()).sort(-1).values for layer in caches[-1].layers]
        assert remembered_after_prefill == [0, 0]  # the prompt's compression remembers nothing (all of it moved)
        return out[0].token_ids, positions, caches[-1], worked_out[0]

    tokens, kept, cache, with_memo = run()
    assert len(tokens) > 5  # decoded with eviction (EOS may end it early)
    assert [sorted(layer.scorer_memo) for layer in cache.layers] == [[("lagkv_ranks", 4, 8, (0, h)) for h in (0, 1)]] * 2
    ranks = lagkv.LagKV._ranks  # every partition worked out, as without the memo
    monkeypatch.setattr(lagkv.LagKV, "_ranks", lambda self, rows, judged, memo, head: ranks(self, rows, None, memo,
                                                                                              head))
    never_tokens, never_kept, _, without = run()
    assert tokens == never_tokens and all(torch.equal(a, b) for a, b in zip(kept, never_kept))
    assert with_memo < without  # the storage's stamps let decode steps keep some partitions' ranks


@pytest.mark.parametrize("cap, tail_kept", [(192, False), (383, True)])
def test_lagkv_under_a_cap_below_its_always_kept_tail_keeps_the_tails_earliest_tokens(cap, tail_kept):
    """LagKV's last whole partition and the remainder after it all score 1: 248 tokens of a 1,916-token prompt
    (4 sinks, lag 128). A cap under that (10 % of the prompt: 192) breaks the tie by position, the earlier kept,
    so the prompt's last tokens go first: with the question seen (compressed with the prompt), the question
    itself. A cap over it (20 %) keeps them all. Why `frontier_2k_aware.yaml`'s LagKV cells at 0.1 continue the
    haystack instead of answering (docs/granularity.md)."""
    N = 1916
    policy = make_policy("lagkv_head")
    inp = score_input(keys=torch.randn(1, 1, N, 64, generator=torch.Generator().manual_seed(0)))
    inp.values = torch.randn(1, 1, N, 64, generator=torch.Generator().manual_seed(1))
    scores = policy.score(inp)
    assert int((scores == 1).sum()) == 4 + 128 + (N - 4) % 128 == 4 + 248  # the sinks and the tail
    keep = policy.select(scores, inp.positions, torch.tensor([N]), torch.tensor([cap]), 16, None)
    kept = inp.positions[keep]
    assert len(kept) == cap
    assert bool((kept >= N - 32).any()) == tail_kept  # the prompt's last 32 tokens: the question and its template
    if not tail_kept:
        assert int(kept.max()) == (N - 248) + (cap - 4) - 1 == 1855  # the tail's earliest, as many as the cap allows


@pytest.mark.parametrize("rows", [1, 2, 3, 17])
def test_a_tokens_projected_value_norm_is_the_same_bits_whichever_tokens_it_is_computed_with(rows):
    """CriticalKV's ‖v W_o‖₁ of a few tokens (a decode step's new ones) equals, bit for bit, theirs computed with
    every token of the layer: without the padding to 16 rows, one to three rows round differently on the CPU.
    Shapes: the default model's (9 query heads of 64 over 3 KV heads, 576 wide), Gemma 3 270M's (4 of 256 over
    1, 640) and a tiny one."""
    from evalkit.policies.critical import projected_value_norms

    g = torch.Generator().manual_seed(rows)
    for kv_heads, q_heads, head_dim, hidden in [(3, 9, 64, 576), (1, 4, 256, 640), (2, 4, 16, 64)]:
        o_proj = torch.randn(hidden, q_heads * head_dim, generator=g)
        for n in (16, 300, 2_100):
            values = torch.randn(1, kv_heads, n, head_dim, generator=g)
            picked = torch.randperm(n, generator=g)[:rows]
            some = projected_value_norms(values[:, :, picked], o_proj)
            assert torch.equal(some, projected_value_norms(values, o_proj)[:, :, picked]), (head_dim, n)


@pytest.mark.parametrize("layout", ["paged", "dense"])
@pytest.mark.parametrize("name", ["critical_keydiff_head", "critical_lagkv_head_page"])
def test_critical_value_norms_kept_per_token_score_as_if_computed_at_every_step(name, layout, monkeypatch):
    """CriticalKV's projected value norms are computed once per stored token (`SlotLayer.per_slot`): through
    a chunked prefill and decode eviction at every step, every norm it scores with, the tokens kept and the
    tokens generated equal a run that computes every token's norm at every compression, bit for bit, from fewer
    rows."""
    import evalkit.policies.critical as critical
    from evalkit.cache.storage import SlotLayer

    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (130, 97)]
    requests = [Request(p[:-5], p[-5:], 8) for p in prompts]
    settings = GenerationSettings(make_policy(name), budget=0.5, page_size=4, prefill="chunked", chunk_size=48,
                                  layout=layout)
    norms_of = critical.projected_value_norms

    def run():
        norms, kept, rows = [], [], []

        def counted(values, o_proj):
            if values.shape[2] >= critical.ROWS_AT_LEAST:  # fewer: padded, and counted as the padded call
                rows.append(values.shape[2])
            return norms_of(values, o_proj)

        def recorded(self, name, of_values):
            out = ScoreInput.of_each_value.__wrapped__(self, name, of_values)
            norms.append(out[self.positions >= 0])
            return out

        def watch(event, cache):
            if event == "compressed":
                kept.append([layer.read().pos.sort(-1).values for layer in cache.layers])

        with monkeypatch.context() as patch:
            patch.setattr(critical, "projected_value_norms", counted)
            recorded.__wrapped__ = ScoreInput.of_each_value
            patch.setattr(ScoreInput, "of_each_value", recorded)
            out = generate(gqa3_model(), None, requests, settings, observe=watch)
        return [g.token_ids for g in out], norms, kept, sum(rows)

    tokens, norms, kept, rows = run()
    monkeypatch.setattr(SlotLayer, "per_slot", lambda self, name, index, compute: compute(index))
    every_step = run()
    assert tokens == every_step[0] and len(norms) == len(every_step[1]) >= 10  # LagKV: every `lag` tokens
    assert all(torch.equal(a, b) for a, b in zip(norms, every_step[1]))
    assert all(torch.equal(a, b) for step, other in zip(kept, every_step[2]) for a, b in zip(step, other))
    assert rows < every_step[3]
