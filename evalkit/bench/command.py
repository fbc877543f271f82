"""`evalkit bench`: speed and memory of every policy against the full cache and HF `generate`, in one run.

Measurement lives in `evalkit.bench.generations` (whole generations) and `evalkit.bench.components`
(one layer's pieces); this module parses the command line, walks the grid with a progress bar,
keeps what is measured in `<out>/bench.json` after every cell (a rerun with the same settings
measures only what is missing), and draws `<out>/bench.png` and `<out>/components.png`.
"""

from __future__ import annotations

import re

import typer

DEFAULT_POLICIES = "h2o_head,snapkv"
DEFAULT_LENGTHS = "1k,2k"
FULL_GRID_HINT = ("full grid: --policies h2o_head,h2o_token,h2o_page,snapkv,streaming_llm,tova,knorm,quest "
                  "--budgets 0.1,0.2,0.5 --layouts paged,dense --lengths 1k,2k,4k,8k")
MIN_PROMPT_TOKENS = 32
COMPONENT_THREADS = 1


def register(app: typer.Typer) -> None:
    """Adds `evalkit bench` to the command line."""
    app.command("bench", epilog=FULL_GRID_HINT)(bench)


def bench(
    model: str = typer.Option("smollm2-135m", help="Embedded default, a local folder or a Hugging Face model id."),
    policies: str = typer.Option(DEFAULT_POLICIES, help="Comma-separated policies; the full cache is always measured."),
    policy_arg: list[str] = typer.Option([], help="Policy hyper-parameter KEY=VALUE for every policy (repeatable)."),
    granularities: str = typer.Option("", help="Comma-separated granularities (head, head_page, token, page) to "
                                               "run every policy at; default: each policy's own."),
    budgets: str = typer.Option("0.2", help="Comma-separated budgets: fractions in (0, 1] or token counts > 1."),
    lengths: str = typer.Option(DEFAULT_LENGTHS,
                                help="Comma-separated prompt + new tokens, e.g. 1k,2k,4k,8k (k = 1024)."),
    layouts: str = typer.Option("paged", help="Comma-separated KV layouts: paged, dense."),
    batch: int = typer.Option(1, help="Prompts per generation."),
    new_tokens: int = typer.Option(16, help="Tokens generated per prompt (EOS disabled, so exactly this many)."),
    repeats: int = typer.Option(2, help="Timed generations per cell, after one warm-up; medians reported."),
    block_size: int = typer.Option(16, help="Tokens per page."),
    components: bool = typer.Option(True, "--components/--no-components",
                                    help="Also time the pieces (prefill statistics, selection, decode attention)."),
    dtype: str = typer.Option("auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N."),
    seed: int = typer.Option(0, help="Seed for random policies."),
    threads: int = typer.Option(0, help="Torch threads per measurement; 0 (default): one per core, as users run. "
                                       "1 steadies timings on a busy machine; the table says which was used."),
    decode_eviction: bool = typer.Option(True, "--decode-eviction/--no-decode-eviction",
                                         help="Keep the cache at budget while decoding (one eviction per "
                                              "token), or let it grow."),
    out_dir: str = typer.Option("runs/bench", "--out", help="Folder for bench.json, bench.png and components.png."),
    fresh: bool = typer.Option(False, "--fresh", help="Measure every cell again instead of reusing bench.json's."),
    speed: str = typer.Option("", help="Instead of the grid, the main job's speed against its baselines "
                                       "(comma-separated: loop, overhead, statistics, sweep; 'all'): "
                                       "<out>/speed.json. Uses --model, --lengths, --repeats, --threads, "
                                       "--samples; docs/benchmarks.md."),
    samples: int = typer.Option(3, help="With --speed sweep: samples of the default task per cell."),
):
    """Time and memory of each policy × budget × length against the full cache and HF generate, same run."""
    import dataclasses

    from evalkit.bench.generations import BenchSettings
    from evalkit.config import parse_policy_args
    from evalkit.results import check_writable_folder

    settings = BenchSettings(model=model, new_tokens=new_tokens, batch=batch, repeats=repeats,
                             block_size=block_size, dtype=dtype, device=device, seed=seed, threads=threads,
                             decode_eviction=decode_eviction)
    if speed:
        _speed(speed, model, lengths, repeats, threads, samples, out_dir)
        return
    policy_args = parse_policy_args(policy_arg)
    plan = _validate(settings, policies, budgets, lengths, layouts, policy_args, granularities)
    settings = dataclasses.replace(settings, policy_args=policy_args)
    check_writable_folder(out_dir, "--out")
    _run(settings, plan, components, out_dir, fresh)


# --- input ----------------------------------------------------------------------------------------

def parse_length(text: str) -> int:
    """'2048' -> 2048, '2k' -> 2048; anything else is refused."""
    from evalkit.errors import EvalkitError

    match = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", text)
    if not match or int(match.group(1)) == 0:
        raise EvalkitError(f"length must be a positive integer, optionally with k (x1024), got {text!r}")
    return int(match.group(1)) * (1024 if match.group(2) else 1)


def _items(text: str, what: str) -> list[str]:
    from evalkit.errors import EvalkitError

    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise EvalkitError(f"--{what} must be a comma-separated list without empty items, got {text!r}")
    return list(dict.fromkeys(items))  # duplicates dropped, order kept


def _validate(settings, policies: str, budgets: str, lengths: str, layouts: str,
              policy_args: dict[str, str] | None = None, granularities: str = "") -> dict:
    """Everything checked before any measurement: one line and exit 2 on bad input."""
    from evalkit.cache import LAYOUTS
    from evalkit.config import DTYPES, SEED_LIMIT
    from evalkit.policies import parse_budget
    from evalkit.errors import EvalkitError
    from evalkit.policies import POLICIES, make_policy

    names = list(dict.fromkeys(POLICIES.canonical(p) for p in _items(policies, "policies")))
    granularity_names = _items(granularities, "granularities") if granularities.strip() else [None]
    for name in names:
        for granularity in granularity_names:
            make_policy(name, granularity, policy_args)
    budget_values = list(dict.fromkeys(parse_budget(b) for b in _items(budgets, "budgets")))
    layout_names = _items(layouts, "layouts")
    for layout in layout_names:
        if layout not in LAYOUTS:
            raise EvalkitError(f"unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    for name in ("batch", "repeats", "block_size"):
        if getattr(settings, name) < 1:
            raise EvalkitError(f"{name.replace('_', '-')} must be >= 1, got {getattr(settings, name)}")
    if not 0 <= settings.seed < SEED_LIMIT:
        raise EvalkitError(f"seed must be in [0, 2**32), got {settings.seed}")
    if settings.threads < 0:
        raise EvalkitError(f"threads must be >= 0 (0: one per core), got {settings.threads}")
    if settings.new_tokens < 2:
        raise EvalkitError(f"new-tokens must be >= 2 (decode steps are timed between tokens), "
                           f"got {settings.new_tokens}")
    if settings.dtype not in DTYPES:
        raise EvalkitError(f"unknown dtype {settings.dtype!r}; choose from {', '.join(DTYPES)}")
    length_values = sorted(set(parse_length(t) for t in _items(lengths, "lengths")))
    for length in length_values:
        if length - settings.new_tokens < MIN_PROMPT_TOKENS:
            raise EvalkitError(f"length {length} leaves fewer than {MIN_PROMPT_TOKENS} prompt tokens after "
                               f"{settings.new_tokens} new tokens")
    config, target_device, target_dtype = _model_facts(settings)
    limit = getattr(config, "max_position_embeddings", None)
    if limit and length_values[-1] > limit:
        raise EvalkitError(f"length {length_values[-1]} exceeds the {limit} positions of {settings.model}")
    return {"policies": names, "budgets": budget_values, "layouts": layout_names, "lengths": length_values,
            "granularities": granularity_names, "config": config, "torch_device": target_device,
            "torch_dtype": target_dtype}


def _model_facts(settings):
    """(config, device, dtype) without loading weights, so a bad model or device fails before any work."""
    from evalkit.models import check_device, model_config, resolve_device, resolve_dtype

    check_device(settings.device)
    target = resolve_device(settings.device)
    return model_config(settings.model), target, resolve_dtype(settings.dtype, target)


# --- the main job's speed (--speed) -------------------------------------------------------------------

def _speed(names: str, model: str, lengths: str, repeats: int, threads: int, samples: int, out_dir: str) -> None:
    import datetime
    import os
    import shlex
    import sys
    from pathlib import Path

    import torch
    from rich.console import Console

    from evalkit.bench import speed
    from evalkit.errors import EvalkitError
    from evalkit.models import model_config
    from evalkit.results import check_writable_folder, package_versions, write_json_atomic

    only = list(speed.MEASURES) if names.strip() == "all" else _items(names, "speed")
    unknown = [name for name in only if name not in speed.MEASURES]
    if unknown:
        raise EvalkitError(f"unknown --speed measurement {unknown[0]!r}; choose from {', '.join(speed.MEASURES)} "
                           "or all")
    for name, value in (("repeats", repeats), ("samples", samples)):
        if value < 1:
            raise EvalkitError(f"{name} must be >= 1, got {value}")
    if threads < 0:
        raise EvalkitError(f"threads must be >= 0 (0: one per core), got {threads}")
    length_values = sorted(set(parse_length(t) for t in _items(lengths, "lengths")))
    limit = getattr(model_config(model), "max_position_embeddings", None)
    if limit and length_values[-1] > limit:
        raise EvalkitError(f"length {length_values[-1]} exceeds the {limit} positions of {model}")
    check_writable_folder(out_dir, "--out")
    if threads:
        torch.set_num_threads(threads)
    err, out = Console(stderr=True), Console(width=max(Console().width, 150))
    started = datetime.datetime.now().isoformat("T", "seconds")
    with err.status("speed") as status:
        rows = speed.measure(only, model, length_values, repeats, samples,
                             lambda name: status.update(f"speed: {name} (see docs/benchmarks.md)"))
    document = {"command": shlex.join(["evalkit", *sys.argv[1:]]), "started": started, "model": model,
                "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "load_average_end": os.getloadavg(),
                "versions": package_versions(("torch", "transformers", "evalkit")), "rows": rows}
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / "speed.json", document)
    out.print(speed.speed_table(rows, f"evalkit bench --speed · {document['threads']} torch threads · "
                                      f"medians of {repeats}"))
    out.print(f"results: {folder / 'speed.json'}")


# --- the run --------------------------------------------------------------------------------------

def _run(settings, plan: dict, with_components: bool, out_dir: str, fresh: bool) -> None:
    import datetime
    import os
    import platform
    import shlex
    import sys
    from dataclasses import asdict
    from pathlib import Path

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from evalkit.bench import components, generations, isolation
    from evalkit.policies import make_policy
    from evalkit.results import package_versions, write_json_atomic

    err = Console(stderr=True)
    out = Console(width=max(Console().width, 170))  # wide tables stay readable when piped to a file
    folder = Path(out_dir)
    json_path = folder / "bench.json"
    cells = generations.grid(plan["policies"], plan["budgets"], plan["layouts"], plan["lengths"],
                            plan["granularities"])
    evicting = [p for p in plan["policies"] if make_policy(p).evicts]
    shape = components.HeadShape.of(plan["config"], plan["torch_dtype"], plan["torch_device"])
    points = (components.plan(plan["lengths"], evicting, plan["budgets"][0], settings.block_size)
              if with_components else [])
    grid_spec = {k: plan[k] for k in ("policies", "budgets", "layouts", "lengths", "granularities")}

    previous = _previous(json_path, asdict(settings), fresh)
    measured = {row["key"]: row for row in previous.get("cells", [])}
    old_components = previous.get("components") or {}
    reuse_components = old_components.get("plan") == _points_spec(points, shape) and bool(points)
    document = {
        "settings": asdict(settings), "grid": grid_spec,
        "environment": {
            "command": shlex.join(["evalkit", *sys.argv[1:]]),
            "started": datetime.datetime.now().isoformat("T", "seconds"),
            "device": str(plan["torch_device"]), "dtype": str(plan["torch_dtype"]), "cpu_count": os.cpu_count(),
            # what the loop's attention dispatch ("auto") picks on this device
            "attention": "Triton kernels" if plan["torch_device"].type == "cuda" else "torch reference",
            "python": platform.python_version(),
            "versions": package_versions(("torch", "transformers", "triton", "evalkit")),
            "load_average_start": os.getloadavg()[0],
        },
        "cells": [], "components": None, "targets": [], "complete": False,
    }
    folder.mkdir(parents=True, exist_ok=True)
    todo = [c for c in cells if c.key not in measured]
    err.print(f"{len(cells)} cells ({len(cells) - len(todo)} already measured in {json_path}), "
              f"{0 if reuse_components else len(points)} component points")
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err, transient=True)
    preload = tuple(m for m in ("transformers.generation.utils", isolation.model_module(plan["config"])) if m)
    with isolation.Isolated(preload) as isolated, progress:
        bar = progress.add_task("bench", total=len(cells) + (0 if reuse_components else len(points)))
        for cell in cells:
            if cell.key not in measured:
                progress.update(bar, description=f"{cell.label} · {cell.layout} · {cell.length} tokens")
                row = isolated.run(settings.threads, generations.measure_cell, settings, cell)
                row["load_average"] = os.getloadavg()[0]
                measured[cell.key] = row
                # Saved after every cell: an interrupted bench keeps what it measured and resumes.
                document["cells"] = [measured[c.key] for c in cells if c.key in measured]
                write_json_atomic(json_path, document)
            progress.advance(bar)
        if reuse_components:
            document["components"] = old_components
        elif points:
            results = _measure_components(isolated, points, shape, lambda text: progress.update(bar, description=text),
                                          lambda: progress.advance(bar))
            document["components"] = {"plan": _points_spec(points, shape), "shape": asdict(shape),
                                      **components.summarise(results, plan["lengths"])}

    rows = [measured[c.key] for c in cells]
    generations.compare_with_full(rows)
    collects = {p for p in plan["policies"] if make_policy(p).collect_prefill == "attention"}
    document.update(cells=rows, targets=generations.targets(rows, collects, settings.block_size), complete=True)
    document["environment"]["load_average_end"] = os.getloadavg()[0]
    write_json_atomic(json_path, document)
    title = (f"{settings.model} · {document['environment']['device']} · {settings.new_tokens} new tokens · "
             f"batch {settings.batch}")
    plot_cells(rows, folder / "bench.png", title)
    if document["components"]:
        plot_components(document["components"], folder / "components.png",
                        f"one layer of {settings.model} ({COMPONENT_THREADS} thread)")
    print_report(out, document, len(plan["layouts"]) > 1)
    out.print(f"results: {json_path}, {folder / 'bench.png'}"
              + (f", {folder / 'components.png'}" if document["components"] else ""))


def _measure_components(isolated, points: list[tuple], shape, describe, advance) -> dict[str, list[dict]]:
    """Every component point, each in its own process on one thread (the pieces' scaling, undisturbed by
    parallel regions stalling on a busy machine); grouped by component."""
    results: dict[str, list[dict]] = {}
    for component, fn, args in points:
        describe(f"{component} {args}")
        results.setdefault(component, []).append(isolated.run(COMPONENT_THREADS, fn, shape, *args))
        advance()
    return results


def _previous(json_path, settings: dict, fresh: bool) -> dict:
    """What an earlier bench in this folder measured, if it used the same settings."""
    from evalkit.errors import EvalkitError
    from evalkit.results import read_json

    if fresh or not json_path.exists():
        return {}
    try:
        previous = read_json(json_path)
    except EvalkitError as error:
        raise EvalkitError(f"{error}: pass --fresh to replace it") from None
    if previous.get("settings") != settings:
        raise EvalkitError(f"{json_path} was measured with other settings: pass --fresh to replace it, "
                           "or choose another --out")
    return previous


def _points_spec(points: list[tuple], shape) -> list:
    from dataclasses import asdict

    return [asdict(shape)] + [[component, list(args)] for component, _, args in points]


# --- report -----------------------------------------------------------------------------------------

def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _series(row: dict, show_layout: bool) -> str:
    return row["label"] + (f" ({row['layout']})" if show_layout and row["loop"] != "hf" else "")


def print_report(console, document: dict, show_layout: bool) -> None:
    from rich.table import Table

    settings = document["settings"]
    threads = settings["threads"] or f"{document['environment']['cpu_count']} (one per core)"
    table = Table(title=f"evalkit bench · {settings['model']} · {document['environment']['device']} · "
                        f"{settings['new_tokens']} new tokens · median of {settings['repeats']} · "
                        f"{threads} torch threads", title_justify="left")
    columns = ("loop", "length", "prefill s", "compress s", "decode ms/tok", "evict ms/tok", "tok/s",
               "decode step / full", "peak MiB", "working MiB", "held MiB", "ideal MiB", "full MiB", "held/ideal")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in document["cells"]:
        vs = row.get("vs_full", {})
        table.add_row(
            _series(row, show_layout), str(row["length"]), f"{row['prefill_seconds']:.3f}",
            f"{row['compression_seconds']:.3f}", f"{1e3 * row['decode_step_seconds']:.1f}",
            f"{1e3 * row['decode_eviction_seconds']:.1f}" if "decode_eviction_seconds" in row else "-",
            f"{row['tokens_per_s']:.1f}", f"{vs['decode_step']:.2f}" if vs else "-",
            _mib(row["peak_rss_bytes"]), _mib(row["working_bytes"]), _mib(row.get("bytes_held")),
            _mib(row.get("bytes_ideal")), _mib(row.get("bytes_full")),
            f"{row['held_over_ideal']:.3f}" if "held_over_ideal" in row else "-")
    console.print(table)
    components = document.get("components")
    if components:
        console.print(_components_table(components))
    if document["targets"]:
        targets = Table(title="targets (same run)", title_justify="left")
        for column in ("target", "cell", "value", "threshold", "met", "note"):
            targets.add_column(column)
        for t in document["targets"]:
            targets.add_row(t["target"], f"{t['label']} · {t['layout']} · {t['length']}", f"{t['value']:.3f}",
                            t["threshold"], "yes" if t["met"] else "[bold red]NO[/]", t["note"])
        console.print(targets)


def _components_table(components: dict):
    from rich.table import Table

    def fit(f) -> str:
        return "-" if f is None else f"n^{f['exponent']:.2f} (x{f['per_doubling']:.2f} per doubling)"

    table = Table(title=f"components (one layer; sizes {components['sizes']})", title_justify="left")
    for column in ("piece", "time", "working memory"):
        table.add_column(column)
    for collect, fits in sorted(components["prefill_statistics"]["fits"].items()):
        table.add_row(f"prefill attention, statistics: {collect}", fit(fits["time"]), fit(fits["working_memory"]))
    for policy, f in sorted(components["selection"]["fits"].items()):
        table.add_row(f"selection (score + select): {policy}", fit(f), "")
    decode = components["decode_attention"]["fits"]
    if decode:
        table.add_row(f"decode attention over length, {decode['fixed_kept']} kept",
                      fit(decode["over_length_at_fixed_kept"]), "")
        table.add_row(f"decode attention over kept, length {decode['fixed_length']}",
                      fit(decode["over_kept_at_fixed_length"]).replace("n^", "k^"), "")
    return table


def _save_figure(figure, path) -> None:
    import os

    tmp = path.with_suffix(".tmp.png")
    figure.savefig(tmp, format="png", dpi=110)
    os.replace(tmp, path)


def plot_cells(rows: list[dict], path, title: str = "") -> None:
    """Time and memory against length, one line per policy (and HF and the full cache)."""
    from matplotlib.figure import Figure

    show_layout = len({r["layout"] for r in rows if r["loop"] != "hf"}) > 1
    panels = (("prefill + compression (s)", lambda r: r["prefill_seconds"] + r["compression_seconds"]),
              ("decode step (ms / token)", lambda r: 1e3 * r["decode_step_seconds"]),
              ("peak memory above the loaded model (MiB)", lambda r: r["working_bytes"] / 2**20),
              ("KV bytes held after prefill (MiB)", lambda r: r.get("bytes_held", 0) / 2**20 or None))
    figure = Figure(figsize=(12, 8), layout="constrained")
    figure.suptitle(title)
    series: dict[str, list[dict]] = {}
    for row in rows:
        series.setdefault(_series(row, show_layout), []).append(row)
    colors = {name: f"C{i % 10}" for i, name in enumerate(series)}  # one colour per series in every panel
    lengths = sorted({r["length"] for r in rows})
    for axes, (panel, value) in zip(figure.subplots(2, 2).flat, panels):
        for name, points in series.items():
            points = sorted(points, key=lambda r: r["length"])
            ys = [value(p) for p in points]
            if any(y is None for y in ys):
                continue
            axes.plot([p["length"] for p in points], ys, marker="o", label=name, color=colors[name],
                      linestyle="--" if name.startswith(("HF", "full")) else "-")
        axes.set_title(panel)
        axes.set_xlabel("length (prompt + new tokens)")
        axes.set_xscale("log", base=2)
        axes.set_xticks(lengths, [str(n) for n in lengths])
        axes.minorticks_off()
        axes.grid(alpha=0.3)
    figure.axes[0].legend(fontsize="small")
    _save_figure(figure, path)


def plot_components(components: dict, path, title: str = "") -> None:
    """Log-log scaling of the pieces: prefill statistics (time and memory), selection, decode attention."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter

    figure = Figure(figsize=(19, 4.5), layout="constrained")
    figure.suptitle(title)
    prefill, prefill_memory, selection, decode = figure.subplots(1, 4)
    for collect in sorted({p["collect"] for p in components["prefill_statistics"]["points"]}):
        points = sorted((p for p in components["prefill_statistics"]["points"] if p["collect"] == collect),
                        key=lambda p: p["n"])
        prefill.plot([p["n"] for p in points], [p["seconds"] for p in points], marker="o", label=f"stats: {collect}")
        prefill_memory.plot([p["n"] for p in points], [max(p["working_bytes"], 1) / 2**20 for p in points],
                            marker="o", label=f"stats: {collect}")
    prefill.set_title("prefill attention, one layer (s)")
    prefill_memory.set_title("its peak memory (MiB)")
    for policy in sorted({p["policy"] for p in components["selection"]["points"]}):
        points = sorted((p for p in components["selection"]["points"] if p["policy"] == policy), key=lambda p: p["n"])
        selection.plot([p["n"] for p in points], [p["seconds"] for p in points], marker="o", label=policy)
    selection.set_title("score + select, one layer (s)")
    fits = components["decode_attention"]["fits"]
    points = components["decode_attention"]["points"]
    if fits:
        over_n = sorted((p for p in points if p["kept"] == fits["fixed_kept"]), key=lambda p: p["n"])
        over_k = sorted((p for p in points if p["n"] == fits["fixed_length"]), key=lambda p: p["kept"])
        decode.plot([p["n"] for p in over_n], [p["seconds"] for p in over_n], marker="o",
                    label=f"x = prompt length, {fits['fixed_kept']} kept")
        decode.plot([p["kept"] for p in over_k], [p["seconds"] for p in over_k], marker="s",
                    label=f"x = kept tokens, length {fits['fixed_length']}")
    decode.set_title("decode read + attention, one layer (s)")
    for axes in (prefill, prefill_memory, selection, decode):
        axes.set_xscale("log", base=2)
        axes.xaxis.set_major_formatter(ScalarFormatter())
        axes.set_yscale("log")
        axes.set_xlabel("tokens")
        axes.grid(alpha=0.3)
        if axes.lines:
            axes.legend(fontsize="small")
    _save_figure(figure, path)
