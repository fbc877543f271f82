"""`ppl`: passages, per-bucket loss, the Austen text, and the runner's streaming perplexity.

Budget 1 must equal the full model's loss over the whole passage in one forward
pass, in chunks and token by token (`--chunk-size 1`); StreamingLLM at a lower
budget, the same pass masked to the tokens it keeps.
"""

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY, needs_model_files, tiny_model
from evalkit.assets import AUSTEN_NOVELS, austen_dir, cache_root, default_model_dir
from evalkit.cli import main
from evalkit.config import RunConfig
from evalkit.errors import EvalkitError
from evalkit.loop import GenerationSettings, score_rolling, score_rolling_branches
from evalkit.loop import teacher_forcing
from evalkit.loop.static_decode import StaticStep
from evalkit.policies import make_policy
from evalkit.runner import run
from evalkit.tasks import TASKS
from evalkit.tasks import ppl as ppl_module
from evalkit.tasks.ppl import CHARS_PER_TOKEN, Perplexity, load_text, perplexity_metrics

LENGTH, CHUNK, BUCKET = 300, 64, 64


# --- passages --------------------------------------------------------------------------------

def test_passages_are_deterministic_spread_over_the_text_and_start_at_paragraphs():
    task = Perplexity(text="essays")
    samples = task.samples(None, LENGTH, 4, seed=3)
    assert samples == task.samples(None, LENGTH, 4, seed=3)
    assert samples != task.samples(None, LENGTH, 4, seed=4)
    description, ((name, text),) = load_text("essays")
    offsets = [s.meta["offset"] for s in samples]
    assert offsets == sorted(offsets) and len(set(offsets)) == 4  # one from each quarter, in order
    assert offsets[-1] > len(text) / 2
    for sample in samples:
        offset = sample.meta["offset"]
        assert offset == 0 or text[offset - 2:offset] == "\n\n"
        assert sample.context == text[offset:offset + LENGTH * CHARS_PER_TOKEN]
        assert sample.meta == {"text": description, "document": name, "offset": offset}
        assert sample.max_new_tokens == 0 and sample.references == []
    assert [s.id for s in samples] == ["ppl-0000", "ppl-0001", "ppl-0002", "ppl-0003"]


def test_settings_are_checked():
    task = TASKS.create("ppl")
    assert (task.text, task.bucket) == ("auto", 512)
    tuned = task.with_args({"text": "essays", "bucket": "128"})
    assert (tuned.text, tuned.bucket) == ("essays", 128)
    for args, message in [({"txt": "essays"}, "unknown ppl task-arg txt; known: bucket, text"),
                          ({"text": "poems"}, "unknown ppl text 'poems'"),
                          ({"bucket": "0"}, "ppl bucket must be a whole number"),
                          ({"bucket": "1.5"}, "ppl bucket must be a whole number")]:
        with pytest.raises(EvalkitError, match=message):
            task.with_args(args)
    with pytest.raises(TypeError):  # nothing is generated: scoring a prediction is a mistake, said loudly
        task.score("text", [])


def test_auto_falls_back_to_the_essays_when_austen_cannot_be_fetched(monkeypatch):
    def unavailable():
        raise EvalkitError("cannot fetch r-cran-janeaustenr: apt-get is not available")

    monkeypatch.setattr(ppl_module, "austen_dir", unavailable)
    load_text.cache_clear()
    try:
        assert load_text("auto")[0].startswith("Paul Graham essays")
        with pytest.raises(EvalkitError, match="apt-get is not available"):
            load_text("austen")
    finally:
        load_text.cache_clear()


def test_austen_novels_come_from_the_debian_package_as_paragraphs():
    if shutil.which("apt-get") is None and not (cache_root() / "texts" / "janeaustenr").exists():
        pytest.skip("no apt-get on this machine to fetch r-cran-janeaustenr (ppl then uses the essays)")
    folder = austen_dir()
    assert (folder / "VERSION").read_text().startswith("r-cran-janeaustenr ")
    texts = {name: (folder / f"{name}.txt").read_text(encoding="utf-8") for name in AUSTEN_NOVELS}
    assert "It is a truth universally acknowledged, that a single man in possession of a good fortune, " \
           "must be in want of a wife." in texts["prideprejudice"]
    assert "Emma Woodhouse, handsome, clever, and rich" in texts["emma"]
    assert 3_500_000 < sum(map(len, texts.values())) < 4_500_000  # the six novels, about 4 MB
    for text in texts.values():
        assert "\n" not in text.replace("\n\n", "").rstrip("\n")  # hard wraps joined; paragraphs kept
    description, documents = load_text("austen")
    assert [name for name, _ in documents] == list(AUSTEN_NOVELS) and "r-cran-janeaustenr" in description


# --- loss per position -------------------------------------------------------------------------

def test_loss_summary_sums_each_bucket_of_positions():
    logprobs = [-1.0, -2.0, -3.0, -0.5, -0.5, -1.5, -2.5]  # positions 5..11
    summary = Perplexity(bucket=4).loss_summary(logprobs, first_position=5)
    assert summary["scored_tokens"] == 7 and summary["nll"] == pytest.approx(11.0)
    assert summary["perplexity"] == pytest.approx(math.exp(11.0 / 7))
    assert summary["buckets"] == [{"start": 5, "end": 8, "tokens": 3, "nll": pytest.approx(6.0)},
                                  {"start": 8, "end": 12, "tokens": 4, "nll": pytest.approx(5.0)}]


def test_run_perplexity_weights_every_token_alike():
    meta = {"meta": {"text": "T"}}
    records = [dict(meta, scored_tokens=3, nll=6.0, buckets=[{"start": 4, "end": 7, "tokens": 3, "nll": 6.0}]),
               dict(meta, scored_tokens=1, nll=0.5, buckets=[{"start": 4, "end": 7, "tokens": 1, "nll": 0.5}])]
    metrics = perplexity_metrics(records)
    assert metrics["perplexity"] == metrics["score"] == pytest.approx(math.exp(6.5 / 4))
    assert metrics["by_position"] == [{"start": 4, "end": 7, "tokens": 4,
                                       "perplexity": pytest.approx(math.exp(6.5 / 4))}]
    assert metrics["higher_is_better"] is False and metrics["metric"] == "perplexity" and metrics["text"] == "T"


# --- through the runner, on a tiny model ---------------------------------------------------------

@pytest.fixture(scope="module")
@needs_model_files  # save_tiny_model: the default model's tokenizer
def tiny_folder(tmp_path_factory):
    """A random 2-layer Llama that reads the default model's tokens, saved as a loadable folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**dict(TINY, vocab_size=len(tokenizer),
                                                                max_position_embeddings=1024)))
    folder = tmp_path_factory.mktemp("tiny-ppl")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def ppl_run(folder, out, policy, budget, chunk=CHUNK, bucket=BUCKET):
    config = RunConfig(policy=policy, budget=budget, task="ppl", task_args={"text": "essays", "bucket": str(bucket)},
                       length=LENGTH, samples=2, chunk_size=chunk, model=str(folder), dtype="float32",
                       device="cpu", out=str(out), wandb="off")
    result = run(config)
    records = [json.loads(line) for line in (out / result.run_id / "predictions.jsonl").read_text().splitlines()]
    return result.metrics, records


def forward_nll(folder, records, allowed=None, first=CHUNK) -> list[list[float]]:
    """Per passage, the negative log-probability of each token from position `first` on, in one forward
    pass of the whole passage; `allowed(query, key)` (positions) masks attention where given."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    samples = {s.id: s for s in Perplexity(text="essays").samples(None, LENGTH, 2, seed=0)}
    mask = None
    if allowed is not None:
        visible = torch.tensor([[allowed(q, k) for k in range(LENGTH)] for q in range(LENGTH)])
        mask = visible[None, None]  # a 4D mask: transformers applies it as given
    losses = []
    for record in records:
        ids = tokenizer(samples[record["id"]].context).input_ids[:LENGTH]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids]), attention_mask=mask).logits[0].double(), -1)
        losses.append([-float(logprobs[p - 1, ids[p]]) for p in range(first, LENGTH)])
    return losses


@pytest.mark.model  # tiny_folder: the default model's tokenizer
def test_budget_one_equals_one_full_forward_pass(tiny_folder, tmp_path):
    full, records = ppl_run(tiny_folder, tmp_path, "full", 1.0)
    assert len(records) == 2 and full["scored_from"] == CHUNK and full["scored_tokens"] == 2 * (LENGTH - CHUNK)
    reference = forward_nll(tiny_folder, records)
    for record, losses in zip(records, reference):
        assert record["prompt_tokens"] == LENGTH - 1 == record["kept_tokens"]  # every fed token kept
        assert record["nll"] == pytest.approx(sum(losses), rel=1e-5)
        assert record["perplexity"] == pytest.approx(math.exp(sum(losses) / len(losses)), rel=1e-5)
        for bucket in record["buckets"]:
            part = losses[bucket["start"] - CHUNK:bucket["end"] - CHUNK]
            assert bucket["tokens"] == len(part) and bucket["nll"] == pytest.approx(sum(part), rel=1e-5)
    every = [loss for losses in reference for loss in losses]
    assert full["perplexity"] == pytest.approx(math.exp(sum(every) / len(every)), rel=1e-5)
    assert [(b["start"], b["end"], b["tokens"]) for b in full["by_position"]] == [
        (64, 128, 128), (128, 192, 128), (192, 256, 128), (256, 300, 88)]  # two passages a bucket
    assert full["text"].startswith("Paul Graham essays") and full["higher_is_better"] is False


@pytest.mark.model  # tiny_folder: the default model's tokenizer
def test_chunk_size_one_scores_every_token_but_the_first_as_one_forward_pass(tiny_folder, tmp_path):
    """`--chunk-size 1` at budget 1, a bucket a position: every token's loss is the whole passage's forward
    pass's, to 1e-4 (the tolerance and its reason: `test_token_by_token_at_budget_one_equals_one_forward_pass`)."""
    metrics, records = ppl_run(tiny_folder, tmp_path, "h2o_head", 1.0, chunk=1, bucket=1)
    assert metrics["scored_from"] == 1 and metrics["scored_tokens"] == 2 * (LENGTH - 1)
    for record, losses in zip(records, forward_nll(tiny_folder, records, first=1)):
        assert record["kept_tokens"] == LENGTH - 1  # nothing evicted
        positions = [(b["start"], b["end"], b["tokens"]) for b in record["buckets"]]
        assert positions == [(p, p + 1, 1) for p in range(1, LENGTH)]
        assert [b["nll"] for b in record["buckets"]] == pytest.approx(losses, rel=0, abs=1e-4)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.mark.fast_tier_keeps_one_in(4)
@pytest.mark.parametrize("decode_step", ["eager", "static"])
@pytest.mark.parametrize("name", ["full", "h2o_head", "h2o_page", "snapkv_head_page", "streaming_llm", "tova_token"])
def test_token_by_token_at_budget_one_equals_one_forward_pass(tiny, monkeypatch, name, decode_step):
    """Two 150-token sequences fed one token a step at budget 1, through either decode step: every token's
    log-probability is the one forward pass's over the whole sequence, to 1e-4. Not to the bit, in float32: the
    pass multiplies [T, d] matrices and attends with one causal SDPA, the steps multiply one row at a time and
    attend one query over the cached K/V, so sums run in other orders and the rounding (measured: at most
    1.7e-5 on this wide-init model, log-probabilities down to -12.5) differs. A token missed or seen in excess
    moves a log-probability by far more: at budget 0.3 the same policies are 1 or more apart."""
    steps = []
    step = StaticStep.step
    monkeypatch.setattr(StaticStep, "step", lambda self: (steps.append(self), step(self)))
    sequences = torch.randint(0, 128, (2, 150), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        expected = torch.log_softmax(tiny(torch.tensor(sequences)).logits.double(), -1)[:, :-1].gather(
            2, torch.tensor(sequences)[:, 1:, None])[..., 0]  # [B, 149]: token p from positions < p

    def scored(budget):
        settings = GenerationSettings(make_policy(name), budget=budget, page_size=4, chunk_size=1,
                                      decode_step=decode_step)
        return score_rolling(tiny, sequences, [149, 149], settings)

    scores = scored(1.0)
    assert len(steps) == (149 if decode_step == "static" else 0)
    for score, want in zip(scores, expected):
        assert score.kept_tokens == 149
        torch.testing.assert_close(torch.tensor(score.logprobs, dtype=torch.float64), want, rtol=0, atol=1e-4)
    if name != "full":  # the comparison sees eviction
        assert max((torch.tensor(s.logprobs, dtype=torch.float64) - w).abs().max() for s, w in
                   zip(scored(0.3), expected)) > 1


# One settings a branch: per-head and shared pages and tokens, a window statistic, positions only, the full cache.
BRANCHES = [("h2o_head", 0.3), ("h2o_page", 0.3), ("snapkv_head_page", 0.4), ("tova_token", 0.5),
            ("streaming_llm", 0.3), ("full", 1.0)]


@pytest.mark.parametrize("chunk, joint", [(1, True), (4, False)], ids=["token by token: one forward a step",
                                                                        "chunks of 4: one branch after another"])
def test_branches_streamed_together_score_what_each_scores_alone(tiny, monkeypatch, chunk, joint):
    """A sweep's perplexity cells on the same passages stream together: token by token, every branch's token
    goes through one forward a step (`joint_decode.forward_branches`); each branch's log-probabilities, kept
    tokens and bytes are its own `score_rolling`'s, bit for bit."""
    sequences = torch.randint(0, 128, (2, 60), generator=torch.Generator().manual_seed(1)).tolist()
    branches = [GenerationSettings(make_policy(name), budget=budget, page_size=4, chunk_size=chunk)
                for name, budget in BRANCHES]
    forwards = []
    joint_forward = teacher_forcing.forward_branches
    monkeypatch.setattr(teacher_forcing, "forward_branches",
                        lambda states, tokens: (forwards.append(len(states)), joint_forward(states, tokens))[1])
    together = score_rolling_branches(tiny, sequences, [50, 50], branches)

    assert forwards == ([len(BRANCHES)] * 59 if joint else [])
    for settings, scores in zip(branches, together):
        alone = score_rolling(tiny, sequences, [50, 50], settings)
        assert [vars(s) for s in scores] == [vars(s) for s in alone], settings.policy.name


@pytest.mark.model  # tiny_folder: the default model's tokenizer
def test_a_sweeps_perplexity_cells_stream_together_and_write_what_their_own_runs_write(tiny_folder, tmp_path,
                                                                                       monkeypatch):
    from evalkit.runner import run_many

    def cells(out):
        return [RunConfig(policy=policy, budget=budget, task="ppl", task_args={"text": "essays"}, length=48, samples=3,
                          batch_size=2, chunk_size=1, block_size=4, model=str(tiny_folder), dtype="float32", device="cpu",
                          out=str(out), wandb="off") for policy, budget in BRANCHES]

    forwards = []
    joint_forward = teacher_forcing.forward_branches
    monkeypatch.setattr(teacher_forcing, "forward_branches",
                        lambda states, tokens: (forwards.append(len(states)), joint_forward(states, tokens))[1])
    together = run_many(cells(tmp_path / "together"))
    assert forwards == [len(BRANCHES)] * 47 * 2  # 3 passages in batches of 2: 47 tokens fed a passage
    for config, result in zip(cells(tmp_path / "alone"), together):
        alone = run(config)
        assert alone.run_id == result.run_id
        assert [{k: v for k, v in r.items() if k != "prefill_seconds"} for r in
                map(json.loads, (Path(alone.path) / "predictions.jsonl").read_text().splitlines())] == \
               [{k: v for k, v in r.items() if k != "prefill_seconds"} for r in
                map(json.loads, (Path(result.path) / "predictions.jsonl").read_text().splitlines())]


@pytest.mark.model  # tiny_folder: the default model's tokenizer
def test_a_lower_budget_equals_a_forward_pass_masked_to_what_streaming_llm_keeps(tiny_folder, tmp_path):
    """StreamingLLM's rule applied by hand: after every chunk the cache keeps the 4 first tokens and
    the most recent ones, budget in all; a query sees what was kept before its chunk, and its own
    chunk up to itself. Positions never shift, so one forward pass with that mask is the expectation."""
    budget = math.ceil(0.2 * (LENGTH - 1))  # 0.2 of the 299 fed tokens: 59.8 -> 60 per head
    sinks, recent = 4, budget - 4

    def allowed(query, key):
        if key > query:
            return False
        start = query // CHUNK * CHUNK  # the query's chunk
        if key >= start or start <= budget:  # its own chunk; or nothing evicted yet
            return True
        return key < sinks or key >= start - recent

    evicted, records = ppl_run(tiny_folder, tmp_path, "streaming_llm", 0.2)
    assert all(r["kept_tokens"] == budget for r in records)
    assert evicted["held_over_full"] < 0.5
    reference = forward_nll(tiny_folder, records, allowed)
    for record, losses in zip(records, reference):
        assert record["nll"] == pytest.approx(sum(losses), rel=1e-5)
        for bucket in record["buckets"]:
            part = losses[bucket["start"] - CHUNK:bucket["end"] - CHUNK]
            assert bucket["nll"] == pytest.approx(sum(part), rel=1e-5)
    # The expectation is not the full cache's: the mask hides something.
    assert sum(map(sum, reference)) != pytest.approx(sum(map(sum, forward_nll(tiny_folder, records))), rel=1e-3)


# --- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--task-arg", "text=poems"], "unknown ppl text 'poems'"),
    (["--task-arg", "window=3"], "unknown ppl task-arg window"),
    # model: the checks against --length come with the default model's window (its config.json)
    pytest.param(["--length", "400", "--chunk-size", "512"], "--length 400 must be more than --chunk-size 512",
                 marks=pytest.mark.model),
    pytest.param(["--length", "9000"], "smollm2-135m has 8192: lower --length", marks=pytest.mark.model),
])
def test_bad_input_is_one_line_and_exit_2_with_no_run_folder(monkeypatch, capsys, tmp_path, args, message):
    out = tmp_path / "runs"
    monkeypatch.setattr(sys, "argv", ["evalkit", "run", "--task", "ppl", *args, "--out", str(out), "--wandb", "off"])
    with pytest.raises(SystemExit) as done:
        main()
    err = capsys.readouterr().err
    assert done.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() or not any(out.iterdir())
