"""The generation loop at Llama-3.1-8B shapes against HF `generate`, and the batch a fixed KV pool holds.

    # on one GPU (an NVIDIA H200; not run yet): the table on stdout, every number in the JSON
    python scripts/bench_gpu_loop.py --out docs/bench_gpu_loop_h200.json | tee docs/bench_gpu_loop_h200.txt

    # on a CPU, in seconds: the same rows and checks on a 2-layer model (tests/test_bench_gpu_loop.py runs it)
    python scripts/bench_gpu_loop.py --tiny --out runs/bench_gpu_loop_tiny.json

The model is built from a `LlamaConfig` of Llama-3.1-8B's shape (hidden 4096, 32 layers, 32 query heads,
8 KV heads, intermediate 14336, vocab 128256, rope theta 500000 with Llama-3.1's rope scaling, 131072
positions) with random bf16 weights: no hub, no download. Prompts are random token ids (8k and 32k tokens;
`--long` adds 64k), batch 1 and 8, 64 new tokens, greedy with EOS disabled.

Rows, per prompt length and batch, each measured by `evalkit bench`'s own machinery
(`evalkit.bench.generations.measure_cell`, one fresh process per row, `Clock`: CUDA events on a GPU;
`PeakMemory`: `torch.cuda.max_memory_allocated` on a GPU, the process's peak resident set on a CPU):
HF `generate` (SDPA, its own DynamicCache) and evalkit's loop (`evalkit.loop.generate`) with the full cache
and with `h2o_head`, `h2o_head_page`, `snapkv_head_page` at budget 0.2 (paged layout, block 16; kernels
"auto": the Triton kernels on a GPU, the torch reference on a CPU). Each row: prefill seconds (evalkit's
include compression), decode ms per step (one token for each sequence of the batch), tokens/s (new tokens
of the whole batch over the whole call), peak memory, KV bytes held after the prefill (HF's computed: its
cache holds the whole prompt), and ratios against the HF row of the same length and batch, measured in the
same run.

Batch fit: the largest batch whose KV fits a fixed pool (`--pool-gib`, 40 GiB), full cache against budget
0.2, from evalkit's own accounting: the pages one KV head takes at its peak in the loop (the sizing of
`evalkit.loop.state.new_cache`: the whole prompt under a full prefill, the budget's cap plus one chunk under
a chunked prefill, plus the answer, plus one) x page bytes (`evalkit.cache`) x layers x KV heads. A budget
keeps a batch under the pool only with a chunked prefill (`--chunk-size`): a full prefill holds the whole
prompt before it compresses, so at 0.2 it fits the full cache's batch (shown, not checked). At the target
length the number is then checked (`--fit-check`): `build` allocates the pool (`KVCache.create(...,
pool_pages=...)`) on the device; `run` generates that batch through the loop with that pool and records the
most pages any layer used; `probe` also runs one sequence more, to see whether the pool runs out.

Targets (issue 33), each printed met or not met from this run's ratios: evalkit `full` >= 0.9x HF generate
tokens/s at every length (8k and 32k); the decode step at budget 0.2 <= 0.5x HF's full-cache step at 32k;
`h2o_head`'s prefill <= 1.5x HF's at 32k; the batch in the same KV memory at 0.2 >= 4x the full cache's.
`--tiny` evaluates them at its 512 tokens, which says nothing about the 8B targets.

The JSON (`--out`) is rewritten after every row, so a run stopped early keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from evalkit.bench import isolation  # noqa: E402
from evalkit.bench.checks import items, parse_length  # noqa: E402
from evalkit.bench.cells import EVALKIT_LOOP, FULL, HF_LOOP, BenchCell, BenchSettings  # noqa: E402
from evalkit.bench.generations import eos_disabled, measure_cell, random_model, random_prompts  # noqa: E402
from evalkit.cache import KVCache, PoolExhausted, model_kv_shape  # noqa: E402
from evalkit.errors import EvalkitError  # noqa: E402
from evalkit.loop import GenerationSettings, Request, generate  # noqa: E402
from evalkit.loop.compression import budgets_for  # noqa: E402
from evalkit.models import check_device, resolve_device, resolve_dtype  # noqa: E402
from evalkit.policies import make_policy  # noqa: E402
from evalkit.results import check_writable_folder, package_versions, write_json_atomic  # noqa: E402

POLICIES = ("h2o_head", "h2o_head_page", "snapkv_head_page")  # at --budget, beside the full cache
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
TARGET_LENGTH = 32768  # the "at 32k" targets; a run without 32k (--tiny) takes its longest length
TARGET_FULL_VS_HF = 0.9
TARGET_DECODE_STEP = 0.5
TARGET_H2O_PREFILL = 1.5
TARGET_BATCH_RATIO = 4.0

# What --tiny and the 8B run default to; every one of them is also a flag.
DEFAULTS = {
    False: dict(lengths="8k,32k", batches="1,8", new_tokens=64, pool_gib=40.0, chunk_size=512, dtype="bfloat16",
                fit_check="run", out="runs/bench_gpu_loop.json"),
    True: dict(lengths="512", batches="1,2", new_tokens=8, pool_gib=2 / 1024, chunk_size=16, dtype="float32",
               fit_check="probe", out="runs/bench_gpu_loop_tiny.json"),
}


def llama_8b_config():
    """Llama-3.1-8B's shape (its published config.json), as a transformers config: no weights, no download."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                       rope_parameters=dict(LLAMA31_ROPE), rms_norm_eps=1e-5, tie_word_embeddings=False,
                       bos_token_id=128000, eos_token_id=128001)


def tiny_config():
    """The same architecture in 2 layers of width 128 (4 query heads, 2 KV heads: GQA kept), the same vocab and
    rope. A wide init (0.2) makes logits peaked, so greedy choices cannot flip on rounding between loops."""
    config = llama_8b_config()
    config.update(dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, initializer_range=0.2))
    return config


@dataclass(frozen=True)
class Plan:
    """Everything one run measures, from the flags."""

    tiny: bool
    lengths: tuple[int, ...]  # prompt tokens
    batches: tuple[int, ...]
    new_tokens: int
    budget: float
    block_size: int
    pool_bytes: int  # the fixed KV pool of the batch fit: K and V pages, every layer
    chunk_size: int  # chunked prefill of the batch fit under a budget
    fit_policy: str
    fit_check: str  # none, build, run, probe
    dtype: str
    device: str
    seed: int
    threads: int
    repeats: int

    @property
    def target_length(self) -> int:
        return TARGET_LENGTH if TARGET_LENGTH in self.lengths else max(self.lengths)


# --- rows -------------------------------------------------------------------------------------------

def row_cells(plan: Plan, length: int) -> list[BenchCell]:
    """HF generate, evalkit's full cache, then each policy at the budget; `length` = prompt + new tokens."""
    cells = [BenchCell(HF_LOOP, HF_LOOP, 1.0, "hf", length), BenchCell(EVALKIT_LOOP, FULL, 1.0, "paged", length)]
    return cells + [BenchCell(EVALKIT_LOOP, policy, plan.budget, "paged", length) for policy in POLICIES]


def bench_settings(plan: Plan, label: str, batch: int) -> BenchSettings:
    return BenchSettings(model=label, new_tokens=plan.new_tokens, batch=batch, repeats=plan.repeats,
                         block_size=plan.block_size, dtype=plan.dtype, device=plan.device, seed=plan.seed,
                         threads=plan.threads)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """K and V of one token, every layer and KV head (what a full cache, HF's included, holds per token)."""
    layers, kv_heads, head_dim = model_kv_shape(config)
    return 2 * layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def add_ratios(rows: list[dict]) -> None:
    """Each evalkit row's ratios against HF generate's row of the same length and batch."""
    hf = {(r["length"], r["batch"]): r for r in rows if r["loop"] == HF_LOOP}
    for row in rows:
        base = hf.get((row["length"], row["batch"]))
        if row["loop"] == HF_LOOP or base is None:
            continue
        row["vs_hf"] = {
            "tokens_per_s": row["tokens_per_s"] / base["tokens_per_s"],
            "decode_step": row["decode_step_seconds"] / base["decode_step_seconds"],
            "prefill": (row["prefill_seconds"] + row["compression_seconds"]) / base["prefill_seconds"],
            "same_tokens": row["token_ids"] == base["token_ids"],  # the batch's first sequence
        }


def peak_bytes(row: dict) -> int:
    """GPU: torch.cuda.max_memory_allocated (model included); CPU: the process's peak resident set."""
    return row.get("cuda_peak_bytes", row["peak_rss_bytes"])


# --- the batch a fixed pool holds ------------------------------------------------------------------------

def pages_per_head(config, policy_name: str, budget: float, prompt_tokens: int, new_tokens: int, block_size: int,
                   prefill: str, chunk_size: int) -> int:
    """Pages one KV head takes at its peak in evalkit's loop, as the loop sizes its own cache
    (`evalkit.loop.state.new_cache`): the prefill's peak (the prompt; under a chunked prefill the widest
    layer's cap plus one chunk, if less) plus the answer plus one, in pages."""
    settings = GenerationSettings(make_policy(policy_name), budget=budget, page_size=block_size, prefill=prefill,
                                  chunk_size=chunk_size)
    budgets = budgets_for(SimpleNamespace(config=config), settings, [range(prompt_tokens)])
    peak = budgets.lengths
    if prefill == "chunked":
        peak = torch.minimum(peak, settings.policy.head_capacity(budgets.caps, budgets.lengths) + chunk_size)
    return math.ceil((int(peak[0]) + new_tokens + 1) / block_size)


def page_bytes(config, block_size: int, dtype: torch.dtype) -> int:
    """K and V bytes of one page (block_size slots of one KV head), from evalkit's storage itself."""
    probe = KVCache.create("paged", config, 1, block_size, block_size, dtype, "meta")
    return probe.layers[0].token_bytes * block_size


def fit_accounting(config, plan: Plan, prompt_tokens: int) -> list[dict]:
    """Per cache (the full cache; the fit policy at the budget, chunked and full prefill): pages per head,
    bytes per sequence, and the largest batch whose pages fit the pool."""
    layers, kv_heads, _ = model_kv_shape(config)
    page = page_bytes(config, plan.block_size, resolve_dtype(plan.dtype, resolve_device(plan.device)))
    pool_pages = plan.pool_bytes // (page * layers)  # per layer: each layer has its own pool
    caches = [(FULL, 1.0, "full"), (plan.fit_policy, plan.budget, "chunked"), (plan.fit_policy, plan.budget, "full")]
    found = []
    for policy, budget, prefill in caches:
        pages = pages_per_head(config, policy, budget, prompt_tokens, plan.new_tokens, plan.block_size, prefill,
                               plan.chunk_size)
        found.append({
            "prompt_tokens": prompt_tokens, "policy": policy, "budget": budget, "prefill": prefill,
            "chunk_size": plan.chunk_size if prefill == "chunked" else None, "block_size": plan.block_size,
            "pages_per_head": pages, "page_bytes": page, "layers": layers, "kv_heads": kv_heads,
            "sequence_bytes": pages * page * layers * kv_heads, "pool_bytes": plan.pool_bytes,
            "pool_pages_per_layer": pool_pages, "pool_kv_bytes": pool_pages * page * layers,
            "batch": pool_pages // (kv_heads * pages),
        })
    return found


def run_batch(model, fit: dict, batch: int, plan: Plan) -> dict:
    """Generate `batch` random prompts through the loop with the fit's pool; the most pages any layer held
    (read after every forward: a layer's pages peak right after it appends, before compression)."""
    settings = GenerationSettings(make_policy(fit["policy"]), budget=fit["budget"], page_size=fit["block_size"],
                                  prefill=fit["prefill"], chunk_size=plan.chunk_size,
                                  pool_pages=fit["pool_pages_per_layer"])
    seen = {"peak_pages_used": 0}

    def observe(event: str, cache: KVCache) -> None:
        seen["peak_pages_used"] = max(seen["peak_pages_used"], max(layer.pool.num_used for layer in cache.layers))
        seen.update(pool_pages_built=cache.layers[0].pool.num_pages, cache_batch=cache.layers[0].batch,
                    storage_bytes=cache.storage_bytes())

    prompts = random_prompts(model.config.vocab_size, fit["prompt_tokens"], batch, plan.seed)
    requests = [Request(p.context_ids, p.question_ids, plan.new_tokens) for p in prompts]
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    begun = time.perf_counter()
    try:
        with eos_disabled(model):
            generations = generate(model, None, requests, settings, observe=observe)
        result = {"fits": True, "new_tokens": sum(len(g.token_ids) for g in generations),
                  "bytes_held": sum(g.bytes_held for g in generations)}
    except PoolExhausted as error:
        result = {"fits": False, "error": str(error)}
    result.update(batch=batch, seconds=time.perf_counter() - begun, **seen)
    if model.device.type == "cuda":
        result["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
    return result


def check_fit(model, fit: dict, plan: Plan) -> dict:
    """`build`: the fitted batch's pool allocated on the device; `run`: that batch generated with it; `probe`:
    and one sequence more."""
    if fit["batch"] < 1:
        return {"mode": plan.fit_check, "skipped": "the pool holds no sequence"}
    if plan.fit_check == "build":
        cache = KVCache.create("paged", model.config, fit["batch"], fit["prompt_tokens"], fit["block_size"],
                               model.dtype, model.device, pool_pages=fit["pool_pages_per_layer"])
        built = {"mode": "build", "pool_pages_built": cache.layers[0].pool.num_pages,
                 "cache_batch": cache.layers[0].batch, "storage_bytes": cache.storage_bytes()}
        del cache
        return built
    checked = {"mode": plan.fit_check, "run": run_batch(model, fit, fit["batch"], plan)}
    if plan.fit_check == "probe":
        checked["one_more"] = run_batch(model, fit, fit["batch"] + 1, plan)
    return checked


# --- targets ------------------------------------------------------------------------------------------

def targets(rows: list[dict], fits: dict[int, list[dict]], plan: Plan) -> list[dict]:
    """The issue's four targets, from this run's ratios (a target whose rows are missing is absent)."""
    found = []

    def add(name, row_label, length, batch, value, threshold, met):
        found.append({"target": name, "row": row_label, "prompt_tokens": length, "batch": batch, "value": value,
                      "threshold": threshold, "met": bool(met)})

    at = plan.target_length
    for row in rows:
        if "vs_hf" not in row:
            continue
        vs, length = row["vs_hf"], row["prompt_tokens_each"]
        if row["policy"] == FULL:
            add("evalkit full tokens/s / HF generate's", row["label"], length, row["batch"], vs["tokens_per_s"],
                f">= {TARGET_FULL_VS_HF}", vs["tokens_per_s"] >= TARGET_FULL_VS_HF)
        elif length == at:
            add(f"decode step at {plan.budget} / HF's full-cache step", row["label"], length, row["batch"],
                vs["decode_step"], f"<= {TARGET_DECODE_STEP}", vs["decode_step"] <= TARGET_DECODE_STEP)
            if row["policy"] == "h2o_head":
                add("h2o_head prefill (+ compression) / HF's prefill", row["label"], length, row["batch"],
                    vs["prefill"], f"<= {TARGET_H2O_PREFILL}", vs["prefill"] <= TARGET_H2O_PREFILL)
    if at in fits:
        full, budgeted = fits[at][0], fits[at][1]
        ratio = budgeted["batch"] / max(1, full["batch"])
        add(f"largest batch in {_size(plan.pool_bytes)} of KV at {plan.budget} / the full cache's",
            f"{plan.fit_policy} @ {plan.budget}, chunked prefill {plan.chunk_size}", at, None, ratio,
            f">= {TARGET_BATCH_RATIO}", ratio >= TARGET_BATCH_RATIO)
    return found


# --- output -------------------------------------------------------------------------------------------

def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:g} MiB"


def _ratio(row: dict, key: str) -> str:
    return f"{row['vs_hf'][key]:.2f}" if "vs_hf" in row else "-"


def print_tables(console: Console, document: dict) -> None:
    env, plan = document["environment"], document["plan"]
    memory = "peak GPU MiB" if env["device"].startswith("cuda") else "peak RSS MiB"
    table = Table(title=f"{document['model']} · {env['device_name']} · {plan['dtype']} · {plan['new_tokens']} new "
                        f"tokens · kernels {env['kernels']} · median of {plan['repeats']}", title_justify="left",
                  caption="prefill s: evalkit's includes compression; decode ms/tok: one decode step (a token for "
                          "every sequence); tok/s: the batch's new tokens over the whole call; KV held: after the "
                          "prefill, HF's computed; ÷ HF: against HF generate at the same prompt and batch; tokens = "
                          "HF: the first sequence's", caption_justify="left")
    columns = ("row", "prompt", "batch", "prefill s", "decode ms/tok", "tok/s", memory, "KV held MiB",
               "tok/s ÷ HF", "decode ÷ HF", "prefill ÷ HF", "tokens = HF")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in document["rows"]:
        vs = row.get("vs_hf")
        table.add_row(row["label"], f"{row['prompt_tokens_each']:,}", str(row["batch"]),
                      f"{row['prefill_seconds'] + row['compression_seconds']:.3f}",
                      f"{1e3 * row['decode_step_seconds']:.2f}", f"{row['tokens_per_s']:.1f}",
                      _mib(peak_bytes(row)), _mib(row["kv_bytes_held"]), _ratio(row, "tokens_per_s"),
                      _ratio(row, "decode_step"), _ratio(row, "prefill"),
                      ("yes" if vs["same_tokens"] else "no") if vs else "-")
    console.print(table)

    fit = Table(title=f"largest batch whose KV fits {_size(plan['pool_bytes'])} (K and V pages, every layer; "
                      f"evalkit's accounting, checked at {plan['target_length']:,} tokens: {plan['fit_check']})",
                title_justify="left")
    for i, column in enumerate(("cache", "prompt", "prefill", "pages/head", "MiB/sequence", "pool pages/layer",
                                "batch", "check")):
        fit.add_column(column, justify="left" if i == 0 else "right")
    for length, found in document["fits"].items():
        for entry in found:
            name = "full cache" if entry["policy"] == FULL else f"{entry['policy']} @ {entry['budget']}"
            prefill = entry["prefill"] + (f" ({entry['chunk_size']})" if entry["chunk_size"] else "")
            fit.add_row(name, f"{entry['prompt_tokens']:,}", prefill, f"{entry['pages_per_head']:,}",
                        _mib(entry["sequence_bytes"]), f"{entry['pool_pages_per_layer']:,}", str(entry["batch"]),
                        _check_text(entry.get("check")))
    console.print(fit)

    goals = Table(title="targets (issue 33; ratios from this run)", title_justify="left")
    for column in ("target", "row", "prompt", "batch", "value", "threshold", "met"):
        goals.add_column(column)
    for t in document["targets"]:
        goals.add_row(t["target"], t["row"], f"{t['prompt_tokens']:,}", "-" if t["batch"] is None else str(t["batch"]),
                      f"{t['value']:.2f}", t["threshold"], "met" if t["met"] else "[bold red]not met[/]")
    console.print(goals)
    if plan["tiny"]:
        console.print("--tiny: a 2-layer model at 512 tokens on this device; nothing here measures the 8B targets.")


def _check_text(check: dict | None) -> str:
    if not check:
        return "-"
    if "skipped" in check:
        return check["skipped"]
    if check["mode"] == "build":
        return f"pool built: {check['pool_pages_built']:,} pages/layer"
    run = check["run"]
    if not run["fits"]:
        return "[bold red]RUN EXHAUSTED THE POOL[/]"
    text = f"ran: peak {run['peak_pages_used']:,} pages/layer"
    if "one_more" in check:
        text += "; +1: " + ("pool exhausted" if not check["one_more"]["fits"] else
                            f"also fits (peak {check['one_more']['peak_pages_used']:,})")
    return text


# --- the run ------------------------------------------------------------------------------------------

def parse_plan(argv: list[str] | None) -> tuple[Plan, str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, 512-token prompts: seconds on a CPU")
    parser.add_argument("--long", action="store_true", help="add 64k-token prompts")
    parser.add_argument("--lengths", help="prompt tokens, comma-separated, k = 1024 (8k,32k; --tiny: 512)")
    parser.add_argument("--batches", help="batch sizes (1,8; --tiny: 1,2)")
    parser.add_argument("--new-tokens", type=int, help="new tokens per sequence (64; --tiny: 8)")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pool-gib", type=float, help="the fixed KV pool of the batch fit, GiB (40; --tiny: 2 MiB)")
    parser.add_argument("--chunk-size", type=int,
                        help="chunked prefill of the batch fit at the budget (512; --tiny: 16)")
    parser.add_argument("--fit-policy", default="h2o_head_page")
    parser.add_argument("--fit-check", choices=("none", "build", "run", "probe"),
                        help="at the target length: allocate the pool, run the batch, or also one more "
                             "(run; --tiny: probe)")
    parser.add_argument("--repeats", type=int, default=1, help="timed generations per row after a warm-up; medians")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="bfloat16; --tiny: float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per row (0: one per core)")
    parser.add_argument("--out", help="the JSON (runs/bench_gpu_loop.json; --tiny: runs/bench_gpu_loop_tiny.json)")
    args = parser.parse_args(argv)
    defaults = DEFAULTS[args.tiny]
    value = {key: default if getattr(args, key) is None else getattr(args, key) for key, default in defaults.items()}
    lengths = [parse_length(text) for text in items(value["lengths"], "lengths")]
    if args.long and 65536 not in lengths:
        lengths.append(65536)
    check_device(args.device)
    device = resolve_device(args.device)
    if device.type == "cpu" and not args.tiny:
        raise EvalkitError("the 8B shape on a CPU would take hours and 16+ GB: run it on a GPU, or pass --tiny")
    if not 0 < args.budget < 1:
        raise EvalkitError(f"--budget must be a fraction in (0, 1), got {args.budget}")
    batches = items(value["batches"], "batches")
    if not all(b.isdigit() and int(b) > 0 for b in batches):
        raise EvalkitError(f"--batches must be positive integers, got {value['batches']!r}")
    plan = Plan(tiny=args.tiny, lengths=tuple(sorted(lengths)), batches=tuple(int(b) for b in batches),
                new_tokens=value["new_tokens"], budget=args.budget, block_size=args.block_size,
                pool_bytes=int(value["pool_gib"] * 2**30), chunk_size=value["chunk_size"], fit_policy=args.fit_policy,
                fit_check=value["fit_check"], dtype=value["dtype"], device=str(device), seed=args.seed,
                threads=args.threads, repeats=args.repeats)
    if plan.new_tokens < 2 or plan.repeats < 1 or plan.chunk_size < 1 or plan.block_size < 1 or plan.pool_bytes < 1:
        raise EvalkitError("--new-tokens must be >= 2 (a decode step to time); --repeats, --chunk-size, --block-size "
                           "and --pool-gib positive")
    make_policy(plan.fit_policy)  # an unknown name is refused here, before any work
    return plan, value["out"]


def measured_order(plan: Plan) -> list[tuple[int, int]]:
    """(prompt tokens, batch) in the order measured: the target length first, so a run stopped early (a device's
    time limit) has the rows its targets need; the tables sort them back."""
    lengths = [plan.target_length] + [n for n in plan.lengths if n != plan.target_length]
    return [(length, batch) for length in lengths for batch in plan.batches]


def measure_rows(plan: Plan, config, label: str, document: dict, save, describe, advance) -> None:
    """Every row, each in a fresh process (`measure_cell` on the model built from `config`); `save()` after each."""
    per_token = kv_bytes_per_token(config, resolve_dtype(plan.dtype, torch.device(plan.device)))
    preload = tuple(m for m in ("transformers.generation.utils", isolation.model_module(config)) if m)
    with isolation.Isolated(preload) as isolated:
        for length, batch in measured_order(plan):
            settings = bench_settings(plan, label, batch)
            for cell in row_cells(plan, length + plan.new_tokens):
                describe(f"{cell.label} · {length:,} tokens · batch {batch}")
                row = isolated.run(plan.threads, measure_cell, settings, cell, config)
                held = row["bytes_held"] if row["loop"] == EVALKIT_LOOP else batch * length * per_token
                row.update(batch=batch, prompt_tokens_each=length, load_average=os.getloadavg()[0], kv_bytes_held=held)
                document["rows"].append(row)
                save()
                advance()


def check_fits(plan: Plan, config, fits: list[dict]) -> None:
    """The full cache's and the budget's (chunked) batch fits checked at the target length, in this process, on
    the model built as the rows built it (after every row's process has ended: their memory is free again)."""
    if plan.threads:
        torch.set_num_threads(plan.threads)
    model = random_model(config, plan.dtype, plan.device, plan.seed)
    for entry in fits[:2]:
        entry["check"] = check_fit(model, entry, plan)


def main(argv: list[str] | None = None) -> int:
    try:
        plan, out = parse_plan(argv)
        config = tiny_config() if plan.tiny else llama_8b_config()
        too_long = [n for n in plan.lengths if n + plan.new_tokens > config.max_position_embeddings]
        if too_long:
            raise EvalkitError(f"prompts of {too_long} tokens (+ {plan.new_tokens} new) exceed the model's "
                               f"{config.max_position_embeddings} positions")
        check_writable_folder(Path(out).parent, "--out")
    except EvalkitError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    label = ("tiny Llama-3.1 shape (2 layers, width 128)" if plan.tiny else "Llama-3.1-8B shape") + \
        f", random {plan.dtype} weights"
    device = torch.device(plan.device)
    document = {
        "model": label, "config": config.to_dict(), "plan": {**asdict(plan), "target_length": plan.target_length},
        "environment": {
            "command": shlex.join(["python", "scripts/bench_gpu_loop.py", *(sys.argv[1:] if argv is None else argv)]),
            "started": datetime.datetime.now().isoformat("T", "seconds"), "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or "cpu",
            "kernels": "Triton" if device.type == "cuda" else "torch reference", "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "versions": package_versions(("torch", "transformers", "triton", "evalkit")),
            "load_average_start": os.getloadavg()[0],
        },
        "rows": [], "targets": [], "complete": False,
        # evalkit's own accounting needs no model: known, and in the JSON, before anything runs
        "fits": {length: fit_accounting(config, plan, length) for length in plan.lengths},
        "kv_bytes_held_note": "after the prefill, every sequence; HF's computed (prompt tokens x K and V bytes per "
                              "token: its DynamicCache holds the whole prompt), evalkit's measured (pages held)",
    }
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every row: a run stopped early keeps its rows, their ratios and targets
        add_ratios(document["rows"])
        document["targets"] = targets(document["rows"], document["fits"], plan)
        write_json_atomic(path, document)

    checking = plan.fit_check != "none"
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True)
    with progress:
        bar = progress.add_task("rows", total=len(measured_order(plan)) * (2 + len(POLICIES)) + checking)
        measure_rows(plan, config, label, document, save, lambda text: progress.update(bar, description=text),
                     lambda: progress.advance(bar))
        if checking:
            progress.update(bar, description=f"batch fit: {plan.fit_check} at {plan.target_length:,} tokens")
            check_fits(plan, config, document["fits"][plan.target_length])
            progress.advance(bar)
    order = {(length, batch): i for i, (length, batch) in enumerate(sorted(measured_order(plan)))}
    document["rows"].sort(key=lambda row: order[(row["prompt_tokens_each"], row["batch"])])  # stable: row order kept
    document["environment"].update(load_average_end=os.getloadavg()[0],
                                   finished=datetime.datetime.now().isoformat("T", "seconds"))
    document["complete"] = True
    save()
    console = Console(width=max(Console().width, 170))  # wide tables stay readable when piped to a file
    print_tables(console, document)
    console.print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
