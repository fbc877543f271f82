"""One prefill, many cells: a prefill shared by several (policy, budget) runs gives each exactly what
its own run gives (docs/sweeps.md, "Sweeps share the prefill").

Checked at three levels: the statistics pass (a statistic does not depend on which others are asked
for with it, and matches a naive float64 attention), the generation loop (`generate(shared=)` ≡
`generate()`: tokens, kept tokens and bytes, both layouts, a left-padded batch), and the results
store (`run_many` ≡ one `run` per cell: every predictions.jsonl line but its timings, for 6 policies
× 3 budgets × both query modes); plus the sweep's --dry-run and `evalkit run`'s baseline.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from conftest import needs_model_files
from evalkit.attention import evalkit_attention
from evalkit.attention_ops import attention_statistics, prompt_attention, window_queries
from evalkit.loop import GenerationSettings, Request, generate, start
from evalkit.loop.state import forward
from evalkit.policies import make_policy
from evalkit.loop.shared_prefill import prefill_statistics, share_prefill

POLICIES = ["h2o_head", "snapkv_head", "tova_token", "knorm_head_page", "streaming_llm", "h2o_page",
            "pyramidkv_head", "adakv_snapkv", "quest", "random",
            "expected_attention_head", "adakv_expected_attention", "critical_snapkv_head", "keydiff_page", "lagkv_token",
            "kvzip_head", "kvzip_page"]
BUDGETS = [0.25, 0.5, 1.0]


def runnable_on(arch: str) -> list[str]:
    """POLICIES but, on Gemma 3 (RoPE per layer type, refused by `RunConfig`), those that apply the model's RoPE."""
    return [name for name in POLICIES if arch != "gemma3" or "expected_attention" not in name]
TIMINGS = ("prefill_seconds", "decode_seconds", "reconstruction_seconds")


def naive_statistic(q, k, q_pos, q_valid, counted, scaling):
    """Each key's probability summed over the counted queries, mean over the group; float64 loops."""
    B, H_q, T, D = q.shape
    H_kv = k.shape[1]
    G = H_q // H_kv
    stats = torch.zeros(B, H_kv, T, dtype=torch.float64)
    for b in range(B):
        for hq in range(H_q):
            for i in range(T):
                if not counted[b, i]:
                    continue
                seen = [j for j in range(T) if q_valid[b, j] and q_pos[b, j] <= q_pos[b, i]]
                scores = torch.stack([(q[b, hq, i].double() @ k[b, hq // G, j].double()) * scaling for j in seen])
                stats[b, hq // G, seen] += torch.softmax(scores, 0) / G
    return stats


@pytest.mark.parametrize("padded", [False, True], ids=["causal (CPU: flash log-sum-exp)", "left-padded (softmax)"])
def test_a_statistic_is_the_same_whichever_others_are_asked_for_and_matches_naive_attention(padded, monkeypatch):
    import evalkit.attention_ops

    monkeypatch.setattr(evalkit.attention_ops, "_STATISTICS_ELEMENTS", 2000)  # several query blocks
    monkeypatch.setattr(evalkit.attention_ops, "_STATISTICS_TILE", (8, 12))  # several tiles, edges off the diagonal
    gen = torch.Generator().manual_seed(3)
    B, H_kv, G, T, D = 2, 2, 3, 40, 8
    q = torch.randn(B, T, H_kv * G, D, generator=gen).transpose(1, 2)  # as transformers passes it
    k, v = torch.randn(B, H_kv, T, D, generator=gen), torch.randn(B, H_kv, T, D, generator=gen)
    valid = torch.ones(B, T, dtype=torch.bool)
    if padded:
        valid[1, :7] = False  # row 1 left-padded, as the loop batches prompts of different lengths
    pos = (valid.cumsum(1) - 1).masked_fill(~valid, 0) + torch.tensor([[0], [3]])
    masks = {"attention": valid, "window 4": window_queries(pos, valid, 4), "window 16": window_queries(pos, valid, 16)}
    together = dict(zip(masks, prompt_attention(q, pos, valid, k, v, 0.5, None, list(masks.values()))[1]))
    for name, mask in masks.items():
        (alone,) = prompt_attention(q, pos, valid, k, v, 0.5, None, [mask])[1]
        assert torch.equal(alone, together[name]), name
        torch.testing.assert_close(alone.double(), naive_statistic(q, k, pos, valid, mask, 0.5), rtol=1e-5, atol=1e-6)
    # The causal half (keys_in_order) skips only keys no query of the block may read.
    k_pos = pos.masked_fill(~valid, -1)[:, None, :].expand(B, H_kv, T)
    (every_key,) = attention_statistics(q, pos, k, k_pos, 0.5, None, [valid])
    torch.testing.assert_close(every_key, together["attention"], rtol=1e-5, atol=1e-6)


def requests(gen) -> list[Request]:
    return [Request(torch.randint(0, 128, (n,), generator=gen).tolist(),
                    torch.randint(0, 128, (6,), generator=gen).tolist(), 6) for n in (70, 52)]


@pytest.mark.slow  # every policy through a shared prefill and its own, on two tiny models
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: a sliding layer's window drop on the shared prompt
@pytest.mark.parametrize("query_aware", [True, False], ids=["query-aware", "query-agnostic"])
def test_a_shared_prefill_generates_what_each_cells_own_prefill_generates(query_aware, arch):
    from conftest import tiny_model

    model = tiny_model(arch)
    batch = requests(torch.Generator().manual_seed(0))
    policies = [make_policy(name) for name in runnable_on(arch)]
    shared = share_prefill(model, batch, query_aware,
                           set().union(*map(prefill_statistics, policies)))
    assert {("attention", 0), ("window", 1), ("window", 32)} <= set(shared.record.statistics)
    compared = 0
    for policy in policies:
        for budget in BUDGETS:
            for layout in ("paged", "dense"):
                settings = GenerationSettings(policy=policy, budget=budget, layout=layout, page_size=4,
                                              query_aware=query_aware)
                own = generate(model, None, batch, settings)
                forked = generate(model, None, batch, settings, shared=shared)
                for a, b in zip(own, forked):
                    assert (a.token_ids, a.kept_tokens, a.bytes_held, a.bytes_ideal) == \
                        (b.token_ids, b.kept_tokens, b.bytes_held, b.bytes_ideal), (policy.name, budget, layout)
                    compared += 1
    assert compared == len(policies) * len(BUDGETS) * 2 * len(batch)


def test_question_unseen_forks_compute_criticalkvs_value_norms_of_the_prompt_once(monkeypatch):
    """CriticalKV's cells of a question-unseen sweep store the whole shared prompt, each the same way per layout:
    the first fork's layers compute its value norms, the later ones take a copy (`KeptPerSlot.share_kept`), and
    every fork generates what its own prefill generates."""
    from conftest import tiny_model
    import evalkit.policies.critical as critical

    model = tiny_model("llama")
    batch = requests(torch.Generator().manual_seed(0))
    policy = make_policy("critical_keydiff_head")
    shared = share_prefill(model, batch, False, prefill_statistics(policy))
    rows = []
    norms = critical.projected_value_norms
    monkeypatch.setattr(critical, "projected_value_norms", lambda values, o_proj: rows.append(values.shape[2]) or
                        norms(values, o_proj))
    for layout in ("paged", "dense"):
        for budget in (0.25, 0.5):
            settings = GenerationSettings(policy=policy, budget=budget, layout=layout, page_size=4, query_aware=False)
            own = generate(model, None, batch, settings)
            rows.clear()
            forked = generate(model, None, batch, settings, shared=shared)
            prompt_rows = [n for n in rows if n >= 52]
            assert len(prompt_rows) == (model.config.num_hidden_layers if budget == 0.25 else 0), (layout, budget)
            assert [(g.token_ids, g.kept_tokens, g.bytes_held) for g in own] == \
                [(g.token_ids, g.kept_tokens, g.bytes_held) for g in forked], (layout, budget)


def held_tokens(cache) -> list:
    """Per layer and (sequence, KV head): positions, statistics, K and V of the live slots in fill order."""
    held = []
    for layer in cache.layers:
        view = layer.read()
        for b in range(view.pos.shape[0]):
            for h in range(view.pos.shape[1]):
                live = view.pos[b, h] >= 0
                held.append((view.pos[b, h][live], view.stats[b, h][live], view.k[b, h][live], view.v[b, h][live]))
    return held, [layer.packed for layer in cache.layers]


@pytest.mark.fast_tier_keeps_one_in(2)
@pytest.mark.parametrize("layout, page_size, arch", [("paged", 4, "llama"), ("paged", 16, "llama"),
                                                     ("dense", 16, "llama"), ("paged", 4, "gemma3")])
def test_a_cell_forked_compressed_holds_what_its_own_compression_leaves(layout, page_size, arch):
    """Query-aware cells never store what compression drops (`SharedPrefill.fork_compressed`): after the
    prefill their cache holds exactly the tokens, in the same order, with the same K, V and statistics,
    as the cell's own prefill and compression (on a sliding layer: its window drop too); the same bytes; and the
    next forward's logits bit for bit."""
    from conftest import tiny_model

    model = tiny_model(arch, seed=3)
    batch = requests(torch.Generator().manual_seed(1))
    policies = [make_policy(name) for name in runnable_on(arch) + ["h2o_head_page", "knorm_head"]]
    shared = share_prefill(model, batch, True, set().union(*map(prefill_statistics, policies)))
    with evalkit_attention(model):
        for policy in policies:
            for budget in (0.2, 0.5, 1.0):
                settings = GenerationSettings(policy=policy, budget=budget, layout=layout, page_size=page_size)
                own, forked = (start(model, None, batch, settings, shared=s) for s in (None, shared))
                assert forked.state.cache.storage_bytes() <= own.state.cache.storage_bytes()
                (own_held, own_packed), (forked_held, forked_packed) = map(held_tokens, (own.state.cache,
                                                                                          forked.state.cache))
                where = (policy.name, budget)
                assert all(all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(own_held, forked_held)), where
                assert all(torch.equal(a, b) for a, b in zip(own_packed, forked_packed)), where
                assert torch.equal(own.state.cache.bytes_held(), forked.state.cache.bytes_held()), where
                assert torch.equal(own.logits, forked.logits), where
                rows = [[int(t)] for t in own.logits.argmax(-1)]
                assert torch.equal(forward(own.state, rows)[0], forward(forked.state, rows)[0]), where


def test_a_shared_prefill_refuses_other_prompts_and_chunked_runs():
    from conftest import tiny_model

    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(1)
    batch, other = requests(gen), requests(gen)
    shared = share_prefill(model, batch, True, {("attention", 0)})
    h2o = make_policy("h2o_head")
    with pytest.raises(ValueError, match="same prompts"):
        generate(model, None, other, GenerationSettings(policy=h2o, budget=0.5), shared=shared)
    with pytest.raises(ValueError, match="full-prefill"):
        generate(model, None, batch, GenerationSettings(policy=h2o, budget=0.5, prefill="chunked"), shared=shared)
    with pytest.raises(ValueError, match="recorded"):  # SnapKV's window was not recorded
        generate(model, None, batch, GenerationSettings(policy=make_policy("snapkv_head"), budget=0.5), shared=shared)


@pytest.fixture(scope="module")
@needs_model_files  # save_tiny_model: the default model's tokenizer
def tiny_model_dir(tmp_path_factory):
    from conftest import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def configs(model: Path, out: Path, query_aware: bool):
    from evalkit.config import RunConfig

    return [RunConfig(policy=policy, budget=budget, task="ruler:niah_single_2", length=320, samples=3,
                      model=str(model), out=str(out), wandb="off", query_aware=query_aware, block_size=4,
                      batch_size=2)
            for policy in POLICIES[:6] for budget in BUDGETS]


def lines(run_path: str) -> list[dict]:
    records = [json.loads(line) for line in (Path(run_path) / "predictions.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records]


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
@pytest.mark.parametrize("query_aware", [True, False], ids=["query-aware", "query-agnostic"])
def test_run_many_writes_what_one_run_per_cell_writes(tiny_model_dir, tmp_path, query_aware):
    from evalkit.loop import shared_prefill
    from evalkit.runner import run, run_many

    prefills = []
    original = shared_prefill.share_prefill

    def counting(*args, **kwargs):
        prefills.append(1)
        return original(*args, **kwargs)

    import evalkit.evaluations as evaluations
    evaluations.share_prefill = counting
    try:
        together = run_many(configs(tiny_model_dir, tmp_path / "shared", query_aware))
    finally:
        evaluations.share_prefill = original
    assert len(prefills) == 2  # 3 samples in batches of 2: two prefills for all 18 cells
    alone = [run(config) for config in configs(tiny_model_dir, tmp_path / "alone", query_aware)]
    assert len(together) == len(alone) == 18
    for a, b in zip(alone, together):
        assert a.run_id == b.run_id
        assert lines(a.path) == lines(b.path), a.run_id
        assert a.metrics["score"] == b.metrics["score"] and a.metrics["kept_tokens"] == b.metrics["kept_tokens"]


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_kvzip_cells_of_a_sweep_share_one_reconstruction_and_write_what_their_own_runs_write(tiny_model_dir, tmp_path,
                                                                                             monkeypatch):
    """Every KVzip cell of a sample (each budget and granularity) reads the scores of one reconstruction, run in
    the shared prefill with the tokenizer's reconstruction prompts; each cell's lines equal its own run's."""
    from evalkit.config import RunConfig
    from evalkit.loop import shared_prefill
    from evalkit.runner import run, run_many

    reconstructions = []
    original = shared_prefill.reconstruct
    monkeypatch.setattr(shared_prefill, "reconstruct", lambda *args: reconstructions.append(1) or original(*args))

    def cells(out):
        return [RunConfig(policy=policy, budget=budget, task="ruler:niah_single_2", length=320, samples=3,
                          model=str(tiny_model_dir), out=str(out), wandb="off", query_aware=False, block_size=4,
                          batch_size=2)
                for policy in ("kvzip_head", "kvzip_page", "kvzip_head_page") for budget in (0.3, 0.6)]

    together = run_many(cells(tmp_path / "shared"))
    assert len(reconstructions) == 2  # 3 samples in batches of 2: one reconstruction a batch for all 6 cells
    alone = [run(config) for config in cells(tmp_path / "alone")]
    for a, b in zip(alone, together):
        assert lines(a.path) == lines(b.path), a.run_id
        assert b.metrics["reconstruction_seconds"] > 0


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_run_many_resumes_each_cell_where_it_stopped(tiny_model_dir, tmp_path, monkeypatch):
    import evalkit.evaluations as evaluations
    from evalkit.runner import run_many

    cells = configs(tiny_model_dir, tmp_path, True)[:3]
    first = run_many(cells)
    reference = [lines(r.path) for r in first]
    # One cell interrupted after a sample, one not started, one complete.
    path = Path(first[0].path)
    kept = (path / "predictions.jsonl").read_text().splitlines(keepends=True)[0]
    (path / "predictions.jsonl").write_text(kept)
    (path / "metrics.json").unlink()
    import shutil
    shutil.rmtree(first[1].path)
    shared_by = []
    original = evaluations.share_prefill
    monkeypatch.setattr(evaluations, "share_prefill",
                        lambda model, requests, *args: shared_by.append(len(requests)) or original(model, requests,
                                                                                                  *args))
    again = run_many(configs(tiny_model_dir, tmp_path, True)[:3])
    assert [r.resumed_from for r in again] == [1, 0, -1]
    assert [lines(r.path) for r in again] == reference
    # The first sample is the new cell's alone; the two others, which both cells lack, share one prefill.
    assert shared_by == [2]


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_sweep_dry_run_says_which_cells_share_a_prefill(tiny_model_dir, tmp_path):
    from evalkit.cli import app

    args = ["sweep", "--policies", "h2o_head,snapkv_head", "--budgets", "0.5", "--tasks", "ruler:niah_single_2",
            "--length", "320", "--samples", "2", "--model", str(tiny_model_dir), "--out", str(tmp_path),
            "--dry-run"]
    shared = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
    assert shared.exit_code == 0, shared.output
    assert shared.output.count("shared by 3 cells") == 3  # the two cells and their baseline
    chunked = CliRunner().invoke(app, args + ["--prefill", "chunked"], env={"COLUMNS": "250"})
    assert chunked.exit_code == 0, chunked.output
    assert chunked.output.count("own (chunked prefill)") == 3 and "shared by" not in chunked.output
    ppl = CliRunner().invoke(app, args[:6] + ["ppl", "--chunk-size", "1"] + args[7:], env={"COLUMNS": "250"})
    assert ppl.exit_code == 0, ppl.output
    assert ppl.output.count("streamed with 3 cells") == 3  # perplexity: the same passages, streamed together
    assert not list(tmp_path.iterdir())


@pytest.mark.model  # tiny_model_dir: the default model's tokenizer
def test_evalkit_run_shows_the_full_cache_beside_the_policy_from_the_same_prefill(tiny_model_dir, tmp_path):
    from evalkit.cli import app

    args = ["run", "--policy", "h2o_head", "--budget", "0.5", "--task", "ruler:niah_single_2", "--length", "320",
            "--samples", "2", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--wandb", "off"]
    first = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
    assert first.exit_code == 0, first.output
    folders = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert len(folders) == 2 and any("-full-1.0-" in name for name in folders)
    full = next(tmp_path.glob("*-full-1.0-*"))
    full_score = json.loads((full / "metrics.json").read_text())["score"]
    header = next(line for line in first.output.splitlines() if line.startswith("┃")).split("┃")
    row = next(line for line in first.output.splitlines() if line.startswith("│")).split("│")
    column = [cell.strip() for cell in header].index("full cache")
    assert "not run" not in first.output and row[column].strip() == f"{100 * full_score:.1f}"
    # Later runs on the same samples reuse the stored baseline; --no-baseline runs none.
    stamp = (full / "metrics.json").stat().st_mtime_ns
    second = CliRunner().invoke(app, [*args[:4], "0.25", *args[5:]], env={"COLUMNS": "250"})
    assert second.exit_code == 0 and (full / "metrics.json").stat().st_mtime_ns == stamp
    alone = tmp_path / "alone"
    third = CliRunner().invoke(app, [*args[:-4], "--out", str(alone), "--wandb", "off", "--no-baseline"],
                               env={"COLUMNS": "250"})
    assert third.exit_code == 0 and "not run" in third.output
    assert len([p for p in alone.iterdir() if p.is_dir()]) == 1
