"""The generation loop against transformers' own greedy generation, and its budget promises."""

import functools
import math

import pytest
import torch

from conftest import SHORT_PROMPT_ARGS, TINY_WINDOW, tiny_model
from evalkit.loop import GenerationSettings, Request, generate
from evalkit.policies import POLICIES, make_policy

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
NEW = 12


def prompts(lengths=(17, 40, 5), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt, new=NEW):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run(model, prompt_list, policy="full", budget=1.0, split=None, observe=None, **settings):
    """Requests with no EOS stop (the tiny models have none) and `split` context tokens when given."""
    model.generation_config.eos_token_id = None
    split = split or (lambda p: len(p))
    requests = [Request(p[: split(p)], p[split(p):], NEW) for p in prompt_list]
    return generate(model, None, requests, GenerationSettings(make_policy(policy, args=SHORT_PROMPT_ARGS.get(policy)),
                                                              budget=budget, **settings), observe=observe)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["paged", "dense"])
def test_full_budget_matches_hf_greedy_on_a_mixed_length_batch(arch, layout):
    model = tiny_model(arch)
    batch = prompts()
    expected = [hf_greedy(model, p) for p in batch]
    assert len({tuple(e) for e in expected}) == len(expected)  # the prompts really lead different ways
    for policy, budget in (("full", 1.0), ("full", 0.1), ("h2o_head", 1.0)):
        got = run(model, batch, policy, budget, layout=layout, page_size=4)
        assert [g.token_ids for g in got] == expected, (policy, budget)


@functools.cache
def hf_greedy_answers() -> list[list[int]]:
    """transformers' greedy answers of tiny_model("llama") to prompts(): the same for every policy, made once."""
    model = tiny_model("llama")
    return [hf_greedy(model, p) for p in prompts()]


@pytest.mark.fast_tier_keeps_one_in(4)
@pytest.mark.parametrize("name", POLICIES.names())
def test_every_policy_at_budget_one_is_the_full_cache(name):
    model = tiny_model("llama")
    batch = prompts()
    expected = hf_greedy_answers()
    for settings in (dict(), dict(prefill="chunked", chunk_size=8), dict(query_aware=False),
                     dict(layout="dense", decode_eviction=False)):
        got = run(model, batch, name, 1.0, split=lambda p: len(p) - 3, page_size=4, **settings)
        assert [g.token_ids for g in got] == expected, settings
        assert all(g.kept_tokens == g.prompt_tokens for g in got)


@pytest.mark.parametrize("name, args", [("kvzip_head", {"layerwise": "true"}), ("kvzip_head_page", {"pool_pages": "true"})])
def test_kvzip_pooling_variants_at_budget_one_are_the_full_cache(name, args):
    """KVzip's per-layer per-head tokens and pooled per-head pages take their own selection paths (not the
    registered names' the test above runs)."""
    model = tiny_model("llama")
    for settings in (dict(), dict(prefill="chunked", chunk_size=8), dict(layout="dense", query_aware=False)):
        got = generate(model, None, [Request(p[:-3], p[-3:], NEW) for p in prompts()],
                       GenerationSettings(make_policy(name, args=args), budget=1.0, page_size=4, **settings))
        assert [g.token_ids for g in got] == hf_greedy_answers(), settings
        assert all(g.kept_tokens == g.prompt_tokens for g in got)


def test_token_budget_larger_than_the_prompt_evicts_nothing():
    model = tiny_model("llama")
    batch = prompts()
    got = run(model, batch, "h2o_head", 64, page_size=4)
    assert [g.token_ids for g in got] == [hf_greedy(model, p) for p in batch]


def kept_sets(cache):
    """{(layer, b, h): frozenset of positions}"""
    sets = {}
    for li, layer in enumerate(cache.layers):
        pos = layer.read().pos
        for b in range(pos.shape[0]):
            for h in range(pos.shape[1]):
                sets[li, b, h] = frozenset(p for p in pos[b, h].tolist() if p >= 0)
    return sets


@pytest.mark.fast_tier_keeps_one_in(8)
@pytest.mark.parametrize("name", [n for n in POLICIES.names() if n != "full"])
@pytest.mark.parametrize("settings", [dict(), dict(prefill="chunked", chunk_size=8), dict(query_aware=False)],
                         ids=["full-prefill", "chunked", "query-agnostic"])
def test_paged_and_dense_keep_the_same_tokens_and_outputs(name, settings):
    model = tiny_model("llama")
    batch = prompts((30, 45, 12))
    results = {}
    for layout in ("paged", "dense"):
        snapshots = []
        gens = run(model, batch, name, 0.3, split=lambda p: len(p) - 4, layout=layout, page_size=4,
                   observe=lambda event, cache: snapshots.append(kept_sets(cache)), **settings)
        results[layout] = ([g.token_ids for g in gens], snapshots)
    assert results["paged"][0] == results["dense"][0]
    assert results["paged"][1] == results["dense"][1]
    # And eviction did happen: some head holds fewer tokens than the sequence has seen.
    last = results["paged"][1][-1]
    assert any(len(s) < len(batch[b]) for (_, b, _), s in last.items()) == make_policy(name).evicts


def test_budget_is_respected_after_prefill_and_while_decoding():
    model = tiny_model("llama")
    batch = prompts((40, 25))
    sizes = []
    run(model, batch, "h2o_head", 0.25, page_size=4,
        observe=lambda event, cache: sizes.append((event, cache.kept_tokens().amax(dim=(0, 2)).tolist())))
    budget = [math.ceil(0.25 * 40), math.ceil(0.25 * 25)]
    prefill_at = [e for e, _ in sizes].index("prefill")
    assert sizes[prefill_at][1] == budget
    # Each decode forward appends one token, then eviction brings the head back to its budget.
    events = sizes[prefill_at + 1:]
    assert [e for e, _ in events] == ["forward", "compressed"] * (len(events) // 2)
    for event, kept in events:
        assert kept == ([b + 1 for b in budget] if event == "forward" else budget)


def test_chunked_prefill_never_holds_more_than_budget_plus_chunk():
    model = tiny_model("llama")
    batch = prompts((70, 33))
    peaks = []
    gens = run(model, batch, "h2o_head", 0.2, prefill="chunked", chunk_size=8, page_size=4,
               observe=lambda event, cache: peaks.append(cache.kept_tokens().amax(dim=(0, 2))))
    budget = torch.tensor([math.ceil(0.2 * 70), math.ceil(0.2 * 33)])
    assert all(bool((p <= budget + 8).all()) for p in peaks)
    assert [g.kept_tokens for g in gens] == budget.float().tolist()


def test_token_granularity_keeps_one_set_for_all_heads_and_head_granularity_does_not():
    model = tiny_model("llama", kv_heads=3)
    batch = prompts((48,))
    sets = {}
    for name in ("h2o_token", "h2o_head"):
        snaps = []
        run(model, batch, name, 0.25, page_size=4, observe=lambda e, c: snaps.append((e, kept_sets(c))))
        sets[name] = dict(snaps)["prefill"]
    for layer in range(2):
        token_sets = {sets["h2o_token"][layer, 0, h] for h in range(3)}
        assert len(token_sets) == 1
    assert any(len({sets["h2o_head"][layer, 0, h] for h in range(3)}) > 1 for layer in range(2))


def test_page_granularity_evicts_only_whole_pages():
    model = tiny_model("llama")
    batch = prompts((64, 50))
    block = 4
    snaps = []
    run(model, batch, "h2o_page", 0.3, page_size=block, observe=lambda e, c: snaps.append((e, kept_sets(c))))
    prefill = dict(snaps)["prefill"]
    lengths = [64, 50]
    for (layer, b, h), kept in prefill.items():
        assert len(kept) < lengths[b]
        for page in range(math.ceil(lengths[b] / block)):
            members = {p for p in range(page * block, min(lengths[b], (page + 1) * block))}
            assert members <= kept or not (members & kept), (layer, b, h, page)
    # Decoding evicts whole pages too: every snapshot keeps whole pages of the prompt.
    for event, sets in snaps:
        for (layer, b, h), kept in sets.items():
            for page in range(lengths[b] // block):
                members = set(range(page * block, (page + 1) * block))
                assert members <= kept or not (members & kept)


def held_positions(cache):
    """[layer][b][h] -> sorted kept positions."""
    return [[[sorted(p for p in row if p >= 0) for row in pos] for pos in layer.read().pos.tolist()]
            for layer in cache.layers]


# (policy, budget, settings): nothing evicted, a budget above the window (its layers left to the window), one below
SLIDING_CASES = [("full", 1.0, {}), ("full", 0.1, dict(decode_eviction=False, query_aware=False)),
                 ("h2o_head", 0.5, dict(prefill="chunked", chunk_size=8)), ("h2o_head", 0.1, dict(layout="dense")),
                 ("snapkv_head_page", 0.1, {}), ("streaming_llm", 0.1, dict(sliding_layers="window"))]


@pytest.mark.parametrize("policy, budget, settings", SLIDING_CASES)
def test_a_sliding_layer_holds_only_its_window_for_every_policy(policy, budget, settings):
    """Gemma 3's layer 0 slides (window W = 8), layer 1 is global. After every compression (each prefill chunk,
    each decode step, with or without decode eviction) and after the prefill, the sliding layer holds no position
    a later query cannot see (p <= seen - W) and at most W - 1 tokens per head; with the full cache exactly the
    last W - 1, as transformers' own cache. The global layer is the policy's alone: everything under `full`."""
    model = tiny_model("gemma3")
    batch = prompts((40, 25, 5))
    snapshots = []
    gens = run(model, batch, policy, budget, page_size=4, **settings,
               observe=lambda event, cache: snapshots.append((event, held_positions(cache))))
    assert any(len(batch[b]) > TINY_WINDOW for b in range(len(batch)))
    checked = 0
    for event, (sliding, global_layer) in snapshots:
        if event == "forward":  # within a forward the new tokens are there: the drop comes right after it
            continue
        for b, heads in enumerate(sliding):
            seen = max(max(h, default=-1) for h in global_layer[b] + heads) + 1  # these policies keep the newest
            for held in heads:
                assert len(held) <= TINY_WINDOW - 1 and all(p > seen - TINY_WINDOW for p in held), (event, b, held)
                whole_window = math.ceil(budget * len(batch[b])) >= TINY_WINDOW - 1  # the policy does not act here
                if policy == "full" or settings.get("sliding_layers") == "window" or whole_window:
                    assert held == list(range(max(0, seen - TINY_WINDOW + 1), seen)), (event, b, held)
            if policy == "full":
                assert all(held == list(range(seen)) for held in global_layer[b]), (event, b)
            checked += 1
    assert checked > len(batch) * NEW
    if policy == "full":
        assert [g.token_ids for g in gens] == [hf_greedy(model, p) for p in batch]


def test_full_cache_bytes_count_a_sliding_layer_s_window_only():
    """KV held / full: the full cache holds min(n, W - 1) tokens in a sliding layer, n in a global one."""
    model = tiny_model("gemma3")
    batch = prompts((40, 5))
    token_bytes = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head dim 16, float32
    for policy, budget in (("full", 1.0), ("h2o_head", 0.1)):
        gens = run(model, batch, policy, budget, page_size=1)
        assert [g.bytes_full for g in gens] == [(7 + 40) * token_bytes, (5 + 5) * token_bytes]
    full = run(model, batch, "full", 1.0, page_size=1)
    assert [g.bytes_held for g in full] == [g.bytes_full for g in full]  # a page of one token: held = full


def test_h2o_statistic_is_the_column_sum_of_attention_probabilities():
    """Prefill statistics equal transformers' eager attention weights, summed over queries, meaned per group."""
    model = tiny_model("llama", kv_heads=2)
    prompt = prompts((20,))[0]
    stats = {}

    def grab(event, cache):
        if event == "forward" and not stats:
            for li, layer in enumerate(cache.layers):
                view = layer.read()
                order = view.pos[0].argsort(-1)[:, -20:]  # live slots sorted by position
                stats[li] = view.stats[0].gather(-1, order)

    run(model, [prompt], "h2o_head", 0.5, page_size=4, observe=grab)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(torch.tensor([prompt]), output_attentions=True).attentions
    for li, weights in enumerate(attentions):  # weights: [1, H_q, T, T]
        expected = weights[0].sum(1).view(2, 3, 20).mean(1)  # [H_kv, T]
        torch.testing.assert_close(stats[li], expected, rtol=1e-5, atol=1e-6)


def test_sampling_is_seeded():
    model = tiny_model("llama")
    batch = prompts((20,))
    first = run(model, batch, "full", 1.0, temperature=1.0, seed=3)[0].token_ids
    again = run(model, batch, "full", 1.0, temperature=1.0, seed=3)[0].token_ids
    other = run(model, batch, "full", 1.0, temperature=1.0, seed=4)[0].token_ids
    assert first == again and first != other


def test_pool_exhaustion_is_a_clear_error():
    from evalkit.cache import PoolExhausted

    model = tiny_model("llama")
    with pytest.raises(PoolExhausted, match=r"asked for \d+ more pages of 4 tokens, \d+ of 3 free"):
        run(model, prompts((40,)), "full", 1.0, page_size=4, pool_pages=3)


@pytest.mark.model  # default_model loads the default model
def test_stop_strings_end_generation_and_are_cut_from_the_text(default_model):
    model, tokenizer = default_model
    prompt = tokenizer("Count from one to ten: one, two, three,").input_ids
    free = generate(model, tokenizer, [Request(prompt, [], 12)], GenerationSettings(make_policy("full")))[0]
    assert "," in free.text  # without a stop string the list goes on
    stopped = generate(model, tokenizer, [Request(prompt, [], 12, stop=(",",))],
                       GenerationSettings(make_policy("full")))[0]
    assert stopped.text == free.text[: free.text.index(",")]
    assert len(stopped.token_ids) < len(free.token_ids)
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]


@pytest.mark.parametrize("layout", ["paged", "dense"])
@pytest.mark.parametrize("decode_eviction", [True, False])
def test_a_batch_whose_answers_differ_in_length_fits_its_cache(layout, decode_eviction):
    # A long prompt with a short answer and a short prompt with a long one: the first keeps being fed
    # until the second is done, so the cache must hold its prompt plus the batch's longest answer.
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None  # no EOS: each answer runs to its max new tokens
    long, short = prompts((100, 10))
    requests = [Request(long, [], 2), Request(short, [], 50)]
    settings = GenerationSettings(make_policy("full"), layout=layout, decode_eviction=decode_eviction)
    with torch.no_grad():
        reference = [model.generate(torch.tensor([r.context_ids]), max_new_tokens=r.max_new_tokens, do_sample=False,
                                    pad_token_id=0)[0, len(r.context_ids):].tolist() for r in requests]
    gens = generate(model, None, requests, settings)
    assert [g.token_ids for g in gens] == reference
