"""`evalkit bench --speed`'s measurements: the main job's speed, as ratios against baselines timed in the same
run (the command, speed.json and its table: `evalkit.bench.speed_command`).

Six measurements (docs/benchmarks.md, "The main job's speed"), each interleaved with its baseline
(baseline, subject, baseline, ...; medians of `repeats` after a warm-up):
- loop: evalkit `full` against HF `generate` (sdpa) on the model (default: the embedded default), same prompt, 16 new tokens
  (EOS off), seconds per prompt at each length; and each with 1 new token (its prefill), for the split;
- overhead: a 2-layer, 64-wide random Qwen2 (built from a config) on an 894-token prompt, where the
  model costs almost nothing: evalkit's decode step (full cache; h2o_head @ 0.2 with and without
  decode eviction) against HF generate's, from (time for 64 tokens - time for 1) / 63; and the ATen
  operators a step runs, counted by the profiler (the same on a busy machine);
- statistics: the model's prompt forward with H2O's column sums, SnapKV's window and both,
  against the plain forward (`shared_prefill.share_prefill`, nothing else), at each length; and the
  floor of any exact second pass: the plain forward plus the causal scores' matmul alone;
- kvzip: KVzip's compression (the prompt forward and its context reconstruction, `share_prefill` with the
  reconstruction scores) against the plain prompt forward, at each length: kvpress states 2-3x the prefill;
- sweep: 8 policies x 3 budgets (+ the full cache) on `samples` samples of the default task at the
  shortest length, all
  cells through one shared prefill per sample (`runner.run_many`) against the same cells one `run`
  at a time, in this process; results compared line by line; then the peak RSS of each way in a
  child process, against one full-cache run's;
- ppl: token-by-token perplexity (`evalkit run --task ppl --chunk-size 1`, `score_rolling`) of one essay passage
  at the shortest length, h2o_head @ 0.2: its tokens/s against the same passage in one forward (a chunk as long
  as the passage), the static decode step against the eager one, and evalkit's pass at budget 1 against HF's
  own forward one token at a time; the log-probabilities of each pair compared.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2Config

from evalkit.attention_ops import causal_tiles
from evalkit.bench.generations import bench_prompts, eos_disabled
from evalkit.config import RunConfig
from evalkit.loop import GenerationSettings, Request, generate, score_rolling, share_prefill
from evalkit.loop.shared_prefill import reconstruction_key
from evalkit.models import load_model
from evalkit.policies import make_policy
from evalkit.runner import run, run_many
from evalkit.tasks.ppl import Perplexity

MEASURES = ("loop", "overhead", "statistics", "kvzip", "sweep", "ppl")

SWEEP_POLICIES = ["h2o_head", "h2o_page", "snapkv_head", "tova_token", "knorm_head", "streaming_llm",
                  "pyramidkv_head", "h2o_head_page"]
SWEEP_BUDGETS = [0.1, 0.2, 0.5]
NEW_TOKENS = 16
PPL_POLICY, PPL_BUDGET = "h2o_head", 0.2


def interleaved(functions: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, called in turn `repeats` times after one warm-up round."""
    for fn in functions.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in functions}
    for _ in range(repeats):
        for name, fn in functions.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def hf_generate(model, ids: list[int], new_tokens: int):
    def call():
        with torch.inference_mode():
            model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return call


def evalkit_generate(model, ids: list[int], new_tokens: int, policy="full", budget=1.0, decode_eviction=True):
    settings = GenerationSettings(policy=make_policy(policy), budget=budget, decode_eviction=decode_eviction)
    return lambda: generate(model, None, [Request(ids, [], new_tokens)], settings)


def measure_loop(model_name: str, lengths: list[int], repeats: int) -> list[dict]:
    model, tokenizer = load_model(model_name)
    rows = []
    with eos_disabled(model):
        for length in lengths:
            ids = bench_prompts(tokenizer, length - NEW_TOKENS, 1)[0].ids
            t = interleaved({"hf": hf_generate(model, ids, NEW_TOKENS),
                             "evalkit": evalkit_generate(model, ids, NEW_TOKENS),
                             "hf_1": hf_generate(model, ids, 1), "evalkit_1": evalkit_generate(model, ids, 1)}, repeats)
            rows.append({"measure": "loop", "length": length, "hf_seconds": t["hf"], "evalkit_seconds": t["evalkit"],
                         "ratio": t["hf"] / t["evalkit"], "target": ">= 1.0 (evalkit full tokens/s over HF's)",
                         # the split: one new token is the prefill; the rest is decode
                         "hf_prefill_seconds": t["hf_1"], "evalkit_prefill_seconds": t["evalkit_1"],
                         "hf_decode_seconds": t["hf"] - t["hf_1"], "evalkit_decode_seconds": t["evalkit"] - t["evalkit_1"]})
    return rows


def tiny_qwen2():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         use_sliding_window=False)
    return AutoModelForCausalLM.from_config(config).eval()


def measure_overhead(repeats: int) -> list[dict]:
    model = tiny_qwen2()
    ids = torch.randint(0, 49152, (894,), generator=torch.Generator().manual_seed(0)).tolist()
    long, short = 64, 1
    functions = {"hf": hf_generate(model, ids, long), "hf_1": hf_generate(model, ids, short)}
    cases = {"full cache": ("full", 1.0, True), "h2o_head @ 0.2, no decode eviction": ("h2o_head", 0.2, False),
             "h2o_head @ 0.2, decode eviction": ("h2o_head", 0.2, True)}
    for name, (policy, budget, evict) in cases.items():
        functions[name] = evalkit_generate(model, ids, long, policy, budget, evict)
        functions[name + " (1)"] = evalkit_generate(model, ids, short, policy, budget, evict)
    with eos_disabled(model):
        t = interleaved(functions, repeats)
        ops = {name: operator_calls(fn) for name, fn in functions.items()}
    hf_step = (t["hf"] - t["hf_1"]) / (long - short)
    hf_ops = (ops["hf"] - ops["hf_1"]) / (long - short)
    rows = []
    for name in cases:
        step = (t[name] - t[name + " (1)"]) / (long - short)
        rows.append({"measure": "overhead", "case": name, "hf_step_ms": 1e3 * hf_step, "evalkit_step_ms": 1e3 * step,
                     "ratio": step / hf_step, "hf_step_ops": hf_ops,
                     "evalkit_step_ops": (ops[name] - ops[name + " (1)"]) / (long - short),
                     "target": "<= 1.5 (evalkit step over HF's)" if name.endswith(", decode eviction")
                     else "<= 1.2 (evalkit step over HF's)"})
    return rows


def operator_calls(fn) -> int:
    """How many ATen operators one call of `fn` runs (nested calls included): unlike its time, the same
    on a busy machine, so a decode step's overhead can be compared between commits anywhere."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(event.count for event in prof.key_averages() if event.key.startswith("aten::"))


def measure_statistics(model_name: str, lengths: list[int], repeats: int) -> list[dict]:
    model, tokenizer = load_model(model_name)
    rows = []
    for length in lengths:
        request = [Request(bench_prompts(tokenizer, length, 1)[0].ids, [], 1)]
        kinds = {"plain": set(), "h2o column sums": {("attention", 0)}, "snapkv window 32": {("window", 32)},
                 "both": {("attention", 0), ("window", 32)}}
        calls = {name: (lambda s=s: share_prefill(model, request, True, s)) for name, s in kinds.items()}
        t = interleaved({**calls, "scores alone": causal_scores_alone(model.config, length)}, repeats)
        for name in list(kinds)[1:]:
            target = {"h2o column sums": "<= 1.2", "snapkv window 32": "<= 1.05"}.get(name, "")
            rows.append({"measure": "statistics", "length": length, "case": name, "plain_seconds": t["plain"],
                         "seconds": t[name], "ratio": t[name] / t["plain"],
                         "target": f"{target} (over the plain prompt forward)" if target else ""})
        rows.append({"measure": "statistics", "length": length, "case": "h2o floor: plain + the scores' matmul alone",
                     "plain_seconds": t["plain"], "seconds": t["plain"] + t["scores alone"],
                     "ratio": (t["plain"] + t["scores alone"]) / t["plain"], "target": ""})
    return rows


def measure_kvzip(model_name: str, lengths: list[int], repeats: int) -> list[dict]:
    model, tokenizer = load_model(model_name)
    reconstruction = {reconstruction_key(make_policy("kvzip"))}
    rows = []
    for length in lengths:
        request = [Request(bench_prompts(tokenizer, length, 1)[0].ids, [], 1)]
        t = interleaved({"plain": lambda: share_prefill(model, request, True, set(), tokenizer),
                         "kvzip": lambda: share_prefill(model, request, True, reconstruction, tokenizer)}, repeats)
        rows.append({"measure": "kvzip", "length": length, "plain_seconds": t["plain"], "seconds": t["kvzip"],
                     "ratio": t["kvzip"] / t["plain"],
                     "target": "<= 3.0 (prompt forward + reconstruction over the forward; kvpress: 2-3x)"})
    return rows


def causal_scores_alone(config, length: int):
    """The least an exact pass after the attention must do for H2O's column sums: every layer's
    causal (query, key) scores, in `causal_statistics`' tiles and shapes, and nothing else."""
    H_q, H_kv = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // H_q
    G = H_q // H_kv
    tiles = list(causal_tiles(list(range(length)), length))  # H2O counts every query
    keys = torch.randn(H_kv, length, D + 1)  # [key, 1] rows, as causal_statistics builds them
    queries = torch.randn(H_kv, D + 1, G * max(qe - qs for qs, qe, _ in tiles))

    def call():
        for _ in range(config.num_hidden_layers):
            for qs, qe, key_ranges in tiles:
                for ks, ke in key_ranges:
                    torch.bmm(keys[:, ks:ke], queries[..., :G * (qe - qs)])
    return call


def sweep_configs(out: Path, samples: int, model: str, length: int):
    grid = [RunConfig(policy=p, budget=b, samples=samples, model=model, length=length, out=str(out), wandb="off")
            for p in SWEEP_POLICIES for b in SWEEP_BUDGETS]
    return [grid[0].full_cache()] + grid


def _lines(path: str) -> list[dict]:
    records = [json.loads(line) for line in (Path(path) / "predictions.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in records]


def _peak_rss_of(code: str) -> int:
    """Peak resident set (bytes) of a child Python process running `code`."""
    script = f"import resource\n{code}\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return int(result.stdout.split()[-1]) * 1024


def measure_sweep(model_name: str, length: int, samples: int) -> list[dict]:
    quiet = Console(stderr=True, quiet=True)
    with tempfile.TemporaryDirectory() as scratch:
        shared_out, alone_out = Path(scratch, "shared"), Path(scratch, "alone")
        start = time.perf_counter()
        together = run_many(sweep_configs(shared_out, samples, model_name, length), quiet)
        shared_seconds = time.perf_counter() - start
        start = time.perf_counter()
        alone = [run(config, quiet) for config in sweep_configs(alone_out, samples, model_name, length)]
        alone_seconds = time.perf_counter() - start
        identical = all(_lines(a.path) == _lines(b.path) for a, b in zip(alone, together))
        common = ("from evalkit.bench.speed import sweep_configs\nfrom evalkit.runner import run_many\n"
                  "from rich.console import Console\nquiet = Console(stderr=True, quiet=True)\n")
        full_rss = _peak_rss_of(common + f"run_many(sweep_configs(__import__('pathlib').Path({scratch!r}, 'rss1'), "
                                         f"{samples}, {model_name!r}, {length})[:1], quiet)")
        sweep_rss = _peak_rss_of(common + f"run_many(sweep_configs(__import__('pathlib').Path({scratch!r}, 'rss2'), "
                                          f"{samples}, {model_name!r}, {length}), quiet)")
    cells = len(together)
    return [{"measure": "sweep", "cells": cells, "samples": samples, "shared_seconds": shared_seconds,
             "one_at_a_time_seconds": alone_seconds, "ratio": shared_seconds / alone_seconds,
             "identical_results": identical, "target": "<= 0.2 (shared over one at a time), identical"},
            {"measure": "sweep memory", "cells": cells, "samples": samples, "full_run_peak_rss": full_rss,
             "sweep_peak_rss": sweep_rss, "ratio": sweep_rss / full_rss, "target": "<= 1.5 (over one full run)"}]


def measure_ppl(model_name: str, length: int, repeats: int) -> list[dict]:
    model, tokenizer = load_model(model_name)
    passage = Perplexity(text="essays").samples(None, length, 1, seed=0)[0]
    ids = tokenizer(passage.context).input_ids[:length]
    logprobs: dict[str, list[float]] = {}  # each way's last answer

    def rolling(name: str, policy: str, budget: float, chunk: int, step: str = "eager"):
        settings = GenerationSettings(make_policy(policy), budget=budget, chunk_size=chunk, decode_step=step)

        def call():
            logprobs[name] = score_rolling(model, [ids], [len(ids) - 1], settings)[0].logprobs
        return call

    def hf():
        logprobs["hf"] = hf_token_by_token(model, ids)

    t = interleaved({"one forward": rolling("one forward", PPL_POLICY, PPL_BUDGET, len(ids)),
                     "eager": rolling("eager", PPL_POLICY, PPL_BUDGET, 1),
                     "static": rolling("static", PPL_POLICY, PPL_BUDGET, 1, "static"),
                     "full": rolling("full", "full", 1.0, 1), "hf": hf}, repeats)

    def apart(a: str, b: str) -> float:
        return max(abs(x - y) for x, y in zip(logprobs[a], logprobs[b]))

    tokens = len(ids) - 1  # fed; each predicts the next
    case = f"{PPL_POLICY} @ {PPL_BUDGET}"
    return [{"measure": "ppl", "case": f"{case}, chunk 1", "length": length, "tokens": tokens,
             "one_forward_seconds": t["one forward"], "seconds": t["eager"], "ratio": t["one forward"] / t["eager"],
             "target": ""},
            {"measure": "ppl static", "case": f"{case}, chunk 1", "length": length, "tokens": tokens,
             "eager_seconds": t["eager"], "seconds": t["static"], "ratio": t["eager"] / t["static"],
             "max_logprob_difference": apart("eager", "static"), "target": ""},
            {"measure": "ppl loop", "case": "full cache, chunk 1", "length": length, "tokens": tokens,
             "hf_seconds": t["hf"], "seconds": t["full"], "ratio": t["hf"] / t["full"],
             "max_logprob_difference": apart("hf", "full"),
             "target": ">= 0.9 (evalkit's token-by-token tokens/s over HF's)"}]


def hf_token_by_token(model, ids: list[int]) -> list[float]:
    """Each token's log-probability from HF's own forward, one token at a time with its DynamicCache: what the
    model alone costs token by token."""
    cache = DynamicCache(config=model.config)
    logprobs = []
    with torch.inference_mode():
        for token, following in zip(ids, ids[1:]):
            logits = model(torch.tensor([[token]], device=model.device), cache=cache, use_cache=True).logits[0, -1]
            logprobs.append(float(torch.log_softmax(logits.float(), -1)[following]))
    return logprobs


def measure(only: list[str], model: str, lengths: list[int], repeats: int, samples: int,
            describe=lambda text: None) -> list[dict]:
    """The rows of every measurement in `only` (names from MEASURES), in that order; the sweep and ppl run at
    the shortest of `lengths`."""
    measures = {"loop": lambda: measure_loop(model, lengths, repeats), "overhead": lambda: measure_overhead(repeats),
                "statistics": lambda: measure_statistics(model, lengths, repeats),
                "kvzip": lambda: measure_kvzip(model, lengths, repeats),
                "sweep": lambda: measure_sweep(model, min(lengths), samples),
                "ppl": lambda: measure_ppl(model, min(lengths), repeats)}
    rows = []
    for name in only:
        describe(name)
        rows += measures[name]()
    return rows
