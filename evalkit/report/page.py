"""`evalkit report`: a self-contained HTML leaderboard with plots, read from the results store only.

Runs are compared within a *setting* (task, length, samples, model, seed, temperature, dtype,
task settings: everything that makes the prompts and the reference answers), along a
*series* (the policy plus any way of running it that differs across the runs: granularity,
policy hyper-parameters, layout, block size, prefill, query-aware, decode eviction, page pool). Each run's full-cache
reference is the `full` run of its setting that shares the most of those ways of running, and each
series gets its area under the quality-vs-budget curve (`evalkit.report.leaderboard.quality_auc`).

The runs may come from several results folders, read together; a run id found in more than one is the
same run (the id hashes the config fields that make the run), shown from the first folder given that
holds it complete.

The page: the leaderboard (`evalkit.report.leaderboard`), the plots of each setting
(`evalkit.report.plots`: the PNGs of each task), the runs' heatmaps and
first predictions, from `assets/index.html.j2`; the command is `evalkit.report.command`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import jinja2
import plotly.offline
from markupsafe import Markup

from evalkit.config import baseline_for, default_of, fields_where
from evalkit.errors import EvalkitError
from evalkit.policies import fraction_of
from evalkit.report import plots as draw
from evalkit.report.answer import CAN_DO, answer_data, as_text, family_of, headline, policy_name, view_of
from evalkit.report.significance import Marks, significance
from evalkit.report.leaderboard import (AUC_DEFINITION, AUC_SHORT, COLUMNS, display, is_number, leaderboard_rows,
                                        quality_auc, write_csv)
from evalkit.results import RunDir, check_writable_folder, read_json
from evalkit.uncertainty import Interval, score_interval

# Each run's first 20 predictions; past 50 runs the runs share 1,000 (at least one each), so that a large store's
# page grows by its leaderboard rows, not by 20 predictions of up to 128 generated tokens a run.
_PREDICTIONS_PER_RUN = 20
_PREDICTIONS_ON_PAGE = 1000
_NUMBERS = ("samples", "bytes_held", "held_over_full", "prompt_tokens", "prefill_tokens_per_s",
            "decode_tokens_per_s")  # metrics the report computes with, when present
_GENERATED = ("quality-vs-budget-*.png", "memory-vs-quality-*.png", "quality-vs-block-size-*.png", "heatmap-*.png",
              "headline.png")
# Written beside index.html by every report (the same bytes each time).


# ---- reading the store --------------------------------------------------------------------------------------

@dataclass
class Entry:
    """One complete run with a score, placed in its setting and series."""

    run_id: str
    folder: Path
    config: dict
    metrics: dict
    setting: str = ""  # label of the comparable group
    series: str = ""  # label of the policy line within it
    variant: dict = field(default_factory=dict)  # the ways of running that differ across the runs (in `series`)
    baseline: dict | None = None  # metrics of the full-cache reference
    baseline_entry: "Entry | None" = None  # that reference
    auc: float | None = None
    records: list[dict] = field(default_factory=list)  # every prediction (the first ones are shown)
    interval: Interval | None = None  # 95 % interval of the score: metrics.json's, or from the records
    marks: Marks | None = None  # paired tests against the baseline and the other granularities

    @property
    def is_full(self) -> bool:
        return self.config.get("policy") == "full"

    @property
    def x(self) -> float:
        return fraction_of(self.config["budget"], self.metrics.get("prompt_tokens"))

    def relative(self, value: float | None) -> float | None:
        base = self.baseline["score"] if self.baseline else None
        return value / base if value is not None and base else None


def load_entries(folders: Sequence[Path]) -> tuple[list[Entry], list[str]]:
    """Complete runs with a score under the results `folders`, and why others were left out (naming the file
    at fault). Everything the report shows is read here, before anything is written."""
    entries, skipped = [], []
    for runs in folders:
        found, reasons = _read_folder(runs)
        entries += found
        # One folder is named on the page already; with several, each reason says which folder it is about.
        skipped += reasons if len(folders) == 1 else [f"{runs}: {reason}" for reason in reasons]
    entries = _each_run_once(entries, skipped)
    _place(entries)
    marks = significance(entries, lambda e: e.records if e.interval is not None else [], policy_name,
                         fields_where(report="variant"))
    for e in entries:
        e.marks = marks.get(e.run_id)
    return entries, skipped


def _read_folder(runs: Path) -> tuple[list[Entry], list[str]]:
    """The complete runs of one results folder, and why its other run folders were left out."""
    entries, skipped = [], []
    for metrics_path in sorted(Path(runs).glob("*/metrics.json")):
        folder = metrics_path.parent
        try:
            provenance = read_json(folder / "config.json")
            metrics = read_json(metrics_path)
        except EvalkitError as error:
            skipped.append(f"{folder.name}: {error}")
            continue
        config = provenance.get("config")
        if not isinstance(config, dict) or not is_number(config.get("budget")) or "policy" not in config \
                or not is_number(metrics.get("score")):
            skipped.append(f"{folder.name}: no policy, budget and score (an lm-eval run?)")
            continue
        config.setdefault("policy_args", {})  # runs from before the option: the policy's defaults
        bad = [key for key in _NUMBERS if key in metrics and not is_number(metrics[key])]
        if bad:
            skipped.append(f"{folder.name}: {metrics_path} has {', '.join(bad)} that are not finite numbers")
            continue
        try:
            records = RunDir(folder.parent, folder.name).predictions()
        except EvalkitError as error:
            records = []
            skipped.append(f"{folder.name}: predictions not shown: {error}")
        entries.append(Entry(str(provenance.get("run_id", folder.name)), folder, config, metrics, records=records,
                             interval=_interval(metrics, records)))
    incomplete = sorted(config.parent.name for config in Path(runs).glob("*/config.json")
                        if not config.with_name("metrics.json").exists())
    if incomplete:  # a run still going, or stopped: its numbers would not be the run's
        skipped.append(f"incomplete runs (no metrics.json yet): {', '.join(incomplete)}")
    return entries, skipped


def _each_run_once(entries: list[Entry], skipped: list[str]) -> list[Entry]:
    """The first entry of each run id (folders in the order given); each later one named in `skipped`. The id
    hashes the config fields that make the run, so a second copy is the same run; the paired tests key on it."""
    kept: dict[str, Entry] = {}
    for e in entries:
        if e.run_id in kept:
            skipped.append(f"{e.folder}: the same run id as {kept[e.run_id].folder}, which is shown")
        else:
            kept[e.run_id] = e
    return list(kept.values())


def _interval(metrics: dict, records: list[dict]) -> Interval | None:
    """The run's recorded interval; for a run recorded before intervals existed, one from its predictions."""
    if "ci_method" in metrics:
        return Interval(**{k: metrics.get(k) for k in Interval.__dataclass_fields__})
    if records and all(is_number(r.get("score")) for r in records):
        return score_interval(records)
    return None


def _key(config: dict, names) -> str:
    return json.dumps({k: config.get(k) for k in names}, sort_keys=True, default=str)


def _place(entries: list[Entry]) -> None:
    """Setting and series labels, full-cache references and AUCs. Config fields are read by their report
    role (`config.setting`): those that say how a policy ran make a series; the granularity run is in
    the policy's label (`policy_label`)."""
    variants = fields_where(report="variant")
    every = sorted({k for e in entries for k in e.config} - set(fields_where(report="ignored")) - set(variants)
                   - set(fields_where(report="curve")))
    setting_keys = [k for k in every if k not in ("task", "length")]
    def varies(key):
        return len({json.dumps(e.config.get(key), default=str) for e in entries}) > 1

    varying_setting = [k for k in setting_keys if varies(k)]
    varying_variant = [k for k in variants if k != "granularity" and varies(k)]

    def label(config, keys):
        return ", ".join(f"{k}={as_text(config.get(k))}" for k in keys)

    # A series names how it ran off the defaults only: a run made as evalkit runs by default stays plain
    # however other runs of the folders ran (KVzip's layerwise=true beside every other policy's defaults).
    defaults = {k: default_of(k) for k in varying_variant}
    for e in entries:
        shown = [k for k in varying_setting if e.config.get(k) not in (None, {}, [])]  # no "task_args={}"
        extra = label(e.config, shown)
        e.setting = f"{e.config.get('task')} @ {e.config.get('length')}" + (f" ({extra})" if extra else "")
        e.variant = {k: e.config[k] for k, default in defaults.items() if e.config.get(k, default) != default}
        variant = label(e.config, list(e.variant))
        e.series = policy_name(e.config) + (f" ({variant})" if variant else "")

    by_setting: dict[str, list[Entry]] = {}
    for e in entries:
        by_setting.setdefault(_key(e.config, ["task", "length", *setting_keys]), []).append(e)
    for group in by_setting.values():
        fulls = [(e.config, e) for e in sorted(group, key=lambda e: e.run_id) if e.is_full]
        for e in group:
            e.baseline_entry = baseline_for(e.config, fulls)
            e.baseline = e.baseline_entry.metrics if e.baseline_entry else None
        policies = [e for e in group if not e.is_full]
        start = min((e.x for e in policies), default=1.0)
        for series in {e.series for e in policies}:
            members = [e for e in policies if e.series == series]
            full = members[0].baseline["score"] if members[0].baseline else None
            auc = quality_auc([(e.x, e.metrics["score"]) for e in members], start, full)
            for e in members:
                e.auc = auc
        for e in group:
            if e.is_full:
                e.auc = e.metrics["score"]  # the reference's curve is flat at its own score


# ---- writing -------------------------------------------------------------------------------------------------

@dataclass
class Written:
    index: Path
    runs: int
    plots: int
    heatmaps: int
    skipped: list[str] = field(default_factory=list)


def build_report(runs: Path | Sequence[Path], output: str | Path) -> Written:
    """index.html (leaderboard, interactive plots, heatmaps, predictions), PNG plots and leaderboard.csv, from
    one results folder or several. Built in a scratch folder and moved into `output` only when whole
    (index.html last): a failure leaves `output` as it was."""
    folders = _results_folders(runs)
    check_writable_folder(output, "-o")  # before Path(""), which is the current folder
    output = Path(output)
    entries, skipped = load_entries(folders)
    if not entries:
        raise EvalkitError(f"no complete runs with a score under {', '.join(repr(str(f)) for f in folders)}")
    with tempfile.TemporaryDirectory(prefix="evalkit-report-") as scratch:
        written = _write_report(folders, entries, skipped, Path(scratch))
        output.mkdir(parents=True, exist_ok=True)
        for pattern in _GENERATED:  # a previous report's plots of settings no longer present
            for stale in output.glob(pattern):
                stale.unlink()
        for path in sorted(Path(scratch).iterdir(), key=lambda p: p.name == "index.html"):
            shutil.move(path, output / path.name)
    written.index = output / written.index.name
    return written


def _results_folders(runs: Path | Sequence[Path]) -> list[Path]:
    """The results folders in the order given, each once (a folder named twice would repeat every run)."""
    given = [Path(runs)] if isinstance(runs, (str, Path)) else [Path(folder) for folder in runs]
    if not given:
        raise EvalkitError("no results folder given")
    for folder in given:
        if not folder.is_dir():
            raise EvalkitError(f"no results folder {str(folder)!r}")
    unique: dict[Path, Path] = {}
    for folder in given:
        unique.setdefault(folder.resolve(), folder)
    return list(unique.values())


def _write_report(folders: list[Path], entries: list[Entry], skipped: list[str], output: Path) -> Written:
    rows = leaderboard_rows(entries)
    write_csv(rows, output / "leaderboard.csv")
    plots = draw.task_plots(entries, list(dict.fromkeys(r["setting"] for r in rows)), output)
    heatmaps = []
    for e in sorted(entries, key=lambda e: (e.setting, e.series, e.x)):
        source = e.folder / "heatmap.png"
        if source.is_file():
            png = output / f"heatmap-{e.folder.name}.png"
            png.write_bytes(source.read_bytes())
            heatmaps.append({"caption": f"{e.setting}: {e.series} @ {e.config['budget']}", "run_id": e.run_id,
                             "png": png.name})

    answer = answer_data(entries)
    views = headline(answer)
    if views:
        draw.headline_png(views, output / "headline.png")
    by_id = {e.run_id: e for e in entries}
    table = [{"cells": [(*display(row[key], kind, row["lower_is_better"]), _css(key, kind)) for _, key, kind in COLUMNS],
              "filters": _filters(by_id[row["run_id"]])} for row in rows]
    assets = files("evalkit.report") / "assets"
    (output / "plotly.min.js").write_text(plotly.offline.get_plotlyjs())  # the same bytes each time: git keeps one
    (output / "report.js").write_text((assets / "report.js").read_text())
    shown = predictions_per_run(len(entries))
    # JSON inside <script>: no "<" can close the element, whatever a run folder's strings hold
    answer = json.dumps(answer, sort_keys=True).replace("<", "\\u003c")
    html = jinja2.Environment(autoescape=True).from_string((assets / "index.html.j2").read_text()).render(
        columns=[heading for heading, _, _ in COLUMNS], headline=[key for _, key, _ in COLUMNS].index("auc"),
        table=table, plots=plots, heatmaps=heatmaps, filters=list(FILTERS), answer_json=Markup(answer),
        can_do=CAN_DO, predictions=[_predictions(e, shown) for e in sorted(entries, key=lambda e: (e.setting, e.series, e.x))],
        runs=[str(folder) for folder in folders], skipped=skipped, auc_definition=AUC_DEFINITION,
        auc_definition_short=AUC_SHORT)
    index = output / "index.html"
    index.write_text(html)
    return Written(index, len(entries), sum(len(pngs) for _, pngs in plots), len(heatmaps), skipped)


FILTERS = ("model", "length", "mode", "task", "scorer", "granularity", "budget")  # the run table's


def _filters(e: Entry) -> dict[str, str]:
    """The run's values for the page's run filters."""
    model, length, mode = view_of(e)
    scorer, granularity = ("full", "-") if e.is_full else family_of(e)
    return dict(zip(FILTERS, (model, str(length), mode, str(e.config.get("task")), scorer, granularity,
                              as_text(e.config.get("budget")))))


def _css(key: str, kind: str) -> str:
    """A cell's class: long text wraps (the marks), run ids small, other text left-aligned."""
    return {"significance": "wrap", "run_id": "run"}.get(key, "text" if kind == "text" else "")


def predictions_per_run(runs: int) -> int:
    """How many of each run's first predictions the page shows when it has `runs` runs."""
    return max(1, min(_PREDICTIONS_PER_RUN, _PREDICTIONS_ON_PAGE // runs))


def _predictions(e: Entry, count: int) -> dict:
    shown = [{"id": as_text(record.get("id")),
              "score": display(record.get("score"), "pct")[0] if is_number(record.get("score")) else "—",
              "prediction": str(record.get("prediction", "")), "references": as_text(record.get("references"))}
             for record in e.records[:count]]
    return {"title": f"{e.setting}: {e.series} @ {e.config['budget']}", "run_id": e.run_id, "records": shown,
            "samples": e.metrics.get("samples")}
