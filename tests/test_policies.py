"""Each policy's definition pinned on a hand-computed example, and the zoo's shared promises."""

import math

import pytest
import torch

from conftest import tiny_model
from evalkit.generate import GenerationSettings, Request, generate
from evalkit.policies import POLICIES, ScoreInput, make_policy, select_adaptive


def score_input(attention=None, keys=None, positions=None):
    attention = torch.as_tensor(attention, dtype=torch.float32) if attention is not None else None
    B, H, N = (attention if attention is not None else keys[..., 0]).shape
    positions = positions if positions is not None else torch.arange(N).expand(B, H, N)
    keys = keys if keys is not None else torch.zeros(B, H, N, 4)
    return ScoreInput(keys, positions, attention if attention is not None else torch.zeros(B, H, N), 0, 0)


def test_knorm_scores_keys_by_negative_norm():
    keys = torch.tensor([[[[3.0, 4.0], [0.0, 1.0], [6.0, 8.0], [1.0, 1.0]]]])  # norms 5, 1, 10, 1.41
    scores = make_policy("knorm").score(score_input(keys=keys))
    assert scores[0, 0].tolist() == pytest.approx([-5.0, -1.0, -10.0, -math.sqrt(2)])


def test_snapkv_max_pools_window_attention_over_neighbouring_positions():
    policy = make_policy("snapkv")
    policy.kernel_size = 3
    # positions 0..7 stored out of order: pooling follows positions, not slots
    positions = torch.tensor([[[3, 0, 1, 2, 7, 6, 5, 4]]])
    by_position = [0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    attention = [[[by_position[p] for p in positions[0, 0].tolist()]]]
    scores = policy.score(score_input(attention, positions=positions))
    pooled = [0.0, 5.0, 5.0, 5.0, 0.0, 1.0, 1.0, 1.0]  # max over p-1, p, p+1
    assert scores[0, 0].tolist() == [pooled[p] for p in positions[0, 0].tolist()]
    assert policy.recent_tokens == policy.observation_window == 32


def test_pyramidkv_budgets_shrink_linearly_and_keep_the_total():
    budgets = make_policy("pyramidkv").layer_budgets(torch.tensor([100]), 4)
    # beta 20: last layer 100/20 = 5, first 2*100 - 5 = 195, then 195 - 190 * l / 3
    assert budgets[:, 0].tolist() == [195, 132, 68, 5]
    assert int(budgets.sum()) == 400


def test_adaptive_selection_splits_a_layer_budget_across_heads_by_score():
    # Two heads, budget 2 per head -> 4 for the layer; safeguard 0.5 -> each head keeps its best 1 first.
    scores = torch.tensor([[[9.0, 8.0, 7.0, 0.0], [1.0, 0.0, 0.5, 0.2]]])
    positions = torch.arange(4).expand(1, 2, 4)
    keep = select_adaptive(scores, positions, torch.tensor([4]), torch.tensor([2]), alpha_safeguard=0.5)
    # forced: head0 pos0 (9), head1 pos0 (1); the two left go to 8 and 7, both in head 0
    assert keep.int().tolist() == [[[1, 1, 1, 0], [1, 0, 0, 0]]]


def test_adaptive_selection_keeps_protected_tokens_and_the_layer_total():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(2, 3, 20, generator=g)
    positions = torch.arange(20).expand(2, 3, 20)
    budget = torch.tensor([6, 9])
    keep = select_adaptive(scores, positions, torch.tensor([20, 20]), budget, alpha_safeguard=0.2,
                           recent=torch.tensor([2, 2]))
    assert keep.sum((1, 2)).tolist() == [18, 27]
    assert keep[..., -2:].all()
    assert len(set(keep[1].sum(-1).tolist())) > 1  # heads hold different numbers of tokens


def test_quest_attends_the_top_pages_by_key_bounds_and_always_the_newest():
    quest = make_policy("quest")
    # one KV head, one query head, D=2, 3 pages of 2 tokens (positions 0..5)
    keys = torch.tensor([[[[1.0, 0.0], [2.0, 0.0],     # page 0: min (1,0) max (2,0)
                           [0.0, 1.0], [0.0, 3.0],     # page 1: min (0,1) max (0,3)
                           [-1.0, 0.0], [0.0, 0.0]]]])  # page 2: newest
    positions = torch.arange(6).view(1, 1, 6)
    query = torch.tensor([[[1.0, 1.0]]])  # bounds: page0 2, page1 3, page2 0
    slots = quest.attended_slots(query, keys, positions, torch.tensor([4]), block_size=2)
    assert slots.int().tolist() == [[[0, 0, 1, 1, 1, 1]]]  # 2 pages: the newest + the best bound (page 1)


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


@pytest.mark.parametrize("name", [n for n in POLICIES.names() if n != "full"])
@pytest.mark.parametrize("kv_heads", [2, 6], ids=["gqa3", "gqa1"])
def test_every_policy_runs_at_every_granularity_with_gqa(name, kv_heads):
    model = tiny_model("llama", kv_heads=kv_heads)
    model.generation_config.eos_token_id = None
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 23)]
    for granularity in ("head", "token", "page"):
        outputs = {}
        for layout in ("paged", "dense"):
            requests = [Request(p[:-5], p[-5:], 6) for p in prompts]
            settings = GenerationSettings(make_policy(name, granularity), budget=0.3, layout=layout, block_size=4)
            outputs[layout] = generate(model, None, requests, settings)
        assert [g.token_ids for g in outputs["paged"]] == [g.token_ids for g in outputs["dense"]]
        policy = make_policy(name, granularity)
        for g in outputs["paged"]:
            assert len(g.token_ids) == 6
            if policy.evicts:
                assert g.kept_tokens < g.prompt_tokens
            else:
                assert g.kept_tokens == g.prompt_tokens and g.attended_fraction < 1.0


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
                                                                        block_size=4), observe=grab)
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
