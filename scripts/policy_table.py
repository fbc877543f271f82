"""Score every policy at a few budgets on one task and print a markdown table (docs/benchmarks.md's).

    python scripts/policy_table.py --length 1024 --samples 6 --budgets 0.1,0.2,0.5

Each cell is an ordinary `evalkit run` (stored under --out, resumable: rerunning skips
finished cells); the table is read back from the stored metrics.
"""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console

from evalkit.config import RunConfig
from evalkit.runner import run

DEFAULT_POLICIES = ("random,streaming_llm,h2o_head,h2o_token,h2o_page,tova,snapkv,pyramidkv,adakv,knorm,quest")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default=DEFAULT_POLICIES)
    parser.add_argument("--budgets", default="0.1,0.2,0.5")
    parser.add_argument("--task", default="ruler:niah_single_2")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--out", default="runs")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "disabled")
    console = Console(stderr=True)
    common = dict(task=args.task, length=args.length, samples=args.samples, out=args.out, wandb="off")
    budgets = args.budgets.split(",")

    full = run(RunConfig(policy="full", budget=1.0, **common), console).metrics
    rows = []
    for policy in args.policies.split(","):
        cells = [run(RunConfig(policy=policy, budget=budget, **common), console).metrics for budget in budgets]
        rows.append((policy, cells))
        console.print(f"{policy}: " + ", ".join(f"{100 * c['score']:.0f}" for c in cells))

    print(f"`python {' '.join(sys.argv)}` — {args.task}, {args.length} tokens, {args.samples} samples; "
          f"full cache: {100 * full['score']:.0f}\n")
    print("| policy | " + " | ".join(f"score @ {b}" for b in budgets) + " | KV held/full @ " + budgets[0]
          + " | attended @ " + budgets[0] + " |")
    print("|---|" + "---:|" * (len(budgets) + 2))
    for policy, cells in rows:
        scores = " | ".join(f"{100 * c['score']:.0f}" for c in cells)
        print(f"| {policy} | {scores} | {100 * cells[0]['held_over_full']:.0f}% "
              f"| {100 * cells[0]['attended_fraction']:.0f}% |")


if __name__ == "__main__":
    main()
