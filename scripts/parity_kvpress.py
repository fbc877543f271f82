"""Per-sample parity with NVIDIA's kvpress: the same data, model and presses, two implementations.

    .venv/bin/python scripts/parity_kvpress.py                  # 20 samples, keep 50 % and 20 %
    .venv/bin/python scripts/parity_kvpress.py --samples 3 --presses none,knorm --keep 0.5

What it does (docs/fidelity.md has the method and the last measured table):
1. Builds, once, a virtualenv OUTSIDE the repository (default $EVALKIT_CACHE/kvpress-venv,
   EVALKIT_CACHE defaulting to ~/.cache/evalkit) holding kvpress 0.5.5: torch==2.13.0 first, then
   kvpress==0.5.5 transformers==5.2.0 constrained to that torch (kvpress pins transformers < 5.3, so it
   never goes into the project's .venv).
2. Writes a kvpress-format JSONL (context, question, answer_prefix, answers, max_new_tokens) of N
   samples of RULER niah_single_2 at --length tokens, made by evalkit's own task generator with the
   default model's tokenizer and a fixed seed: offline, made here.
3. Runs kvpress's `kv-press-text-generation` pipeline (in that virtualenv, through a helper script)
   and `evalkit run --task jsonl:... --format kvpress --query-agnostic --no-decode-eviction` on that
   file with the same model folder, greedy, for each press at each keep fraction
   (kvpress compression_ratio = 1 - keep, evalkit --budget keep).
4. Prints, per press: both scores, per-sample pass/fail agreement and seconds per sample for both
   tools, and writes the table (JSON with every sample's answers, and markdown) to --out: this invocation's
   rows and every earlier invocation's complete rows on the same data (and --kvpress-rules).

With --kvpress-rules evalkit, kvpress's ScorerPress keeps evalkit's count (ceil(n * keep) tokens a head, not
int(n * (1 - ratio))) and breaks ties as evalkit does (the earlier position, not torch.topk's unspecified order):
what differs then is the scoring itself. Its answers are cached apart, the evalkit runs are the same, and the
table is written as parity-<data>-evalkit-rules.{json,md}.

Resumable: kvpress answers are cached per (press, keep) in --out/kvpress/; an evalkit cell whose
folder already holds a finished run (metrics.json) is not run again (--rerun-evalkit runs it anyway;
`evalkit run` itself resumes a half-finished run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KVPRESS_SPEC = ("kvpress==0.5.5", "transformers==5.2.0")
TORCH_SPEC = "torch==2.13.0"
TASK = "ruler:niah_single_2"
TARGET_AGREEMENT = 0.9


@dataclass(frozen=True)
class Press:
    """One row family of the table: a kvpress press and the evalkit policy matched to it."""

    name: str  # the name --presses takes
    kvpress_class: str | None  # None: no press (the full cache)
    kvpress_kwargs: dict = field(default_factory=dict)
    eager: bool = False  # kvpress needs attn_implementation="eager"
    policy: str = "full"
    policy_args: tuple[str, ...] = ()  # evalkit --policy-arg KEY=VALUE
    compressing: bool = True  # False: the full cache, one row at keep 1
    kvpress_of: str | None = None  # evalkit-only row, compared with this press's kvpress answers
    note: str = ""
    # A wrapper press (AdaKVPress, CriticalKVPress, ChunkKVPress) takes the press it wraps as `press=`;
    # the compression ratio is the wrapped press's (the wrappers forward theirs to it).
    kvpress_inner: str | None = None
    kvpress_inner_kwargs: dict = field(default_factory=dict)
    evalkit_args: tuple[str, ...] = ()  # further `evalkit run` options, e.g. ("--block-size", "16")
    # The press's keyword for the removed fraction 1 - keep (DuoAttentionPress: head_compression_ratio, the share of
    # heads that stream), and the evalkit policy-arg that takes the same number (None: --budget alone says it).
    kvpress_ratio_kwarg: str = "compression_ratio"
    ratio_policy_arg: str | None = None
    # DuoAttentionPress(on_the_fly_scoring=True) calibrates on the hub's kmfoda/booksum: the helper substitutes
    # evalkit's calibration text (`calibration_texts`), so both tools rank the heads on the same tokens.
    calibration: bool = False

    @property
    def matched(self) -> bool:
        return self.kvpress_of is None

    @property
    def kvpress_label(self) -> str:
        if self.kvpress_class is None:
            return "no press"

        def label(cls: str, kwargs: dict, inner: str | None = None) -> str:
            args = ", ".join([*([inner] if inner else []), *(f"{k}={v}" for k, v in kwargs.items())])
            return f"{cls}({args})" if args else cls

        inner = label(self.kvpress_inner, self.kvpress_inner_kwargs) if self.kvpress_inner else None
        return label(self.kvpress_class, self.kvpress_kwargs, inner)

    @property
    def evalkit_label(self) -> str:
        return " ".join([self.policy, *(f"--policy-arg {a}" for a in self.policy_args), *self.evalkit_args])


PRESSES: dict[str, Press] = {p.name: p for p in (
    Press("none", None, policy="full", compressing=False),
    Press("streaming_llm", "StreamingLLMPress", {"n_sink": 4}, policy="streaming_llm"),
    Press("knorm", "KnormPress", policy="knorm_head"),
    Press("snapkv", "SnapKVPress", {"window_size": 64, "kernel_size": 5}, policy="snapkv",
          policy_args=("window=64", "kernel=5", "pooling=avg")),
    Press("tova", "TOVAPress", policy="tova"),
    Press("tova_head", "TOVAPress", policy="tova_head", kvpress_of="tova",
          note="unmatched: evalkit's per-KV-head TOVA against kvpress's TOVAPress"),
    Press("observed_attention", "ObservedAttentionPress", eager=True, policy="h2o_head",
          policy_args=("normalize=true", "recent_fraction=0")),
    # The zoo of issue #29: none of these needs eager attention (AdaKVPress and CriticalAdaKVPress refuse it).
    Press("expected_attention", "ExpectedAttentionPress", policy="expected_attention_head"),
    Press("adakv_expected_attention", "AdaKVPress", kvpress_inner="ExpectedAttentionPress",
          policy="adakv_expected_attention"),
    Press("keydiff", "KeyDiffPress", policy="keydiff_head"),
    Press("lagkv", "LagKVPress", {"n_sink": 4, "lag_size": 128}, policy="lagkv_head"),
    Press("critical_snapkv", "CriticalKVPress", kvpress_inner="SnapKVPress",
          kvpress_inner_kwargs={"window_size": 64, "kernel_size": 5}, policy="critical_snapkv_head",
          policy_args=("window=64", "kernel=5", "pooling=avg")),
    Press("chunkkv_snapkv", "ChunkKVPress", {"chunk_length": 16}, kvpress_inner="SnapKVPress",
          kvpress_inner_kwargs={"window_size": 64, "kernel_size": 5}, policy="snapkv_page",
          policy_args=("window=64", "kernel=5", "pooling=avg"), evalkit_args=("--block-size", "16")),
    # KVzip: kvpress's defaults (4 sinks, chunks of 2048, layerwise=False: one budget pooled over every layer and
    # KV head) are kvzip_head's. It runs a reconstruction forward after the prefill; sdpa, not eager (it asserts so).
    Press("kvzip", "KVzipPress", policy="kvzip_head"),
    # DuoAttention: a fixed share 1 - keep of the heads stream on both sides (kvpress's head_compression_ratio;
    # evalkit's policy-arg of that name, its budget then only switching compression on), heads ranked on evalkit's
    # calibration text on both sides; 128 sinks + 256 recent (kvpress's on-the-fly values, evalkit's defaults).
    # Not eager (DuoAttentionPress asserts it).
    Press("duo_attention", "DuoAttentionPress", {"on_the_fly_scoring": True}, policy="duo_attention",
          kvpress_ratio_kwarg="head_compression_ratio", ratio_policy_arg="head_compression_ratio", calibration=True),
)}
DEFAULT_PRESSES = tuple(PRESSES)
# kvpress 0.5.5's presses whose `compress` is ScorerPress's (score, then topk): the ones --kvpress-rules evalkit can
# change (the helper checks it again).
SCORER_PRESSES = frozenset({"StreamingLLMPress", "KnormPress", "SnapKVPress", "TOVAPress", "ObservedAttentionPress",
                            "ExpectedAttentionPress", "KeyDiffPress", "LagKVPress", "CriticalKVPress"})
RULES = ("kvpress", "evalkit")
DEFAULT_KEEP = (0.5, 0.2)
TOOLS = ("kvpress", "evalkit")


class ParityError(Exception):
    """A problem the user can fix: printed as one line, exit 2 for arguments, 1 otherwise."""


# --- arguments ---------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints the usage too)
        sys.stderr.write(f"parity_kvpress.py: error: {message}\n")
        sys.exit(2)


def cache_root() -> Path:
    return Path(os.environ.get("EVALKIT_CACHE") or Path.home() / ".cache" / "evalkit")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def parse_keep(text: str) -> tuple[float, ...]:
    """`0.5,0.2` -> (0.5, 0.2): fractions of the context kept, each in (0, 1), no repeats."""
    values = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--keep takes fractions in (0, 1) separated by commas, "
                                             f"got {part.strip()!r}") from None
        if not 0 < value < 1 or math.isnan(value):
            raise argparse.ArgumentTypeError(f"--keep values must be in (0, 1) (kept fraction; the full cache "
                                             f"is the 'none' press), got {part.strip()!r}")
        if value in values:
            raise argparse.ArgumentTypeError(f"--keep value {value:g} given twice")
        values.append(value)
    return tuple(values)


def parse_presses(text: str) -> tuple[str, ...]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PRESSES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown press {', '.join(map(repr, unknown)) or repr(text)}; choose from "
                                         f"{', '.join(PRESSES)}")
    return tuple(dict.fromkeys(names))


def parse_tools(text: str) -> tuple[str, ...]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or set(names) - set(TOOLS):
        raise argparse.ArgumentTypeError(f"--tools takes kvpress, evalkit or both, got {text!r}")
    return tuple(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=_positive_int, default=20, help="samples of the task (default 20)")
    parser.add_argument("--length", type=_positive_int, default=2048,
                        help="prompt + answer tokens per sample (default 2048)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task generator (default 0)")
    parser.add_argument("--keep", type=parse_keep, default=DEFAULT_KEEP,
                        help="kept fractions, comma-separated (default 0.5,0.2; kvpress ratio = 1 - keep)")
    parser.add_argument("--presses", type=parse_presses, default=DEFAULT_PRESSES,
                        help=f"comma-separated, from {', '.join(PRESSES)} (default: all)")
    parser.add_argument("--tools", type=parse_tools, default=TOOLS,
                        help="run kvpress, evalkit or both (default); the table uses what is stored")
    parser.add_argument("--out", default=str(REPO / "runs" / "parity"), help="output folder (default runs/parity)")
    parser.add_argument("--venv", default=None, help="kvpress virtualenv (default $EVALKIT_CACHE/kvpress-venv)")
    parser.add_argument("--model-dir", default=None,
                        help="model folder both tools load (default: evalkit's converted default model, "
                             "$EVALKIT_CACHE/models/SmolLM2-135M-Instruct, created when missing)")
    parser.add_argument("--evalkit", default=None, help="the evalkit command (default: beside this Python)")
    parser.add_argument("--threads", type=_positive_int, default=1,
                        help="torch threads for both tools (default 1: on a shared machine 1 thread is faster)")
    parser.add_argument("--kvpress-rules", choices=RULES, default="kvpress",
                        help="evalkit: kvpress's scorer presses keep evalkit's token count and tie order, so that "
                             "only the scores differ (answers cached apart, table parity-<data>-evalkit-rules.*)")
    parser.add_argument("--rerun-evalkit", action="store_true",
                        help="run evalkit cells again even when a finished run is stored (the old one is "
                             "renamed <cell>.replaced-<time>)")
    parser.add_argument("--setup-only", action="store_true", help="build the kvpress virtualenv and stop")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.venv is not None and _inside(Path(args.venv), REPO):
        _Parser().error(f"--venv {args.venv} is inside the repository; kvpress stays out of it")
    if args.kvpress_rules == "evalkit":
        other = [name for name in args.presses if PRESSES[name].kvpress_class not in SCORER_PRESSES]
        if other:
            _Parser().error(f"--kvpress-rules evalkit changes kvpress's ScorerPress only, not {', '.join(other)}")
    return args


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.expanduser().resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


# --- cells -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cell:
    press: Press
    keep: float  # 1.0 for the full cache
    rules: str = "kvpress"  # "evalkit": kvpress keeps evalkit's count and tie order (--kvpress-rules)

    @property
    def key(self) -> str:
        return f"{self.press.name}-keep{self.keep:g}"

    @property
    def ratio(self) -> float:
        return round(1 - self.keep, 9)

    @property
    def kvpress_key(self) -> str:  # whose kvpress answers this row is compared with
        rules = "-evalkit-rules" if self.rules == "evalkit" else ""
        return f"{self.press.kvpress_of or self.press.name}-keep{self.keep:g}{rules}"

    @property
    def budget(self) -> str:
        return "1.0" if not self.press.compressing else f"{self.keep:g}"

    @property
    def policy_args(self) -> tuple[str, ...]:
        """The row's --policy-arg values, with the removed fraction where the policy takes it as an arg."""
        extra = (f"{self.press.ratio_policy_arg}={self.ratio:g}",) if self.press.ratio_policy_arg else ()
        return (*self.press.policy_args, *extra)

    @property
    def kvpress_label(self) -> str:
        if self.rules == "evalkit":
            return f"{self.press.kvpress_label}, evalkit's count and ties"
        if self.press.kvpress_ratio_kwarg == "compression_ratio":  # the keep column says it
            return self.press.kvpress_label
        return f"{self.press.kvpress_label[:-1]}, {self.press.kvpress_ratio_kwarg}={self.ratio:g})" \
            if self.press.kvpress_label.endswith(")") else \
            f"{self.press.kvpress_label}({self.press.kvpress_ratio_kwarg}={self.ratio:g})"

    @property
    def evalkit_label(self) -> str:
        return " ".join([self.press.policy, *(f"--policy-arg {a}" for a in self.policy_args), *self.press.evalkit_args])


def cells(presses: tuple[str, ...], keeps: tuple[float, ...], rules: str = "kvpress") -> list[Cell]:
    """The table's rows in the order they run: the full cache, then every press at the first keep, ..."""
    chosen = [PRESSES[name] for name in presses]
    return ([Cell(p, 1.0) for p in chosen if not p.compressing]
            + [Cell(p, keep, rules) for keep in keeps for p in chosen if p.compressing])


# --- agreement ---------------------------------------------------------------------------------

def passed(score: float) -> bool:
    return score >= 1.0 - 1e-9


def agreement_row(kvpress: dict[str, float], evalkit: dict[str, float]) -> dict:
    """Per-sample scores of both tools (by sample id) -> scores in percent and pass/fail agreement
    over the samples both have."""
    common = row_ids(kvpress, evalkit)
    if not common:
        return {"samples": 0, "kvpress_score": None, "evalkit_score": None, "agree": 0, "agree_pct": None,
                "disagree_ids": []}
    disagree = [i for i in common if passed(kvpress[i]) != passed(evalkit[i])]
    return {
        "samples": len(common),
        "kvpress_score": 100 * sum(kvpress[i] for i in common) / len(common),
        "evalkit_score": 100 * sum(evalkit[i] for i in common) / len(common),
        "agree": len(common) - len(disagree),
        "agree_pct": 100 * (len(common) - len(disagree)) / len(common),
        "disagree_ids": disagree,
    }


def row_ids(kvpress: dict, evalkit: dict) -> list[str]:
    """The samples both tools have, in kvpress's order."""
    return [sample_id for sample_id in kvpress if sample_id in evalkit]


def _num(value, digits: int = 1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def table_rows(rows: list[dict]) -> list[list[str]]:
    header = ["press", "keep", "kvpress", "evalkit", "kvpress score", "evalkit score", "agree", "agree %",
              "same text", "kvpress s/sample", "evalkit s/sample"]
    body = [header]
    for row in rows:
        agree = f"{row['agree']}/{row['samples']}" if row["samples"] else "—"
        body.append([
            row["press"] + ("" if row["matched"] else " (unmatched)"), f"{row['keep']:g}", row["kvpress"],
            row["evalkit"], _num(row["kvpress_score"]), _num(row["evalkit_score"]), agree, _num(row["agree_pct"], 0),
            f"{row['same_answer']}/{row['samples']}" if row["samples"] and "same_answer" in row else "—",
            _num(row["kvpress_seconds"], 2), _num(row["evalkit_seconds"], 2),
        ])
    return body


def format_text(rows: list[dict]) -> str:
    body = table_rows(rows)
    widths = [max(len(line[i]) for line in body) for i in range(len(body[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in body)


def format_markdown(rows: list[dict]) -> str:
    body = table_rows(rows)
    escaped = [[cell.replace("|", "\\|") for cell in line] for line in body]
    lines = ["| " + " | ".join(escaped[0]) + " |", "|" + "|".join("---" for _ in escaped[0]) + "|"]
    lines += ["| " + " | ".join(line) + " |" for line in escaped[1:]]
    return "\n".join(lines)


# --- the kvpress virtualenv --------------------------------------------------------------------

_VERSIONS = ("import json, importlib.metadata as m; print(json.dumps({p: m.version(p) for p in "
             "('kvpress', 'transformers', 'torch')}))")


def kvpress_versions(venv: Path) -> dict | None:
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    done = subprocess.run([str(python), "-c", _VERSIONS], capture_output=True, text=True)
    return json.loads(done.stdout) if done.returncode == 0 else None


def _versions_ok(versions: dict | None) -> bool:
    if not versions:
        return False
    wanted = {spec.split("==")[0]: spec.split("==")[1] for spec in (*KVPRESS_SPEC, TORCH_SPEC)}
    return all(versions.get(name, "").split("+")[0] == version for name, version in wanted.items())


def ensure_venv(venv: Path) -> dict:
    """The kvpress virtualenv, built when missing or holding other versions; returns its versions."""
    versions = kvpress_versions(venv)
    if _versions_ok(versions):
        return versions
    print(f"building the kvpress virtualenv in {venv} (a few minutes)", file=sys.stderr)
    base = getattr(sys, "_base_executable", None) or sys.executable
    steps = [[base, "-m", "venv", str(venv)]]
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write(TORCH_SPEC + "\n")
    try:
        steps += [pip + [TORCH_SPEC], pip + ["-c", constraints.name, *KVPRESS_SPEC]]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                lines = [line for line in (done.stderr + done.stdout).splitlines()
                         if line.strip() and "is ignored: it is neither a file nor a directory" not in line]
                raise ParityError(f"building the kvpress virtualenv failed at `{' '.join(step[-3:])}`: "
                                  f"{lines[-1] if lines else 'exit ' + str(done.returncode)}")
    finally:
        os.unlink(constraints.name)
    versions = kvpress_versions(venv)
    if not _versions_ok(versions):
        raise ParityError(f"the kvpress virtualenv {venv} holds {versions}, not {', '.join((TORCH_SPEC, *KVPRESS_SPEC))}")
    return versions


# --- data --------------------------------------------------------------------------------------

def data_path(out: Path, length: int, samples: int, seed: int) -> Path:
    return out / "data" / f"niah_single_2-L{length}-n{samples}-seed{seed}.jsonl"


def make_data(path: Path, model_dir: Path, length: int, samples: int, seed: int) -> list[dict]:
    """N samples of RULER niah_single_2 from evalkit's generator, as kvpress-format records."""
    if path.exists():
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if len(records) == samples:
            return records
    from transformers import AutoTokenizer

    from evalkit.prompt import prompt_length
    from evalkit.tasks import TASKS

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    task = TASKS.create(TASK)
    records = [{"id": s.id, "context": s.context, "question": s.question, "answer_prefix": s.answer_prefix,
                "answers": list(s.references), "max_new_tokens": s.max_new_tokens}
               for s in task.samples(prompt_length(tokenizer), length, samples, seed)]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    tmp.replace(path)
    return records


def evalkit_tokens(records: list[dict], model_dir: Path) -> dict[str, dict]:
    """What evalkit feeds the model per sample: context / question token counts and a digest of the ids."""
    from transformers import AutoTokenizer

    from evalkit.prompt import encode
    from evalkit.tasks import Sample

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    out = {}
    for r in records:
        sample = Sample(r["id"], r["context"], r["question"], r.get("answer_prefix", ""), r["answers"],
                        r["max_new_tokens"])
        context_ids, question_ids = encode(tokenizer, sample)
        out[r["id"]] = {"context": len(context_ids), "question": len(question_ids),
                        "digest": _digest(context_ids, question_ids)}
    return out


def _digest(context_ids, question_ids) -> str:
    return hashlib.sha256(json.dumps([list(map(int, context_ids)), list(map(int, question_ids))]).encode()
                          ).hexdigest()[:16]


# --- kvpress side ------------------------------------------------------------------------------

# Runs inside the kvpress virtualenv: python helper.py job.json. Answers go to one JSON file per
# cell, rewritten after every sample, so an interrupted run resumes where it stopped.
KVPRESS_HELPER = r'''
import hashlib, json, math, os, sys, time
import torch
import kvpress
from kvpress.presses.scorer_press import ScorerPress
from transformers import pipeline
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()

job = json.load(open(sys.argv[1]))
records = [json.loads(line) for line in open(job["data"]) if line.strip()]
pipes = {}

def get_pipe(eager):
    if eager not in pipes:
        kwargs = {"attn_implementation": "eager"} if eager else {}
        pipes[eager] = pipeline("kv-press-text-generation", model=job["model"], device="cpu",
                                dtype=torch.float32, model_kwargs=kwargs)
    return pipes[eager]

def substitute_calibration(texts):
    # DuoAttentionPress(on_the_fly_scoring=True) ranks heads on 50 BookSum chapters from the hub
    # (load_dataset("kmfoda/booksum"), unreachable offline): it gets evalkit's calibration texts instead, all of them
    # (num_samples = their number), each tokenised by kvpress's own tokenizer to exactly evalkit's ids.
    import functools
    import pandas
    from kvpress.presses import duo_attention_press as duo
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    for t in texts:
        if tokenizer(t["text"])["input_ids"] != t["ids"]:
            sys.exit("kvpress's tokenizer does not read the calibration text as evalkit's ids")

    class Calibration:
        def to_pandas(self):
            return pandas.DataFrame({"chapter": [t["text"] for t in texts]})

    def load_dataset(name, split=None, **kwargs):
        assert (name, split) == ("kmfoda/booksum", "train"), (name, split)
        return Calibration()

    duo.load_dataset = load_dataset
    if not isinstance(duo.duo_attention_on_the_fly, functools.partial):
        duo.duo_attention_on_the_fly = functools.partial(duo.duo_attention_on_the_fly, num_samples=len(texts))
    return duo

KVPRESS_COMPRESS = ScorerPress.compress

def evalkit_rules(keep):
    # ScorerPress.compress keeping evalkit's count, ceil(n * keep) rounded as evalkit/policies/budget.py does, and
    # its tie rule: equal scores keep the earlier position (a stable sort; topk leaves the order of ties unspecified).
    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
        n_kept = math.ceil(round(keys.shape[2] * keep, 9))
        indices = scores.sort(dim=-1, descending=True, stable=True).indices[..., :n_kept]
        indices = indices.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
        return keys.gather(2, indices).contiguous(), values.gather(2, indices).contiguous()
    return compress

def question(record):
    # evalkit's prompt is context + "\n" + question; kvpress joins context and question with nothing.
    return "\n" + record["question"]

def write(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)

if job.get("tokens"):
    pipe = get_pipe(False)
    tokens = {}
    for r in records:
        t = pipe.preprocess(r["context"], [question(r)], r.get("answer_prefix", ""), 10**10)
        c, (q,) = t["context_ids"][0].tolist(), [x[0].tolist() for x in t["questions_ids"]]
        digest = hashlib.sha256(json.dumps([c, q]).encode()).hexdigest()[:16]
        tokens[r["id"]] = {"context": len(c), "question": len(q), "digest": digest}
    write(job["tokens"], tokens)

for cell in job["cells"]:
    path = cell["cache"]
    answers = json.load(open(path)) if os.path.exists(path) else {}
    todo = [r for r in records if r["id"] not in answers]
    if not todo:
        continue
    press = None
    ratio = {cell.get("ratio_kwarg", "compression_ratio"): cell["ratio"]}
    duo = substitute_calibration(cell["calibration"]) if cell.get("calibration") else None
    if cell["press"] is not None and cell.get("inner"):  # a wrapper: the ratio is the wrapped press's
        inner = getattr(kvpress, cell["inner"])(**ratio, **cell["inner_kwargs"])
        press = getattr(kvpress, cell["press"])(press=inner, **cell["kwargs"])
    elif cell["press"] is not None:
        press = getattr(kvpress, cell["press"])(**ratio, **cell["kwargs"])
    rules_keep = cell.get("evalkit_rules_keep")
    ScorerPress.compress = evalkit_rules(rules_keep) if rules_keep is not None else KVPRESS_COMPRESS
    if rules_keep is not None and type(press).compress is not ScorerPress.compress:
        sys.exit(f"{cell['press']} has a compress of its own: --kvpress-rules evalkit cannot change it")
    pipe = get_pipe(cell["eager"])
    if duo is not None:  # the head scores and streaming heads kvpress used, beside the answers
        scores = duo.duo_attention_on_the_fly(pipe.model)
        press.post_init_from_model(pipe.model)
        write(path[:-len(".json")] + ".heads.json",
              {"scores": scores.tolist(), "streaming": press.streaming_mask.int().tolist()})
    for number, r in enumerate(todo, 1):
        start = time.perf_counter()
        out = pipe(r["context"], question=question(r), answer_prefix=r.get("answer_prefix", ""), press=press,
                   max_new_tokens=r["max_new_tokens"])
        answers[r["id"]] = {"answer": out["answer"], "seconds": time.perf_counter() - start}
        write(path, answers)
        print(f"kvpress {cell['key']}: {len(records) - len(todo) + number}/{len(records)} "
              f"({answers[r['id']]['seconds']:.1f} s) {out['answer'][:60]!r}", file=sys.stderr, flush=True)
'''


def kvpress_cache(out: Path, stem: str, key: str) -> Path:
    return out / "kvpress" / stem / f"{key}.json"


def calibration_texts(model_dir: Path) -> list[dict]:
    """evalkit's DuoAttention calibration (`evalkit.policies.duo_calibration.calibration_ids`: the first 1,024 tokens of
    the first 4 shipped Paul Graham essays, in the model's tokenizer) as text kvpress's `tokenizer(text)` turns into
    the same ids: each as {"text", "ids"}, the decoded ids, checked to tokenise back to them here (and again in
    kvpress's virtualenv by the helper)."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoTokenizer

    from evalkit.policies.duo_calibration import calibration_ids

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = SimpleNamespace(config=AutoConfig.from_pretrained(str(model_dir)))  # what calibration_ids reads
    texts = []
    for ids in calibration_ids(model, tokenizer):
        text = tokenizer.decode(ids)
        if tokenizer(text)["input_ids"] != ids:
            raise ParityError("a DuoAttention calibration text does not tokenise back to evalkit's calibration ids")
        texts.append({"text": text, "ids": ids})
    return texts


def tool_env(threads: int) -> dict:
    """The environment both tools run in: the same thread count, offline, no progress bars."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "WANDB_MODE": "disabled"}


def _complete(cache: Path, data: Path) -> bool:
    ids = {json.loads(line)["id"] for line in data.read_text().splitlines() if line.strip()}
    return ids <= set(json.loads(cache.read_text()))


def run_kvpress(venv: Path, model_dir: Path, data: Path, out: Path, todo: list[Cell], threads: int) -> None:
    stem = data.stem
    (out / "kvpress" / stem).mkdir(parents=True, exist_ok=True)
    seen, job_cells = set(), []
    for cell in todo:
        if cell.press.kvpress_of is not None or cell.kvpress_key in seen:
            continue  # evalkit-only rows reuse the matched press's answers
        seen.add(cell.kvpress_key)
        job_cells.append({"key": cell.kvpress_key, "press": cell.press.kvpress_class, "ratio": cell.ratio,
                          "ratio_kwarg": cell.press.kvpress_ratio_kwarg,
                          "kwargs": cell.press.kvpress_kwargs, "eager": cell.press.eager,
                          "inner": cell.press.kvpress_inner, "inner_kwargs": cell.press.kvpress_inner_kwargs,
                          "calibration": cell.press.calibration,
                          "evalkit_rules_keep": cell.keep if cell.rules == "evalkit" else None,
                          "cache": str(kvpress_cache(out, stem, cell.kvpress_key))})
    tokens = out / "kvpress" / stem / "tokens.json"
    if tokens.exists() and all(Path(c["cache"]).exists() and _complete(Path(c["cache"]), data) for c in job_cells):
        return
    for job_cell in job_cells:
        job_cell["calibration"] = calibration_texts(model_dir) if job_cell["calibration"] else None
    job = {"data": str(data), "model": str(model_dir), "cells": job_cells,
           "tokens": None if tokens.exists() else str(tokens)}
    with tempfile.TemporaryDirectory() as tmp:
        helper, job_file = Path(tmp) / "kvpress_helper.py", Path(tmp) / "job.json"
        helper.write_text(KVPRESS_HELPER)
        job_file.write_text(json.dumps(job))
        done = subprocess.run([str(venv / "bin" / "python"), str(helper), str(job_file)], env=tool_env(threads))
    if done.returncode != 0:
        raise ParityError(f"the kvpress helper failed (exit {done.returncode}); its traceback is above")


# --- evalkit side ------------------------------------------------------------------------------

def evalkit_command(args) -> list[str]:
    if args.evalkit:
        return args.evalkit.split()
    beside = Path(sys.executable).parent / "evalkit"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("evalkit")
    if found:
        return [found]
    raise ParityError("no evalkit command beside this Python or on PATH: run with the project's "
                      ".venv/bin/python or give --evalkit")


def evalkit_features(command: list[str]) -> dict:
    """What this evalkit supports: --policy-arg, and the policy names."""
    help_text = subprocess.run(command + ["run", "--help"], capture_output=True, text=True,
                               env={**os.environ, "COLUMNS": "200"}).stdout
    from evalkit.errors import EvalkitError
    from evalkit.policies import POLICIES  # the same installed package the command runs

    from evalkit.policies import make_policy, policy_args

    names, takes = set(), {}
    for name in {press.policy for press in PRESSES.values()}:
        try:
            POLICIES.canonical(name)
            names.add(name)
            policy = make_policy(name)
            takes[name] = set(policy_args(policy)) | set(policy.arg_aliases)
        except EvalkitError:
            pass
    return {"policy_arg": "--policy-arg" in help_text, "policies": names, "no_baseline": "--no-baseline" in help_text,
            "policy_args": takes}


def missing_feature(cell: Cell, features: dict) -> str | None:
    if cell.policy_args and not features["policy_arg"]:
        return "this evalkit has no --policy-arg"
    if cell.press.policy not in features["policies"]:
        return f"this evalkit has no policy {cell.press.policy}"
    takes = features.get("policy_args", {}).get(cell.press.policy, set())
    if cell.press.ratio_policy_arg and cell.press.ratio_policy_arg not in takes:
        return f"this evalkit's {cell.press.policy} has no policy-arg {cell.press.ratio_policy_arg}"
    if cell.press.name == "tova" and "tova_head" not in features["policies"]:
        return "this evalkit's tova is still the per-KV-head variant (no tova_head yet)"
    return None


def evalkit_dir(out: Path, stem: str, cell: Cell) -> Path:
    return out / "evalkit" / stem / cell.key


def finished_run(folder: Path, cell: Cell | None = None) -> Path | None:
    """The newest finished run in a cell's folder (of the cell's policy and budget, when `cell` is given:
    an `evalkit run` without --no-baseline also stores its full-cache baseline run there)."""
    runs = [m.parent for m in folder.glob("*/metrics.json")] if folder.exists() else []
    if cell is not None:
        runs = [run for run in runs if _made_by(run, cell)]
    return max(runs, key=lambda p: (p / "metrics.json").stat().st_mtime) if runs else None


def _made_by(run: Path, cell: Cell) -> bool:
    try:
        config = json.loads((run / "config.json").read_text()).get("config", {})
    except (OSError, ValueError):
        return False
    return (_canonical(config.get("policy")) == _canonical(cell.press.policy)
            and abs(float(config.get("budget", -1)) - float(cell.budget)) < 1e-9)


def _canonical(name):
    """The name evalkit stores for a policy (a run of `tova` records `tova_token`); the name itself when unknown."""
    try:
        from evalkit.errors import EvalkitError
        from evalkit.policies import POLICIES
    except ImportError:
        return name
    try:
        return POLICIES.canonical(name)
    except (EvalkitError, TypeError):
        return name


def run_evalkit(command: list[str], cell: Cell, data: Path, out: Path, length: int, seed: int,
                model: str, rerun: bool, threads: int, no_baseline: bool = False) -> str | None:
    """Runs one cell unless finished; returns why it failed, or None."""
    folder = evalkit_dir(out, data.stem, cell)
    if finished_run(folder, cell):
        if not rerun:
            return None
        # evalkit would return its finished run of the same settings as it is: set it aside.
        folder.rename(folder.with_name(f"{folder.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"))
    argv = command + ["run", "--task", f"jsonl:{data}", "--format", "kvpress", "--query-agnostic",
                      "--no-decode-eviction", "--model", model, "--policy", cell.press.policy,
                      "--budget", cell.budget, "--length", str(length), "--seed", str(seed),
                      "--out", str(folder), "--wandb", "off"]
    for arg in cell.policy_args:
        argv += ["--policy-arg", arg]
    argv += list(cell.press.evalkit_args)
    if no_baseline:  # the cell's own run only (the full cache is the `none` row)
        argv.append("--no-baseline")
    print(f"evalkit {cell.key}: {' '.join(argv[1:])}", file=sys.stderr, flush=True)
    start, commit = time.perf_counter(), git_commit()
    done = subprocess.run(argv, capture_output=True, text=True, env=tool_env(threads))
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        return lines[-1].strip() if lines else f"exit {done.returncode}"
    print(f"evalkit {cell.key}: done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    if run := finished_run(folder, cell):  # evalkit is edited while this runs: which code made the run
        (run / "parity_commit.txt").write_text(commit + "\n")
    return None


def evalkit_results(folder: Path, cell: Cell) -> tuple[dict, dict, dict | None]:
    """(scores by id, seconds by id, the run's config.json) of a cell's newest finished run."""
    run = finished_run(folder, cell)
    if run is None:
        return {}, {}, None
    records = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines() if line.strip()]
    scores = {r["id"]: float(r["score"]) for r in records}
    seconds = {r["id"]: r.get("prefill_seconds", 0.0) + r.get("decode_seconds", 0.0) for r in records}
    predictions = {r["id"]: r["prediction"] for r in records}
    config = json.loads((run / "config.json").read_text())
    return scores, seconds, {"run": str(run), "config": config, "predictions": predictions}


# --- the table ---------------------------------------------------------------------------------

def table_cells(out: Path, data: Path, records: list[dict], todo: list[Cell], rules: str) -> list[Cell]:
    """The table's rows: this invocation's cells and every earlier one complete on disk for the same data and rules
    (kvpress answers for every sample and a finished evalkit run), so a narrower invocation keeps the others' rows.
    Ordered by keep (descending), then as PRESSES lists the presses."""
    folder = out / "kvpress" / data.stem
    keeps = {c.keep for c in todo} | {float(m.group(1)) for f in folder.glob("*.json")
                                      if (m := re.fullmatch(r".+-keep([0-9.]+)(?:-evalkit-rules)?\.json", f.name))}
    ids = {r["id"] for r in records}

    def complete(cell: Cell) -> bool:
        path = kvpress_cache(out, data.stem, cell.kvpress_key)
        return (path.exists() and ids <= set(json.loads(path.read_text()))
                and finished_run(evalkit_dir(out, data.stem, cell), cell) is not None)

    chosen = {c.key for c in todo}
    return [c for c in cells(tuple(PRESSES), tuple(sorted(keeps, reverse=True)), rules)
            if c.key in chosen or complete(c)]


def collect(out: Path, data: Path, records: list[dict], todo: list[Cell], skipped: dict[str, str]) -> list[dict]:
    from evalkit.tasks.metrics import METRICS

    references = {r["id"]: r["answers"] for r in records}
    rows = []
    for cell in todo:
        path = kvpress_cache(out, data.stem, cell.kvpress_key)
        answers = json.loads(path.read_text()) if path.exists() else {}
        answers = {i: a for i, a in answers.items() if i in references}
        kv_scores = {i: METRICS["string_match_all"](a["answer"], references[i]) for i, a in answers.items()}
        ek_scores, ek_seconds, ek = evalkit_results(evalkit_dir(out, data.stem, cell), cell)
        row = {"press": cell.press.name, "keep": cell.keep, "kvpress_ratio": cell.ratio,
               "kvpress": cell.kvpress_label, "evalkit": f"{cell.evalkit_label} --budget {cell.budget}",
               "matched": cell.press.matched, "note": cell.press.note or skipped.get(cell.key, ""),
               **agreement_row(kv_scores, ek_scores)}
        row["kvpress_seconds"] = (sum(a["seconds"] for a in answers.values()) / len(answers)) if answers else None
        row["evalkit_seconds"] = (sum(ek_seconds.values()) / len(ek_seconds)) if ek_seconds else None
        same = [i for i in row_ids(kv_scores, ek_scores)
                if answers[i]["answer"].strip() == ek["predictions"].get(i, "").strip()] if ek else []
        row["same_answer"] = len(same)
        row["evalkit_run"] = ek["run"] if ek else None
        stamp = Path(ek["run"]) / "parity_commit.txt" if ek else None
        row["evalkit_commit"] = stamp.read_text().strip() if stamp and stamp.exists() else None
        row["per_sample"] = {i: {"kvpress_answer": answers.get(i, {}).get("answer"), "kvpress_score": kv_scores.get(i),
                                 "evalkit_answer": ek["predictions"].get(i) if ek else None,
                                 "evalkit_score": ek_scores.get(i)} for i in references}
        rows.append(row)
    return rows


def git_commit() -> str:
    def git(*a):
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "evalkit")
    return commit + (" + uncommitted changes in evalkit/" if dirty else "")


def table_stem(data: Path, rules: str) -> str:
    return f"parity-{data.stem}" + ("-evalkit-rules" if rules == "evalkit" else "")


def write_outputs(out: Path, data: Path, rows: list[dict], meta: dict) -> tuple[Path, Path]:
    stem = table_stem(data, meta["kvpress_rules"])
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps({**meta, "rows": rows}, indent=1, sort_keys=True) + "\n")
    lines = [f"# kvpress parity: {data.stem}", "",
             f"kvpress {meta['versions']['kvpress']} (transformers {meta['versions']['kvpress_transformers']}, "
             f"torch {meta['versions']['kvpress_torch']}) vs evalkit (transformers "
             f"{meta['versions']['evalkit_transformers']}, torch {meta['versions']['evalkit_torch']}; {meta['commit']} when "
             f"this invocation started, each row's own commit below); "
             f"{meta['samples']} samples; prompt tokens identical in both tools: {meta['tokens_identical']}.", "",
             format_markdown(rows), ""]
    notes = [f"- {r['press']} keep {r['keep']:g}: {r['note']}" for r in rows if r["note"]]
    lines += (["Notes:", *notes, ""] if notes else [])
    commits: dict[str, list[str]] = {}
    for r in rows:
        if r.get("evalkit_commit"):
            commits.setdefault(r["evalkit_commit"], []).append(f"{r['press']} {r['keep']:g}")
    if commits:  # evalkit's tree may change while the cells run, one after the other
        lines += ["evalkit code each run was made with:",
                  *(f"- {commit}: {', '.join(cells)}" for commit, cells in commits.items()), ""]
    md_path.write_text("\n".join(lines))
    return json_path, md_path


# --- main --------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()
    out = Path(args.out).expanduser().resolve()
    venv = Path(args.venv).expanduser() if args.venv else cache_root() / "kvpress-venv"
    if "kvpress" in args.tools or args.setup_only:
        versions = ensure_venv(venv)
        if args.setup_only:
            print(f"kvpress virtualenv ready: {venv} ({versions})")
            return 0
    else:
        versions = kvpress_versions(venv) or {}
    try:
        import torch
        import transformers

        from evalkit.assets import default_model_dir
    except ImportError as error:
        raise ParityError(f"cannot import {error.name}: run with the project's Python (.venv/bin/python)") from None
    model_dir = Path(args.model_dir).expanduser().resolve() if args.model_dir else default_model_dir()
    if not (model_dir / "config.json").exists():
        raise ParityError(f"no model in {model_dir} (config.json missing)")
    model = "smollm2-135m" if not args.model_dir else str(model_dir)

    data = data_path(out, args.length, args.samples, args.seed)
    records = make_data(data, model_dir, args.length, args.samples, args.seed)
    todo = cells(args.presses, args.keep, args.kvpress_rules)

    ours = evalkit_tokens(records, model_dir)
    commit = git_commit()
    command = evalkit_command(args) if "evalkit" in args.tools else None
    features = evalkit_features(command) if command else None
    skipped: dict[str, str] = {}
    failed = False
    # Cell by cell, both tools, the table rewritten after each: an interrupted run leaves whole rows.
    for number, cell in enumerate(todo):
        if "kvpress" in args.tools:
            run_kvpress(venv, model_dir, data, out, [cell], args.threads)
        if command:
            reason = missing_feature(cell, features)
            if reason is None:
                reason = run_evalkit(command, cell, data, out, args.length, args.seed, model, args.rerun_evalkit,
                                     args.threads, features["no_baseline"])
                failed |= reason is not None
            if reason:
                skipped[cell.key] = f"evalkit not run: {reason}"
                print(f"evalkit {cell.key}: {skipped[cell.key]}", file=sys.stderr)
        write_outputs(out, data, *table(args, argv, out, data, records, todo[:number + 1], skipped, ours, versions,
                                        model_dir, started, commit))
    rows, meta = table(args, argv, out, data, records, todo, skipped, ours, versions, model_dir, started, commit)
    json_path, md_path = write_outputs(out, data, rows, meta)
    print(format_text(rows))
    print(f"\nprompt tokens identical in both tools: {meta['tokens_identical']}")
    low = [r for r in rows if r["matched"] and r["agree_pct"] is not None and r["agree_pct"] < 100 * TARGET_AGREEMENT]
    if low:
        print("below 90 % agreement: " + ", ".join(f"{r['press']} keep {r['keep']:g} ({r['agree_pct']:.0f} %)"
                                                     for r in low))
    for key, reason in skipped.items():
        print(f"{key}: {reason}")
    print(f"written: {json_path}, {md_path} ({meta['seconds']:.0f} s)")
    return 1 if failed else 0


def table(args, argv, out: Path, data: Path, records: list[dict], todo: list[Cell], skipped: dict[str, str],
          ours: dict, versions: dict, model_dir: Path, started: float, commit: str) -> tuple[list[dict], dict]:
    import torch
    import transformers

    tokens_file = out / "kvpress" / data.stem / "tokens.json"
    identical = "not checked"
    if tokens_file.exists():
        theirs = json.loads(tokens_file.read_text())
        differ = [i for i in ours if theirs.get(i) != ours[i]]
        identical = "yes" if not differ else f"NO ({len(differ)} samples differ, e.g. {differ[0]})"
    rows = collect(out, data, records, table_cells(out, data, records, todo, args.kvpress_rules), skipped)
    meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else " ".join(argv),
            "commit": commit, "commit_at_end": git_commit(), "threads": args.threads, "samples": len(records), "length": args.length, "seed": args.seed,
            "kvpress_rules": args.kvpress_rules, "task": TASK, "data": str(data), "model_dir": str(model_dir), "tokens_identical": identical,
            "versions": {"kvpress": versions.get("kvpress"), "kvpress_transformers": versions.get("transformers"),
                         "kvpress_torch": versions.get("torch"), "evalkit_transformers": transformers.__version__,
                         "evalkit_torch": torch.__version__, "python": platform.python_version()},
            "seconds": round(time.time() - started, 1)}
    return rows, meta


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ParityError as error:
        sys.stderr.write(f"parity_kvpress.py: error: {error}\n")
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
