"""Every granularity at the same budget, in the real loop; per-head pages; decoded tokens never scored as zero."""

import dataclasses

import pytest
import torch

from conftest import SHORT_PROMPT_ARGS, tiny_model
from evalkit.loop import GenerationSettings, Request, generate
from evalkit.policies import GRANULARITIES, POLICIES, make_policy

BUDGET, BLOCK, PROMPT = 100, 16, 240


def _request(n, new, question=0, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (n,), generator=g).tolist()
    return Request(ids[: n - question], ids[n - question:], new)


def _run(model, policy, budget, requests, observe=None, **settings):
    model.generation_config.eos_token_id = None
    return generate(model, None, requests, GenerationSettings(policy, budget=budget, **settings), observe=observe)


def _every_policy_and_granularity():
    """(label, policy) for every registered policy at every granularity it runs at, duplicates once."""
    seen, cases = set(), []
    for name in POLICIES.names():
        for granularity in GRANULARITIES:
            if granularity in POLICIES.create(name).cannot_run_at:
                continue
            policy = make_policy(name, granularity, SHORT_PROMPT_ARGS.get(name))
            key = (type(policy), repr(dataclasses.replace(policy, name="")))
            if key not in seen:
                seen.add(key)
                cases.append(pytest.param(policy, id=f"{name}@{granularity}"))
    return cases


@pytest.mark.fast_tier_keeps_one_in(2)
@pytest.mark.parametrize("policy", _every_policy_and_granularity())
def test_every_policy_and_granularity_keeps_between_a_page_short_and_the_budget(policy):
    model = tiny_model("llama", kv_heads=2)
    kept_per_head = []

    def observe(event, cache):
        if event == "prefill":
            kept_per_head.append(cache.kept_tokens())  # [L, B, H_kv]

    gen, = _run(model, policy, BUDGET, [_request(PROMPT, 4)], observe=observe, page_size=BLOCK)
    kept = kept_per_head[0].float()
    if not policy.evicts:  # full and Quest hold everything by definition
        assert bool((kept == PROMPT).all()) and gen.kept_tokens == PROMPT
        return
    # Recorded kept_tokens is the mean per (layer, KV head): what predictions.jsonl reports.
    assert gen.kept_tokens == pytest.approx(float(kept.mean()))
    duo = type(policy).__name__ == "DuoAttention"  # whole heads stream: short by less than one head's share
    lowest = BUDGET - ((PROMPT - policy.sink_tokens - policy.recent_tokens) / kept.numel() if duo else BLOCK - 1)
    assert lowest <= gen.kept_tokens <= BUDGET, kept.tolist()
    adaptive = policy.layer_caps(torch.tensor([BUDGET]), torch.tensor([PROMPT]), 2).unique().numel() > 1 \
        or type(policy).__name__.startswith("Ada") and policy.granularity == "head" or duo \
        or policy.selects_across_layers
    if not adaptive:  # uniform budgets: every single head within a page of the budget
        assert bool((kept <= BUDGET).all()) and bool((kept >= BUDGET - (BLOCK - 1)).all()), kept.tolist()


@pytest.mark.parametrize("name", ["h2o_head_page", "snapkv_head_page", "knorm_head_page"])
def test_head_page_frees_whole_storage_pages_so_nothing_is_compacted(name):
    """A head's storage page holds exactly one position page, before and after decoding with eviction,
    and the KV held is the page floor: ceil(kept / S) pages per head."""
    model = tiny_model("llama", kv_heads=2)
    block = 8
    snapshots = []
    _run(model, make_policy(name), 0.3, [_request(150, 12), _request(97, 12, seed=4)], page_size=block,
         observe=lambda event, cache: snapshots.append(event) or _check_aligned(cache, block))
    assert "compressed" in snapshots


def _check_aligned(cache, block):
    for layer in cache.layers:
        slots = layer.pos.view(-1, block)  # [pages, S] original position of every slot
        for b, row in enumerate(layer.tables):
            for h, table in enumerate(row):
                for page in table:
                    live = [p for p in slots[page].tolist() if p >= 0]
                    assert live, "a page with no live token is held"
                    assert len({p // block for p in live}) == 1, (b, h, page, live)
                    # lowest free slot first: a page's tokens sit in order from its first slot
                    assert slots[page].tolist()[: len(live)] == sorted(live)
        held_pages = layer.held_slots() // block
        floor = (layer.live_counts() + block - 1).div(block, rounding_mode="floor").sum(-1)
        assert held_pages.tolist() == floor.tolist()


@pytest.mark.parametrize("name", ["snapkv_head", "pyramidkv_head", "adakv_snapkv", "snapkv_head_page"])
def test_prefill_only_scorers_keep_decoded_tokens_instead_of_scoring_them_zero(name):
    """SnapKV-family policies collect nothing while decoding: every decoded token must survive decode
    eviction (before the fix they scored 0 and left as soon as they fell out of the 32-token window)."""
    model = tiny_model("llama", kv_heads=2)
    new = 40  # more than the 32-token window
    final = []
    gen, = _run(model, make_policy(name), 0.5, [_request(200, new)], page_size=8,
                observe=lambda event, cache: final.__setitem__(slice(None), [cache]))
    seen = 200 + new - 1  # the last token is sampled, never fed
    decoded = set(range(200, seen))
    for layer in final[0].layers:
        pos = layer.read().pos[0]
        for h in range(pos.shape[0]):
            kept = {p for p in pos[h].tolist() if p >= 0}
            # All of them; when window + decoded tokens outgrow a (PyramidKV) layer's cap, the most recent.
            assert kept & decoded == decoded & set(range(seen - len(kept), seen)), (name, h, sorted(kept))
    assert len(gen.token_ids) == new


@pytest.mark.parametrize("scorer", ["h2o", "snapkv", "tova", "knorm"])
@pytest.mark.parametrize("per_head, shared", [("head", "token"), ("head_page", "page")])
def test_with_one_kv_head_per_head_and_shared_granularities_are_the_same(scorer, per_head, shared):
    """Gemma 3 270M has one KV head (docs/granularity.md): there a per-head choice is the shared one, so its
    study compares tokens with pages only."""
    model = tiny_model("llama", kv_heads=1)
    requests = [_request(PROMPT, 12, question=8)]
    runs = []
    for granularity in (per_head, shared):
        kept = []  # per layer: the positions held after the prefill, [1 sequence, 1 KV head, slots]

        def observe(event, cache):
            if event == "prefill":
                for pos in (layer.read().pos[0, 0] for layer in cache.layers):
                    kept.append(sorted(pos[pos >= 0].tolist()))

        gen, = _run(model, make_policy(f"{scorer}_head", granularity), BUDGET, requests, observe=observe,
                    page_size=BLOCK)
        runs.append((kept, gen.token_ids))
    assert all(len(positions) < PROMPT for positions in runs[0][0])  # it evicted
    assert runs[0] == runs[1]
