"""`evalkit bench --speed`, the command: its options checked before anything is measured, the measurements of
`evalkit.bench.speed` run in turn under a status line, their rows written to `<out>/speed.json` and shown as a
table, one line per measured ratio with its baseline, its target and whether it is met.
"""

from __future__ import annotations

import datetime
import os
import shlex
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from evalkit.bench.checks import items, parse_length
from evalkit.bench.speed import MEASURES, measure
from evalkit.errors import EvalkitError
from evalkit.models import model_config
from evalkit.results import check_writable_folder, package_versions, write_json_atomic


def _shown(row: dict, key: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    if key.endswith("_ms"):
        return f"{value:.2f} ms"
    if key.endswith("rss"):
        return f"{value / 2**20:.0f} MiB"
    return f"{value:.2f} s" if isinstance(value, float) else str(value)


_BASELINE = {"loop": ("HF generate", "hf_seconds", "evalkit_seconds"),
             "overhead": ("HF decode step", "hf_step_ms", "evalkit_step_ms"),
             "statistics": ("plain prompt forward", "plain_seconds", "seconds"),
             "kvzip": ("plain prompt forward", "plain_seconds", "seconds"),
             "sweep": ("one run per cell", "one_at_a_time_seconds", "shared_seconds"),
             "sweep memory": ("one full-cache run", "full_run_peak_rss", "sweep_peak_rss"),
             "ppl": ("the passage in one forward", "one_forward_seconds", "seconds"),
             "ppl static": ("the eager step", "eager_seconds", "seconds"),
             "ppl loop": ("HF token by token", "hf_seconds", "seconds")}


def speed_table(rows: list[dict], title: str):
    """A rich table: one line per measured ratio, with its baseline, its target and whether it is met."""
    table = Table(title=title, title_justify="left")
    for column in ("measure", "case", "baseline", "baseline value", "evalkit", "ratio", "target"):
        table.add_column(column, justify="right" if column in ("baseline value", "evalkit", "ratio") else "left")
    for row in rows:
        baseline, base_key, own_key = _BASELINE[row["measure"]]
        case = row.get("case") or (f"{row['length']} tokens" if "length" in row else f"{row['cells']} cells, "
                                   f"{row['samples']} samples")
        if row["measure"] == "loop":
            case += (f" (prefill {row['hf_prefill_seconds']:.2f} / {row['evalkit_prefill_seconds']:.2f} s, decode "
                     f"{row['hf_decode_seconds']:.2f} / {row['evalkit_decode_seconds']:.2f} s: HF / evalkit)")
        if "length" in row and row.get("case"):
            case = f"{case}, {row['length']} tokens"
        if row["measure"] == "sweep":
            case += ", identical results" if row["identical_results"] else ", RESULTS DIFFER"
        if row["measure"].startswith("ppl"):
            apart = row.get("max_logprob_difference")
            case += (f" ({row['tokens'] / row[base_key]:.1f} / {row['tokens'] / row[own_key]:.1f} tok/s"
                     + ("" if apart is None else f", log-probs at most {apart:.1e} apart") + ")")
        if row["measure"] == "overhead":
            case += f" ({row['hf_step_ops']:.0f} / {row['evalkit_step_ops']:.0f} ATen ops a step: HF / evalkit)"
        table.add_row(row["measure"], case, baseline, _shown(row, base_key), _shown(row, own_key),
                      f"{row['ratio']:.2f}", row["target"])
    return table


def run_measurements(names: str, model: str, lengths: str, repeats: int, threads: int, samples: int,
                     out_dir: str) -> None:
    """The measurements `names` (comma-separated from MEASURES, or "all"), options checked first:
    `<out_dir>/speed.json` and a table."""
    only = list(MEASURES) if names.strip() == "all" else items(names, "speed")
    unknown = [name for name in only if name not in MEASURES]
    if unknown:
        raise EvalkitError(f"unknown --speed measurement {unknown[0]!r}; choose from {', '.join(MEASURES)} "
                           "or all")
    for name, value in (("repeats", repeats), ("samples", samples)):
        if value < 1:
            raise EvalkitError(f"{name} must be >= 1, got {value}")
    if threads < 0:
        raise EvalkitError(f"threads must be >= 0 (0: one per core), got {threads}")
    length_values = sorted(set(parse_length(t) for t in items(lengths, "lengths")))
    limit = getattr(model_config(model), "max_position_embeddings", None)
    if limit and length_values[-1] > limit:
        raise EvalkitError(f"length {length_values[-1]} exceeds the {limit} positions of {model}")
    check_writable_folder(out_dir, "--out")
    if threads:
        torch.set_num_threads(threads)
    err, out = Console(stderr=True), Console(width=max(Console().width, 150))
    started = datetime.datetime.now().isoformat("T", "seconds")
    with err.status("speed") as status:
        rows = measure(only, model, length_values, repeats, samples,
                       lambda name: status.update(f"speed: {name} (see docs/benchmarks.md)"))
    document = {"command": shlex.join(["evalkit", *sys.argv[1:]]), "started": started, "model": model,
                "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "load_average_end": os.getloadavg(),
                "versions": package_versions(("torch", "transformers", "evalkit")), "rows": rows}
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / "speed.json", document)
    out.print(speed_table(rows, f"evalkit bench --speed · {document['threads']} torch threads · "
                                f"medians of {repeats}"))
    out.print(f"results: {folder / 'speed.json'}")
