"""`evalkit bench`: speed and memory of every policy against the full cache and HF `generate`, in one run.

This module is the command line only: its options, checked by `evalkit.bench.checks`, then the grid
measured by `evalkit.bench.grid` (or, with --speed, the main job's speed by `evalkit.bench.speed_command`).
"""

from __future__ import annotations

import typer

DEFAULT_POLICIES = "h2o_head,snapkv"
DEFAULT_LENGTHS = "1k,2k"
FULL_GRID_HINT = ("full grid: --policies h2o_head,h2o_token,h2o_page,snapkv,streaming_llm,tova,knorm,quest "
                  "--budgets 0.1,0.2,0.5 --layouts paged,dense --lengths 1k,2k,4k,8k")


def register(app: typer.Typer) -> None:
    """Adds `evalkit bench` to the command line."""
    app.command("bench", epilog=FULL_GRID_HINT)(bench)


def bench(
    model: str = typer.Option("smollm2-135m", help="Embedded: smollm2-135m (the default) or gemma3-270m; a local "
                                                    "folder or a Hugging Face model id."),
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
                                       "(comma-separated: loop, overhead, statistics, kvzip, sweep, ppl; "
                                       "'all'): <out>/speed.json. Uses --model, --lengths, --repeats, --threads, "
                                       "--samples; docs/benchmarks.md."),
    samples: int = typer.Option(3, help="With --speed sweep: samples of the default task per cell."),
):
    """Time and memory of each policy × budget × length against the full cache and HF generate, same run."""
    # Checking the options imports torch and transformers (policies, the model's config): imported when
    # `evalkit bench` runs, so that the command line starts without them.
    from evalkit.bench import checks, speed_command

    if speed:
        speed_command.run_measurements(speed, model, lengths, repeats, threads, samples, out_dir)
        return
    settings, grid = checks.check_grid(
        model=model, new_tokens=new_tokens, batch=batch, repeats=repeats, block_size=block_size, dtype=dtype,
        device=device, seed=seed, threads=threads, decode_eviction=decode_eviction, policy_arg=policy_arg,
        policies=policies, granularities=granularities, budgets=budgets, lengths=lengths, layouts=layouts,
        out_dir=out_dir)
    _run(settings, grid, components, out_dir, fresh)


def _run(settings, grid, with_components: bool, out_dir: str, fresh: bool) -> None:
    """Measures the checked grid: where the work starts, every check passed."""
    from evalkit.bench.grid import measure  # torch and matplotlib, for the same reason as in `bench`

    measure(settings, grid, with_components, out_dir, fresh)
