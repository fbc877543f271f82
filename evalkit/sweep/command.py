"""`evalkit sweep`: the command line over a plan (`evalkit.sweep.plan`), its engines (`evalkit.sweep.engines`)
and what it prints (`evalkit.sweep.tables`): --dry-run prints the cells and what is done, otherwise runs them
and prints the score grid."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from evalkit.errors import EvalkitError


def register(app: typer.Typer) -> None:
    """Adds `evalkit sweep` to the command line."""
    app.command("sweep")(sweep)


def sweep(
    ctx: typer.Context,
    config_file: Optional[Path] = typer.Option(None, "--config", help="YAML, TOML or JSON file of these options "
                                               "(keys as the option names); flags given here override it."),
    policies: str = typer.Option("h2o_head,h2o_token,h2o_page,snapkv", help="Comma-separated policies."),
    budgets: str = typer.Option("0.1,0.2,0.5", help="Comma-separated budgets: fractions in (0, 1] or token counts."),
    tasks: str = typer.Option("ruler:niah_single_2", help="Comma-separated tasks."),
    length: str = typer.Option("2048", help="Prompt + answer tokens per sample; comma-separated for several."),
    samples: Optional[int] = typer.Option(None, help="Samples per cell (default 10); data tasks take --limit."),
    task_arg: list[str] = typer.Option([], help="Task setting KEY=VALUE for every task (repeatable)."),
    data_format: Optional[str] = typer.Option(None, "--format",
                                              help="Data tasks: kvpress, ruler, longbench or auto."),
    metric: Optional[str] = typer.Option(None, help="Data tasks: the metric (default: the format's own)."),
    limit: Optional[int] = typer.Option(None, help="Data tasks: at most this many records (default: all)."),
    offset: Optional[int] = typer.Option(None, help="Data tasks: skip this many records first (default 0)."),
    model: str = typer.Option("smollm2-135m", help="Embedded: smollm2-135m (the default) or gemma3-270m; a local "
                                                    "folder or a Hugging Face model id."),
    layout: str = typer.Option("paged", help="KV storage: paged or dense."),
    block_size: int = typer.Option(16, help="Tokens per page."),
    granularity: Optional[str] = typer.Option(None, help="Override every policy's granularity: head, head_page, "
                                                         "token or page."),
    policy_arg: list[str] = typer.Option([], help="Policy hyper-parameter KEY=VALUE for every policy (repeatable; "
                                                  "not the full-cache baseline)."),
    prefill: str = typer.Option("full", help="full or chunked."),
    chunk_size: int = typer.Option(512, help="Tokens per chunk with --prefill chunked."),
    query_aware: bool = typer.Option(True, "--query-aware/--query-agnostic",
                                     help="Compress with the question in the prompt, or before it is seen."),
    decode_eviction: bool = typer.Option(True, "--decode-eviction/--no-decode-eviction",
                                         help="Keep the cache at budget while decoding, or let it grow."),
    sliding_layers: str = typer.Option("budget", help="Sliding-window layers (Gemma 3): budget (each keeps "
                                                      "min(budget, window)) or window (each keeps its whole window)."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    seed: int = typer.Option(0, help="Seed for samples, random policies and sampling."),
    batch_size: int = typer.Option(1, help="Prompts per generation batch."),
    pool_pages: Optional[int] = typer.Option(None, help="Pages per layer's pool (default: what the batch needs)."),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16, float16."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N."),
    out: str = typer.Option("runs", "--out", help="Results folder (shared with `evalkit run`)."),
    wandb: str = typer.Option("auto", help="auto (online only with credentials), off, offline, online."),
    kernels: str = typer.Option("auto", help="Attention: auto (Triton kernels on CUDA, torch elsewhere), "
                                             "triton, torch."),
    engine: str = typer.Option("local", help="local: cells one after another in this process; ray: one Ray task "
                               "per cell (one GPU each where the cluster has GPUs)."),
    ray_address: Optional[str] = typer.Option(None, help="Ray cluster to join (default: start a local instance)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the cells and what is already done; run nothing."),
    detect: Optional[float] = typer.Option(None, help="With --dry-run: samples each cell needs to detect this many "
                                           "points of difference from its full cache (docs/statistics.md)."),
):
    """Run a grid of policies × budgets × tasks (× lengths) plus each full-cache baseline; resumable."""
    # The plan checks every cell as a RunConfig (torch, transformers): imported when `evalkit sweep` runs, so
    # that the command line starts without them.
    from evalkit.sweep import engines, plan as sweep_plan, tables

    if detect is not None and not dry_run:
        raise EvalkitError("--detect says how many samples a sweep needs: give it with --dry-run")
    if detect is not None and not 0 < detect < 100:
        raise EvalkitError(f"--detect must be in (0, 100) points, got {detect:g}")
    plan = sweep_plan.plan_sweep(sweep_plan.resolve_settings(ctx, config_file))
    stdout, stderr = Console(), Console(stderr=True)
    if dry_run:
        tables.print_plan(plan, stdout, detect)
        return
    engines.run_sweep(plan, stderr)
    tables.print_scores(plan, stdout)
