"""evalkit's generation loop held to the naive oracle (tests/oracle.py), after every step.

For every registered policy x every granularity it accepts x budgets 0.1 / 0.3 / 0.6, a batch of
mixed-length prompts goes through `evalkit.loop.generate.generate` on a float64 tiny GQA model; each
sequence then goes alone through the oracle. The kept positions of every (layer, KV head) must be
equal after every prefill chunk, after prefill and after every decode step, and so must the tokens.

Decode eviction on/off, query-aware/agnostic, full/chunked prefill, llama/qwen2 and the paged/dense
layouts are assigned by a fixed pairwise covering table (COVERING), and hyper-parameter variants
(VARIANTS) rotate, so the default run stays short; `EVALKIT_ORACLE_FULL=1` runs every combination.
Cases whose policy is identical to an earlier one (e.g. `h2o_page` at granularity `head` is
`h2o_head`) are not repeated; granularities a policy refuses are listed as skips. A policy the
oracle has no rule for fails until tests/oracle.py learns it. CriticalKV and Ada-KV over every scorer
(`critical_<scorer>`, `adakv_<scorer>`) are marked `slow`, and so are three in four of the other cases of the
main and hyper-parameter tables (the fast tier runs a stable sample: the `fast_tier_keeps_one_in` marker, tests/conftest.py). Cases
where evalkit departs from the rules (KNOWN_DEVIATIONS) are strict xfails, each with its reason.

Every hyper-parameter of every family also leaves its default in some case (HYPER_CASES, with other block
and chunk sizes; `test_every_hyper_parameter_is_varied_against_the_oracle` fails for one that does not),
kvpress's parity settings (docs/fidelity.md) are cases, and every registered name and alias, made as named,
is held to the oracle at the granularity tests/test_policies.py pins for it. A few cases each decide a rule no other
case does (issue #53's mutation study): CriticalKV's first stage of one token, Ada-KV's safeguard, ties between
DuoAttention's head scores, KVzip's prompts in a chat template's words and its pooled budget over sliding layers.

Long decodes (issue #48): H2O, TOVA, SnapKV and KeyDiff at all four granularities, StreamingLLM at three, Ada-KV
over H2O and PyramidKV generate 201 tokens on a two-layer model at a budget of 20 tokens per KV head, compressing
after each of the 200 decode steps; each case checks that decoded tokens, and at page granularities whole pages of
them, were evicted. No mutation was found that they catch and the short cases miss: when they were added they ran
no line of evalkit that the short cases do not, and a page selection that drops the page being filled is caught by
the short cases already.

Conversations (issue #48, `evalkit.loop.conversation.converse`): three turns on one compressed context, the oracle's
`run_oracle` given the later turns, for H2O, SnapKV, TOVA and KeyDiff at all four granularities, StreamingLLM, and
one conversation without decode eviction; every later turn must evict tokens of earlier turns.

Mutation tests show the comparison has teeth: H2O without decode accumulation, a SnapKV window one
query too wide, and one small error in each scorer of issue #29 (KeyDiff's anchor from raw keys, LagKV
partitions normalised by their own range, Expected Attention's moments of the queries after RoPE,
CriticalKV's value norms through the wrong query heads' output projection, Ada-KV reallocating nothing,
KVzip's reconstruction softmax without the sinks, a DuoAttention streaming head one recent token short)
each make evalkit disagree with the oracle.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from unittest import mock

import pytest
import torch

from conftest import SHORT_PROMPT_ARGS, TINY, tiny_config
from oracle import (FAMILIES, Settings, Spec, budget_tokens, duo_streaming, kvzip_prompts, published_spec,
                    pyramid_budgets, run_oracle)
from test_policies import every_name, published_granularity

import evalkit.attention
import evalkit.attention_ops
import evalkit.loop.conversation
import evalkit.policies.adakv
import evalkit.policies.critical
import evalkit.policies.duo_attention
import evalkit.policies.duo_calibration
import evalkit.policies.h2o
import evalkit.policies.keydiff
import evalkit.policies.lagkv
import evalkit.policies.query_moments
from evalkit.errors import EvalkitError
from evalkit.loop import Conversation, GenerationSettings, Request, converse, generate, start
from evalkit.policies import GRANULARITIES, POLICIES, make_policy, policy_args

BUDGETS = (0.1, 0.3, 0.6)
BLOCK = 4
CHUNK = 16
NEW_TOKENS = 5
LAYERS = 3  # > 2 so Quest restricts reads (layers 0 and 1 read everything)
SEED = 3
FULL = os.environ.get("EVALKIT_ORACLE_FULL") == "1"

# Hyper-parameter variants, each given to evalkit (as --policy-arg strings) and to the oracle alike.
# At the published SnapKV window (32) most of these short prompts is window, so the SnapKV family
# also runs with small windows where pooling and the prefix really decide.
VARIANTS = {
    "h2o": [{}, {"normalize": "true"}],
    "snapkv": [{}, {"window": "8", "kernel": "5", "pooling": "avg"}, {"window": "6", "kernel": "3"}],
    "pyramidkv": [{}, {"window": "8", "kernel": "5", "pooling": "avg"}, {"window": "6", "kernel": "3"}],
    "adakv_snapkv": [{}, {"window": "8", "kernel": "5", "pooling": "avg"}, {"window": "6", "kernel": "3"}],
}
# The scorers of issue #29 and the scorers the wrappers take: between them, each scorer's variants move every one
# of its hyper-parameters. LagKV runs with lags small enough that these prompts hold several partitions (at 128
# they are all its short-prompt recency rule), KVzip with chunks small enough to reconstruct several.
_SCORER_VARIANTS = {
    "h2o": [{}, {"normalize": "true", "sink_tokens": "2", "observation_window": "4"},
            {"recent_fraction": "0.25", "recent_tokens": "2"}],
    "snapkv": [{}, {"window": "8", "kernel": "5", "pooling": "avg", "sink_tokens": "2"},
               {"window": "6", "kernel": "3", "recent_fraction": "0.2", "recent_tokens": "1"}],
    "tova": [{}, {"recent_tokens": "0", "sink_tokens": "2"}, {"observation_window": "3", "recent_fraction": "0.25"}],
    "knorm": [{}, {"sink_tokens": "3", "recent_tokens": "2"}, {"recent_fraction": "0.3", "observation_window": "5"}],
    "keydiff": [{}, {"sink_tokens": "3", "recent_tokens": "2"}, {"recent_fraction": "0.3", "observation_window": "5"}],
    "lagkv": [{"lag_size": "8"}, {"lag": "5", "sink_tokens": "2", "recent_tokens": "2"},
              {"lag_size": "6", "recent_fraction": "0.2", "observation_window": "3"}],
    "expected_attention": [{}, {"n_future_positions": "16", "use_covariance": "false", "sink_tokens": "2",
                                "recent_tokens": "2", "epsilon": "0.01"},
                           {"n_future": "64", "use_vnorm": "false", "recent_fraction": "0.2",
                            "observation_window": "3"}],
}
VARIANTS |= {name: _SCORER_VARIANTS[name] for name in ("keydiff", "lagkv", "expected_attention")}
VARIANTS["kvzip"] = [{}, {"chunk_size": "24", "sink_tokens": "2", "recent_tokens": "2"},
                     {"chunk": "16", "layerwise": "true", "recent_fraction": "0.2", "observation_window": "3"}]
# DuoAttention: windows these short prompts evict around (its published 128 + 256 hold them whole); a zero sink.
VARIANTS["duo_attention"] = [dict(SHORT_PROMPT_ARGS["duo_attention"]), {"sink_tokens": "2", "recent_tokens": "5"},
                             {"sink_size": "0", "recent_size": "6"}]
# CriticalKV: epsilon and a smaller first stage (and Expected Attention's value norm back on, kvpress's default
# outside CriticalKV); Ada-KV: a larger and a zero safeguard.
VARIANTS |= {f"critical_{name}": [{}, {**variants[1], "epsilon": "0.01"},
                                  {**variants[2], "first_stage_ratio": "0.25",
                                   **({"use_vnorm": "true"} if name == "expected_attention" else {})}]
             for name, variants in _SCORER_VARIANTS.items()}
VARIANTS |= {f"adakv_{name}": [{}, {**variants[1], "alpha_safeguard": "0.5"}, {**variants[2], "alpha_safeguard": "0"}]
             for name, variants in _SCORER_VARIANTS.items() if name != "snapkv"}
# --policy-arg key -> (the oracle's Spec field, its parse).
ORACLE_ARG = {"window": ("window", int), "observation_window": ("window", int), "kernel": ("kernel", int),
              "pooling": ("pooling", str), "normalize": ("normalize", lambda text: text == "true"),
              "sink_tokens": ("sinks", int), "recent_tokens": ("recent_tokens", int),
              "recent_fraction": ("recent_fraction", float), "beta": ("beta", float),
              "alpha_safeguard": ("alpha", float), "dense_layers": ("dense_layers", int),
              "min_pages": ("min_pages", int), "lag_size": ("lag_size", int), "lag": ("lag_size", int),
              "n_sink": ("sinks", int), "n_future_positions": ("n_future", int), "n_future": ("n_future", int),
              "use_covariance": ("use_covariance", lambda text: text == "true"),
              "use_vnorm": ("use_vnorm", lambda text: text == "true"), "epsilon": ("epsilon", float),
              "scorer_epsilon": ("scorer_epsilon", float),
              "first_stage_ratio": ("first_stage_ratio", float), "chunk_size": ("recon_chunk", int),
              "chunk": ("recon_chunk", int), "layerwise": ("layerwise", lambda text: text == "true"),
              "pool_pages": ("pool_pages", lambda text: text == "true"),
              "sink_size": ("sinks", int), "recent_size": ("recent_tokens", int),
              "head_compression_ratio": ("head_compression_ratio", float)}
# Hyper-parameters a family refuses to move off their default (its check() says why): no case can vary them.
UNMOVABLE = {"duo_attention": {"recent_fraction", "observation_window"}}

# Environments: a fixed covering table, one row per (granularity, budget) cell of a family (found by a
# seeded search, checked below). Within a family, any two of the five factors show all four value
# pairs (already among the head and token cells alone), and every granularity and every budget
# meets both values of every factor. EVALKIT_ORACLE_FULL=1 runs all 32 rows for every cell.
FACTORS = {
    "arch": ("llama", "qwen2"),
    "layout": ("paged", "dense"),
    "prefill": ("full", "chunked"),
    "query_aware": (True, False),
    "decode_eviction": (True, False),
}
COVERING = {  # granularity -> one row per budget in BUDGETS
    "head": ((1, 1, 1, 1, 0), (1, 1, 0, 0, 1), (0, 0, 1, 0, 0)),
    "token": ((0, 0, 0, 1, 1), (1, 0, 0, 1, 0), (0, 1, 1, 0, 1)),
    "page": ((0, 0, 0, 0, 0), (0, 0, 1, 0, 1), (1, 1, 0, 1, 1)),
    "head_page": ((1, 0, 1, 0, 1), (0, 1, 1, 1, 1), (0, 1, 0, 1, 0)),
}


def _covers_pairs(rows) -> bool:
    return all({(r[i], r[j]) for r in rows} == {(0, 0), (0, 1), (1, 0), (1, 1)}
               for i, j in itertools.combinations(range(len(FACTORS)), 2))


assert set(COVERING) == set(GRANULARITIES), "a new granularity needs its rows in COVERING"
assert _covers_pairs([r for g in GRANULARITIES for r in COVERING[g]])
assert _covers_pairs(COVERING["head"] + COVERING["token"])
assert all({r[c] for r in COVERING[g]} == {0, 1} for g in GRANULARITIES for c in range(len(FACTORS)))
assert all({COVERING[g][b][c] for g in GRANULARITIES} == {0, 1}
           for b in range(len(BUDGETS)) for c in range(len(FACTORS)))


def family_of(name: str) -> str | None:
    for family in sorted(FAMILIES, key=len, reverse=True):
        if name == family or name.startswith(family + "_"):
            return family
    return None


# Cases where evalkit departs from the rules (found by this oracle, reported, not fixed in the tests): strict xfail,
# so that once evalkit is fixed the case passes, its xfail fails, and its entry here must go.
KNOWN_DEVIATIONS: dict[str, str] = {}  # case id -> why evalkit departs from the rules there


def _known(case_id: str) -> list:
    return [pytest.mark.xfail(strict=True, reason=KNOWN_DEVIATIONS[case_id])] if case_id in KNOWN_DEVIATIONS else []


def _slow_if_it_wraps_a_scorer(name: str) -> list:
    """`slow` for CriticalKV and Ada-KV over every scorer (`critical_<scorer>`, `adakv_<scorer>`; the original
    `adakv_snapkv` stays in the fast tier): 150 cases against the oracle, 20-30 s in all."""
    return [pytest.mark.slow] if name.startswith(("critical_", "adakv_")) and name != "adakv_snapkv" else []


def _identity(policy) -> tuple:
    fields = tuple((f.name, getattr(policy, f.name)) for f in dataclasses.fields(policy) if f.compare)
    return (type(policy).__name__, fields)


def _cases():
    """pytest params (name, granularity, args, budget, environment) over the whole registry."""
    params, seen = [], set()
    for name in POLICIES.names():
        family = family_of(name)
        if family is None:  # a new policy the oracle does not know yet: fails until tests/oracle.py learns it
            params.append(pytest.param(name, "head", {}, 0.3, {}, id=f"{name}-unknown-to-oracle",
                                       marks=_slow_if_it_wraps_a_scorer(name)))
            continue
        for g_index, granularity in enumerate(GRANULARITIES):
            try:
                identity = _identity(make_policy(name, granularity))
            except EvalkitError as refused:
                params.append(pytest.param(name, granularity, {}, None, {}, id=f"{name}-{granularity}-refused",
                                           marks=[pytest.mark.skip(reason=f"refused: {refused}"),
                                                  *_slow_if_it_wraps_a_scorer(name)]))
                continue
            if identity in seen:
                continue  # the same policy as an earlier case (e.g. h2o_page at granularity head = h2o_head)
            seen.add(identity)
            variants = VARIANTS.get(family, [{}])
            for b_index, budget in enumerate(BUDGETS):
                # Variants rotate over granularities and budgets (every one of each sees every variant).
                chosen = variants if FULL else [variants[(g_index + b_index) % len(variants)]]
                for args in chosen:
                    label = ",".join(f"{k}={v}" for k, v in args.items())
                    rows = (itertools.product((0, 1), repeat=len(FACTORS)) if FULL
                            else [COVERING[granularity][b_index]])
                    for bits in rows:
                        env = {factor: values[bit] for (factor, values), bit in zip(FACTORS.items(), bits)}
                        tag = "-".join(f"{k}={int(v)}" if isinstance(v, bool) else str(v) for k, v in env.items())
                        case_id = f"{name}-{granularity}{'-' + label if label else ''}-{budget}-{tag}"
                        params.append(pytest.param(name, granularity, args, budget, env, id=case_id,
                                                   marks=_known(case_id) + _slow_if_it_wraps_a_scorer(name)))
    return params


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny float64 matmuls: one thread is ~10x faster than two on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def model(arch: str, layers: int = LAYERS):
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, layers=layers)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(config).double().eval()
    m.generation_config.eos_token_id = None  # EOS unreachable: every sequence runs all its steps
    return m


def model_of(env: dict):
    """The case's model: its architecture, with LAYERS layers unless the environment names another count."""
    return model(env["arch"], env.get("layers", LAYERS))


def batch(seed: int = 1, shapes=((52, 4), (66, 6), (41, 3))):
    """Requests of mixed lengths, (context, question) of the `shapes` (three by default).

    No token id repeats within a prompt: two copies of one token have layer-0 keys that differ only
    by RoPE, which transformers computes in float32, so their norms differ by ~1e-8 relative, below
    the float32 precision at which scores are compared; their order would be rounding noise.
    """
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for c, q in shapes:
        ids = (torch.randperm(TINY["vocab_size"] - 3, generator=g)[:c + q] + 3).tolist()
        prompts.append((ids[:c], ids[c:]))
    return prompts


def _snapshot(cache):
    """[b][layer][head] -> tuple of kept positions."""
    per_layer = [layer.read().pos.cpu() for layer in cache.layers]
    B, H = per_layer[0].shape[:2]
    return [tuple(tuple(tuple(sorted(p for p in pos[b, h].tolist() if p >= 0)) for h in range(H))
                  for pos in per_layer) for b in range(B)]


def run_evalkit(name, granularity, args, budget, env, new_tokens, requests, page_size=BLOCK, chunk_size=CHUNK,
                tokenizer=None):
    policy = make_policy(name, granularity, args)
    settings = GenerationSettings(policy, budget=budget, layout=env["layout"], page_size=page_size,
                                  prefill=env["prefill"], chunk_size=chunk_size, query_aware=env["query_aware"],
                                  decode_eviction=env["decode_eviction"], seed=SEED,
                                  sliding_layers=env.get("sliding_layers", "budget"))
    events = []
    out = generate(model_of(env), tokenizer, [Request(c, q, new_tokens) for c, q in requests], settings,
                   observe=lambda event, cache: events.append((event, _snapshot(cache))))
    chunks, prefill, steps = [], None, []
    for event, snap in events:
        if prefill is None:
            if event == "compressed":
                chunks.append(snap)
            elif event == "prefill":
                prefill = snap
        elif event == "forward":  # a decode step begins: its state is this, or the compression after it
            steps.append(snap)
        elif event == "compressed":
            steps[-1] = snap
    return [g.token_ids for g in out], chunks, prefill, steps, {e for e, _ in events}


def oracle_setup(name, granularity, args, budget, env, page_size=BLOCK, chunk_size=CHUNK) -> tuple[Spec, Settings]:
    """The oracle's Spec and Settings for evalkit's `name` at `granularity` with --policy-arg `args`."""
    family = family_of(name)
    overrides = {ORACLE_ARG[k][0]: ORACLE_ARG[k][1](v) for k, v in args.items()}
    if family.startswith("critical_") and "epsilon" in overrides:  # CriticalKV's epsilon, not its scorer's
        overrides["critical_epsilon"] = overrides.pop("epsilon")
    if "scorer_epsilon" in overrides:  # the wrapped scorer's own (Expected Attention's)
        overrides["epsilon"] = overrides.pop("scorer_epsilon")
    if family == "duo_attention":
        # The head scores are the oracle's input: evalkit's own, computed once per model (cached in process), as the
        # loop's `prepare` computes them. The calibration itself is held to kvpress's computation in
        # tests/test_duo_attention.py::test_head_scores_are_kvpress_on_the_fly_scores; the oracle re-derives how many
        # heads stream, which, and what each keeps.
        scores = evalkit.policies.duo_calibration.calibrated_head_scores(model_of(env))
        overrides["head_scores"] = tuple(tuple(float(x) for x in row) for row in scores.tolist())
    spec = published_spec(family, granularity, **overrides)
    settings = Settings(budget, page_size, env["prefill"], chunk_size, env["query_aware"], env["decode_eviction"],
                        SEED, env.get("sliding_layers", "budget"))
    return spec, settings


def disagreement(name, granularity, args, budget, env, new_tokens=NEW_TOKENS, requests=None, page_size=BLOCK,
                 chunk_size=CHUNK, own_granularity=False, tokenizer=None, traces=None) -> str | None:
    """None when evalkit and the oracle agree on every step; else where they first differ. With
    `own_granularity`, evalkit runs `name` at the granularity it resolves to, the oracle at `granularity`; both
    get `tokenizer` (None: token ids alone, as every case but KVzip's chat-template ones)."""
    requests = requests or batch()
    spec, settings = oracle_setup(name, granularity, args, budget, env, page_size, chunk_size)
    tokens, chunks, prefill, steps, events = run_evalkit(name, None if own_granularity else granularity, args,
                                                         budget, env, new_tokens, requests, page_size, chunk_size,
                                                         tokenizer)
    sizes = "" if (page_size, chunk_size) == (BLOCK, CHUNK) else f" block={page_size} chunk={chunk_size}"
    case = (f"policy={name} granularity={granularity}{' (its own)' if own_granularity else ''} "
            f"args={args or 'published'} budget={budget}{sizes} "
            f"[{env['arch']}, {env['layout']}, prefill={env['prefill']}, "
            f"{'query-aware' if env['query_aware'] else 'query-agnostic'}, "
            f"decode eviction {'on' if env['decode_eviction'] else 'off'}"
            f"{', sliding layers: ' + env['sliding_layers'] if 'sliding_layers' in env else ''}"
            f"{', with a chat template' if tokenizer is not None else ''}]")
    m = model_of(env)
    for b, (context, question) in enumerate(requests):
        trace = run_oracle(m, spec, settings, context, question, new_tokens, tokenizer)
        if traces is not None:
            traces.append(trace)
        where = (f"{case}: sequence {b} (context {len(context)}, question {len(question)} tokens; "
                 f"k={trace.budget}, k_l={trace.layer_budgets or 'not evicting'})")

        def compare(phase, ours, theirs):
            return first_difference(where, phase, ours, theirs, trace, events)

        own = [c[b] for c in chunks]
        if len(own) < len(trace.chunks):
            return (f"{where}: evalkit reported {len(own)} compressions during prefill, the oracle "
                    f"{len(trace.chunks)} chunks (is the 'compressed' event emitted? events: {sorted(events)})")
        for i, theirs in enumerate(trace.chunks):
            if (msg := compare(f"prefill chunk {i}", own[i], theirs)) is not None:
                return msg
        for i in range(len(trace.chunks), len(own)):  # the batch's later chunks feed this sequence nothing
            if (msg := compare(f"prefill chunk {i} (empty for this sequence)", own[i], trace.chunks[-1])):
                return msg
        if (msg := compare("after prefill", prefill[b] if prefill else None, trace.prefill)) is not None:
            return msg
        for i, theirs in enumerate(trace.steps):
            if tokens[b][i] != trace.tokens[i]:
                return (f"{where}: generated token {i} differs: evalkit {tokens[b][:i + 1]}, "
                        f"oracle {trace.tokens[:i + 1]}")
            ours = steps[i][b] if i < len(steps) else None
            if (msg := compare(f"decode step {i}", ours, theirs)) is not None:
                return msg
        if tokens[b] != trace.tokens:
            return f"{where}: tokens differ: evalkit {tokens[b]}, oracle {trace.tokens}"
    return None


def first_difference(where, phase, ours, theirs, trace, events) -> str | None:
    """None when evalkit's kept positions `ours` [layer][KV head] equal the oracle's `theirs` after `phase`; else
    the first (layer, KV head) where they differ, with the oracle's scores there when it compressed."""
    if ours is None:
        return f"{where}, {phase}: evalkit emitted no state (events seen: {sorted(events)})"
    for l, (ours_l, theirs_l) in enumerate(zip(ours, theirs)):
        for h, (o, t) in enumerate(zip(ours_l, theirs_l)):
            if o != t:
                extra = sorted(set(o) - set(t))
                missing = sorted(set(t) - set(o))
                scores = trace.scores.get(phase, {}).get(l)  # the oracle's, when it compressed here
                hint = "" if scores is None else "; oracle scores " + ", ".join(
                    f"{p}: {float(scores[h][p]):.7g}" if p in scores[h] else f"{p}: -" for p in extra + missing)
                return (f"{where}, {phase}, layer {l}, KV head {h}: evalkit kept {list(o)} "
                        f"({len(o)}), oracle kept {list(t)} ({len(t)}); only evalkit {extra}, "
                        f"only oracle {missing}{hint}")
    return None


@pytest.mark.fast_tier_keeps_one_in(4)
@pytest.mark.parametrize("name, granularity, args, budget, env", _cases())
def test_evalkit_keeps_what_the_oracle_keeps(name, granularity, args, budget, env):
    if family_of(name) is None:
        pytest.fail(f"policy {name!r} is registered but tests/oracle.py has no rule for it")
    message = disagreement(name, granularity, args, budget, env)
    assert message is None, message


# --- every hyper-parameter, every name, the kvpress parity settings -------------------------------

DECODING = dict(arch="llama", layout="paged", prefill="full", query_aware=True, decode_eviction=True)
CHUNKED = dict(arch="qwen2", layout="dense", prefill="chunked", query_aware=False, decode_eviction=True)
PAGED_CHUNKED = dict(arch="llama", layout="paged", prefill="chunked", query_aware=True, decode_eviction=True)
# kvpress's protocol (docs/fidelity.md): the context compressed once, the question after it, no decode eviction
KVPRESS = dict(arch="llama", layout="paged", prefill="full", query_aware=False, decode_eviction=False)


def long_batch():
    """Two contexts long enough that a 64-query window leaves a prefix to select from (110 and 90 tokens)."""
    return batch(2, ((110, 5), (90, 4)))


# (name, granularity, --policy-arg, budget, environment, settings): each hyper-parameter away from its default
# where it decides something (block sizes at page granularities and Quest, chunk sizes in chunked prefills).
HYPER_CASES = [
    ("h2o_head", "head", {"sink_tokens": "3", "recent_fraction": "0.25"}, 0.3, DECODING, {}),
    ("h2o_page", "page", {"recent_fraction": "0", "recent_tokens": "5", "observation_window": "4"}, 0.3,
     PAGED_CHUNKED, {"page_size": 2, "chunk_size": 7}),
    ("tova_token", "token", {"recent_tokens": "0", "sink_tokens": "2"}, 0.3, DECODING, {}),  # the paper's rule
    ("tova_head", "head", {"observation_window": "3", "recent_fraction": "0.25", "recent_tokens": "2"}, 0.3,
     CHUNKED, {}),
    ("snapkv_head", "head", {"window": "8", "sink_tokens": "2", "recent_tokens": "3"}, 0.3, DECODING, {}),
    ("snapkv_token", "token", {"window": "6", "kernel": "3", "recent_fraction": "0.3"}, 0.6, PAGED_CHUNKED,
     {"chunk_size": 32}),
    ("pyramidkv_head", "head", {"window": "8", "beta": "2"}, 0.6, DECODING, {}),
    ("pyramidkv_head_page", "head_page", {"window": "6", "kernel": "3", "beta": "5", "sink_tokens": "2",
                                          "recent_tokens": "2"}, 0.6, CHUNKED, {"page_size": 2}),
    ("pyramidkv_token", "token", {"window": "8", "pooling": "avg", "recent_fraction": "0.2"}, 0.3, DECODING, {}),
    ("adakv_snapkv", "head", {"window": "8", "alpha_safeguard": "0.5"}, 0.3, DECODING, {}),
    ("adakv_snapkv", "head", {"window": "6", "kernel": "3", "alpha_safeguard": "0", "sink_tokens": "2"}, 0.3,
     CHUNKED, {}),
    ("adakv_snapkv", "head", {"window": "8", "pooling": "avg", "alpha_safeguard": "0.9", "recent_tokens": "3",
                              "recent_fraction": "0.2"}, 0.6, PAGED_CHUNKED, {}),
    ("knorm_head", "head", {"sink_tokens": "3", "recent_tokens": "2"}, 0.3, DECODING, {}),
    ("knorm_head_page", "head_page", {"recent_fraction": "0.5", "observation_window": "5"}, 0.3, CHUNKED,
     {"page_size": 8}),
    ("random", "head", {"sink_tokens": "2", "recent_fraction": "0.3", "recent_tokens": "1",
                        "observation_window": "5"}, 0.3, DECODING, {}),
    ("streaming_llm", "head", {"sink_tokens": "0", "recent_fraction": "0.5"}, 0.3, DECODING, {}),
    ("streaming_llm", "page", {"sink_tokens": "6", "recent_fraction": "0", "recent_tokens": "3",
                               "observation_window": "5"}, 0.3, CHUNKED, {"page_size": 8}),
    ("quest", "head", {"dense_layers": "0", "min_pages": "1"}, 0.1, DECODING, {}),  # 2 pages read, not 3
    ("quest_token", "token", {"dense_layers": "1", "min_pages": "5", "sink_tokens": "2", "recent_fraction": "0.5",
                              "recent_tokens": "2", "observation_window": "3"}, 0.3, DECODING, {"page_size": 8}),
    ("full", "head", {"sink_tokens": "2", "recent_fraction": "0.5", "recent_tokens": "1",
                      "observation_window": "3"}, 0.3, DECODING, {}),
    # scripts/parity_kvpress.py's settings (docs/fidelity.md): ObservedAttention at its keeps 50 % and 20 %, and
    # SnapKVPress(window_size=64, kernel_size=5) on contexts long enough for a 64-query window
    ("h2o_head", "head", {"normalize": "true", "recent_fraction": "0"}, 0.5, KVPRESS, {}),
    ("h2o_head", "head", {"normalize": "true", "recent_fraction": "0"}, 0.2, KVPRESS, {}),
    ("snapkv_head", "head", {"window": "64", "kernel": "5", "pooling": "avg"}, 0.8, KVPRESS, {"long": True}),
    # Issue #29's scorers, each hyper-parameter moved where it decides something: LagKV's partitions while
    # decoding (lag 4), KVzip's several reconstructions (chunks of 7 and 9, a chunked prefill of 20) and its
    # per-layer budget, Expected Attention's mean alone (one future position, no covariance, no value norm).
    ("keydiff_head", "head", {"sink_tokens": "2", "recent_tokens": "2", "recent_fraction": "0.2",
                              "observation_window": "3"}, 0.3, DECODING, {}),
    ("keydiff_page", "page", {}, 0.3, PAGED_CHUNKED, {"page_size": 8, "chunk_size": 10}),
    ("lagkv_head", "head", {"lag_size": "4", "sink_tokens": "1"}, 0.3, DECODING, {}),
    ("lagkv_head_page", "head_page", {"lag": "8", "recent_tokens": "2"}, 0.6, CHUNKED, {"page_size": 2}),
    ("expected_attention_head", "head", {"n_future": "1", "use_covariance": "false", "use_vnorm": "false"}, 0.3,
     DECODING, {}),
    ("expected_attention_token", "token", {"n_sink": "0", "epsilon": "0.5", "recent_tokens": "1"}, 0.3, CHUNKED,
     {"chunk_size": 12}),
    ("kvzip_head", "head", {"chunk_size": "7", "sink_tokens": "1", "recent_tokens": "1"}, 0.3, DECODING, {}),
    ("kvzip_head", "head", {"chunk": "11", "layerwise": "true"}, 0.6, CHUNKED, {"chunk_size": 33}),
    ("kvzip_page", "page", {"chunk_size": "8", "recent_fraction": "0.2", "observation_window": "2"}, 0.3,
     PAGED_CHUNKED, {"page_size": 8, "chunk_size": 24}),
    # KVzip's per-head pages with the budget pooled over layers and heads (pool_pages): decoding, a chunked
    # prefill with protected tokens, pages of 2 and 8
    ("kvzip_head_page", "head_page", {"pool_pages": "true"}, 0.3, DECODING, {"page_size": 2}),
    ("kvzip_head_page", "head_page", {"pool_pages": "true", "chunk_size": "9", "sink_tokens": "2",
                                      "recent_tokens": "2"}, 0.6, PAGED_CHUNKED, {"page_size": 8}),
    ("kvzip_head_page", "head_page", {"pool_pages": "true", "recent_fraction": "0.2", "observation_window": "3"},
     0.1, CHUNKED, {}),
    ("critical_snapkv_head", "head", {"window": "8", "first_stage_ratio": "0", "epsilon": "0"}, 0.3, DECODING, {}),
    ("critical_h2o_token", "token", {"first_stage_ratio": "1", "normalize": "true"}, 0.3, CHUNKED, {}),
    # Expected Attention's value norm under CriticalKV, with CriticalKV's epsilon 0 (the two share the name)
    ("critical_expected_attention_head", "head", {"use_vnorm": "true", "epsilon": "0"}, 0.3, DECODING, {}),
    ("critical_expected_attention_head", "head", {"use_vnorm": "true", "scorer_epsilon": "0.5"}, 0.3, DECODING, {}),
    ("critical_lagkv_head_page", "head_page", {"lag": "6", "first_stage_ratio": "0.75"}, 0.6, DECODING,
     {"page_size": 2}),
    ("adakv_expected_attention", "head", {"alpha_safeguard": "1", "n_future": "32"}, 0.3, CHUNKED, {}),
    ("adakv_keydiff", "head", {"alpha_safeguard": "0", "sink_tokens": "2"}, 0.1, DECODING, {}),
    ("adakv_lagkv", "head", {"lag": "4", "alpha_safeguard": "0.4"}, 0.3, DECODING, {}),
    # DuoAttention: pages of 2 and 8 within its sink and recent windows, chunked prefills of 10 (the window slides
    # over each chunk), an integer budget below sinks + recent (2 < 3: every head streams, the mean over the budget),
    # and no sink at budget 0.1
    ("duo_attention", "head_page", {"sink_size": "3", "recent_size": "5"}, 0.3, CHUNKED, {"page_size": 2,
                                                                                          "chunk_size": 10}),
    ("duo_attention", "head_page", {"sink_size": "8", "recent_size": "9"}, 0.6, PAGED_CHUNKED, {"page_size": 8}),
    ("duo_attention", "head", {"sink_size": "2", "recent_size": "1"}, 2, CHUNKED, {"chunk_size": 10}),
    ("duo_attention", "head", {"sink_size": "0", "recent_size": "4"}, 0.1, DECODING, {}),
    # a fixed share of streaming heads (kvpress's head_compression_ratio) of the 3 x 2 heads, whatever the budget:
    # 3 where budget 0.9 alone streams 1, and round(1.5) = 2 (half to even, as Python's round) where budget 0.3
    # alone streams all 6, in kvpress's protocol as the parity row runs it
    ("duo_attention", "head", {"sink_size": "2", "recent_size": "3", "head_compression_ratio": "0.5"}, 0.9,
     DECODING, {}),
    ("duo_attention", "head_page", {"sink_size": "2", "recent_size": "4", "head_compression_ratio": "0.25"}, 0.3,
     KVPRESS, {"page_size": 2}),
    # scripts/parity_kvpress.py's rows for them: published settings, query-agnostic, no decode eviction
    ("expected_attention_head", "head", {}, 0.5, KVPRESS, {"long": True}),
    ("adakv_expected_attention", "head", {}, 0.2, KVPRESS, {"long": True}),
    ("keydiff_head", "head", {}, 0.2, KVPRESS, {"long": True}),
    ("lagkv_head", "head", {}, 0.5, KVPRESS, {"long": True}),
    ("kvzip_head", "head", {}, 0.2, KVPRESS, {"long": True}),
    ("kvzip_head_page", "head_page", {"pool_pages": "true"}, 0.2, KVPRESS, {"long": True}),
    ("critical_snapkv_head", "head", {"window": "64", "kernel": "5", "pooling": "avg"}, 0.8, KVPRESS,
     {"long": True}),
]


def _hyper_id(name, granularity, args, budget, env, sizes) -> str:
    label = ",".join(f"{k}={v}" for k, v in [*args.items(), *sizes.items()])
    return f"{name}-{granularity}-{label}-{budget}-{'kvpress' if env is KVPRESS else env['prefill']}"


@pytest.mark.fast_tier_keeps_one_in(4)
@pytest.mark.parametrize("name, granularity, args, budget, env, sizes",
                         [pytest.param(*case, id=_hyper_id(*case), marks=_known(_hyper_id(*case))) for case in HYPER_CASES])
def test_hyper_parameters_against_the_oracle(name, granularity, args, budget, env, sizes):
    sizes = dict(sizes)
    requests = long_batch() if sizes.pop("long", False) else None
    message = disagreement(name, granularity, args, budget, env, requests=requests, **sizes)
    assert message is None, message


def test_every_hyper_parameter_is_varied_against_the_oracle():
    """Each hyper-parameter of each family the oracle knows leaves its default in some oracle case (VARIANTS or
    HYPER_CASES), and so do the block size and the chunk size (in a chunked prefill): a new one fails here
    until a case varies it."""
    cases = [(name, granularity, args) for name, granularity, args, *_ in HYPER_CASES]
    cases += [(family, None, args) for family, variants in VARIANTS.items() for args in variants]  # `h2o`: h2o_head
    varied = {}
    for name, granularity, args in cases:
        policy, default = make_policy(name, granularity, args), make_policy(name, granularity)
        varied.setdefault(family_of(name), set()).update(
            key for key in policy_args(policy) if getattr(policy, key) != getattr(default, key))
    for family, keys in UNMOVABLE.items():  # refused indeed, so no case can move them
        for key in keys:
            with pytest.raises(EvalkitError):
                make_policy(family, None, {key: "2"})
    missing = sorted({f"{family_of(name)}: {key}" for name in POLICIES.names() if family_of(name) is not None
                      for key in policy_args(make_policy(name)) if key not in varied.get(family_of(name), ())
                      and key not in UNMOVABLE.get(family_of(name), ())})
    assert not missing, f"hyper-parameters no oracle case varies (add one to HYPER_CASES): {missing}"
    assert {sizes["page_size"] for *_, sizes in HYPER_CASES if "page_size" in sizes} - {BLOCK}
    assert {sizes["chunk_size"] for *_, env, sizes in HYPER_CASES
            if "chunk_size" in sizes and env["prefill"] == "chunked"} - {CHUNK}


def _named_cases():
    """Every registered name and alias, made as named (no --granularity), and the granularity
    tests/test_policies.py pins for it."""
    return [pytest.param(name, published_granularity(name), (DECODING, CHUNKED)[i % 2], id=name,
                         marks=_slow_if_it_wraps_a_scorer(name))
            for i, name in enumerate(every_name())]


@pytest.mark.fast_tier_keeps_one_in(2)
@pytest.mark.parametrize("name, granularity, env", _named_cases())
def test_every_name_and_alias_runs_at_its_published_granularity(name, granularity, env):
    """A preset named after its granularity (`h2o_page`) must be the policy the main cases run at that
    granularity; any other name (`tova`, `h2o_block1`, `adakv`, `quest`) runs against the oracle."""
    if family_of(name) is None or granularity is None:
        pytest.fail(f"{name!r}: tests/oracle.py has no rule for it, or tests/test_policies.py no granularity")
    if name.endswith(f"_{granularity}"):
        assert _identity(make_policy(name)) == _identity(make_policy(name, granularity)), name
        return
    message = disagreement(name, granularity, SHORT_PROMPT_ARGS.get(name, {}), 0.3, env, own_granularity=True)
    assert message is None, message


# --- sliding-window layers (Gemma 3) ---------------------------------------------------------------

# A tiny Gemma 3 (tests/conftest.py): layers 0 and 2 slide over 8 positions, layer 1 is global; the prompts (44 to 72
# tokens) are many windows long. Budget 0.3 keeps more than a window (the policy acts in the global layer only),
# 0.1 fewer (in every layer); `sliding_layers="window"` leaves the sliding layers their whole window.
GEMMA3 = dict(arch="gemma3", layout="paged", prefill="full", query_aware=True, decode_eviction=True)
GEMMA3_CHUNKED = dict(arch="gemma3", layout="dense", prefill="chunked", query_aware=False, decode_eviction=True)
GEMMA3_NO_DECODE_EVICTION = dict(arch="gemma3", layout="paged", prefill="chunked", query_aware=True,
                                 decode_eviction=False)
SLIDING_CASES = [
    ("full", "head", {}, 1.0, GEMMA3),
    ("full", "head", {}, 0.1, GEMMA3_CHUNKED),
    ("h2o_head", "head", {}, 0.3, GEMMA3),
    ("h2o_head", "head", {}, 0.1, GEMMA3_CHUNKED),
    ("h2o_token", "token", {}, 0.1, GEMMA3_NO_DECODE_EVICTION),
    ("snapkv_head", "head", {"window": "4", "kernel": "3"}, 0.1, GEMMA3),
    ("snapkv_head_page", "head_page", {"window": "4"}, 0.1, GEMMA3_CHUNKED),
    ("tova_token", "token", {}, 0.1, {**GEMMA3, "sliding_layers": "window"}),
    ("streaming_llm", "page", {}, 0.1, {**GEMMA3_CHUNKED, "sliding_layers": "window"}),
    ("knorm_head", "head", {}, 0.3, {**GEMMA3_NO_DECODE_EVICTION, "layout": "dense"}),
    # KVzip's reconstruction queries attend within the window; its score's softmax has none (kvpress).
    ("kvzip_head", "head", {"chunk_size": "24", "sink_tokens": "2"}, 0.1, GEMMA3),
    ("kvzip_token", "token", {"chunk_size": "12"}, 0.3, GEMMA3_CHUNKED),
    # KVzip's budget pooled over layers sums every layer's cap, a sliding layer's W - 1 too: what the global layer
    # keeps depends on it, above the window (0.3) and with `sliding_layers="window"`.
    ("kvzip_head", "head", {"chunk_size": "24", "sink_tokens": "2"}, 0.3, GEMMA3),
    ("kvzip_head", "head", {"chunk_size": "12"}, 0.3, {**GEMMA3_CHUNKED, "sliding_layers": "window"}),
    # and so does its budget pooled over every layer's pages (pool_pages)
    ("kvzip_head_page", "head_page", {"pool_pages": "true", "chunk_size": "24"}, 0.3, GEMMA3),
    ("kvzip_head_page", "head_page", {"pool_pages": "true", "chunk_size": "12"}, 0.1,
     {**GEMMA3_CHUNKED, "sliding_layers": "window"}),
]


def _sliding_id(name, granularity, args, budget, env) -> str:
    return (f"{name}-{granularity}-{budget}-{env['prefill']}-{env.get('sliding_layers', 'budget')}"
            f"{'' if env['decode_eviction'] else '-no_decode_eviction'}")


@pytest.mark.fast_tier_keeps_one_in(2)
@pytest.mark.parametrize("name, granularity, args, budget, env",
                         [pytest.param(*case, id=_sliding_id(*case)) for case in SLIDING_CASES])
def test_sliding_window_layers_against_the_oracle(name, granularity, args, budget, env):
    """Every policy drops what a sliding layer's window lost after every forward, then evicts within the rest down
    to min(its cap, W - 1) (or keeps the whole window): kept positions and tokens equal the oracle's after every
    prefill chunk, after prefill and after every decode step."""
    message = disagreement(name, granularity, args, budget, env)
    assert message is None, message


# --- long decodes (issue #48): 200 decode steps, each compressing back to the budget ------------------------

# Two prompts whose lengths put the first decoded token at the start of a page (72 = 18 x 4) and in the middle of
# the prompt's last page (62: positions 62 and 63 share page 15 with the prompt's 60 and 61), a budget of 20 tokens
# per KV head, far below both, and 201 new tokens: 200 decode steps, each followed by a compression, so the decoded
# tokens themselves are scored, ranked and evicted, and at page granularities whole pages of them (pages 16 and up
# of the first prompt, 18 and up of the second) are taken and later freed. A two-layer model keeps the oracle's
# whole-sequence float64 recomputation to a few seconds a case.
LONG_NEW_TOKENS = 201
LONG_BUDGET = 20
LONG_AWARE = dict(arch="llama", layout="paged", prefill="full", query_aware=True, decode_eviction=True, layers=2)
LONG_AGNOSTIC = dict(arch="qwen2", layout="dense", prefill="chunked", query_aware=False, decode_eviction=True,
                     layers=2)


def long_decode_batch():
    """(context, question) of 58 + 4 and 68 + 4 tokens, no id repeated within a prompt (see `batch`)."""
    return batch(4, ((58, 4), (68, 4)))


# (name, granularity, --policy-arg): the scorers whose decode-time rule differs, each at every granularity: H2O
# (every decoded query's attention added), TOVA (the last query's, replacing), StreamingLLM (position only; at
# `token` it keeps what it keeps at `head`), SnapKV (decoded tokens never scored: protected until they alone fill
# the budget), KeyDiff (no statistic, no protected token); and the allocators Ada-KV (over H2O: a layer's budget
# moves between its heads every step) and PyramidKV.
LONG_DECODE_CASES = [
    ("h2o_head", "head", {}),
    ("h2o_token", "token", {"normalize": "true"}),
    ("h2o_page", "page", {}),
    ("h2o_head_page", "head_page", {}),
    ("tova", "token", {}),
    ("tova_head", "head", {}),
    ("tova_page", "page", {}),
    ("tova_head_page", "head_page", {}),
    ("streaming_llm", "head", {}),
    ("streaming_llm", "page", {}),
    ("streaming_llm", "head_page", {}),
    ("snapkv_head", "head", {}),  # its published window (32) exceeds the budget: recency alone
    ("snapkv_token", "token", {"window": "8"}),
    ("snapkv_page", "page", {"window": "8", "kernel": "5", "pooling": "avg"}),
    ("snapkv_head_page", "head_page", {"window": "6", "kernel": "3"}),
    ("keydiff_head", "head", {}),
    ("keydiff_token", "token", {}),
    ("keydiff_page", "page", {}),
    ("keydiff_head_page", "head_page", {}),
    ("adakv_h2o", "head", {}),
    ("pyramidkv_head_page", "head_page", {"window": "8"}),
]


def _long_id(index: int, name: str, granularity: str, args: dict) -> str:
    label = ",".join(f"{k}={v}" for k, v in args.items())
    return f"{name}-{granularity}{'-' + label if label else ''}-{'aware' if index % 2 == 0 else 'agnostic'}"


def _long_cases():
    return [pytest.param(name, granularity, args, (LONG_AWARE, LONG_AGNOSTIC)[i % 2],
                         id=_long_id(i, name, granularity, args))
            for i, (name, granularity, args) in enumerate(LONG_DECODE_CASES)]


def decoded_evictions(trace, context, question, page_size=BLOCK) -> tuple[set, set, set]:
    """From an oracle trace, over every (layer, KV head): the decoded positions fed and not held after the last
    step (evicted); those of them held after some step (evicted after surviving one); and the pages lying wholly
    in decoded positions held whole after some step and not at all after the last."""
    first = len(context) + len(question)  # the first decoded token's position
    fed = set(range(first, first + len(trace.steps)))
    evicted, survived, pages = set(), set(), set()
    for l, heads in enumerate(trace.steps[-1]):
        for h, final in enumerate(heads):
            gone = fed - set(final)
            evicted |= gone
            held = [set(step[l][h]) for step in trace.steps]
            survived |= gone & set().union(*held)
            for page in {p // page_size for p in gone if p // page_size * page_size >= first}:
                span = set(range(page * page_size, (page + 1) * page_size))
                if not span & set(final) and any(span <= x for x in held):
                    pages.add(page)
    return evicted, survived, pages


@pytest.mark.slow  # 200 decode steps, the oracle recomputing the whole sequence in float64 at each (6-9 s a case)
@pytest.mark.parametrize("name, granularity, args, env", _long_cases())
def test_long_decodes_against_the_oracle(name, granularity, args, env):
    """200 decode steps, each compressing back to the budget: the kept positions of every (layer, KV head) after
    every step, and every token, equal the oracle's. The case has power: every sequence runs all its steps (EOS is
    unreachable: `model`), holds no more than its cap in any layer after any step, and evicts decoded tokens, at
    page granularities whole pages of them."""
    requests, traces = long_decode_batch(), []
    message = disagreement(name, granularity, args, LONG_BUDGET, env, new_tokens=LONG_NEW_TOKENS, requests=requests,
                           traces=traces)
    assert message is None, message
    assert len(traces) == len(requests)
    for (context, question), trace in zip(requests, traces):
        assert trace.evicting and len(trace.tokens) == LONG_NEW_TOKENS and len(trace.steps) == LONG_NEW_TOKENS - 1
        appended = 0 if env["query_aware"] else len(question)
        for step in trace.steps:
            for cap, heads in zip(trace.layer_budgets, step):
                assert sum(map(len, heads)) <= (cap + appended) * len(heads), (name, cap, heads)
        evicted, survived, pages = decoded_evictions(trace, context, question)
        # The budget (20, plus the question when query-agnostic) holds a tenth of what is decoded.
        assert len(evicted) > LONG_NEW_TOKENS // 2 and survived, (name, sorted(evicted), sorted(survived))
        if granularity in ("page", "head_page"):
            assert len(pages) > 10, f"{name}: only decoded pages {sorted(pages)} were held whole and evicted whole"


# --- conversations (issue #48): several turns on one compressed context ------------------------------------

# `evalkit.loop.conversation.converse` against the oracle's conversation (`run_oracle`'s `later_turns`): the context
# prefilled and compressed once, the first question answered as a single-question run, then per later turn one
# forward of the previous answer's last token (answers run to max new tokens: EOS is unreachable, `model`) and the
# turn's prompt, evicted back to the caps the first answer began with, and the turn's answer decoded with eviction
# after every step. A budget of 16 tokens per KV head holds a fraction of what the turns add (about 45 tokens), so
# the earlier turns' prompts and answers are scored, ranked and evicted in later turns.
CONVERSATION_NEW_TOKENS = 10
CONVERSATION_BUDGET = 16
CONVERSATION_AWARE = dict(arch="llama", layout="paged", prefill="full", query_aware=True, decode_eviction=True,
                          layers=2)
CONVERSATION_AGNOSTIC = dict(arch="qwen2", layout="dense", prefill="chunked", query_aware=False,
                             decode_eviction=True, layers=2)


def conversations():
    """(context, [turn prompts]) of 50 + (4, 3, 5) and 61 + (3, 5, 4) tokens, no id repeated within one (see
    `batch`): the first answer begins mid-page in one (position 54) and on a page boundary in the other (64)."""
    g = torch.Generator().manual_seed(5)
    talks = []
    for c, turns in ((50, (4, 3, 5)), (61, (3, 5, 4))):
        ids = (torch.randperm(TINY["vocab_size"] - 3, generator=g)[:c + sum(turns)] + 3).tolist()
        bounds = list(itertools.accumulate(turns, initial=c))
        talks.append((ids[:c], [ids[a:b] for a, b in zip(bounds, bounds[1:])]))
    return talks


def run_conversation(name, granularity, args, budget, env, context, turns, new_tokens):
    """evalkit's `converse` on one conversation: (each turn's answer, the kept [layer][KV head] after each prefill
    chunk, after prefill, and after every later forward (and its compression), the events seen)."""
    settings = GenerationSettings(make_policy(name, granularity, args), budget=budget, layout=env["layout"],
                                  page_size=BLOCK, prefill=env["prefill"], chunk_size=CHUNK,
                                  query_aware=env["query_aware"], decode_eviction=env["decode_eviction"], seed=SEED)
    events = []

    def observed_start(*args, **kwargs):  # `converse` takes no observer: its prefill's `start` is given one
        return start(*args, observe=lambda event, cache: events.append((event, _snapshot(cache)[0])), **kwargs)

    with mock.patch.object(evalkit.loop.conversation, "start", observed_start):
        out = converse(model_of(env), None, Conversation(context, turns, new_tokens), settings)
    chunks, prefill, after = [], None, []
    for event, snap in events:
        if prefill is None:
            if event == "compressed":
                chunks.append(snap)
            elif event == "prefill":
                prefill = snap
        elif event == "forward":  # a later forward: its state is this, or the compression after it
            after.append(snap)
        elif event == "compressed":
            after[-1] = snap
    return [g.token_ids for g in out], chunks, prefill, after, {e for e, _ in events}


def conversation_disagreement(name, granularity, args, budget, env, talks, new_tokens, traces=None) -> str | None:
    """None when evalkit's conversation and the oracle's agree: every turn's answer, and the kept positions of
    every (layer, KV head) after every prefill chunk, after prefill and after every later forward (each decode step,
    each turn's prompt); else where they first differ."""
    spec, settings = oracle_setup(name, granularity, args, budget, env)
    case = (f"policy={name} granularity={granularity} args={args or 'published'} budget={budget} "
            f"[{env['arch']}, {env['layout']}, prefill={env['prefill']}, "
            f"{'query-aware' if env['query_aware'] else 'query-agnostic'}, "
            f"decode eviction {'on' if env['decode_eviction'] else 'off'}, a conversation]")
    for b, (context, turns) in enumerate(talks):
        answers, chunks, prefill, after, events = run_conversation(name, granularity, args, budget, env, context,
                                                                   turns, new_tokens)
        trace = run_oracle(model_of(env), spec, settings, context, turns[0], new_tokens, later_turns=turns[1:])
        if traces is not None:
            traces.append(trace)
        where = (f"{case}: conversation {b} (context {len(context)}, turns {[len(t) for t in turns]} tokens; "
                 f"k={trace.budget}, k_l={trace.layer_budgets or 'not evicting'})")
        if len(chunks) != len(trace.chunks):
            return (f"{where}: evalkit reported {len(chunks)} compressions during prefill, the oracle "
                    f"{len(trace.chunks)} chunks (events: {sorted(events)})")
        for i, (ours, theirs) in enumerate(zip(chunks, trace.chunks)):
            if (msg := first_difference(where, f"prefill chunk {i}", ours, theirs, trace, events)) is not None:
                return msg
        if (msg := first_difference(where, "after prefill", prefill, trace.prefill, trace, events)) is not None:
            return msg
        # The oracle's turns: (phase of the forward that fed the turn's prompt, or None for the first turn, whose
        # prompt the prefill fed), its answer, the kept after each decode step.
        oracle_turns = [(None, trace.tokens, trace.steps, "decode step ")]
        oracle_turns += [((f"turn {t} prompt", turn.after_fed), turn.tokens, turn.steps, f"turn {t} decode step ")
                         for t, turn in enumerate(trace.turns, start=2)]
        if len(answers) != len(oracle_turns):
            return f"{where}: evalkit answered {len(answers)} turns, the oracle {len(oracle_turns)}"
        index = 0  # into evalkit's states after prefill
        for t, ((prompt, tokens, steps, label), ours) in enumerate(zip(oracle_turns, answers), start=1):
            if prompt is not None:
                phase, theirs = prompt
                state = after[index] if index < len(after) else None
                if (msg := first_difference(where, phase, state, theirs, trace, events)) is not None:
                    return msg
                index += 1
            for i, theirs in enumerate(steps):
                if ours[:i + 1] != tokens[:i + 1]:
                    return f"{where}: turn {t}'s token {i} differs: evalkit {ours[:i + 1]}, oracle {tokens[:i + 1]}"
                state = after[index] if index < len(after) else None
                if (msg := first_difference(where, f"{label}{i}", state, theirs, trace, events)) is not None:
                    return msg
                index += 1
            if ours != tokens:
                return f"{where}: turn {t}'s answer differs: evalkit {ours}, oracle {tokens}"
        if index != len(after):
            return f"{where}: evalkit ran {len(after)} forwards after prefill, the oracle {index}"
    return None


def earlier_turns_evicted(trace, context, turns, query_aware) -> set:
    """From an oracle conversation, over every (layer, KV head): the (turn, position) pairs of a position fed after
    the compressed prompt in an earlier turn (the first question when query-agnostic, an answer, a later turn's
    prompt) that the head held when the turn began and no longer holds when it ends."""
    start = len(context) + (0 if query_aware else len(turns[0]))  # the first position fed after compression
    # The kept, and the tokens fed, as the second turn begins (the first answer's last token not yet fed).
    began = trace.steps[-1] if trace.steps else trace.prefill
    seen = len(context) + len(turns[0]) + len(trace.steps)
    gone = set()
    for number, turn in enumerate(trace.turns, start=2):
        ended = turn.steps[-1] if turn.steps else turn.after_fed
        for l, heads in enumerate(ended):
            for h, final in enumerate(heads):
                gone |= {(number, p) for p in set(began[l][h]) - set(final) if start <= p < seen}
        began, seen = ended, seen + len(turn.fed) + len(turn.steps)
    return gone


# (name, granularity, --policy-arg, decode eviction): H2O, SnapKV, TOVA and KeyDiff at every granularity, and
# StreamingLLM, alternately query-aware and query-agnostic; and a conversation whose cache grows by every turn.
CONVERSATION_CASES = [
    ("h2o_head", "head", {}, True),
    ("h2o_token", "token", {}, True),
    ("h2o_page", "page", {}, True),
    ("h2o_head_page", "head_page", {}, True),
    ("snapkv_head", "head", {"window": "8"}, True),
    ("snapkv_token", "token", {"window": "6", "kernel": "3"}, True),
    ("snapkv_page", "page", {"window": "8", "kernel": "5", "pooling": "avg"}, True),
    ("snapkv_head_page", "head_page", {"window": "8"}, True),
    ("tova", "token", {}, True),
    ("tova_head", "head", {}, True),
    ("tova_page", "page", {}, True),
    ("tova_head_page", "head_page", {}, True),
    ("keydiff_head", "head", {}, True),
    ("keydiff_token", "token", {}, True),
    ("keydiff_page", "page", {}, True),
    ("keydiff_head_page", "head_page", {}, True),
    ("streaming_llm", "head", {}, True),
    ("h2o_head", "head", {}, False),
    # KVzip's budget pooled over layers and heads: a head may hold more than its cap, so the cache is sized for every
    # turn (per-head pages on the paged layout; tokens on the dense one)
    ("kvzip_head_page", "head_page", {"pool_pages": "true", "chunk_size": "24"}, True),
    ("kvzip_head", "head", {"chunk_size": "24"}, True),
]


def _conversation_id(index: int, name: str, granularity: str, args: dict, decode_eviction: bool) -> str:
    label = ",".join(f"{k}={v}" for k, v in args.items())
    return (f"{name}-{granularity}{'-' + label if label else ''}-{'aware' if index % 2 == 0 else 'agnostic'}"
            f"{'' if decode_eviction else '-no_decode_eviction'}")


def _conversation_cases():
    return [pytest.param(name, granularity, args,
                         {**(CONVERSATION_AWARE, CONVERSATION_AGNOSTIC)[i % 2], "decode_eviction": decode_eviction},
                         id=_conversation_id(i, name, granularity, args, decode_eviction))
            for i, (name, granularity, args, decode_eviction) in enumerate(CONVERSATION_CASES)]


@pytest.mark.slow  # three turns, the oracle recomputing the whole conversation at each forward (1 s a case)
@pytest.mark.parametrize("name, granularity, args, env", _conversation_cases())
def test_conversations_against_the_oracle(name, granularity, args, env):
    """Three turns on one compressed context: every answer, and the kept positions of every (layer, KV head) after
    every forward, equal the oracle's conversation. The case has power: every answer runs to max new tokens, and
    with decode eviction every head holds at most its decode cap after every forward and every later turn evicts
    tokens of earlier turns (questions, answers); without it nothing fed after the prompt is ever evicted and the
    cache grows by every turn."""
    talks, traces = conversations(), []
    message = conversation_disagreement(name, granularity, args, CONVERSATION_BUDGET, env, talks,
                                        CONVERSATION_NEW_TOKENS, traces)
    assert message is None, message
    for (context, turns), trace in zip(talks, traces):
        answers = [trace.tokens, *(turn.tokens for turn in trace.turns)]
        assert trace.evicting and len(answers) == len(turns), (name, len(answers))
        assert all(len(a) == CONVERSATION_NEW_TOKENS for a in answers), answers
        later = [*trace.steps, *(s for turn in trace.turns for s in (turn.after_fed, *turn.steps))]
        appended = 0 if env["query_aware"] else len(turns[0])
        if env["decode_eviction"]:
            policy = make_policy(name, granularity, args)
            for state in later:
                # one budget for the sequence: a layer or head may hold more than its own cap, and KVzip's pooled
                # tokens keep every protected one, its sinks on top of each layer's recent ones
                bounds = [(cap + appended + policy.sink_tokens) * len(heads)
                          for cap, heads in zip(trace.layer_budgets, state)]
                sizes = [sum(len(held) for held in heads) for heads in state]
                if policy.selects_across_layers:
                    assert sum(sizes) <= sum(bounds), (name, sizes, bounds)
                else:
                    for cap, heads in zip(trace.layer_budgets, state):
                        assert all(len(held) <= cap + appended for held in heads), (name, cap, heads)
            gone = earlier_turns_evicted(trace, context, turns, env["query_aware"])
            assert {t for t, _ in gone} == set(range(2, len(turns) + 1)), \
                f"{name}: some later turn evicted no token of an earlier turn: {sorted(gone)}"
        else:
            compressed = len(context) + (len(turns[0]) if env["query_aware"] else 0)
            fed = compressed + appended + sum(len(t) for t in turns[1:]) + len(turns) * CONVERSATION_NEW_TOKENS - 1
            for heads in later[-1]:  # every position fed after the compressed prompt is still held by every head
                assert all(set(range(compressed, fed)) <= set(held) for held in heads), (name, heads)
            sizes = [sum(len(held) for heads in state for held in heads)  # after prefill, as each turn ends
                     for state in [trace.prefill, trace.steps[-1], *(turn.steps[-1] for turn in trace.turns)]]
            assert sizes == sorted(set(sizes)), f"{name}: the cache did not grow by every turn: {sizes}"


# --- rules only a corner decides (issue #53's mutation study: no other case failed when each was broken) -----

CORNER_CASES = [
    # floor(0.1 x cap) is 0 at caps of 5 to 8: the first stage still picks one token (the scorer's best: no sinks, no
    # recent window), which the value-norm correction alone would not keep
    pytest.param("critical_knorm_head", "head", {"first_stage_ratio": "0.1"}, 0.1, DECODING,
                 id="critical_first_stage_below_one_token_keeps_one"),
    # caps of 3: KeyDiff's heads score so differently that one would take its layer's whole budget and the other
    # keep nothing, but for the published safeguard, ceil(0.2 x 3) = 1 token (no decode eviction: there a head can be
    # left two tokens, whose cosines to their mean are equal, a tie that rounding noise decides)
    pytest.param("adakv_keydiff", "head", {}, 3,
                 dict(arch="qwen2", layout="paged", prefill="full", query_aware=True, decode_eviction=False),
                 id="adakv_published_safeguard_keeps_a_head_its_best_token"),
]


@pytest.mark.parametrize("name, granularity, args, budget, env", CORNER_CASES)
def test_corner_rules_against_the_oracle(name, granularity, args, budget, env):
    """Each rule that only its corner case decides (the comment above it says which) is the oracle's."""
    message = disagreement(name, granularity, args, budget, env)
    assert message is None, message


@functools.lru_cache(maxsize=None)
def chat_tokenizer():
    """A tokenizer of the tiny models' ids, built here (nothing from the hub): one id per character (a newline and
    printable ASCII, then unused ids up to the vocabulary's size) and SmolLM2's chat template, ChatML."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    characters = ["\n", *map(chr, range(32, 127))]
    vocab = {c: i for i, c in enumerate(characters)} | {f"<unused{i}>": i
                                                        for i in range(len(characters), TINY["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=f"<unused{TINY['vocab_size'] - 1}>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    template = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=template)


@pytest.mark.parametrize("granularity, args, env", [
    pytest.param("head", {"chunk_size": "12"}, DECODING, id="first_and_later_chunks_after_the_prefix"),
    pytest.param("token", {"chunk_size": "24", "sink_tokens": "2"}, CHUNKED,
                 id="a_prefill_chunk_within_the_prefix_reconstructs_nothing"),
])
def test_kvzip_reconstruction_prompts_follow_the_chat_template(granularity, args, env):
    """With a tokenizer that has a chat template, KVzip asks in its words, as kvpress: the prompt's first positions
    (the template's "<|im_start|>user\\n", 17 characters) are never reconstructed, the first chunk after them is
    asked to be repeated, a later one from the previous chunk's tail, each in the template's assistant turn."""
    assert kvzip_prompts(chat_tokenizer()).prefix > CHUNK  # the chunked prefill's first chunk is all prefix
    message = disagreement("kvzip_head", granularity, args, 0.3, env, tokenizer=chat_tokenizer())
    assert message is None, message


def test_duo_attention_ties_between_head_scores_stream_the_lower_layer_and_head(monkeypatch):
    """Head scores with ties, three heads at 0.2 and three at 0.5, at a budget that streams two heads in every
    sequence: of the three tied lowest, (0, 1) and (1, 0) stream, not (2, 1)."""
    tied = torch.tensor([[0.5, 0.2], [0.2, 0.5], [0.5, 0.2]])
    for module in (evalkit.policies.duo_attention, evalkit.policies.duo_calibration):
        monkeypatch.setattr(module, "calibrated_head_scores", lambda model, tokenizer=None: tied)
    args = SHORT_PROMPT_ARGS["duo_attention"]
    window = int(args["sink_size"]) + int(args["recent_size"])
    for context, question in batch():
        n = len(context) + len(question)
        assert duo_streaming(tied.tolist(), budget_tokens(0.7, n), n, window) == {(0, 1), (1, 0)}
    message = disagreement("duo_attention", "head", args, 0.7, DECODING)
    assert message is None, message


# --- the suite catches real mistakes --------------------------------------------------------------

MUTATION_ENVS = [dict(arch="llama", layout="paged", prefill="full", query_aware=True, decode_eviction=True),
                 dict(arch="qwen2", layout="dense", prefill="chunked", query_aware=False, decode_eviction=True)]


def _caught(monkeypatch, cases) -> str:
    """The first case where the mutated evalkit disagrees; the same case must agree once it is undone."""
    for case in cases:
        message = disagreement(*case, new_tokens=8)
        if message is not None:
            monkeypatch.undo()
            assert disagreement(*case, new_tokens=8) is None, "this case disagrees even without the mutation"
            return message
    pytest.fail("the mutated evalkit still agrees with the oracle on every case")


def test_mutation_h2o_without_decode_accumulation_is_caught(monkeypatch):
    """H2O that stops adding decode queries' attention must disagree with the oracle, while decoding."""
    monkeypatch.setattr(evalkit.policies.h2o.H2O, "collect_decode", None)
    cases = [("h2o_head", g, {}, budget, env) for env in MUTATION_ENVS for g in ("head", "token")
             for budget in (0.3, 0.6)]
    found = _caught(monkeypatch, cases)
    assert "decode step" in found, found  # prefill is untouched by this mutation


def test_mutation_snapkv_window_off_by_one_is_caught(monkeypatch):
    """A SnapKV window statistic over w + 1 queries (evalkit's side only) must disagree with the oracle."""
    window_queries = evalkit.attention_ops.window_queries
    monkeypatch.setattr(evalkit.attention_ops, "window_queries",
                        lambda q_pos, q_valid, window: window_queries(q_pos, q_valid, window + 1))
    cases = [("snapkv_head", "head", args, budget, env) for env in MUTATION_ENVS
             for args in ({}, {"window": "8", "kernel": "5", "pooling": "avg"}) for budget in (0.3, 0.6)]
    _caught(monkeypatch, cases)


def test_mutation_keydiff_anchor_from_raw_keys_is_caught(monkeypatch):
    """KeyDiff's anchor as the mean of the raw keys (not of the unit-normalised ones) must disagree."""

    def raw_anchor(self, inp):
        live = (inp.positions >= 0)[..., None]
        keys = inp.keys.float()
        anchor = (keys * live).sum(2, keepdim=True) / live.sum(2, keepdim=True).clamp(min=1)
        return -torch.nn.functional.cosine_similarity(keys, anchor, dim=-1)

    monkeypatch.setattr(evalkit.policies.keydiff.KeyDiff, "score", raw_anchor)
    _caught(monkeypatch, [("keydiff_head", g, {}, budget, env) for env in MUTATION_ENVS for g in ("head", "token")
                          for budget in (0.3, 0.6)])


def test_mutation_lagkv_partition_against_its_own_range_is_caught(monkeypatch):
    """LagKV normalising a partition by its own range instead of the next partition's must disagree."""

    def own_range(self, parts):
        judged = parts[:-1]
        low, high = judged.amin(1, keepdim=True), judged.amax(1, keepdim=True)
        return ((judged - low) / (high - low)).std(-1).softmax(-1)

    monkeypatch.setattr(evalkit.policies.lagkv.LagKV, "_spread", own_range)
    _caught(monkeypatch, [("lagkv_head", "head", {"lag_size": lag}, budget, env) for env in MUTATION_ENVS
                          for lag in ("8", "5") for budget in (0.3, 0.6)])


def test_mutation_expected_attention_moments_after_rope_are_caught(monkeypatch):
    """Expected Attention's query moments summed over the queries after RoPE (not turned back) must disagree."""
    monkeypatch.setattr(evalkit.policies.query_moments, "unrotate", lambda q, cos, sin: q)
    _caught(monkeypatch, [("expected_attention_head", g, {}, budget, env) for env in MUTATION_ENVS
                          for g in ("head", "token") for budget in (0.3, 0.6)])


def test_mutation_critical_value_norms_through_the_wrong_heads_are_caught(monkeypatch):
    """CriticalKV projecting each value through the next query head's slice of o_proj must disagree."""
    norms = evalkit.policies.critical.projected_value_norms

    def shifted(values, o_proj):
        hidden, D = o_proj.shape[0], values.shape[-1]
        return norms(values, o_proj.view(hidden, -1, D).roll(1, dims=1).reshape(hidden, -1))

    monkeypatch.setattr(evalkit.policies.critical, "projected_value_norms", shifted)
    _caught(monkeypatch, [(name, "head", {}, budget, env) for env in MUTATION_ENVS
                          for name in ("critical_keydiff_head", "critical_snapkv_head") for budget in (0.3, 0.6)])


def test_mutation_adakv_safeguard_of_the_whole_budget_is_caught(monkeypatch):
    """Ada-KV over other scorers than SnapKV with a safeguard of the whole budget (alpha 1: every head keeps its
    own budget, nothing is reallocated) must disagree."""
    select = evalkit.policies.adakv.select_adaptive
    monkeypatch.setattr(evalkit.policies.adakv, "select_adaptive",
                        lambda scores, positions, seen, caps, alpha, *rest: select(scores, positions, seen, caps, 1.0,
                                                                                   *rest))
    _caught(monkeypatch, [(name, "head", {}, budget, env) for env in MUTATION_ENVS
                          for name in ("adakv_expected_attention", "adakv_keydiff") for budget in (0.3, 0.6)])


def test_mutation_kvzip_reconstruction_without_the_sinks_is_caught(monkeypatch):
    """KVzip's reconstruction softmax leaving out the sinks before a later chunk must disagree."""
    scores = evalkit.attention.reconstruction_attention
    monkeypatch.setattr(evalkit.attention, "reconstruction_attention",
                        lambda *args, **kwargs: scores(*args, **{**kwargs, "sinks": 0}))
    _caught(monkeypatch, [("kvzip_head", g, {"chunk_size": "24"}, budget, env) for env in MUTATION_ENVS
                          for g in ("head", "token") for budget in (0.3, 0.6)])


def test_mutation_duo_attention_streaming_head_one_recent_token_short_is_caught(monkeypatch):
    """A DuoAttention streaming head keeping one fewer recent token than recent_size must disagree."""
    select = evalkit.policies.duo_attention.DuoAttention.select
    monkeypatch.setattr(evalkit.policies.duo_attention.DuoAttention, "select",
                        lambda self, scores, positions, seen, caps, *rest: select(self, scores, positions, seen,
                                                                                   caps - 1, *rest))
    _caught(monkeypatch, [("duo_attention", g, SHORT_PROMPT_ARGS["duo_attention"], budget, env)
                          for env in MUTATION_ENVS for g in ("head", "head_page") for budget in (0.3, 0.6)])


def test_kvzip_reconstructs_chunks_smaller_than_a_prefill_chunk():
    """KVzip chunks of 12 in prefill chunks of 16: the last prefill chunk of every prompt ends before its second
    reconstruction chunk begins."""
    message = disagreement("kvzip_head", "head", {"chunk_size": "12"}, 0.3, CHUNKED)
    assert message is None, message


def test_quest_reads_change_tokens_so_its_comparison_has_power():
    """Quest evicts nothing: only its tokens are compared. They must depend on what it reads."""
    settings = Settings(0.3, BLOCK, "full", CHUNK, True, True, SEED)
    m = model("llama")
    for granularity in ("head", "token"):
        differs = [run_oracle(m, published_spec("quest", granularity), settings, c, q, NEW_TOKENS).tokens
                   != run_oracle(m, published_spec("full"), settings, c, q, NEW_TOKENS).tokens for c, q in batch()]
        assert any(differs), f"Quest ({granularity}) reads change no token of the batch: the test cannot see them"


# --- rules cheap enough to check exhaustively -----------------------------------------------------


def test_pyramid_layer_budgets_match_the_oracle_schedule():
    policy = make_policy("pyramidkv_head", None, {"window": "8"})
    mismatches = []
    for layers in (2, 3, 4, 5, 7, 30):
        for n in (20, 41, 64, 100, 257):
            for k in range(1, n):
                ours = policy.layer_caps(torch.tensor([k]), torch.tensor([n]), layers)[:, 0].tolist()
                theirs = pyramid_budgets(k, n, layers, 8, 20.0)
                if ours != theirs:
                    mismatches.append(f"L={layers} n={n} k={k}: evalkit {ours}, oracle {theirs}")
    assert not mismatches, "\n".join(mismatches[:20])


@pytest.mark.parametrize("name, granularity, args", [("h2o_head", "head", {}),
                                                     ("snapkv_head", "token", {"window": "8"})])
def test_a_sequence_within_its_budget_is_never_evicted_in_an_evicting_batch(name, granularity, args):
    """Budget 45 tokens: the 44-token prompt keeps everything while the other two are evicted."""
    for query_aware in (True, False):
        lengths = [len(c) + len(q) if query_aware else len(c) for c, q in batch()]
        assert [budget_tokens(45, n) < n for n in lengths] == [True, True, False]
        env = dict(arch="qwen2", layout="paged", prefill="chunked", query_aware=query_aware, decode_eviction=True)
        message = disagreement(name, granularity, args, 45, env)
        assert message is None, message


@pytest.mark.parametrize("name, granularity", [("h2o_page", "page"), ("knorm_head_page", "head_page")])
def test_a_share_below_one_page_keeps_one_page(name, granularity):
    """At a page granularity a sample whose budget is below one page keeps one page (3 tokens < 4)."""
    env = dict(arch="llama", layout="paged", prefill="chunked", query_aware=False, decode_eviction=True)
    assert budget_tokens(3, 40) < BLOCK
    message = disagreement(name, granularity, {}, 3, env)
    assert message is None, message
