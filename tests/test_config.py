"""RunConfig's field groups, run ids that name the granularity run, the baseline rule, the one mapping to the
loop's settings, and the budget vocabulary (`evalkit.policies.budget`)."""

import json
import shutil
from dataclasses import fields

import pytest
import torch

from evalkit.config import RunConfig, baseline_for, fields_where
from evalkit.errors import EvalkitError
from evalkit.loop import GenerationSettings
from evalkit.policies import make_policy
from evalkit.policies.names import policy_label
from evalkit.policies.budget import at_least_one_page, check_budget, fraction_of, tokens_for, tokens_of
from evalkit.report.page import Entry, _place
from evalkit.runner import prefill_key


# Another value of each field, to see what changing it changes (the groups declared on the fields say what).
OTHER_VALUE = {
    "policy": "snapkv_head", "budget": 0.5, "task": "ruler:vt", "task_args": {"x": "1"}, "length": 4096,
    "samples": 20, "model": "gemma3-270m", "layout": "dense", "block_size": 8, "granularity": "head_page",
    "policy_args": {"sink_tokens": "4"}, "prefill": "chunked", "chunk_size": 256, "query_aware": False,
    "decode_eviction": False, "sliding_layers": "window", "temperature": 0.7, "seed": 1, "batch_size": 4,
    "pool_pages": 1000, "dtype": "float32", "device": "cpu", "out": "elsewhere", "wandb": "off", "kernels": "torch",
    "data_format": "kvpress", "metric": "f1", "limit": 5, "offset": 2, "data_sha256": "ab" * 32,
    "question_split": True,
}


@pytest.mark.parametrize("name", [f.name for f in fields(RunConfig)])
def test_each_fields_groups_say_what_changing_it_changes(name):
    """A field in the run id changes the id; a baseline field parts a run from a full-cache run that differs in
    it; a field after the prefill leaves the shared prefill's key as it is; and in the report a setting field
    parts the runs' settings, a variant field their series within one setting, an ignored one neither."""
    run = RunConfig(policy="h2o_head")
    changed = RunConfig(**{**run.to_dict(), name: OTHER_VALUE[name]})
    if name in fields_where(data=True):  # a data file's options: nothing to a registered task, its id unchanged
        assert changed.run_id() == run.run_id()
        run = RunConfig(policy="h2o_head", task="jsonl:records.jsonl")
        changed = RunConfig(**{**run.to_dict(), name: OTHER_VALUE[name]})
    assert (changed.run_id() != run.run_id()) == (name in fields_where(in_id=True)), name
    full = {**changed.to_dict(), "policy": "full", "budget": 1.0}
    assert (baseline_for(run.to_dict(), [(full, {"score": 1})]) is None) == (name in fields_where(baseline=True))
    if name not in ("prefill", "task"):  # chunked prefill, perplexity: no shared prefill at all
        assert (prefill_key(changed) == prefill_key(run)) == (name in fields_where(after_prefill=True)), name
    if name in ("policy", "budget"):  # the report's curve: along a series' line
        return
    entries = [entry("a", **run.to_dict()), entry("b", **changed.to_dict())]
    _place(entries)
    role = next(f.metadata["report"] for f in fields(RunConfig) if f.name == name)
    assert (entries[0].setting != entries[1].setting) == (role == "setting"), name
    assert (entries[0].series != entries[1].series) == (role == "variant"), name


@pytest.mark.model  # RunConfig.validate on the default model reads its window (config.json)
def test_the_default_run_keeps_its_id():
    assert RunConfig().validate().run_id() == "niah_single_2-h2o_head-0.2-b9c3cc36"  # README's example


@pytest.mark.model  # RunConfig.validate on the default model reads its window (config.json)
def test_sliding_layers_enter_the_run_id_only_when_not_the_default():
    """`--sliding-layers window` is a run of its own; `budget` (the default) keeps every earlier id, and a window
    run's full-cache baseline is the default's (a full cache keeps a sliding layer's window either way)."""
    default = RunConfig().validate()
    window = RunConfig(sliding_layers="window").validate()
    assert RunConfig(sliding_layers="budget").validate().run_id() == default.run_id()
    assert window.run_id() != default.run_id()
    assert window.full_cache().run_id() == default.full_cache().run_id()
    with pytest.raises(EvalkitError, match="unknown sliding layers 'all'; choose from budget, window"):
        RunConfig(sliding_layers="all").validate()


def test_policies_that_apply_the_model_s_rope_are_refused_on_gemma3(monkeypatch):
    """Gemma 3 rotates its sliding and global layers with RoPEs of their own: Expected Attention (and its wrappers)
    and DuoAttention, which apply one RoPE themselves, are refused in one line before any work."""
    from conftest import tiny_config
    import evalkit.config

    monkeypatch.setattr(evalkit.config, "model_config", lambda name: tiny_config("gemma3"))
    for policy in ("expected_attention", "adakv_expected_attention", "critical_expected_attention", "duo_attention"):
        with pytest.raises(EvalkitError, match="has one per layer type"):
            RunConfig(policy=policy)._check_rope(make_policy(policy))
    RunConfig(policy="kvzip")._check_rope(make_policy("kvzip"))


@pytest.mark.model  # RunConfig.validate on the default model reads its window (config.json)
def test_run_ids_name_the_granularity_run(tmp_path):
    assert "-random@head_page-0.2-" in RunConfig(policy="random", granularity="head_page", out=str(tmp_path)) \
        .validate().run_id()
    assert "-h2o_head-" in RunConfig(policy="h2o", granularity="head").validate().run_id()  # the preset's own
    assert policy_label("h2o_token", "head") == "h2o_head"  # a folder written before contradictions were refused
    assert policy_label("random", None) == "random"
    assert policy_label("h2o_block1", "token") == "h2o_token"


@pytest.mark.parametrize("policy, granularity, hint", [
    ("h2o_token", "head", "use --policy h2o_head"),
    ("h2o", "page", "use --policy h2o_page"),
    ("snapkv_head_page", "token", "use --policy snapkv_token"),
])
def test_a_granularity_that_contradicts_a_preset_is_refused(policy, granularity, hint):
    with pytest.raises(EvalkitError, match=hint):
        RunConfig(policy=policy, granularity=granularity).validate()


@pytest.mark.model  # RunConfig.validate on the default model reads its window (config.json)
def test_a_folder_named_before_the_granularity_label_keeps_its_name(tmp_path):
    config = RunConfig(policy="random", granularity="head_page", out=str(tmp_path)).validate()
    current = config.run_id()
    earlier = current.replace("random@head_page", "random")
    (tmp_path / earlier).mkdir()
    assert config.run_id() == earlier
    (tmp_path / current).mkdir()  # both exist: the current name wins
    assert config.run_id() == current


@pytest.mark.model  # save_tiny_model in its body
def test_an_earlier_folder_resumes_where_it_stopped(tmp_path):
    from conftest import save_tiny_model
    from evalkit.runner import run

    model = save_tiny_model(tmp_path / "tiny")
    config = RunConfig(policy="random", granularity="head_page", budget=0.5, length=256, samples=2,
                       model=str(model), out=str(tmp_path / "runs"), wandb="off")
    first = run(config)
    current = first.run_id
    assert "random@head_page" in current
    # As an earlier evalkit left it: named after the policy alone, one sample done, not finished.
    earlier = tmp_path / "runs" / current.replace("random@head_page", "random")
    shutil.move(tmp_path / "runs" / current, earlier)
    lines = (earlier / "predictions.jsonl").read_text().splitlines(keepends=True)
    (earlier / "predictions.jsonl").write_text(lines[0])
    (earlier / "metrics.json").unlink()
    again = run(RunConfig(**{**config.to_dict(), "granularity": "head_page"}))
    assert again.path == str(earlier) and again.resumed_from == 1
    assert [json.loads(line)["id"] for line in (earlier / "predictions.jsonl").read_text().splitlines()] == \
        [json.loads(line)["id"] for line in lines]
    assert not (tmp_path / "runs" / current).exists()


def entry(run_id: str, metrics: dict | None = None, **config) -> Entry:
    base = {"task": "t", "length": 100, "samples": 2, "model": "m", "seed": 0, "temperature": 0.0, "dtype": "auto",
            "budget": 0.5, "layout": "paged", "query_aware": True, "granularity": None}
    return Entry(run_id, None, {**base, **config}, {"score": 50.0, **(metrics or {})})


def test_the_report_labels_the_granularity_each_folder_ran():
    entries = [entry("a", policy="h2o_token", granularity="head"),  # written before contradictions were refused
               entry("b", policy="h2o_head"), entry("c", policy="random", granularity="head_page"),
               entry("d", policy="random"), entry("f", {"score": 90.0}, policy="full", budget=1.0)]
    _place(entries)
    assert [e.series for e in entries] == ["h2o_head", "h2o_head", "random@head_page", "random", "full"]
    assert all(e.baseline == {"score": 90.0} for e in entries)


def test_the_baseline_is_the_full_run_on_the_same_samples_that_ran_most_alike():
    run = {"policy": "h2o_head", "task": "t", "length": 100, "layout": "dense", "query_aware": False}
    paged = ({**run, "policy": "full", "layout": "paged"}, {"score": 1})
    dense = ({**run, "policy": "full"}, {"score": 2})
    other_length = ({**run, "policy": "full", "length": 200}, {"score": 3})
    assert baseline_for(run, [paged, dense, other_length]) == {"score": 2}
    assert baseline_for(run, [paged, other_length]) == {"score": 1}
    assert baseline_for(run, [other_length]) is None
    ppl = {**run, "task": "ppl", "chunk_size": 256}
    assert baseline_for(ppl, [({**ppl, "policy": "full", "chunk_size": 512}, {"score": 4})]) is None


@pytest.mark.model  # RunConfig.validate on the default model reads its window (config.json)
def test_generation_settings_come_from_the_config_by_name():
    config = RunConfig(policy="snapkv", budget=64, layout="dense", block_size=8, prefill="chunked", chunk_size=128,
                       query_aware=False, decode_eviction=False, temperature=0.5, seed=3, pool_pages=99,
                       kernels="torch", policy_args={"window": "8"})
    settings = config.resolve().generation_settings()
    assert settings == GenerationSettings(make_policy("snapkv", None, {"window": "8"}), 64, "dense", 8, "chunked",
                                          128, False, False, 0.5, 3, 99, "torch")


def test_budgets_convert_in_one_place():
    lengths = torch.tensor([100, 7, 1000])
    assert tokens_for(0.07, lengths).tolist() == [7, 1, 70]
    assert tokens_for(64, lengths).tolist() == [64, 7, 64]
    assert tokens_of(1.0, 5) == 5
    assert fraction_of(0.3, None) == 0.3 and fraction_of(50, 200.0) == 0.25 and fraction_of(500, 200.0) == 1.0
    caps = torch.tensor([[3, 40], [20, 2]])  # [L, B]
    assert at_least_one_page(caps, torch.tensor([100, 10]), 16).tolist() == [[16, 40], [20, 10]]
    check_budget(16, 100, 16, "page")
    with pytest.raises(EvalkitError, match="less than one page"):
        check_budget(15, 100, 16, "head_page")
    check_budget(15, 100, 16, None)
    with pytest.raises(EvalkitError, match="less than one token"):
        check_budget(0.001, 100, 16, None)
