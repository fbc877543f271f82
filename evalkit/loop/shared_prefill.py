"""One prefill of a batch's prompts, shared by every branch: each (policy, budget, ...) settings that
continues it, such as the runs of a sweep.

In full-prefill mode the prompt's forward pass does not depend on the policy (a layer's first
tokens attend to themselves the same way whatever the storage or statistic:
`evalkit.attention_ops.prompt_attention`), so `share_prefill` runs it once, recording each layer's K/V
and every statistic the branches need, and `generate(..., shared=)` gives each branch the cache its own
forward and compression would have left: a branch whose prompt is compressed whole (query-aware, the
usual case) chooses its tokens on a copy of the prompt stored once for every branch of its layout, and
its own cache receives only the tokens it keeps (`SharedPrefill.fork_compressed`); a branch whose
question is appended after compression stores the whole prompt, compresses it and goes on as its own
run would (`SharedPrefill.fork_into`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from evalkit.attention import PromptRecord, evalkit_attention, store_statistic
from evalkit.cache import KVCache
from evalkit.loop.compression import slots_to_keep
from evalkit.loop.reconstruction import reconstruct, reconstruction_prompts
from evalkit.loop.state import (GenerationSettings, LoopState, Request, advance, forward, left_padded, new_cache,
                                 split_prompts)
from evalkit.policies import Policy, make_policy
from evalkit.policies.query_moments import QueryMoments


MOMENTS = "queries"  # a statistic key's kind for the prompt queries' moments: (MOMENTS, skip)
RECONSTRUCTION = "reconstruction"  # KVzip's reconstruction scores: (RECONSTRUCTION, (chunk size, sinks))


def statistic_key(policy: Policy, collect: str | None) -> tuple | None:
    """How a shared prefill names the statistic `collect` of `policy`: (collect, its window or 0)."""
    if collect is None:
        return None
    return collect, policy.observation_window if collect == "window" else 0


def reconstruction_key(policy: Policy) -> tuple | None:
    """How a shared prefill names `policy`'s reconstruction scores (None: it reconstructs nothing)."""
    return (RECONSTRUCTION, (policy.chunk_size, policy.sink_tokens)) if policy.reconstructs else None


def prefill_statistics(policy: Policy) -> set[tuple]:
    """Every statistic a shared prefill records for `policy`'s compression: its prefill statistic or its
    reconstruction scores and, when it reads them, the prompt queries' moments (MOMENTS, the positions they skip)."""
    keys = {statistic_key(policy, policy.collect_prefill), reconstruction_key(policy)} - {None}
    return keys | {(MOMENTS, policy.sink_tokens)} if policy.reads_query_moments else keys


@dataclass
class SharedPrefill:
    """One full prefill of a batch's compressed prompts, forked into any number of branches."""

    compressed: list[list[int]]  # the prompts prefilled, as `split_prompts` gives them
    record: PromptRecord
    logits: torch.Tensor  # [B, V] float32 after each prompt's last token
    seconds: float  # the whole shared prefill, reconstructions included
    moments: list[QueryMoments] = field(default_factory=list)  # the queries' moments, one per skip asked for
    reconstruction_seconds: dict = field(default_factory=dict)  # reconstruction key -> seconds it took

    # The prompts stored once per storage shape: (layout, page size, pool pages, tokens after the prefill)
    # -> (the cache, each layer's slots, {statistic key: the same storage with that statistic}).
    _stored: dict = field(default_factory=dict, repr=False)
    # Per layer, what forks that store the whole prompt computed of it per slot (`KeptPerSlot.share_kept`).
    _kept: dict = field(default_factory=dict, repr=False)

    def fork_into(self, state: LoopState) -> torch.Tensor:
        """Store the prefill in `state`'s empty cache with the statistic `state.collect`; the last logits."""
        key = self._statistic(state)
        valid, positions = self._positions(state)
        for layer_idx, layer in enumerate(state.cache.layers):
            k, v, stats = self.record.layers[layer_idx]
            slots = layer.append(k, v, positions, valid)
            layer.share_kept(self._kept.setdefault(layer_idx, []))
            if key is not None:
                store_statistic(layer, slots, state.collect, stats[key], valid)
        self._advance(state, valid, key)
        if state.observe:
            state.observe("forward", state.cache)
        return self.logits.clone()

    def fork_compressed(self, state: LoopState, caps: torch.Tensor, after_prefill: torch.Tensor) -> torch.Tensor:
        """`fork_into`, `compress` to `caps` [L, B] and compaction, for a branch with no cache yet,
        without storing what compression drops: the policy chooses on the prompt as `fork_into` would have
        stored it (kept here, shared by every branch of the same storage shape), and the branch's new cache,
        sized for what it keeps plus `after_prefill` [B], receives the kept tokens in their order, as
        compaction would have left them. The last logits."""
        valid, positions = self._positions(state)
        key = self._statistic(state)
        stored = self._stored_with(state, after_prefill, valid, positions, key)
        self._advance(state, valid, key)
        chosen = slots_to_keep(state, stored.layers, caps)
        choices = [(layer.slot_index(), layer.gather(layer.pos, layer.slot_index()) >= 0) if c is None else c
                   for layer, c in zip(stored.layers, chosen)]
        kept = torch.stack([keep.sum(-1).amax(-1) for _, keep in choices]).amax(0)  # [B] most a head keeps
        peak = kept if state.settings.layout == "paged" else valid.sum(1)  # a dense buffer's width shows in views
        state.cache = new_cache(state.model, state.settings, peak.cpu(), after_prefill)
        for layer, source, (index, keep) in zip(state.cache.layers, stored.layers, choices):
            layer.fill(source, index, keep)
        return self.logits.clone()

    def _stored_with(self, state: LoopState, after_prefill: torch.Tensor, valid: torch.Tensor,
                     positions: torch.Tensor, key: tuple | None) -> KVCache:
        """The prompts as `fork_into` stores them in a new cache of `state`'s settings, with statistic `key`."""
        settings = state.settings
        shape = (settings.layout, settings.page_size, settings.pool_pages, tuple(after_prefill.tolist()))
        if shape not in self._stored:
            cache = new_cache(state.model, settings, valid.sum(1).cpu(), after_prefill)
            slots = [layer.append(k, v, positions, valid) for layer, (k, v, _) in zip(cache.layers, self._kvs())]
            self._stored[shape] = (cache, slots, {})
        cache, slots, with_statistic = self._stored[shape]
        if key is None:
            return cache
        if key not in with_statistic:  # the same K, V and tables; its own statistic
            layers = []
            for layer, layer_slots, (_, _, stats) in zip(cache.layers, slots, self._kvs()):
                layer = copy.copy(layer)
                layer.stats = torch.zeros_like(layer.stats)
                store_statistic(layer, layer_slots, state.collect, stats[key], valid)
                layers.append(layer)
            with_statistic[key] = KVCache(layers, cache.layout)
        return with_statistic[key]

    def moments_for(self, skip: int) -> QueryMoments:
        """The prompts' query moments at positions >= `skip` (read only: nothing adds to them after the prefill)."""
        found = [m for m in self.moments if m.skip == skip]
        if not found:
            raise ValueError(f"the shared prefill recorded query moments skipping {[m.skip for m in self.moments]}, "
                             f"not {skip}")
        return found[0]

    def _kvs(self):
        return [self.record.layers[layer_idx] for layer_idx in range(len(self.record.layers))]

    def _statistic(self, state: LoopState) -> tuple | None:
        """The statistic a branch's prefill stores: its reconstruction scores when it reconstructs (KVzip,
        evicting), else the one it collects."""
        key = reconstruction_key(state.policy) if state.reconstruction is not None else \
            statistic_key(state.policy, state.collect)
        if key is not None and key not in self.record.statistics:
            raise ValueError(f"the shared prefill recorded {self.record.statistics}, not {key}")
        return key

    def _positions(self, state: LoopState) -> tuple[torch.Tensor, torch.Tensor]:
        """valid and positions [B, T] of the prompts' tokens, on the model's device."""
        _, valid, positions = left_padded(self.compressed, state.seen)
        device = state.model.device
        return valid.to(device), positions.to(device)

    def _advance(self, state: LoopState, valid: torch.Tensor, key: tuple | None) -> None:
        """The branch has seen the prompts, scored when it stored a statistic (`key`)."""
        advance(state.seen, state.stat_end, valid.sum(1).cpu(), scored=key is not None)
        if key in self.reconstruction_seconds:
            state.reconstruction_seconds = self.reconstruction_seconds[key]


@torch.inference_mode()
def share_prefill(model, requests: list[Request], query_aware: bool, statistics: set[tuple],
                  tokenizer=None) -> SharedPrefill:
    """The full prefill of `requests`' compressed prompts, once, with every statistic in `statistics`
    (reconstruction scores asked with `tokenizer`'s prompts, as each branch's own prefill would)."""
    compressed, _ = split_prompts(requests, query_aware)
    settings = GenerationSettings(policy=make_policy("full"))
    start = torch.zeros(len(requests), dtype=torch.long)
    moments = [QueryMoments(skip) for kind, skip in sorted(statistics) if kind == MOMENTS]
    state = LoopState(model, None, settings.policy, settings, start, start.clone(),
                      record=PromptRecord(sorted(s for s in statistics if s[0] not in (MOMENTS, RECONSTRUCTION))),
                      moments=moments, collect_moments=bool(moments))
    began = time.perf_counter()
    seconds = {}
    with evalkit_attention(model):
        logits, _ = forward(state, compressed)
        for key in sorted(s for s in statistics if s[0] == RECONSTRUCTION):
            seconds[key] = _reconstructed(model, tokenizer, compressed, state.record, key)
    return SharedPrefill(compressed, state.record, logits, time.perf_counter() - began, moments, seconds)


def _reconstructed(model, tokenizer, compressed: list[list[int]], record: PromptRecord, key: tuple) -> float:
    """Add KVzip's reconstruction scores `key` to `record`: `reconstruct` on a cache holding the recorded
    prompts, as a branch's own prefill leaves its cache. The seconds it took."""
    chunk_size, sinks = key[1]
    policy = make_policy("kvzip", args={"chunk_size": str(chunk_size), "sink_tokens": str(sinks)})
    settings = GenerationSettings(policy=policy)
    _, valid, positions = left_padded(compressed, torch.zeros(len(compressed), dtype=torch.long))
    lengths = valid.sum(1)
    cache = new_cache(model, settings, lengths, torch.zeros_like(lengths))
    device = model.device
    layers = [record.layers[layer_idx] for layer_idx in range(len(cache.layers))]
    slots = [layer.append(k, v, positions.to(device), valid.to(device)) for layer, (k, v, _) in zip(cache.layers, layers)]
    state = LoopState(model, cache, policy, settings, lengths.clone(), lengths.clone(),
                      reconstruction=reconstruction_prompts(tokenizer))
    reconstruct(state, compressed)
    for layer, layer_slots, (_, _, stats) in zip(cache.layers, slots, layers):
        stats[key] = layer.gather(layer.stats, layer_slots)
    record.statistics.append(key)
    return state.reconstruction_seconds
