"""Benchmark the evalkit generation loop: throughput against HF `generate`, and KV memory per layout.

    .venv/bin/python scripts/bench_loop.py [--length 1024] [--new-tokens 32] [--repeats 3]
                                           [--threads N] [--device cpu] [--out bench_loop.json]

Part 1 times the loop with policy `full` (budget 1.0) against `model.generate` (greedy) on the same
prompt, both forced to produce exactly `--new-tokens` tokens (EOS disabled in both), and checks that
the two produce the same token ids. Part 2 reads the KV bytes held after prefill compression for
`h2o_head` on the paged and dense layouts. Prints markdown tables ready for a README and writes JSON.
A benchmark, not a test: it never fails on a missed target, it reports it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from evalkit.assets import default_model_dir
from evalkit.generate import GenerationSettings, Request, generate
from evalkit.policies import make_policy
from evalkit.tasks import TASKS

BUDGETS = (0.1, 0.2, 0.5)
LAYOUTS = ("paged", "dense")
TARGET_SPEED = 0.9  # loop tokens/s >= 0.9 x HF
TARGET_PAGED = 1.05  # paged head-granular held/ideal after compact


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder or HF id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--length", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_loop.json", help="JSON results path")
    return parser.parse_args(argv)


# --- setup ----------------------------------------------------------------------------------------

@dataclass
class Prompt:
    context_ids: list[int]
    question_ids: list[int]

    @property
    def ids(self) -> list[int]:
        return self.context_ids + self.question_ids


def make_prompt(tokenizer, length: int, seed: int) -> Prompt:
    """A ruler:niah_single_2 prompt of exactly `length` tokens: fitted with some slack, then the
    end of the haystack trimmed (the needle sits at 50% depth, well before the cut)."""
    task = TASKS.create("ruler:niah_single_2")

    def count(s):
        return len(tokenizer(s.context + "\n" + s.question + s.answer_prefix).input_ids)

    slack = 128
    sample = task.samples(count, length + slack + task.max_new_tokens, 1, seed)[0]
    context = tokenizer(sample.context + "\n", add_special_tokens=False).input_ids
    question = tokenizer(sample.question + sample.answer_prefix, add_special_tokens=False).input_ids
    keep = length - len(question)
    if keep <= 0 or len(context) < keep:
        raise SystemExit(f"cannot build a {length}-token prompt (context {len(context)}, question {len(question)})")
    return Prompt(context[:keep], question)


@contextlib.contextmanager
def eos_disabled(model):
    """No EOS for either loop, so both generate exactly N greedy tokens from the same logits.
    (HF's min_new_tokens would instead mask EOS's logit, which changes the argmax.)"""
    previous = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        yield
    finally:
        model.generation_config.eos_token_id = previous


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- part 1: throughput ---------------------------------------------------------------------------

def run_evalkit(model, prompt: Prompt, new_tokens: int, block_size: int) -> dict:
    request = Request(prompt.context_ids, prompt.question_ids, new_tokens)
    settings = GenerationSettings(make_policy("full"), budget=1.0, layout="paged", block_size=block_size)
    sync(model.device)
    start = time.perf_counter()
    (gen,) = generate(model, None, [request], settings)  # tokenizer None: no text decoding, no EOS
    sync(model.device)
    total = time.perf_counter() - start
    return {"total": total, "prefill": gen.timing["prefill_seconds"], "decode": gen.timing["decode_seconds"],
            "ids": gen.token_ids}


class _FirstStep(LogitsProcessor):
    """Notes when generate first asks for logits processing: its prefill forward has just ended."""

    def __init__(self, device: torch.device):
        self.device, self.at = device, None

    def __call__(self, input_ids, scores):
        if self.at is None:
            sync(self.device)
            self.at = time.perf_counter()
        return scores  # unchanged: greedy picks the same token


@torch.inference_mode()
def run_hf(model, prompt: Prompt, new_tokens: int) -> dict:
    ids = torch.tensor([prompt.ids], device=model.device)
    mask = torch.ones_like(ids)
    sync(model.device)
    start = time.perf_counter()  # a lone prefill forward, for reference (kept in the JSON)
    model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
    sync(model.device)
    lone_prefill = time.perf_counter() - start
    # Prefill and decode are split inside the timed generate call itself, so machine noise between
    # two separate calls can never make decode time negative.
    first = _FirstStep(model.device)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=model.generation_config.pad_token_id,
                         logits_processor=LogitsProcessorList([first]))
    sync(model.device)
    end = time.perf_counter()
    return {"total": end - start, "prefill": first.at - start, "decode": end - first.at,
            "lone_prefill_forward": lone_prefill, "ids": out[0, ids.shape[1]:].tolist()}


def summarise(runs: list[dict], new_tokens: int) -> dict:
    med = {key: statistics.median(r[key] for r in runs) for key in ("total", "prefill", "decode")}
    return {"seconds": med["total"], "tokens_per_s": new_tokens / med["total"], "prefill_seconds": med["prefill"],
            "decode_tokens_per_s": new_tokens / med["decode"],
            "runs": [{k: v for k, v in r.items() if k != "ids"} for r in runs]}


def throughput(model, prompt: Prompt, args) -> dict:
    loops = {"evalkit": lambda: run_evalkit(model, prompt, args.new_tokens, args.block_size),
             "hf": lambda: run_hf(model, prompt, args.new_tokens)}
    runs: dict[str, list[dict]] = {name: [] for name in loops}
    with eos_disabled(model):
        for name, loop in loops.items():
            loop()  # warm-up
        for _ in range(args.repeats):  # interleaved, so drift in machine load hits both alike
            for name, loop in loops.items():
                runs[name].append(loop())
    ids = {name: r[-1]["ids"] for name, r in runs.items()}
    same = ids["evalkit"] == ids["hf"]
    first_diff = next((i for i, (a, b) in enumerate(zip(ids["evalkit"], ids["hf"])) if a != b), None)
    result = {name: summarise(r, args.new_tokens) for name, r in runs.items()}
    result["ratio"] = result["evalkit"]["tokens_per_s"] / result["hf"]["tokens_per_s"]
    result["identical_ids"] = same
    result["first_difference"] = first_diff
    result["token_ids"] = ids
    return result


# --- part 2: memory -------------------------------------------------------------------------------

def memory(model, prompt: Prompt, args) -> list[dict]:
    rows = []
    request = Request(prompt.context_ids, prompt.question_ids, args.new_tokens)
    for layout in LAYOUTS:
        for budget in BUDGETS:
            settings = GenerationSettings(make_policy("h2o_head"), budget=budget, layout=layout,
                                          block_size=args.block_size)
            (gen,) = generate(model, None, [request], settings)
            # The loop sizes a dense buffer for prompt + new tokens + 1 per head, whatever the budget.
            token_bytes = gen.bytes_full // gen.prompt_tokens
            capacity = (gen.prompt_tokens + args.new_tokens + 1) * token_bytes
            rows.append({"layout": layout, "budget": budget, "kept_tokens": gen.kept_tokens,
                         "bytes_held": gen.bytes_held, "bytes_ideal": gen.bytes_ideal, "bytes_full": gen.bytes_full,
                         "held_over_ideal": gen.bytes_held / gen.bytes_ideal,
                         "held_over_full": gen.bytes_held / gen.bytes_full, "dense_capacity_bytes": capacity,
                         # best any paged layout can do: every head in ceil(kept / S) pages
                         "paged_floor": math.ceil(gen.kept_tokens / args.block_size) * args.block_size
                         / gen.kept_tokens})
    return rows


# --- report ---------------------------------------------------------------------------------------

def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def ok(flag: bool) -> str:
    return "yes" if flag else "**NO**"


def report(header: dict, speed: dict, rows: list[dict]) -> str:
    lines = [f"`{header['command']}`", "",
             f"{header['date']} · {header['cpu_count']} CPUs, {header['threads']} threads · torch {header['torch']} · "
             f"transformers {header['transformers']} · {header['device']} · prompt {header['length']} tokens "
             f"(ruler:niah_single_2), {header['new_tokens']} new tokens, median of {header['repeats']} · "
             f"load average {header['load_before']:.1f} → {header['load_after']:.1f}", "",
             "| loop | seconds | tokens/s | prefill s | decode tokens/s |", "|---|---:|---:|---:|---:|"]
    for name, label in (("evalkit", "evalkit (`full`, paged)"), ("hf", "HF `generate` (greedy)")):
        s = speed[name]
        lines.append(f"| {label} | {s['seconds']:.3f} | {s['tokens_per_s']:.1f} | {s['prefill_seconds']:.3f} "
                     f"| {s['decode_tokens_per_s']:.1f} |")
    lines += ["", "tokens/s = new tokens / total seconds; decode tokens/s = new tokens / decode seconds "
                  "(evalkit: its own timing; HF: split at generate's first logits-processor call)",
              "", f"evalkit / HF tokens/s: **{speed['ratio']:.2f}x** (target >= {TARGET_SPEED}x: "
                  f"{ok(speed['ratio'] >= TARGET_SPEED)}); identical token ids: {ok(speed['identical_ids'])}", "",
              "| layout | budget | kept/head | held MiB | ideal MiB | full MiB | held/ideal | held/full | target |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["layout"] == "paged":
            target = (f"held/ideal <= {TARGET_PAGED}: {ok(r['held_over_ideal'] <= TARGET_PAGED)} "
                      f"(page floor {r['paged_floor']:.3f})")
        else:
            target = f"held = capacity: {ok(r['bytes_held'] == r['dense_capacity_bytes'])}"
        lines.append(f"| {r['layout']} | {r['budget']} | {r['kept_tokens']:.1f} | {mib(r['bytes_held'])} "
                     f"| {mib(r['bytes_ideal'])} | {mib(r['bytes_full'])} | {r['held_over_ideal']:.3f} "
                     f"| {r['held_over_full']:.3f} | {target} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = args.model or str(default_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).to(args.device).eval()
    prompt = make_prompt(tokenizer, args.length, args.seed)
    header = {"command": shlex.join([os.path.basename(sys.executable), *sys.argv]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu_count": os.cpu_count(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
              "python": platform.python_version(), "device": args.device, "model": folder,
              "hf_attention": model.config._attn_implementation, "length": len(prompt.ids),
              "new_tokens": args.new_tokens, "repeats": args.repeats, "block_size": args.block_size}

    header["load_before"] = os.getloadavg()[0]  # other work on the machine skews every timing
    speed = throughput(model, prompt, args)
    header["load_after"] = os.getloadavg()[0]
    rows = memory(model, prompt, args)
    print(report(header, speed, rows))
    if not speed["identical_ids"]:
        bar = "!" * 72
        print(f"\n{bar}\nEQUIVALENCE BROKEN: evalkit and HF token ids differ from index {speed['first_difference']}"
              f"\n  evalkit: {speed['token_ids']['evalkit']}\n  hf:      {speed['token_ids']['hf']}\n{bar}")
    with open(args.out, "w") as f:
        json.dump({"header": header, "throughput": speed, "memory": rows,
                   "targets": {"speed_ratio": TARGET_SPEED, "paged_held_over_ideal": TARGET_PAGED}}, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
