"""A measured grid's rows compared: each row against the full cache measured in the same grid
(`compare_with_full`), then the issue's targets evaluated on whatever cells the grid holds (`targets`).
"""

from __future__ import annotations

import math

from evalkit.bench.cells import EVALKIT_LOOP, FULL, HF_LOOP


def compare_with_full(rows: list[dict]) -> None:
    """Adds to each row its ratios against the full cache measured in the same grid (same layout, length)."""
    full = {(r["layout"], r["length"]): r for r in rows if r["policy"] == FULL}
    paged_full = {r["length"]: r for r in rows if r["policy"] == FULL and r["layout"] == "paged"}
    for row in rows:
        reference = full.get((row["layout"], row["length"])) or paged_full.get(row["length"])
        if reference is None or row is reference:
            continue
        row["vs_full"] = {
            "tokens_per_s": row["tokens_per_s"] / reference["tokens_per_s"],
            "decode_step": row["decode_step_seconds"] / reference["decode_step_seconds"],
            "prefill_seconds": (row["prefill_seconds"] + row["compression_seconds"])
            / (reference["prefill_seconds"] + reference["compression_seconds"]),
            "peak_rss": row["peak_rss_bytes"] / reference["peak_rss_bytes"],
            "working": row["working_bytes"] / max(1, reference["working_bytes"]),
        }


TARGET_LOOP_VS_HF = 0.9
TARGET_DECODE_STEP = 0.8
TARGET_DECODE_BUDGET = 0.2
TARGET_PAGED_OVER_IDEAL = 1.05
TARGET_STATISTICS_MEMORY = 1.2


def targets(rows: list[dict], collects_attention: set[str], block_size: int) -> list[dict]:
    """The issue's targets, evaluated on whatever cells this grid holds (a target with no cell is absent).

    `collects_attention`: policies whose prefill gathers H2O's column sums.
    """
    found = []

    def add(name, row, value, threshold, met, note=""):
        found.append({"target": name, "cell": row["key"], "label": row["label"], "layout": row["layout"],
                      "length": row["length"], "value": value, "threshold": threshold, "met": bool(met),
                      "note": note})

    by_key = {(r["loop"], r["policy"], r["layout"], r["length"]): r for r in rows}
    for row in rows:
        if row["loop"] == HF_LOOP:
            full = by_key.get((EVALKIT_LOOP, FULL, "paged", row["length"]))
            if full:
                same = full["token_ids"] == row["token_ids"]
                add("full-cache loop tokens/s / HF generate tokens/s", full,
                    full["tokens_per_s"] / row["tokens_per_s"], f">= {TARGET_LOOP_VS_HF}",
                    full["tokens_per_s"] / row["tokens_per_s"] >= TARGET_LOOP_VS_HF,
                    "identical token ids" if same else "TOKEN IDS DIFFER")
            continue
        if row["policy"] == FULL or "vs_full" not in row:
            continue
        evicting = row["bytes_ideal"] < row["bytes_full"]
        if row["budget"] == TARGET_DECODE_BUDGET:
            add("decode step / full-cache decode step", row, row["vs_full"]["decode_step"],
                f"<= {TARGET_DECODE_STEP}", row["vs_full"]["decode_step"] <= TARGET_DECODE_STEP)
        if row["layout"] == "paged" and evicting:
            kept = row["kept_tokens"]
            floor = math.ceil(kept / block_size) * block_size / kept
            add("paged KV bytes held / ideal", row, row["held_over_ideal"], f"<= {TARGET_PAGED_OVER_IDEAL}",
                row["held_over_ideal"] <= TARGET_PAGED_OVER_IDEAL,
                f"page floor ceil(k/S)*S/k at the mean k = {kept:.0f}: {floor:.3f}")
        if row["layout"] == "dense":
            add("dense KV bytes held / capacity", row, row["bytes_held"] / row["storage_bytes"], "== 1",
                row["bytes_held"] == row["storage_bytes"])
        if row["policy"] in collects_attention:
            add("peak process memory / full cache's", row, row["vs_full"]["peak_rss"],
                f"<= {TARGET_STATISTICS_MEMORY}", row["vs_full"]["peak_rss"] <= TARGET_STATISTICS_MEMORY,
                f"working set above the loaded model: {row['vs_full']['working']:.2f}x")
    return found
