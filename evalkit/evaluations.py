"""What a run evaluates and how (`Evaluation`): the samples, each one's model input, a batch's records under each
run's settings, a run's metrics. Three kinds (`evaluation_for`): answers generated and scored by the task, a
conversation of several turns on one context (a multi-turn task, `loop.conversation`), and passages streamed
through the cache for their perplexity (`ppl`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from evalkit.config import RunConfig
from evalkit.errors import EvalkitError
from evalkit.loop import (Conversation, GenerationSettings, Request, SharedPrefill, converse_branches, generate,
                          generate_branches, prefill_statistics, score_rolling, score_rolling_branches, share_prefill)
from evalkit.models import max_positions
from evalkit.prompt import encode, encode_conversation, prompt_length
from evalkit.results import Record
from evalkit.tasks import Sample, Task
from evalkit.tasks.custom import is_data_task
from evalkit.tasks.ppl import Perplexity, perplexity_metrics
from evalkit.uncertainty import score_interval


def evaluation_for(task: Task, config: RunConfig, model, tokenizer) -> "Evaluation":
    if isinstance(task, Perplexity):
        return perplexity_evaluation(task, config, model, tokenizer)
    samples = task.samples(prompt_length(tokenizer), config.length, config.samples, config.seed)
    if any(sample.followups for sample in samples):
        return conversation_evaluation(task, samples, config, model, tokenizer)
    return generation_evaluation(task, samples, config, model, tokenizer)


def check_positions(config: RunConfig, model, needs: list[tuple[str, int]]) -> None:
    """Refuses a sample whose (id, positions needed: prompt and answers) the model cannot hold."""
    limit = max_positions(model)
    lower = ("the task's lengths" if "lengths" in config.task_args else
             "the record (data samples are never cut; skip it with --offset/--limit)" if is_data_task(config.task)
             else "--length")
    for sample_id, needed in needs:
        if limit and needed > limit:
            raise EvalkitError(f"sample {sample_id} needs {needed} positions (prompt + answers) but "
                               f"{config.model} has {limit}: lower {lower}")


@dataclass
class Evaluation:
    """What a group of runs evaluates and how: the samples, each one's model input, a batch's records under
    each run's settings (from a shared prefill, if given), a run's metrics; and how to share a batch's
    prefill."""

    samples: list[Sample]
    inputs: list
    evaluate: Callable[[list[tuple[Sample, Any]], list[GenerationSettings], SharedPrefill | None], list[list[dict]]]
    summarize: Callable[[list[dict]], dict]
    share: Callable[[list[tuple[Sample, Any]], list[GenerationSettings]], SharedPrefill | None] = \
        lambda batch, settings: None


def generation_evaluation(task: Task, samples: list[Sample], config: RunConfig, model, tokenizer) -> Evaluation:
    """Prompts whose answers are generated and scored by the task."""
    encoded = [encode(tokenizer, sample) for sample in samples]
    check_positions(config, model, [(sample.id, len(context_ids) + len(question_ids) + sample.max_new_tokens)
                                    for sample, (context_ids, question_ids) in zip(samples, encoded)])

    def requests(batch: list[tuple[Sample, tuple[list[int], list[int]]]]) -> list[Request]:
        return [Request(c, q, s.max_new_tokens) for s, (c, q) in batch]

    def share(batch, each: list[GenerationSettings]) -> SharedPrefill:
        statistics = set().union(*(prefill_statistics(s.policy) for s in each))
        return share_prefill(model, requests(batch), each[0].query_aware, statistics, tokenizer)

    def evaluate(batch, each: list[GenerationSettings], shared: SharedPrefill | None) -> list[list[dict]]:
        if shared is None:
            generations = [generate(model, tokenizer, requests(batch), settings) for settings in each]
        else:  # the runs decode together, branches of the shared prefill (joint_decode)
            generations = generate_branches(model, tokenizer, requests(batch), each, shared)
        return [records(batch, run_generations) for run_generations in generations]

    def records(batch, generations) -> list[dict]:
        return [Record(
            sample.id, gen.prompt_tokens, task.score(gen.text, sample.references), gen.kept_tokens, gen.bytes_held,
            gen.bytes_ideal, gen.bytes_full, len(gen.token_ids), gen.attended_fraction, sample.meta,
            # Batch-wide timings, divided evenly so sums over records stay right.
            {key: value / len(batch) for key, value in gen.timing.items() if key.endswith("seconds")},
            {"prediction": gen.text, "references": sample.references,
             **({"details": details} if (details := task.score_details(gen.text, sample.references)) else {})},
        ).as_dict() for (sample, _), gen in zip(batch, generations)]

    def summarize(records: list[dict]) -> dict:
        details = sorted({key for r in records for key in r.get("details", {})})
        return {**aggregate(records), "metric": task.metric, "higher_is_better": True,
                **score_interval(records).as_metrics(),
                **({"details": {key: sum(r["details"][key] for r in records) / len(records) for key in details}}
                   if details else {})}

    return Evaluation(samples, encoded, evaluate, summarize, share)


def conversation_evaluation(task: Task, samples: list[Sample], config: RunConfig, model, tokenizer) -> Evaluation:
    """Samples whose questions are asked turn after turn on one compressed context (`loop.conversation`), one
    sample at a time. A sample's record: the mean of its turns' scores, the cache as its last answer began (KV
    held, kept and full), new tokens and seconds summed over turns, and each turn's own under `turns`."""
    encoded = [encode_conversation(tokenizer, sample) for sample in samples]
    check_positions(config, model, [(sample.id, len(context_ids) + sum(map(len, turns))
                                     + len(turns) * sample.max_new_tokens)
                                    for sample, (context_ids, turns) in zip(samples, encoded)])

    def evaluate(batch, each: list[GenerationSettings], shared: None) -> list[list[dict]]:
        records: list[list[dict]] = [[] for _ in each]
        for sample, (context_ids, turns) in batch:
            conversation = Conversation(context_ids, turns, sample.max_new_tokens)
            # Runs grouped by `runner.prefill_key` fork one prefill of the first turn, sample by sample, and decode
            # their answers together.
            prefill = share_prefill(model, [Request(context_ids, turns[0], sample.max_new_tokens)],
                                    each[0].query_aware, set().union(*(prefill_statistics(s.policy) for s in each)),
                                    tokenizer) if len(each) > 1 else None
            for run_records, generations in zip(records, converse_branches(model, tokenizer, conversation, each,
                                                                            prefill)):
                run_records.append(conversation_record(task, sample, generations))
        return records

    def summarize(records: list[dict]) -> dict:
        return {**aggregate(records), "metric": task.metric, "higher_is_better": True,
                **score_interval(records).as_metrics(), "by_turn": by_turn(records)}

    return Evaluation(samples, encoded, evaluate, summarize)


def conversation_record(task: Task, sample: Sample, generations) -> dict:
    questions = [(sample.question, sample.references), *((t.question, t.references) for t in sample.followups)]
    turns = [{"turn": index + 1, "question": question, "prediction": gen.text, "references": references,
              "score": task.score(gen.text, references), "new_tokens": len(gen.token_ids),
              "prompt_tokens": gen.prompt_tokens, "kept_tokens": gen.kept_tokens, "bytes_held": gen.bytes_held,
              "bytes_ideal": gen.bytes_ideal, "bytes_full": gen.bytes_full}
             for index, ((question, references), gen) in enumerate(zip(questions, generations))]
    last = generations[-1]
    seconds = {key: sum(gen.timing.get(key, 0.0) for gen in generations)
               for key in ("prefill_seconds", "decode_seconds")}
    if "reconstruction_seconds" in generations[0].timing:  # KVzip's, spent once, in the first turn's prefill
        seconds["reconstruction_seconds"] = generations[0].timing["reconstruction_seconds"]
    return Record(
        sample.id, last.prompt_tokens, sum(t["score"] for t in turns) / len(turns), last.kept_tokens,
        last.bytes_held, last.bytes_ideal, last.bytes_full, sum(t["new_tokens"] for t in turns),
        sum(gen.attended_fraction for gen in generations) / len(generations), sample.meta, seconds,
        {"prediction": "\n".join(f"[{t['turn']}] {t['prediction']}" for t in turns),
         "references": [" / ".join(t["references"]) for t in turns], "turns": turns},
    ).as_dict()


def by_turn(records: list[dict]) -> list[dict]:
    """Per turn index: the score with its 95 % interval over the samples, and the cache as that turn's answer
    began (means)."""
    rows = []
    for index in range(max(len(r["turns"]) for r in records)):
        turns = [(r["id"], r["turns"][index]) for r in records if len(r["turns"]) > index]
        interval = score_interval([{"id": sample_id, "score": t["score"]} for sample_id, t in turns])
        mean = {key: sum(t[key] for _, t in turns) / len(turns)
                for key in ("score", "new_tokens", "prompt_tokens", "kept_tokens", "bytes_held", "bytes_full")}
        rows.append({"turn": index + 1, **mean, "held_over_full": mean["bytes_held"] / mean["bytes_full"],
                     "ci_low": interval.ci_low, "ci_high": interval.ci_high, "ci_method": interval.ci_method})
    return rows


def perplexity_evaluation(task: Perplexity, config: RunConfig, model, tokenizer) -> Evaluation:
    """Passages of `--length` tokens streamed in chunks; the loss of every token after the first chunk."""
    chunk = config.chunk_size
    if config.length <= chunk:
        raise EvalkitError(f"ppl scores the tokens after the first chunk: --length {config.length} must be "
                           f"more than --chunk-size {chunk}")
    samples = task.samples(prompt_length(tokenizer), config.length, config.samples, config.seed)
    passages = []
    for sample in samples:
        ids = tokenizer(sample.context).input_ids[:config.length]
        if len(ids) < config.length:
            raise EvalkitError(f"passage {sample.id} has only {len(ids)} tokens, fewer than --length {config.length}")
        passages.append(ids)

    def evaluate(batch: list[tuple[Sample, list[int]]], each: list[GenerationSettings],
                 shared: None) -> list[list[dict]]:
        """Runs on the same passages stream them together (`score_rolling_branches`); each run's seconds are
        an even share of the batch's."""
        texts, scored = [ids for _, ids in batch], [len(ids) - chunk for _, ids in batch]
        start = time.perf_counter()
        scores = score_rolling_branches(model, texts, scored, each) if len(each) > 1 else \
            [score_rolling(model, texts, scored, each[0])]
        seconds = (time.perf_counter() - start) / len(batch) / len(each)
        return [records_of(batch, run_scores, seconds) for run_scores in scores]

    def records_of(batch: list[tuple[Sample, list[int]]], scores, seconds: float) -> list[dict]:
        records = []
        for (sample, _), scored in zip(batch, scores):
            summary = task.loss_summary(scored.logprobs, first_position=chunk)
            records.append(Record(
                sample.id, scored.prompt_tokens, summary["perplexity"], scored.kept_tokens, scored.bytes_held,
                scored.bytes_ideal, scored.bytes_full, 0, 1.0, sample.meta,
                {"prefill_seconds": seconds, "decode_seconds": 0.0}, summary,
            ).as_dict())
        return records

    def summarize(records: list[dict]) -> dict:
        return {**aggregate(records), **perplexity_metrics(records), "scored_from": chunk,
                **score_interval(records).as_metrics()}

    return Evaluation(samples, passages, evaluate, summarize)


def aggregate(records: list[dict]) -> dict:
    """Means over samples; a group task (samples carrying meta["task"]) scores the mean of its tasks' means."""
    n = len(records)

    def total(key):
        return sum(r[key] for r in records)

    by_task: dict[str, list[float]] = {}
    for r in records:
        if "task" in r.get("meta", {}):
            by_task.setdefault(r["meta"]["task"], []).append(r["score"])
    task_means = {task: sum(scores) / len(scores) for task, scores in sorted(by_task.items())}
    return {
        "samples": n,
        "score": sum(task_means.values()) / len(task_means) if task_means else total("score") / n,
        **({"by_task": task_means} if task_means else {}),
        "kept_tokens": total("kept_tokens") / n,
        "prompt_tokens": total("prompt_tokens") / n,
        "bytes_held": total("bytes_held") / n,
        "bytes_ideal": total("bytes_ideal") / n,
        "bytes_full": total("bytes_full") / n,
        "held_over_full": total("bytes_held") / total("bytes_full"),
        "held_over_ideal": total("bytes_held") / max(1, total("bytes_ideal")),
        "attended_fraction": total("attended_fraction") / n,
        "new_tokens": total("new_tokens") / n,
        "prefill_tokens_per_s": total("prompt_tokens") / max(1e-9, total("prefill_seconds")),
        "decode_tokens_per_s": total("new_tokens") / max(1e-9, total("decode_seconds")),
        "seconds": total("prefill_seconds") + total("decode_seconds"),
        **({"reconstruction_seconds": total("reconstruction_seconds") / n}
           if all("reconstruction_seconds" in r for r in records) else {}),
    }
