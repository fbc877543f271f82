"""`evalkit` command line. Bad input is one line on stderr and exit code 2.

Start-up stays light (typer and rich): a command imports what it runs on (torch, transformers, lm-eval,
matplotlib: seconds) when it runs, so `evalkit --help` and the listings never wait for the others.
"""

from __future__ import annotations

import re
import sys
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from evalkit.bench import command as bench_command
from evalkit.errors import EvalkitError
from evalkit.report import command as report_command
from evalkit.sweep import command as sweep_command

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Judge sparse KV-cache policies: quality lost per budget, memory and time saved.")
out = Console()
err = Console(stderr=True)


def _error(message: str) -> None:
    """One line on stderr: the message as given (a Text: never read as markup or emoji codes, so user text such
    as `hf:a:b:c` or `[client]` is printed as it is), control characters escaped (a newline in a path stays
    `\\n`: the line stays one)."""
    one_line = re.sub(r"[\x00-\x1f\x7f]", lambda m: repr(m.group())[1:-1], str(message))
    err.print(Text.assemble(("error:", "bold red"), " ", one_line), highlight=False, soft_wrap=True)


@app.command()
def run(
    policy: str = typer.Option("h2o_head", help="Policy name (see `evalkit policies`)."),
    budget: str = typer.Option("0.2", help="Fraction of the prompt kept, in (0, 1], or tokens kept per head (integer > 1)."),
    task: str = typer.Option("ruler:niah_single_2", help="Task name (see `evalkit tasks`), or your data: "
                                                          "jsonl:PATH or hf:NAME[:CONFIG]:SPLIT."),
    task_arg: list[str] = typer.Option([], help="Task setting KEY=VALUE (repeatable; see `evalkit tasks`)."),
    length: int = typer.Option(2048, help="Prompt + answer tokens per sample (data tasks: the most one may take)."),
    samples: Optional[int] = typer.Option(None, help="Number of samples (default 10); data tasks take --limit."),
    data_format: Optional[str] = typer.Option(None, "--format",
                                              help="Data tasks: kvpress, ruler, longbench or auto (detected)."),
    metric: Optional[str] = typer.Option(None, help="Data tasks: string_match_all (default), string_match_part, "
                                                    "exact, f1, rouge_l, ... (LongBench data: its own)."),
    limit: Optional[int] = typer.Option(None, help="Data tasks: at most this many records (default: all)."),
    offset: Optional[int] = typer.Option(None, help="Data tasks: skip this many records first (default 0)."),
    model: str = typer.Option("smollm2-135m", help="Embedded: smollm2-135m (the default) or gemma3-270m; a local "
                                                    "folder or a Hugging Face model id."),
    layout: str = typer.Option("paged", help="KV storage: paged (per-head block tables) or dense."),
    block_size: int = typer.Option(16, help="Tokens per page (also the page of --granularity page)."),
    granularity: Optional[str] = typer.Option(None, help="Override the policy's granularity: head, head_page, token "
                                                         "or page."),
    policy_arg: list[str] = typer.Option([], help="Policy hyper-parameter KEY=VALUE (repeatable), e.g. window=64."),
    prefill: str = typer.Option("full", help="full: compress once after the prompt; chunked: after every chunk."),
    chunk_size: int = typer.Option(512, help="Tokens per chunk with --prefill chunked."),
    query_aware: bool = typer.Option(True, "--query-aware/--query-agnostic",
                                     help="Compress with the question in the prompt, or before it is seen."),
    decode_eviction: bool = typer.Option(True, "--decode-eviction/--no-decode-eviction",
                                         help="Keep the cache at budget while decoding, or let it grow."),
    sliding_layers: str = typer.Option("budget", help="Sliding-window layers (Gemma 3): budget (each keeps "
                                                      "min(budget, window)) or window (each keeps its whole window; "
                                                      "the budget evicts in global layers only)."),
    temperature: float = typer.Option(0.0, help="0 = greedy; > 0 samples with --seed."),
    seed: int = typer.Option(0, help="Seed for samples, random policies and sampling."),
    batch_size: int = typer.Option(1, help="Prompts per generation batch."),
    pool_pages: Optional[int] = typer.Option(None, help="Pages per layer's pool (default: what the batch needs)."),
    dtype: str = typer.Option("auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N."),
    out_dir: str = typer.Option("runs", "--out", help="Results folder."),
    wandb: str = typer.Option("auto", help="auto (online only with credentials), off, offline, online."),
    kernels: str = typer.Option("auto", help="Attention: auto (Triton kernels on CUDA, torch elsewhere), "
                                             "triton (forced; on a CPU needs TRITON_INTERPRET=1), torch."),
    baseline: bool = typer.Option(True, "--baseline/--no-baseline",
                                  help="Also run the full cache on the same samples (from the same prefill, "
                                       "stored as the `full` run and reused), unless one is already stored."),
):
    """Evaluate one policy at one budget on one task; results go to runs/<run_id>/."""
    # RunConfig and the runner import torch and transformers: imported when `evalkit run` runs (start-up).
    from evalkit import runner
    from evalkit.config import RunConfig, parse_policy_args, parse_task_args
    from evalkit.integrations import wandb as wandb_mirror
    from evalkit.tasks.custom import is_data_task

    if samples is not None and is_data_task(task):
        raise EvalkitError("--samples is not for data tasks: they run every record in "
                           "[--offset, --offset + --limit); use --limit N")
    config = RunConfig(policy=policy, budget=budget, task=task, task_args=parse_task_args(task_arg), length=length,
                       **({} if samples is None else {"samples": samples}), model=model,
                       layout=layout, block_size=block_size, granularity=granularity,
                       policy_args=parse_policy_args(policy_arg), prefill=prefill,
                       chunk_size=chunk_size, query_aware=query_aware, decode_eviction=decode_eviction,
                       sliding_layers=sliding_layers, temperature=temperature, seed=seed, batch_size=batch_size,
                       pool_pages=pool_pages, dtype=dtype, device=device, out=out_dir, wandb=wandb, kernels=kernels,
                       data_format=data_format, metric=metric, limit=limit, offset=offset)
    result = runner.run_many([config.resolve()], err, mirror=wandb_mirror, baselines=baseline)[0]
    _print_result(result)


def _print_result(result) -> None:
    m, base = result.metrics, result.baseline
    # Perplexity (ppl) is shown as it is, lower is better; other scores are fractions shown in percent.
    perplexity = m.get("metric") == "perplexity"

    def shown(score: float) -> str:
        return f"{score:.2f}" if perplexity else f"{100 * score:.1f}"

    table = Table(title=f"{result.run_id}  ({m['samples']} samples)", title_justify="left")
    for column in ("perplexity" if perplexity else "score", "95% CI", "full cache", "KV held/full", "KV held",
                   "kept/head", "prefill tok/s", "decode tok/s"):
        table.add_column(column, justify="right")
    table.add_row(
        shown(m["score"]),
        # Runs recorded before intervals existed have none; a single non-binary sample has none either.
        f"{shown(m['ci_low'])}–{shown(m['ci_high'])}" if m.get("ci_low") is not None else "-",
        shown(base["score"]) if base else "not run",
        f"{100 * m['held_over_full']:.1f}%",
        f"{m['bytes_held'] / 2**20:.1f} MiB",
        f"{m['kept_tokens']:.0f}/{m['prompt_tokens']:.0f}",
        f"{m['prefill_tokens_per_s']:.0f}",
        f"{m['decode_tokens_per_s']:.1f}",
    )
    _wide().print(table)  # one line a run: never squeezed into a narrow terminal
    if m.get("by_task"):
        tasks = Table(title="per task", title_justify="left")
        tasks.add_column("task")
        tasks.add_column("score", justify="right")
        for name, score in m["by_task"].items():
            tasks.add_row(name, f"{100 * score:.1f}")
        out.print(tasks)
    if m.get("by_position"):
        positions = Table(title="perplexity by position", title_justify="left")
        positions.add_column("positions")
        positions.add_column("perplexity", justify="right")
        for bucket in m["by_position"]:
            positions.add_row(f"{bucket['start']}-{bucket['end']}", f"{bucket['perplexity']:.2f}")
        out.print(positions)
    note = "already complete" if result.resumed_from < 0 else (
        f"resumed after {result.resumed_from} samples" if result.resumed_from else "")
    out.print(f"results: {result.path}" + (f" ({note})" if note else ""))


@app.command()
def heatmap(
    run_dirs: list[str] = typer.Argument(..., help="niah run folders (runs/niah-*), one panel each."),
    out_path: str = typer.Option("niah_heatmaps.png", "--out", "-o", help="PNG to write."),
):
    """Needle-in-a-haystack heatmaps of niah runs side by side, one per policy and budget, on one colour scale."""
    from evalkit.report.heatmap import write_side_by_side  # matplotlib and numpy: imported here (start-up)

    out.print(f"wrote {write_side_by_side(run_dirs, out_path)}")


@app.command()
def policies():
    """List the registered policies: one row per scorer family, with its name at each granularity."""
    from evalkit.policies import POLICIES, policy_args  # torch: imported here (start-up)
    from evalkit.policies.names import policy_family

    families: dict[str, list[str]] = {}
    for name in POLICIES.names():
        families.setdefault(policy_family(name, None)[0], []).append(name)
    wrappers = ("adakv_", "critical_")  # listed after the scorers they wrap
    order = sorted(families, key=lambda family: (family.startswith(wrappers), family))
    table = Table(caption="Exact rules: docs/policies.md. --policy-arg KEY=VALUE sets a hyper-parameter.")
    table.add_column("policies", no_wrap=True)  # names whole, each alias on its own line
    table.add_column("saves", no_wrap=True)
    for column in ("description", "kvpress 0.5.5", "differs from the paper", "policy-args"):
        table.add_column(column, overflow="fold")
    table.add_column("paper", min_width=20)  # an arXiv id on one line
    for family in order:
        names = families[family]
        policy = POLICIES.create(names[0])
        active = policy.evicts or policy.restricts_reads
        labels = [name + "".join(f"\n  = {alias}" for alias in POLICIES.aliases_of(name)) for name in names]
        if len(names) == 1 and active:  # no presets: --granularity picks any it does not refuse
            refused = ", ".join(policy.cannot_run_at)
            labels.append(f"  --granularity: any{' but ' + refused if refused else ''} ({policy.granularity})")
        short = {field: key for key, field in policy.arg_aliases.items()}
        args = ", ".join(f"{short.get(field, field)}={getattr(policy, field)}" for field in policy_args(policy))
        table.add_row("\n".join(labels), policy.saves if active else "-", policy.description,
                      policy.kvpress or "-", differs_from_the_paper(policy), args if active else "-", policy.paper)
    _wide().print(table)


def differs_from_the_paper(policy) -> str:
    """`evalkit policies`' column: what the policy does differently, then why it refuses the granularities it
    refuses (a reason given for several of them, once)."""
    reasons = list(dict.fromkeys(policy.cannot_run_at.values()))
    return "; ".join([policy.differs] * bool(policy.differs) + reasons) or "-"


@app.command("lm-eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)
def lm_eval_command(ctx: typer.Context):
    """lm-evaluation-harness tasks under a sparse KV cache (takes lm-eval's own arguments)."""
    from evalkit.integrations.lm_eval_command import main as lm_eval_main  # lm-eval, torch: here (start-up)

    raise typer.Exit(lm_eval_main(ctx.args))


def _wide() -> Console:
    """Listings are tables of several long columns: at least 160 columns, wider terminals used in full."""
    return Console(width=max(out.width, 160))


@app.command()
def tasks():
    """List the registered tasks."""
    from evalkit.tasks import TASKS  # every task module, registering itself: imported here (start-up)

    table = Table()
    table.add_column("name", no_wrap=True)
    for column in ("metric", "description", "source"):
        table.add_column(column)
    for name in TASKS.names():
        task = TASKS.create(name)
        aliases = TASKS.aliases_of(name)
        table.add_row(name + (f" ({', '.join(aliases)})" if aliases else ""), task.metric, task.description,
                      task.source)
    _wide().print(table)


# Commands that live beside their code (the tools: evalkit.bench, evalkit.sweep, evalkit.report), registered
# after this module's own so that `evalkit --help` lists them in this order.
for _module in (bench_command, sweep_command, report_command):
    _module.register(app)


def main():
    # The CLI owns the terminal: its own progress bars only, not transformers' loading bars. Imported here,
    # not at the top: importing evalkit.cli (the tests do) stays free of transformers.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        code = app(standalone_mode=False)  # a typer.Exit inside a command comes back as its code
        if isinstance(code, int) and code:
            sys.exit(code)
    except EvalkitError as error:
        _error(str(error))
        sys.exit(getattr(error, "exit_code", 2))  # 1 for results that could not be written (errors.WriteFailed)
    except KeyboardInterrupt:
        err.print("interrupted: finished samples are saved; run the same command again to resume")
        sys.exit(130)
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except typer.Abort:
        sys.exit(130)
    except typer.TyperException as error:  # usage errors: bad option values, unknown options
        message = error.format_message() if hasattr(error, "format_message") else str(error)
        if message:
            _error(message)
        sys.exit(getattr(error, "exit_code", 2))
