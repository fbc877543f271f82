"""`evalkit bench`'s report of a bench.json document: the tables it prints and the plots it draws
(`bench.png`: time and memory against length; `components.png`: the pieces' scaling)."""

from __future__ import annotations

import os

from matplotlib.figure import Figure
from matplotlib.ticker import ScalarFormatter
from rich.table import Table


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def _series(row: dict, show_layout: bool) -> str:
    return row["label"] + (f" ({row['layout']})" if show_layout and row["loop"] != "hf" else "")


def print_report(console, document: dict, show_layout: bool) -> None:
    """The grid's table, the components' fitted exponents and the targets, from a bench.json document."""
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


def _components_table(components: dict) -> Table:
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
    tmp = path.with_suffix(".tmp.png")
    figure.savefig(tmp, format="png", dpi=110)
    os.replace(tmp, path)


def plot_cells(rows: list[dict], path, title: str = "") -> None:
    """Time and memory against length, one line per policy (and HF and the full cache)."""
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
