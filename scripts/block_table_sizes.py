"""Block-table entries and bytes per sequence: per-(layer, KV head) tables vs one table shared by all heads.

    python scripts/block_table_sizes.py [--lengths 8192,32768,131072] [--budget 0.2] [--block-size 16]

Computed, not measured: vLLM keeps one block table per sequence (int32 page ids), shared by every layer and
KV head; per-head eviction needs one per (layer, KV head). Shapes are the published configs.
"""

from __future__ import annotations

import argparse
import math

from evalkit.policies.budget import tokens_of

SHAPES = {  # name: (layers, KV heads, head dim); bf16
    "Llama-3.1-8B": (32, 8, 128),
    "Llama-3.1-70B": (80, 8, 128),
}
ENTRY_BYTES = 4  # int32 page id
KV_BYTES = 2  # bf16


def rows(lengths: list[int], budget: float, block: int):
    for name, (layers, heads, dim) in SHAPES.items():
        for n in lengths:
            kept = tokens_of(budget, n)
            shared_full = math.ceil(n / block)
            shared_evicted = math.ceil(kept / block)  # page granularity: the same pages for every head
            per_head = layers * heads * math.ceil(kept / block)
            kv = layers * heads * kept * 2 * dim * KV_BYTES
            yield (name, n, kept, shared_full, shared_evicted, per_head, per_head * ENTRY_BYTES, kv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,32768,131072")
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"| model | prompt | kept/head ({args.budget}) | shared table, full | shared table, evicted | "
          f"per-head tables: entries | per-head tables: bytes | KV bytes kept | tables / KV |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, n, kept, full, evicted, entries, table_bytes, kv in rows(lengths, args.budget, args.block_size):
        print(f"| {name} | {n:,} | {kept:,} | {full:,} ({full * ENTRY_BYTES / 1024:.1f} KiB) | "
              f"{evicted:,} ({evicted * ENTRY_BYTES / 1024:.1f} KiB) | {entries:,} | {table_bytes / 1024:,.0f} KiB | "
              f"{kv / 2**20:,.0f} MiB | {table_bytes / kv:.3%} |")


if __name__ == "__main__":
    main()
