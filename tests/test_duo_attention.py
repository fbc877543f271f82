"""DuoAttention (on-the-fly head scores): the budget's streaming heads, their windows after prefill and while
decoding, the pages they free, the head scores against kvpress's computation written out, refusals."""

import json

import pytest
import torch

from conftest import tiny_model
from evalkit.errors import EvalkitError
from evalkit.loop import GenerationSettings, Request, generate
from evalkit.policies import duo_attention, duo_calibration, make_policy
from evalkit.policies.duo_attention import DuoAttention

SMALL = {"sink_size": "2", "recent_size": "6"}  # windows the tiny model's short prompts can hold
# Hand-set head scores of the tiny model (2 layers x 2 KV heads); lowest first: (0, 1), (1, 0), (0, 0), (1, 1).
SCORES = torch.tensor([[0.3, 0.1], [0.2, 0.4]])
STREAM_ORDER = [(0, 1), (1, 0), (0, 0), (1, 1)]


def small_policy(granularity=None, **args) -> DuoAttention:
    return make_policy("duo_attention", granularity, {**SMALL, **args})


@pytest.fixture
def fixed_scores(monkeypatch):
    """Every model's heads scored SCORES (the calibration itself is tested on its own)."""
    monkeypatch.setattr(duo_attention, "calibrated_head_scores", lambda model, tokenizer=None: SCORES)


# --- the budget: how many heads stream ---------------------------------------------------------------

def test_the_budget_sets_the_fewest_streaming_heads_that_keep_the_mean_within_it():
    policy = make_policy("duo_attention")  # 128 sinks + 256 recent: a streaming head drops n - 384 tokens
    count = policy.streaming_heads(torch.tensor([500, 1000, 1000, 300, 300, 300]),
                                   torch.tensor([1000, 1000, 2000, 385, 384, 1000]), 90)
    # 90 x 500 / 616 = 73.05 -> 74 heads (1000 - 74 x 616 / 90 = 493.5 <= 500; 73 would keep 500.4); none at the
    # whole prompt; 90 x 1000 / 1616 = 55.7 -> 56; one token over the window: 90 x 85 / 1 -> all 90; a prompt no
    # longer than the window: none (kvpress compresses nothing); 300 < 384: all 90, and above the budget.
    assert count.tolist() == [74, 0, 56, 90, 0, 90]
    n, w, H = 1000, 384, 90
    for tokens in (100, 384, 385, 500, 700, 999):
        s = int(policy.streaming_heads(torch.tensor([tokens]), torch.tensor([n]), H))
        kept = n - s * (n - w) / H
        assert kept <= tokens or s == H
        # kvpress's accounting: compression_ratio = streaming share x (1 - (sink + recent) / n)
        assert 1 - kept / n == pytest.approx(s / H * (1 - w / n))
        if 0 < s < H:
            assert n - (s - 1) * (n - w) / H > tokens  # one fewer streaming head would be over the budget


def test_the_lowest_scoring_heads_of_the_whole_model_stream_and_set_the_layer_caps():
    policy = small_policy()
    policy.head_scores = SCORES
    # n = 64, window 8: a streaming head drops 56; budgets 40 -> ceil(4 x 24 / 56) = 2, 20 -> 4 (all), 64 -> 0
    caps = policy.layer_caps(torch.tensor([40, 20, 64]), torch.tensor([64, 64, 64]), 2)
    streaming = [sorted((l, h) for l in range(2) for h in range(2) if policy.streaming[b, l, h]) for b in range(3)]
    assert streaming == [sorted(STREAM_ORDER[:2]), sorted(STREAM_ORDER), []]
    assert caps.tolist() == [[8, 8, 64], [8, 8, 64]]  # [L, B]: the window where a head streams
    policy.layer_caps(torch.tensor([50]), torch.tensor([64]), 2)  # ceil(4 x 14 / 56) = 1: the lowest head
    assert policy.streaming[0].nonzero().tolist() == [list(STREAM_ORDER[0])]
    assert policy.layer_caps(torch.tensor([50]), torch.tensor([64]), 2)[:, 0].tolist() == [8, 64]
    assert policy.head_capacity(torch.tensor([[8], [64]]), torch.tensor([64])).tolist() == [64]


@pytest.mark.parametrize("ratio, expected", [("0.5", 45), ("0.8", 72), ("0.2", 18), ("1", 90), ("0.005", 0),
                                             ("0.25", 22), ("0.05", 4)])
def test_head_compression_ratio_fixes_round_heads_times_ratio_whatever_the_budget(ratio, expected):
    """kvpress's n_pruned = round(L x H_kv x ratio), Python's round (90 x 0.25 = 22.5 -> 22 and 90 x 0.05 = 4.5 -> 4:
    half to even), for every budget and length, none when the prompt is no longer than sinks + recent."""
    policy = make_policy("duo_attention", args={"head_compression_ratio": ratio})
    assert expected == round(90 * float(ratio))
    tokens = torch.tensor([1, 300, 500, 1000, 1500, 10, 300])
    lengths = torch.tensor([1000, 1000, 1000, 1001, 2000, 385, 384])
    assert policy.streaming_heads(tokens, lengths, 90).tolist() == [expected] * 6 + [0]
    follows = make_policy("duo_attention").streaming_heads(tokens, lengths, 90)  # the default: the budget decides
    assert follows.tolist() == [90, 90, 74, 1, 28, 90, 0]


def test_head_compression_ratio_streams_the_lowest_heads_and_sets_the_caps():
    policy = small_policy(head_compression_ratio="0.5")  # 2 of the 4 heads, at any budget
    policy.head_scores = SCORES
    caps = policy.layer_caps(torch.tensor([63, 8, 1]), torch.tensor([64, 64, 64]), 2)
    for b in range(3):
        assert sorted(map(tuple, policy.streaming[b].nonzero().tolist())) == sorted(STREAM_ORDER[:2])
    assert caps.tolist() == [[8, 8, 8], [8, 8, 8]]  # one streaming head in each layer
    assert make_policy("duo_attention").head_compression_ratio == 0  # unset: the budget decides


@pytest.mark.parametrize("ratio", ["-0.1", "1.5", "nan", "half"])
def test_a_head_compression_ratio_outside_0_1_is_one_line(ratio):
    with pytest.raises(EvalkitError) as error:
        make_policy("duo_attention", args={"head_compression_ratio": ratio})
    message = str(error.value)
    assert "head_compression_ratio" in message and "\n" not in message
    assert ("must be in [0.0, 1.0]" if ratio in ("-0.1", "1.5") else "must be float") in message


# --- what the loop keeps --------------------------------------------------------------------------

def _expected(seen: int, window: int, sinks: int = 2) -> set:
    return {p for p in range(seen) if p < sinks or p >= seen - window}


def _observe(records):
    def observe(event, cache):
        if event in ("compressed", "prefill"):
            kept = {(l, h): {p for p in layer.read().pos[0, h].tolist() if p >= 0}
                    for l, layer in enumerate(cache.layers) for h in range(2)}
            records.append((event, kept, int(cache.bytes_held()[0]), cache.layers[0].token_bytes))
    return observe


@pytest.mark.parametrize("layout", ["paged", "dense"])
@pytest.mark.parametrize("settings", [dict(), dict(prefill="chunked", chunk_size=16), dict(query_aware=False)],
                         ids=["full", "chunked", "query-agnostic"])
def test_retrieval_heads_keep_everything_and_streaming_heads_a_sliding_window(fixed_scores, layout, settings):
    """n = 64 tokens, budget 40: two heads stream, one in each layer (so each layer holds both kinds, and a chunked
    prefill's cache must hold the retrieval heads' whole prompt). After every compression a streaming head holds
    its 2 sinks and its 6 most recent positions (plus the question appended uncompressed, query-agnostic), a
    retrieval head every position; after prefill each head holds its own ceil(kept / 4) pages."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, 128, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    question = 5 if settings.get("query_aware") is False else 0
    records = []
    out, = generate(model, None, [Request(ids[:64 - question], ids[64 - question:], 6)],
                    GenerationSettings(small_policy(), budget=40, layout=layout, page_size=4, **settings),
                    observe=_observe(records))
    n = 64 - question
    streaming = set(STREAM_ORDER[:2])
    assert out.kept_tokens == (2 * n + 2 * 8) / 4 + question  # (64 + 64 + 8 + 8) / 4 = 36 <= 40
    at_prefill = [event for event, *_ in records].index("prefill")
    decoded = 0
    for i, (event, kept, held, token_bytes) in enumerate(records):
        seen = max(max(k) for k in kept.values()) + 1
        after_prompt = i >= at_prefill
        decoded += after_prompt and event == "compressed"
        for head, positions in kept.items():
            if head in streaming:
                assert positions == _expected(seen, 6 + (question if after_prompt else 0)), (event, head)
            else:
                assert positions == set(range(seen)), (event, head)
        if layout == "paged" and event == "prefill":  # compacted: each head its own ceil(kept / 4) pages
            assert held == sum(-(-len(k) // 4) for k in kept.values()) * 4 * token_bytes
        elif layout == "paged" and after_prompt:  # and while decoding, a page more at most for the slot just freed
            assert held <= sum(-(-(len(k) + 1) // 4) for k in kept.values()) * 4 * token_bytes
    assert decoded == 5  # every decode step but the last token's (sampled, never fed)


def test_streaming_heads_free_their_pages(fixed_scores):
    """Paged: after prefill a streaming head holds ceil(8 / 4) = 2 pages of a 256-token prompt, a retrieval head
    64; all four heads streaming hold 8 pages where the full cache holds 256."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, 128, (256,), generator=torch.Generator().manual_seed(6)).tolist()
    held = {}
    for budget in (1.0, 0.5, 0.02):
        records = []
        generate(model, None, [Request(ids, [], 1)], GenerationSettings(small_policy(), budget=budget, page_size=4),
                 observe=_observe(records))
        event, kept, held[budget], token_bytes = next(r for r in records if r[0] == "prefill")
        held[budget] //= 4 * token_bytes  # pages
    # budget 0.5 = 128 tokens: ceil(4 x 128 / 248) = 3 heads stream, 64 + 3 x 2 pages
    assert held == {1.0: 4 * 64, 0.5: 64 + 3 * 2, 0.02: 4 * 2}


def test_head_page_streaming_heads_keep_whole_pages_and_their_newest(fixed_scores):
    """page_size 4, 2 sinks + 6 recent: a streaming head keeps its pages lying wholly within the window (none
    within the 2 sinks) and its newest page; whole pages leave, so each storage page holds one position page."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, 128, (64,), generator=torch.Generator().manual_seed(7)).tolist()
    records = []
    generate(model, None, [Request(ids, [], 8)], GenerationSettings(small_policy("head_page"), budget=40, page_size=4),
             observe=_observe(records))
    for event, kept, *_ in records:
        seen = max(max(k) for k in kept.values()) + 1
        newest = (seen - 1) // 4
        pages = {p for p in range(newest + 1) if p * 4 >= seen - 6 or p == newest}
        for head, positions in kept.items():
            expected = {p for p in range(seen) if p // 4 in pages} if head in STREAM_ORDER[:2] else set(range(seen))
            assert positions == expected, (event, seen, head)


def test_a_prompt_no_longer_than_sinks_plus_recent_is_not_compressed(fixed_scores):
    """kvpress compresses nothing when k_len <= sink + recent: at 8 tokens every head keeps everything and the
    answer is the full cache's; at 9 the budget's heads stream."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(8)).tolist()
    full, = generate(model, None, [Request(ids[:8], [], 6)], GenerationSettings(make_policy("full")))
    short, = generate(model, None, [Request(ids[:8], [], 6)], GenerationSettings(small_policy(), budget=0.2))
    assert short.token_ids == full.token_ids and short.kept_tokens == 8
    longer, = generate(model, None, [Request(ids, [], 1)], GenerationSettings(small_policy(), budget=0.2))
    assert longer.kept_tokens == 8  # ceil(4 x 7 / 1): every head streams, 2 sinks + 6 recent


@pytest.mark.parametrize("query_aware", [True, False], ids=["query-aware", "query-agnostic"])
def test_each_sequence_streams_its_own_heads_and_a_shared_prefill_gives_what_its_own_gives(fixed_scores, query_aware):
    """A batch of 64 and 30 tokens at budget 0.6: ceil(4 x 25 / 56) = 2 and ceil(4 x 12 / 22) = 3 heads stream;
    a prefill shared with other cells (forked, or forked compressed) generates and keeps what each cell's own
    prefill does, on both layouts."""
    from evalkit.loop.shared_prefill import prefill_statistics, share_prefill

    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(10)
    batch = [Request(torch.randint(3, 128, (n - 4,), generator=g).tolist(), [7, 8, 9, 10], 5) for n in (64, 30)]
    policy = small_policy()
    shared = share_prefill(model, batch, query_aware, prefill_statistics(policy))
    for layout in ("paged", "dense"):
        settings = GenerationSettings(policy, budget=0.6, layout=layout, page_size=4, query_aware=query_aware)
        own = generate(model, None, batch, settings)
        assert policy.streaming.flatten(1).sum(1).tolist() == [2, 3]  # agnostic: 60, 26 tokens -> 2, 3 as well
        forked = generate(model, None, batch, settings, shared=shared)
        for a, b in zip(own, forked):
            assert (a.token_ids, a.kept_tokens, a.bytes_held) == (b.token_ids, b.kept_tokens, b.bytes_held), layout
        (n1, n2), q = ((64, 30), 0) if query_aware else ((60, 26), 4)  # the question appended uncompressed
        assert [o.kept_tokens for o in own] == [(2 * n1 + 2 * 8) / 4 + q, (n2 + 3 * 8) / 4 + q]


# --- the head scores ---------------------------------------------------------------------------------

def kvpress_scores(model, texts, q_len):
    """kvpress 0.5.5's `duo_attention_on_the_fly` loop, written out as it is (hidden states, mean q and k repeated
    q_len times, RoPE, repeat_interleave, the last query's softmax, cumsum averaged), for given token ids."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    config = model.config
    G = config.num_attention_heads // config.num_key_value_heads
    position_ids = torch.arange(q_len).unsqueeze(0)
    scores = torch.zeros((config.num_hidden_layers, config.num_key_value_heads))
    for ids in texts:
        with torch.no_grad():
            hidden_states = list(model(torch.tensor([ids]), output_hidden_states=True).hidden_states[:-1])
            for layer_idx, h in enumerate(hidden_states):
                module = model.model.layers[layer_idx]
                d = module.self_attn.head_dim
                h = module.input_layernorm(h)
                q = module.self_attn.q_proj(h)
                q = q.view(1, q.shape[1], -1, d).mean(dim=1, keepdim=True).repeat(1, q_len, 1, 1).transpose(1, 2)
                k = module.self_attn.k_proj(h)
                k = k.view(1, k.shape[1], -1, d).mean(dim=1, keepdim=True).repeat(1, q_len, 1, 1).transpose(1, 2)
                cos, sin = model.model.rotary_emb(h, position_ids)
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                k = k.repeat_interleave(G, dim=1)
                attn_weights = torch.matmul(q[:, :, -1:, :], k.transpose(2, 3)) / (d ** 0.5)
                attn_weights = attn_weights.softmax(dim=-1, dtype=torch.float32).squeeze()
                s = torch.cumsum(attn_weights, dim=1).mean(1)
                s = s.view(-1, G).mean(1)
                scores[layer_idx] += s / len(texts)
    return scores


def test_head_scores_are_kvpress_on_the_fly_scores():
    model = tiny_model("llama", kv_heads=2, seed=3)
    g = torch.Generator().manual_seed(9)
    texts = [torch.randint(0, 128, (96,), generator=g).tolist() for _ in range(3)]
    ours = duo_calibration.score_heads(model, texts)
    torch.testing.assert_close(ours, kvpress_scores(model, texts, duo_calibration.QUERY_LENGTH), rtol=1e-5, atol=1e-6)
    assert ours.shape == (2, 2) and len(set(ours.flatten().tolist())) == 4  # heads told apart


def test_head_scores_are_computed_once_per_model_and_kept_on_disk(monkeypatch, tmp_path):
    calls = []
    real = duo_calibration.text_scores
    monkeypatch.setattr(duo_calibration, "text_scores",
                        lambda model, texts: calls.append(len(texts)) or real(model, texts))
    monkeypatch.setattr(duo_calibration, "_cache_dir", lambda: tmp_path)
    model = tiny_model("llama", seed=11)
    first = duo_calibration.calibrated_head_scores(model)
    assert sum(calls) == duo_calibration.CALIBRATION_TEXTS
    assert duo_calibration.calibrated_head_scores(model) is first  # the same model: kept on it
    assert not list(tmp_path.iterdir())  # a model built from a config has no folder to key a file on
    twin = duo_calibration.calibrated_head_scores(tiny_model("llama", seed=11))  # the same weights, a new object
    assert sum(calls) == 2 * duo_calibration.CALIBRATION_TEXTS and torch.equal(twin, first)
    other = duo_calibration.calibrated_head_scores(tiny_model("llama", seed=12))
    assert sum(calls) == 3 * duo_calibration.CALIBRATION_TEXTS and not torch.equal(first, other)

    bytes_tokenizer = lambda text: {"input_ids": [b % 128 for b in text.encode("utf-8")]}  # noqa: E731

    def named():  # a model loaded from a folder, as a new process loads it
        loaded = tiny_model("llama", seed=11)
        loaded.config.name_or_path = "some/folder"
        return loaded

    again = duo_calibration.calibrated_head_scores(named(), bytes_tokenizer)
    assert sum(calls) == 4 * duo_calibration.CALIBRATION_TEXTS  # computed, then written
    saved, = tmp_path.iterdir()
    assert json.loads(saved.read_text())["scores"] == again.tolist()
    assert torch.equal(duo_calibration.calibrated_head_scores(named(), bytes_tokenizer), again)  # read back
    assert sum(calls) == 4 * duo_calibration.CALIBRATION_TEXTS and torch.allclose(first, again)
    assert not any(isinstance(value, dict) and value for name, value in vars(duo_calibration).items()
                   if not name.startswith("__"))  # no state in the module


# --- refusals ------------------------------------------------------------------------------------------

def test_granularities_that_share_one_set_over_heads_are_refused():
    for granularity in ("token", "page"):
        with pytest.raises(EvalkitError, match=f"cannot run at granularity {granularity}: DuoAttention gives each"):
            make_policy("duo_attention", granularity)
    assert make_policy("duo_attention", "head_page").granularity == "head_page"


def test_a_length_the_window_covers_and_knobs_that_do_not_apply_are_refused():
    with pytest.raises(EvalkitError, match=r"128 sinks \+ 256 recent tokens, a whole --length 384 prompt"):
        make_policy("duo_attention").check_fits(384)
    make_policy("duo_attention").check_fits(385)
    with pytest.raises(EvalkitError, match="recent_fraction and observation_window do not apply"):
        make_policy("duo_attention", args={"recent_fraction": "0.5"})


def test_no_calibration_text_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr("evalkit.assets.essays_dir", lambda: tmp_path)
    model = tiny_model("llama", seed=13)
    with pytest.raises(EvalkitError, match="duo_attention: no calibration text of 512 tokens in"):
        generate(model, None, [Request([5] * 20, [], 1)], GenerationSettings(small_policy(), budget=0.5))


@pytest.mark.model  # its refusal names the default model's positions (its config.json)
def test_cli_refuses_a_length_no_longer_than_the_window_with_no_run_folder(monkeypatch, capsys, tmp_path):
    from helpers import evalkit

    out = tmp_path / "runs"
    code, _, err = evalkit(monkeypatch, capsys, "run", "--policy", "duo_attention", "--length", "300",
                           "--out", str(out), "--wandb", "off")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "a whole --length 300 prompt: nothing to evict" in err
    assert not out.exists() or not any(out.iterdir())
