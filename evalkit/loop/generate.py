"""The generation loop: prefill (compressing as the policy says), then decode, with our own cache.

Read: `generate` → `start` (`prefill`, `compress`) → `Decoding` (a step: pick the tokens, `forward`
them, evict). Every forward passes true `position_ids`, so eviction never shifts a token's position.
Teacher forcing through the same cache: `evalkit.loop.teacher_forcing`.
"""

from __future__ import annotations

import time

import torch

from evalkit.attention import evalkit_attention
from evalkit.loop.compression import Budgets, budgets_for, compress, slide
from evalkit.loop.reconstruction import reconstruct, reconstruction_prompts
from evalkit.loop.shared_prefill import SharedPrefill
from evalkit.loop.static_decode import StaticStep, static_step
from evalkit.loop.state import (NO_LIMIT, Generation, GenerationSettings, LoopState, Observer, Request, forward,
                                full_cache_bytes, new_state, split_prompts)
from evalkit.policies.query_moments import QueryMoments


def prefill(state: LoopState, compressed: list[list[int]], appended: list[list[int]], caps: torch.Tensor,
            appended_collect: str | None, shared: SharedPrefill | None = None):
    """Prefill `compressed` (in chunks when chunked; taken from `shared` when given), compressing to
    `caps` [L, B]; then `appended` as is, collecting `appended_collect` for it (the question after
    compression is read like decoded tokens)."""
    settings = state.settings
    longest = max(len(t) for t in compressed)
    chunk = settings.chunk_size if settings.prefill == "chunked" else longest
    if shared is not None:
        logits = shared.fork_into(state)
        compress(state, caps)
    else:
        logits = None
        for start in range(0, longest, chunk):
            step_logits, counts = forward(state, [t[start:start + chunk] for t in compressed])
            logits = step_logits if logits is None else torch.where(counts[:, None] > 0, step_logits, logits)
            if state.reconstruction is not None:  # KVzip: score what was just fed by repeating it
                reconstruct(state, compressed, start, start + chunk)
            compress(state, caps)
    state.collect_moments = False
    if any(appended):
        state.collect = appended_collect
        step_logits, counts = forward(state, appended)
        logits = torch.where(counts[:, None] > 0, step_logits, logits)
        slide(state)
    state.cache.compact()
    if state.observe:
        state.observe("prefill", state.cache)
    return logits


def _next_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""


def _stop_text(text: str, stops: tuple[str, ...]) -> str | None:
    cuts = [text.index(s) for s in stops if s in text]
    return text[: min(cuts)] if cuts else None


class Decoding:
    """One batch under one policy and budget, from the end of its prefill to its last token.

    `generate` steps one; `joint_decode.generate_branches` steps several (branches of a shared prefill) through one
    forward per step. A step: `next_tokens` picks each sequence's token from the last logits (None once
    every sequence is done), the caller feeds them, `advance` takes the new logits and evicts down to
    `caps` [L, B] (decode eviction).
    """

    def __init__(self, state: LoopState, requests: list[Request], tokenizer, logits: torch.Tensor,
                 caps: torch.Tensor, evict: bool, prompt_tokens: torch.Tensor, prefill_seconds: float):
        self.state, self.requests, self.tokenizer = state, requests, tokenizer
        self.logits, self.caps, self.evict = logits, caps, evict
        # What the prefill left, reported with every generation: [B] each.
        self.prompt_tokens, self.prefill_seconds = prompt_tokens, prefill_seconds  # compressed + appended
        self.kept = state.cache.kept_tokens().float().mean(dim=(0, 2))  # mean per layer and KV head
        self.held, self.ideal = state.cache.bytes_held(), state.cache.bytes_ideal()
        self.eos_ids = _eos_ids(state.model, tokenizer)
        self.outputs: list[list[int]] = [[] for _ in requests]
        self.texts: list[str | None] = [None] * len(requests)
        self.generator = torch.Generator().manual_seed(state.settings.seed)
        self.static: StaticStep | None = None  # the decode step with fixed shapes (`loop.static_decode`), if used

    def next_tokens(self) -> list[list[int]] | None:
        """The next token to feed each sequence, or None once every sequence has finished (EOS, a stop
        string or max new tokens). Finished sequences keep feeding their last token; their outputs are
        no longer read."""
        chosen = _next_tokens(self.logits, self.state.settings.temperature, self.generator).tolist()
        for b, token in enumerate(chosen):
            if self.texts[b] is not None:
                continue
            request, output = self.requests[b], self.outputs[b]
            if token in self.eos_ids:
                self.texts[b] = _text(self.tokenizer, output)
                continue
            output.append(token)
            if request.stop:
                self.texts[b] = _stop_text(_text(self.tokenizer, output), request.stop)
            if self.texts[b] is None and len(output) >= request.max_new_tokens:
                self.texts[b] = _text(self.tokenizer, output)
        if all(t is not None for t in self.texts):
            return None
        return [[token] for token in chosen]

    def feed(self, tokens: list[list[int]]) -> None:
        """Feed `next_tokens`' tokens and take the next logits: through the static step when there is one."""
        if self.static is not None:
            self.logits = self.static(tokens)
        else:
            logits, _ = forward(self.state, tokens)
            self.advance(logits)

    def advance(self, logits: torch.Tensor) -> None:
        """Take the logits of the tokens just fed; evict (decode eviction), or drop only what sliding-window layers
        no longer see."""
        self.logits = logits
        if self.evict:
            compress(self.state, self.caps)
        elif self.state.sliding_windows:
            compress(self.state, torch.full_like(self.caps, NO_LIMIT))

    def generations(self, decode_seconds: float) -> list[Generation]:
        timing = {"prefill_seconds": self.prefill_seconds, "decode_seconds": decode_seconds,
                  "prompt_tokens": int(self.prompt_tokens.sum()), "new_tokens": sum(len(o) for o in self.outputs)}
        if self.state.reconstruction is not None:  # KVzip's extra forward, inside the prefill's seconds
            timing["reconstruction_seconds"] = self.state.reconstruction_seconds
        attended, available = self.state.attended, self.state.available
        read = torch.where(available > 0, attended / available.clamp(min=1), 1.0)
        full = full_cache_bytes(self.state, self.prompt_tokens)
        return [Generation(self.outputs[b], self.texts[b], int(self.prompt_tokens[b]), float(self.kept[b]),
                           int(self.held[b]), int(self.ideal[b]), int(full[b]), float(read[b]), timing)
                for b in range(len(self.requests))]


@torch.inference_mode()
def generate(model, tokenizer, requests: list[Request], settings: GenerationSettings,
             observe: Observer | None = None, shared: SharedPrefill | None = None) -> list[Generation]:
    """Generate answers for a batch of requests under one policy and budget; with `shared`, from a
    prefill of the same requests shared with other branches (full prefill only)."""
    with evalkit_attention(model):
        run = start(model, tokenizer, requests, settings, observe, shared)
        run.static = static_step(run.state, run.caps, run.evict, max(r.max_new_tokens for r in requests))
        begun = time.perf_counter()
        while (tokens := run.next_tokens()) is not None:
            run.feed(tokens)
    return run.generations(time.perf_counter() - begun)


def start(model, tokenizer, requests: list[Request], settings: GenerationSettings,
          observe: Observer | None = None, shared: SharedPrefill | None = None,
          later_turns: tuple[int, ...] = ()) -> Decoding:
    """Prefill (compressing as the policy says) and get ready to decode; call inside `evalkit_attention`.
    `later_turns`: the prompt tokens of a conversation's later turns (`loop.conversation`), each answered in up to
    the requests' max new tokens: room for them too."""
    policy = settings.policy
    compressed, appended = split_prompts(requests, settings.query_aware)
    if shared is not None and (settings.prefill != "full" or shared.compressed != compressed):
        raise ValueError("a shared prefill serves full-prefill runs of the same prompts only")
    policy.prepare(model, tokenizer)
    budgets = budgets_for(model, settings, compressed)
    extra = torch.tensor([len(t) for t in appended])
    # Every sequence is fed until the last one finishes (`Decoding.next_tokens`): the batch's longest answer.
    max_new = max(r.max_new_tokens for r in requests)
    begun = time.perf_counter()
    prompts = reconstruction_prompts(tokenizer) if policy.reconstructs and budgets.any_evicting else None
    decode_evicts = budgets.any_evicting and settings.decode_eviction
    room = extra + max_new  # [B] tokens the cache takes after the prefill
    if later_turns:  # decode eviction holds the cache at its first answer's size; else every turn may stay
        room = room + (max(0, max(later_turns) + 1 - max_new) if decode_evicts and policy.holds_caps_while_decoding
                       else sum(later_turns) + len(later_turns) * max_new)
    decode_collect = policy.collect_decode if decode_evicts else None
    forks_compressed = shared is not None and not any(appended) and observe is None
    state = new_state(model, settings, budgets.lengths, budgets.caps, room, observe, with_cache=not forks_compressed)
    state.reconstruction = prompts
    state.collect = policy.collect_prefill if budgets.any_evicting else None
    if policy.reads_query_moments and budgets.any_evicting:  # summed over the compressed prompt only
        state.moments = [shared.moments_for(policy.sink_tokens) if shared is not None
                         else QueryMoments(policy.sink_tokens)]
        state.collect_moments = shared is None
    if forks_compressed:  # the branch's cache receives only what compression keeps (`SharedPrefill.fork_compressed`)
        logits = shared.fork_compressed(state, budgets.caps, room)
    else:
        logits = prefill(state, compressed, appended, budgets.caps, decode_collect, shared)
    prefill_seconds = time.perf_counter() - begun + (shared.seconds if shared is not None else 0.0)

    state.collect = decode_collect
    restrict_reads(state, budgets, extra)
    return Decoding(state, requests, tokenizer, logits, budgets.caps + extra, decode_evicts, budgets.lengths + extra,
                    prefill_seconds)


def restrict_reads(state: LoopState, budgets: Budgets, extra: torch.Tensor) -> None:
    """Install the policy's decode-time read restriction (Quest), if it has one: reads of the budget's
    tokens plus the `extra` [B] appended ones."""
    policy, settings = state.policy, state.settings
    tokens, lengths = budgets.tokens, budgets.lengths
    if policy.restricts_reads:
        read_tokens = torch.where(tokens < lengths, tokens + extra, NO_LIMIT)
        state.attend_filter = lambda layer, query, keys, positions: policy.attended_slots(
            layer, query, keys, positions, read_tokens, settings.page_size)
    state.attended, state.available = torch.zeros(len(lengths)), torch.zeros(len(lengths))


def _eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
