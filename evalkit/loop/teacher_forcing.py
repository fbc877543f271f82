"""Teacher forcing through the generation loop's cache: `score_continuations` (a continuation's
log-probabilities after its prompt was compressed, as `generate` compresses it) and `score_rolling`
(streaming log-likelihood of a whole text, compressed after every chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from evalkit.attention import evalkit_attention
from evalkit.cache import KVCache
from evalkit.loop.compression import budgets_for, compress
from evalkit.loop.generate import prefill, restrict_reads
from evalkit.loop.joint_decode import branch_groups, forward_branches, linears_apart, model_rows_apart
from evalkit.loop.static_decode import StaticStep, static_step
from evalkit.loop.state import (GenerationSettings, LoopState, Observer, forward, full_cache_bytes, new_state,
                                split_prompts)


@dataclass
class ScoreRequest:
    """A continuation to score after a prompt, by teacher forcing."""

    context_ids: list[int]  # prefilled and compressed
    question_ids: list[int]  # appended after compression when query-agnostic; part of the prompt otherwise
    continuation_ids: list[int]  # scored token by token; at least one token


@dataclass
class Score:
    logprobs: list[float]  # one per scored token
    greedy: bool  # every scored token was the model's argmax
    prompt_tokens: int
    kept_tokens: float  # mean per layer and KV head after prefill (after the last chunk for rolling)
    bytes_held: int
    bytes_ideal: int
    bytes_full: int


@torch.inference_mode()
def score_continuations(model, requests: list[ScoreRequest], settings: GenerationSettings,
                        observe: Observer | None = None) -> list[Score]:
    """Log-probabilities of each continuation, its prompt prefilled and compressed as `generate` would.

    The continuation is then read through the sparse cache like an answer being decoded: with
    decode eviction on (and a sequence being evicted) or a read restriction (Quest), one token per
    forward with eviction after each; otherwise all its tokens in one forward. Requests that share
    the prompt and all but the last continuation token share one pass (multiple-choice answers).
    """
    unique, member = _sharing_a_pass(requests)
    policy = settings.policy
    compressed, appended = split_prompts(unique, settings.query_aware)
    policy.prepare(model)
    budgets = budgets_for(model, settings, compressed)
    extra = torch.tensor([len(t) for t in appended])
    fed = [r.continuation_ids[:-1] for r in unique]  # the last token is predicted, never fed
    state = new_state(model, settings, budgets.lengths, budgets.caps, extra + torch.tensor([len(f) for f in fed]),
                      observe)
    cache = state.cache
    tally = _ContinuationLogprobs([r.continuation_ids for r in unique])

    with evalkit_attention(model):
        decode_evicts = budgets.any_evicting and settings.decode_eviction
        decode_collect = policy.collect_decode if decode_evicts else None
        state.collect = policy.collect_prefill if budgets.any_evicting else None
        logits = prefill(state, compressed, appended, budgets.caps, decode_collect)
        kept = cache.kept_tokens().float().mean(dim=(0, 2))
        held, ideal = cache.bytes_held(), cache.bytes_ideal()
        logprobs = torch.log_softmax(logits, -1)
        for b in range(len(unique)):
            tally.take(b, logprobs[b:b + 1], 0)

        state.collect = decode_collect
        restrict_reads(state, budgets, extra)
        stepwise = decode_evicts or (policy.restricts_reads and bool((budgets.tokens < budgets.lengths).any()))
        _feed_continuations(state, fed, tally, stepwise, budgets.caps + extra)

    scores = []
    prompts = torch.tensor([len(c) + len(a) for c, a in zip(compressed, appended)])
    full = full_cache_bytes(state, prompts)
    for r, g in zip(requests, member):
        final = tally.last[g][r.continuation_ids[-1]]
        greedy = tally.greedy[g] and int(tally.last[g].argmax()) == r.continuation_ids[-1]
        scores.append(Score(tally.shared[g] + [float(final)], greedy,
                            int(prompts[g]), float(kept[g]), int(held[g]), int(ideal[g]), int(full[g])))
    return scores


def _sharing_a_pass(requests: list[ScoreRequest]) -> tuple[list[ScoreRequest], list[int]]:
    """The requests that need a pass of their own (one per prompt and continuation but its last token), and
    for each request the index among them of the one whose pass it shares."""
    groups: dict[tuple, int] = {}
    for r in requests:
        groups.setdefault((tuple(r.context_ids), tuple(r.question_ids), tuple(r.continuation_ids[:-1])), len(groups))
    member = [groups[(tuple(r.context_ids), tuple(r.question_ids), tuple(r.continuation_ids[:-1]))]
              for r in requests]
    return [requests[member.index(g)] for g in range(len(groups))], member


class _ContinuationLogprobs:
    """Per continuation scored in one pass: the log-probabilities of its tokens but the last (shared by the
    requests that differ only in their last token), whether each was the argmax, and the last distribution."""

    def __init__(self, continuations: list[list[int]]):
        self.continuations = continuations
        self.shared: list[list[float]] = [[] for _ in continuations]
        self.greedy = [True] * len(continuations)
        self.last: list[torch.Tensor | None] = [None] * len(continuations)  # [V] each

    def take(self, b: int, rows: torch.Tensor, first: int) -> None:
        """rows [n, V] log-probs predicting continuation tokens first .. first+n-1 of continuation b."""
        cont = self.continuations[b]
        n_shared = max(0, min(len(rows), len(cont) - 1 - first))
        if n_shared:
            targets = torch.tensor(cont[first:first + n_shared], device=rows.device)
            self.shared[b] += rows[:n_shared].gather(1, targets[:, None])[:, 0].tolist()
            self.greedy[b] = self.greedy[b] and bool((rows[:n_shared].argmax(-1) == targets).all())
        if first + len(rows) == len(cont):
            self.last[b] = rows[-1].cpu()


def _feed_continuations(state: LoopState, fed: list[list[int]], tally: _ContinuationLogprobs, stepwise: bool,
                        caps: torch.Tensor) -> None:
    """Each continuation's fed tokens `fed[b]` through the compressed cache, their log-probabilities into
    `tally`: where `stepwise`, one token per forward, the cache compressed to `caps` [L, B] after each;
    otherwise all of them in one forward."""
    if stepwise:
        for step in range(max(len(f) for f in fed)):
            logits, counts = forward(state, [f[step:step + 1] for f in fed])
            compress(state, caps)
            logprobs = torch.log_softmax(logits, -1)
            for b in range(len(fed)):
                if counts[b]:
                    tally.take(b, logprobs[b:b + 1], step + 1)
    elif any(fed):
        logits, counts = forward(state, fed, all_logits=True)
        width = logits.shape[1]
        for b in range(len(fed)):
            if counts[b]:
                tally.take(b, torch.log_softmax(logits[b, width - int(counts[b]):], -1), 1)


@torch.inference_mode()
def score_rolling(model, sequences: list[list[int]], scored: list[int], settings: GenerationSettings,
                  observe: Observer | None = None) -> list[Score]:
    """Streaming log-likelihood: the log-probability of the last `scored[b]` tokens of `sequences[b]`.

    Every token but the last is fed in chunks of `settings.chunk_size` (whatever `settings.prefill`:
    in one chunk nothing would be read through the sparse cache), compressing to the budget, a
    fraction of the fed tokens, after every chunk; so each token is predicted from the ones before it
    that the cache kept, plus its own chunk, and the cache never exceeds budget + chunk.

    Chunks of one token (H2O's and StreamingLLM's token-by-token evaluation) are decode steps whose tokens are
    given rather than picked: where `settings.decode_step` takes the static step (`loop.static_decode`; by
    default a CUDA graph on CUDA, and the eager step on a CPU, where the static one is no faster) and every
    sequence is as long, they run through it.
    """
    with evalkit_attention(model):
        rolling = _Rolling(model, sequences, scored, settings, observe)
        for start in rolling.starts:
            rolling.feed(start)
        return rolling.scores()


@torch.inference_mode()
def score_rolling_branches(model, sequences: list[list[int]], scored: list[int],
                           branches: list[GenerationSettings]) -> list[list[Score]]:
    """`score_rolling(model, sequences, scored, settings)` for every settings in `branches`, the same scores:
    where every branch feeds one token a step through the eager step and the sequences are equally long, each
    step feeds every branch's tokens through one forward (`joint_decode.forward_branches`: bit for bit each
    branch's own forward, where its probes say so); otherwise the branches stream one after another. As many
    branches at a time as their caches fit (`joint_decode.branch_groups`)."""
    scores: list[list[Score]] = []
    rows_apart = len(branches) > 1 and model_rows_apart(model, len(sequences))
    with evalkit_attention(model):
        for group in branch_groups(model, branches, lambda settings: _Rolling(model, sequences, scored, settings)):
            together = (rows_apart and len(group) > 1 and len({len(s) for s in sequences}) == 1
                        and all(r.chunk == 1 and r.static is None for r in group)
                        and linears_apart(model, len(group), len(sequences)))
            one_each = torch.ones(len(sequences), dtype=torch.long)
            for start in group[0].starts if together else ():
                logits, _ = forward_branches([r.state for r in group], [r.fed(start) for r in group])
                for rolling, branch_logits in zip(group, logits):
                    rolling.take(start, branch_logits[:, None].to(model.device), one_each, compressing=True)
            for rolling in group if not together else ():
                for start in rolling.starts:
                    rolling.feed(start)
            scores += [rolling.scores() for rolling in group]
    return scores


class _Rolling:
    """One settings' stream through `sequences` (`score_rolling`): its loop state, fed chunk by chunk, and the
    log-probabilities of the scored tokens so far. Made inside `evalkit_attention`."""

    def __init__(self, model, sequences: list[list[int]], scored: list[int], settings: GenerationSettings,
                 observe: Observer | None = None):
        self.settings = replace(settings, prefill="chunked", temperature=0.0)  # nothing is sampled
        self.policy, self.sequences, self.chunk = self.settings.policy, sequences, self.settings.chunk_size
        self.inputs = [list(s[:-1]) for s in sequences]
        self.policy.prepare(model)
        self.budgets = budgets_for(model, self.settings, self.inputs)
        lengths = self.budgets.lengths
        self.state = new_state(model, self.settings, lengths, self.budgets.caps,
                               torch.zeros(len(self.inputs), dtype=torch.long), observe)
        self.first_scored = [len(t) - n for t, n in zip(self.inputs, scored)]
        self.logprobs: list[list[float]] = [[] for _ in self.inputs]
        self.greedy = [True] * len(self.inputs)
        longest = max(len(t) for t in self.inputs)
        self.starts = range(0, longest, self.chunk)
        self.state.collect = self.policy.collect_prefill if self.budgets.any_evicting else None
        # The static step feeds every sequence a token a step: a ragged batch takes the eager path.
        self.static = static_step(self.state, self.budgets.caps, self.budgets.any_evicting, longest) \
            if self.chunk == 1 and all(len(t) == longest for t in self.inputs) else None

    def fed(self, start: int) -> list[list[int]]:
        return [t[start:start + self.chunk] for t in self.inputs]

    def feed(self, start: int) -> None:
        """The chunk at `start` through this stream's own forward (the static step where it has one)."""
        if self.static is not None:  # logits [B, 1, V]; the step evicts
            logits = self.static(self.fed(start))[:, None]
            self.take(start, logits, torch.ones_like(self.budgets.lengths), compressing=False)
        else:
            logits, counts = forward(self.state, self.fed(start), all_logits=True)
            self.take(start, logits, counts, compressing=True)

    def take(self, start: int, logits: torch.Tensor, counts: torch.Tensor, compressing: bool) -> None:
        """After the forward of the chunk at `start` (logits [B, T, V]: row b's new tokens its last counts[b]
        columns): compress (unless the static step did), then the scored tokens' log-probabilities."""
        if compressing:
            compress(self.state, self.budgets.caps)
        width = logits.shape[1]
        for b, sequence in enumerate(self.sequences):
            n = int(counts[b])
            skip = max(0, self.first_scored[b] - start)  # fed positions before the scored part
            if n <= skip:
                continue
            rows = torch.log_softmax(logits[b, width - n + skip:], -1)
            targets = torch.tensor(sequence[start + skip + 1:start + n + 1], device=rows.device)
            self.logprobs[b] += rows.gather(1, targets[:, None])[:, 0].tolist()
            self.greedy[b] = self.greedy[b] and bool((rows.argmax(-1) == targets).all())

    def scores(self) -> list[Score]:
        state, lengths = self.state, self.budgets.lengths
        if self.static is not None:
            state.cache = _thawed(state, self.static, lengths, self.budgets.caps)
        cache = state.cache
        cache.compact()
        if state.observe:
            state.observe("prefill", cache)
        kept = cache.kept_tokens().float().mean(dim=(0, 2))
        held, ideal = cache.bytes_held(), cache.bytes_ideal()
        full = full_cache_bytes(state, lengths)
        return [Score(self.logprobs[b], self.greedy[b], int(lengths[b]), float(kept[b]), int(held[b]), int(ideal[b]),
                      int(full[b])) for b in range(len(self.inputs))]


def _thawed(state: LoopState, static: StaticStep, lengths: torch.Tensor, caps: torch.Tensor) -> KVCache:
    """The static step's live tokens in a cache built as its own was (`lengths` [B], `caps` [L, B]), packed as
    `compact` packs them: a frozen head keeps every page it reserved (`SlotLayer.freeze`) where the eager path
    returns those it empties, and the bytes held after the last token are reported."""
    cache = new_state(state.model, state.settings, lengths, caps, torch.zeros_like(lengths), None).cache
    for layer, frozen, slots in zip(cache.layers, state.cache.layers, static.slots):
        layer.fill(frozen, slots.index, frozen.gather(frozen.pos, slots.index) >= 0)
    return cache
