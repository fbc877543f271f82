"""Several turns on one compressed context (`loop.conversation`, the multi-turn tasks): the full cache is
transformers' greedy generation over the concatenated conversation, the first turn is a single-question run,
decode eviction holds the cache at its first answer's size, and a shared prefill changes nothing."""

import json
from unittest import mock

import pytest
import torch

from conftest import SHORT_PROMPT_ARGS, needs_model_files, save_tiny_model, tiny_model
from helpers import evalkit, read_run
from evalkit.cache import KVCache
from evalkit.loop import Conversation, GenerationSettings, Request, converse, generate, prefill_statistics, share_prefill
from evalkit.loop.conversation import converse_branches
from evalkit.policies import make_policy

NEW = 6
EOS = 60  # ends the second answer early in `conversation()` (checked below)


def conversation(seed=3, context=40, turns=(5, 4, 6)):
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(10, 128, (n,), generator=g).tolist() for n in (context, *turns)]
    return Conversation(tokens[0], tokens[1:], NEW)


def hf_conversation(model, talk: Conversation) -> list[list[int]]:
    """Each turn's answer by transformers' greedy generation over everything said so far (EOS left out of the
    answer: the next turn's prompt follows it, as a chat template's end of turn does)."""
    ids, answers = list(talk.context_ids), []
    for turn in talk.turns:
        ids += turn
        prompt = torch.tensor([ids])
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=talk.max_new_tokens,
                             do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        answer = out[:out.index(EOS)] if EOS in out else out
        answers.append(answer)
        ids += answer
    return answers


def settings(policy="full", budget=1.0, **kwargs):
    return GenerationSettings(make_policy(policy), budget=budget, page_size=4, **kwargs)


@pytest.fixture(scope="module")
def model():
    model = tiny_model("llama")
    model.generation_config.eos_token_id = EOS
    return model


def test_the_conversation_ends_some_answers_on_eos_and_others_on_length(model):
    # The cases below then cover both ends of an answer: EOS (never fed) and max new tokens (last token unfed).
    answers = hf_conversation(model, conversation())
    assert any(len(a) < NEW for a in answers) and any(len(a) == NEW for a in answers), answers


@pytest.mark.parametrize("policy", ["full", "h2o_head", "snapkv_head_page", "tova_page", "streaming_llm"])
@pytest.mark.parametrize("options", [dict(), dict(layout="dense", decode_eviction=False), dict(query_aware=False)])
def test_budget_one_is_greedy_generation_over_the_concatenated_conversation(model, policy, options):
    talk = conversation()
    got = converse(model, None, talk, settings(policy, **options))
    assert [g.token_ids for g in got] == hf_conversation(model, talk)
    fed = [len(talk.context_ids) + sum(map(len, talk.turns[:k + 1])) + sum(len(g.token_ids) for g in got[:k])
           for k in range(len(talk.turns))]
    assert [g.prompt_tokens for g in got] == fed
    assert [g.kept_tokens for g in got] == fed  # nothing evicted: every token said so far is held


@pytest.mark.parametrize("policy", ["h2o_head", "snapkv_head_page", "keydiff_page"])
@pytest.mark.parametrize("query_aware", [True, False])
def test_the_first_turn_is_the_single_question_run(model, policy, query_aware):
    talk = conversation()
    chosen = settings(policy, 0.3, query_aware=query_aware)
    first = converse(model, None, talk, chosen)[0]
    alone = generate(model, None, [Request(talk.context_ids, talk.turns[0], NEW)], chosen)[0]
    assert first.token_ids == alone.token_ids
    assert (first.kept_tokens, first.bytes_held, first.bytes_ideal) == (alone.kept_tokens, alone.bytes_held,
                                                                         alone.bytes_ideal)


@pytest.mark.parametrize("policy", ["h2o_head", "snapkv_head_page"])
def test_decode_eviction_holds_the_cache_at_its_first_answers_size(model, policy):
    talk = conversation()
    held = converse(model, None, talk, settings(policy, 0.3))
    # Per-head tokens: every turn's answer begins from the first's size; whole pages: at most that.
    cap = converse(model, None, talk, settings("h2o_head", 0.3))[0].kept_tokens
    kept = {g.kept_tokens for g in held}
    assert kept == {cap} if policy.endswith("_head") else max(kept) <= cap
    grown = converse(model, None, talk, settings(policy, 0.3, decode_eviction=False))
    assert grown[0].kept_tokens == held[0].kept_tokens
    # Without decode eviction every token after the compressed context stays, turn after turn.
    assert [g.kept_tokens - grown[0].kept_tokens for g in grown] == \
        [g.prompt_tokens - grown[0].prompt_tokens for g in grown]
    assert grown[-1].kept_tokens > held[-1].kept_tokens


@pytest.mark.parametrize("policy, args, grows", [
    ("h2o_head", {}, False), ("adakv_snapkv", {"window": "4"}, False),  # a layer's budget moves between its heads
    ("kvzip_head", {}, True), ("kvzip_head_page", {"pool_pages": "true"}, True),  # pooled over layers and heads
    ("duo_attention", SHORT_PROMPT_ARGS["duo_attention"], True)])  # retrieval heads keep every token
def test_a_cache_that_may_outgrow_its_caps_is_sized_for_every_turn(model, policy, args, grows):
    """Decode eviction holds each layer within its caps, so the cache needs room for the first answer and the
    longest later turn only; where a layer may keep more (a budget pooled over layers, heads that keep everything)
    every token of every turn may stay, so the cache has room for all of them: with the first sizing KVzip's
    pooled pages ran out at 2,048 tokens and DuoAttention on these tiny conversations."""
    talk = conversation()
    with mock.patch.object(KVCache, "create", wraps=KVCache.create) as create:
        converse(model, None, talk, GenerationSettings(make_policy(policy, args=args), budget=0.3, page_size=4))
    capacity = create.call_args.args[3]  # the most tokens one head must hold at once
    every_turn = len(talk.context_ids) + sum(len(t) + 1 for t in talk.turns) + len(talk.turns) * NEW
    assert (capacity >= every_turn) == grows, (capacity, every_turn)


@pytest.mark.parametrize("query_aware", [True, False])
def test_a_shared_prefill_gives_each_run_what_it_gives_alone(model, query_aware):
    talk = conversation()
    each = [settings("h2o_head", 0.3, query_aware=query_aware), settings("tova_page", 0.5, query_aware=query_aware)]
    shared = share_prefill(model, [Request(talk.context_ids, talk.turns[0], NEW)], query_aware,
                           set().union(*(prefill_statistics(s.policy) for s in each)), None)
    for chosen in each:
        alone, forked = converse(model, None, talk, chosen), converse(model, None, talk, chosen, shared)
        assert [g.token_ids for g in forked] == [g.token_ids for g in alone]
        assert [g.kept_tokens for g in forked] == [g.kept_tokens for g in alone]


@pytest.mark.parametrize("query_aware", [True, False])
def test_branches_conversing_together_give_what_each_gives_alone(model, monkeypatch, query_aware):
    import evalkit.loop.joint_decode as joint_decode

    talk = conversation()
    each = [settings("h2o_head", 0.3, query_aware=query_aware), settings("tova_page", 0.5, query_aware=query_aware),
            settings("full", query_aware=query_aware),
            settings("snapkv_head_page", 0.3, query_aware=query_aware, decode_eviction=False)]
    shared = share_prefill(model, [Request(talk.context_ids, talk.turns[0], NEW)], query_aware,
                           set().union(*(prefill_statistics(s.policy) for s in each)), None)
    joint_steps = []
    forward_branches = joint_decode.forward_branches
    monkeypatch.setattr(joint_decode, "forward_branches",
                        lambda states, tokens: joint_steps.append(len(states)) or forward_branches(states, tokens))
    together = converse_branches(model, None, talk, each, shared)
    assert joint_steps and max(joint_steps) == len(each)  # the branches' decode steps went through one forward
    for chosen, got in zip(each, together):
        alone = converse(model, None, talk, chosen)
        assert [g.token_ids for g in got] == [g.token_ids for g in alone]
        assert [(g.kept_tokens, g.bytes_held, g.prompt_tokens) for g in got] == \
            [(g.kept_tokens, g.bytes_held, g.prompt_tokens) for g in alone]
    # The answers end at different steps (EOS or length), so a branch asks its next question while others decode.
    assert len({tuple(len(g.token_ids) for g in got) for got in together}) > 1


@pytest.fixture(scope="module")
@needs_model_files  # save_tiny_model: the default model's tokenizer
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.mark.model  # tiny_folder: the default model's tokenizer
def test_a_multiturn_run_reports_each_turns_score_interval_and_cache(monkeypatch, capsys, tmp_path, tiny_folder):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    code, _, err = evalkit(monkeypatch, capsys, "run", "--model", str(tiny_folder), "--task", "multiturn_niah",
                           "--task-arg", "turns=3", "--policy", "h2o_head", "--budget", "0.3", "--length", "512",
                           "--samples", "4", "--out", str(tmp_path), "--wandb", "offline")
    assert code == 0, err
    for policy in ("h2o_head", "full"):
        _, records, metrics = read_run(tmp_path, policy)
        assert all(r["score"] == sum(t["score"] for t in r["turns"]) / 3 for r in records)
        assert [row["turn"] for row in metrics["by_turn"]] == [1, 2, 3]
        for index, row in enumerate(metrics["by_turn"]):
            turns = [r["turns"][index] for r in records]
            assert row["score"] == sum(t["score"] for t in turns) / len(turns)
            assert row["ci_low"] <= row["score"] <= row["ci_high"] and row["ci_method"] == "wilson"
            assert row["prompt_tokens"] == sum(t["prompt_tokens"] for t in turns) / len(turns)
        by_turn = metrics["by_turn"]
        assert by_turn[0]["prompt_tokens"] < by_turn[1]["prompt_tokens"] < by_turn[2]["prompt_tokens"]
        kept = [row["kept_tokens"] for row in by_turn]
        # Decode eviction holds the evicting run's cache at its first turn's size; the full cache keeps all.
        assert (len(set(kept)) == 1) if policy == "h2o_head" else \
            kept == [row["prompt_tokens"] for row in by_turn]
        assert metrics["bytes_held"] == sum(r["turns"][-1]["bytes_held"] for r in records) / len(records)
        (by_turn,) = (tmp_path / read_run(tmp_path, policy)[0].name).glob("wandb/offline-run-*/files/media/table/"
                                                                            "by_turn_*.table.json")
        logged = json.loads(by_turn.read_text())  # W&B's copy: the same rows
        assert [dict(zip(logged["columns"], row))["score"] for row in logged["data"]] == \
            [row["score"] for row in metrics["by_turn"]]
