"""Block tables and page fragmentation of per-head eviction, in numbers (docs/storage-and-kernels.md).

    python scripts/block_table_sizes.py [--models NAME,...] [--lengths 8192,32768,131072] [--budgets 0.2] [--block-size 16]
    python scripts/block_table_sizes.py --runs runs/granularity runs/granularity-query-agnostic runs/study
    python scripts/block_table_sizes.py --decode [--budgets 0.1,0.2,0.5] [--samples 2] [--length 2048] [--new-tokens 256]

Block tables, computed, not measured: vLLM keeps one block table per sequence (int32 page ids), shared by every
layer and KV head; per-head eviction needs one per (layer, KV head). Shapes are the published configs.

Fragmentation, measured: allocated pages × page size over live tokens, all layers and KV heads (a run's
bytes held over its ideal bytes), per granularity and budget. `--runs` pools the samples of run folders, whose
bytes are taken when the prefill ends (after compression, compaction and the appended question: before any
decode step). `--decode` runs evalkit's loop (H2O, block 16, query-aware, the default model, RULER's
niah_single_2, EOS off so every sample decodes `--new-tokens`) and reads the cache after each decode step's eviction.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import defaultdict
from pathlib import Path

from evalkit.policies.budget import tokens_of

SHAPES = {  # name: (layers, KV heads, head dim); bf16
    "Llama-3.1-8B": (32, 8, 128),
    "Llama-3.1-70B": (80, 8, 128),
}
ENTRY_BYTES = 4  # int32 page id
KV_BYTES = 2  # bf16
GRANULARITY = re.compile(r"granularity=<Granularity\.\w+: '(\w+)'>")  # in a run's config.json "policy" repr


def rows(models: list[str], lengths: list[int], budgets: list[float], block: int):
    for name in models:
        layers, heads, dim = SHAPES[name]
        for n in lengths:
            for budget in budgets:
                kept = tokens_of(budget, n)
                shared_full = math.ceil(n / block)
                shared_evicted = math.ceil(kept / block)  # page granularity: the same pages for every head
                per_head = layers * heads * math.ceil(kept / block)
                kv = layers * heads * kept * 2 * dim * KV_BYTES
                yield (name, n, budget, kept, shared_full, shared_evicted, per_head, per_head * ENTRY_BYTES, kv)


def table_sizes(args) -> None:
    models, budgets = args.models.split(","), [float(x) for x in args.budgets.split(",")]
    several = len(budgets) > 1  # then a budget column; one budget is named in the header
    kept = "| budget | kept/head" if several else f"| kept/head ({budgets[0]})"
    print(f"| model | prompt {kept} | shared table, full | shared table, evicted | "
          f"per-head tables: entries | per-head tables: bytes | KV bytes kept | tables / KV |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if several else ""))
    for name, n, budget, kept, full, evicted, entries, table_bytes, kv in rows(
            models, [int(x) for x in args.lengths.split(",")], budgets, args.block_size):
        print(f"| {name} | {n:,} |{f' {budget} |' if several else ''} {kept:,} | "
              f"{full:,} ({full * ENTRY_BYTES / 1024:.1f} KiB) | {evicted:,} ({evicted * ENTRY_BYTES / 1024:.1f} KiB) | "
              f"{entries:,} | {table_bytes / 1024:,.0f} KiB | {kv / 2**20:,.0f} MiB | {table_bytes / kv:.3%} |")
    for name in models:
        layers, heads, _ = SHAPES[name]
        print(f"\n{name}: per-head token counts (a block-sparse kernel's seq_lens, int32) add "
              f"{layers * heads * ENTRY_BYTES / 1024:.1f} KiB per sequence, {layers} layers × {heads} KV heads.")


def run_fragmentation(folders: list[str]) -> None:
    """Bytes held over ideal bytes, pooled over every sample of the paged runs in `folders`."""
    pooled = defaultdict(lambda: [0, 0, 0, 0])  # (row, budget) -> held, ideal, runs, samples
    for config_path in sorted(path for folder in folders for path in Path(folder).glob("*/config.json")):
        record = json.loads(config_path.read_text())
        config = record["config"]
        if config["layout"] != "paged":
            continue
        row = (config["model"], "aware" if config["query_aware"] else "agnostic",
               GRANULARITY.search(record["policy"]).group(1), config["block_size"])
        text = (config_path.parent / "predictions.jsonl").read_text()
        samples = [json.loads(line) for line in text.split("\n")[:-1]]  # a line still being written has no "\n"
        cell = pooled[row, config["budget"]]
        cell[0] += sum(s["bytes_held"] for s in samples)
        cell[1] += sum(s["bytes_ideal"] for s in samples)
        cell[2] += 1
        cell[3] += len(samples)
    budgets = sorted({budget for _, budget in pooled})
    print("| model | question | granularity | block | " + " | ".join(f"{b:g}" for b in budgets) + " | runs / samples |")
    print("|---|---|---|---:|" + "---:|" * len(budgets) + "---:|")
    for row in sorted({row for row, _ in pooled}):
        cells = [pooled.get((row, b)) for b in budgets]
        ratios = [f"{c[0] / c[1]:.4f}" if c else "–" for c in cells]
        runs, samples = sum(c[2] for c in cells if c), sum(c[3] for c in cells if c)
        print(f"| {' | '.join(map(str, row))} | {' | '.join(ratios)} | {runs} / {samples} |")


def decode_fragmentation(args) -> None:
    """Bytes held over ideal bytes when the prefill ends, after the last decode step, and at the worst step."""
    from evalkit.bench.generations import eos_disabled
    from evalkit.loop import GenerationSettings, Request, generate
    from evalkit.models import load_model
    from evalkit.policies import make_policy
    from evalkit.policies.selection import GRANULARITIES
    from evalkit.prompt import encode, prompt_length
    from evalkit.tasks import TASKS

    model, tokenizer = load_model(args.model)
    samples = TASKS.create(args.task).samples(prompt_length(tokenizer), args.length, args.samples, 0)
    requests = [Request(*encode(tokenizer, sample), args.new_tokens) for sample in samples]
    print(f"| granularity | budget | prefill end | after {args.new_tokens} decode steps | worst step |")
    print("|---|---:|---:|---:|---:|")
    for granularity in GRANULARITIES:
        for budget in [float(x) for x in args.budgets.split(",")]:
            steps = defaultdict(lambda: [0, 0])  # step (0 = prefill end) -> held, ideal, summed over samples
            settings = GenerationSettings(make_policy(args.policy, granularity), budget=budget,
                                          page_size=args.block_size)
            for request in requests:
                trace = []

                def observe(event, cache, trace=trace):
                    if event == "prefill" or (event == "compressed" and trace):  # from the prefill's end on
                        trace.append((int(cache.bytes_held().sum()), int(cache.bytes_ideal().sum())))

                with eos_disabled(model):
                    generate(model, None, [request], settings, observe=observe)
                for step, (held, ideal) in enumerate(trace):
                    steps[step][0] += held
                    steps[step][1] += ideal
            ratio = {step: held / ideal for step, (held, ideal) in steps.items()}
            print(f"| {granularity} | {budget:g} | {ratio[0]:.4f} | {ratio[max(ratio)]:.4f} | "
                  f"{max(ratio.values()):.4f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--lengths", default="8192,32768,131072")
    parser.add_argument("--budgets", "--budget", default=None, help="comma-separated (default 0.2; --decode 0.1,0.2,0.5)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--runs", nargs="+", metavar="FOLDER", help="fragmentation of these run folders' runs")
    parser.add_argument("--decode", action="store_true", help="measure fragmentation through decode-time eviction")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--policy", default="h2o")
    parser.add_argument("--task", default="niah_single_2")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    if args.runs:
        run_fragmentation(args.runs)
    elif args.decode:
        args.budgets = args.budgets or "0.1,0.2,0.5"
        decode_fragmentation(args)
    else:
        args.budgets = args.budgets or "0.2"
        table_sizes(args)


if __name__ == "__main__":
    main()
