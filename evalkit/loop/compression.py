"""Where budget meets policy meets cache: the caps each layer is evicted down to (`Budgets`), the slots
the policy keeps (`slots_to_keep`) and the eviction itself (`compress`).

A sliding-window layer (window W: a query at position q sees the keys in (q - W, q]) first drops, for every
policy and budget, the tokens no later query can see (positions <= seen - W, `in_window`), so that between
forwards it holds at most W - 1 tokens, as transformers' own cache does; the policy then evicts within what is
left, down to the layer's cap (`sliding_caps`). The storage stays storage and the policy never sees the dropped
tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from evalkit.cache import SlotView, model_kv_shape
from evalkit.loop.state import NO_LIMIT, GenerationSettings, LoopState
from evalkit.models import output_projection, rope_of
from evalkit.policies import PAGE_GRANULARITIES, ScoreInput, tokens_for
from evalkit.policies.budget import at_least_one_page


@dataclass
class Budgets:
    """A batch's budget in every shape the loop needs (`policies.budget` names them)."""

    lengths: torch.Tensor  # [B] tokens of each compressed prompt
    tokens: torch.Tensor  # [B] the budget in tokens per KV head
    evicting: torch.Tensor  # [B] bool: the budget is below the prompt (and the policy evicts)
    caps: torch.Tensor  # [L, B] tokens per KV head of each layer; NO_LIMIT where not evicting

    @property
    def any_evicting(self) -> bool:
        return bool(self.evicting.any())


def budgets_for(model, settings: GenerationSettings, compressed: list[list[int]]) -> Budgets:
    """The budgets of the compressed prompts under `settings`."""
    policy = settings.policy
    lengths = torch.tensor([len(t) for t in compressed])
    tokens = tokens_for(settings.budget, lengths)
    evicting = (tokens < lengths) & policy.evicts
    num_layers = model_kv_shape(model.config)[0]
    # A sequence at full budget is never evicted, not even while decoding.
    caps = torch.where(evicting, torch.minimum(policy.layer_caps(tokens, lengths, num_layers), lengths), NO_LIMIT)
    if policy.granularity in PAGE_GRANULARITIES:
        caps = at_least_one_page(caps, lengths, settings.page_size)
    return Budgets(lengths, tokens, evicting, caps)


def compress(state: LoopState, caps: torch.Tensor) -> None:
    """Evict down to `caps[l, b]` tokens per head in layer l, as the policy chooses (`slots_to_keep`)."""
    _evict(state, caps)
    if state.observe:
        state.observe("compressed", state.cache)


def slide(state: LoopState) -> None:
    """Drop what no later query of a sliding-window layer can see, nothing else (`compress` does it too)."""
    if state.sliding_windows:
        _evict(state, torch.full((len(state.cache.layers), len(state.seen)), NO_LIMIT))


def _evict(state: LoopState, caps: torch.Tensor) -> None:
    for layer, chosen in zip(state.cache.layers, slots_to_keep(state, state.cache.layers, caps)):
        if chosen is not None:
            layer.evict(*chosen)


def sliding_caps(state: LoopState, caps: torch.Tensor) -> torch.Tensor:
    """caps [L, B] in force: a sliding layer of window W keeps at most W - 1 tokens per head, the most its next
    query can see: `sliding_layers` "budget" (the default) caps it at min(its budget, W - 1), "window" at W - 1
    whatever the budget (which then evicts in global layers only)."""
    if not state.sliding_windows:
        return caps
    window_only = state.settings.sliding_layers == "window"
    caps = caps.clone()
    for layer, sliding_window in enumerate(state.sliding_windows):
        if sliding_window is not None:
            caps[layer] = sliding_window - 1 if window_only else caps[layer].clamp(max=sliding_window - 1)
    return caps


def in_window(state: LoopState, view: SlotView, layer_idx: int) -> SlotView:
    """`view` of layer `layer_idx` with the tokens no later query can see shown as empty slots (position -1):
    in a sliding layer of window W the positions <= seen - W. The view itself where there are none."""
    sliding_window = state.sliding_windows[layer_idx] if state.sliding_windows else None
    if sliding_window is None:
        return view
    stale = (view.pos >= 0) & (view.pos <= (state.seen.to(view.pos.device) - sliding_window)[:, None, None])
    if not bool(stale.any()):
        return view
    return SlotView(view.layer, view.index, view.pos.masked_fill(stale, -1))


def _padded_to(x: torch.Tensor, width: int, fill: float = 0.0) -> torch.Tensor:
    """x [..., n] widened to [..., width] with `fill`; x itself when already that wide (no copy)."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]), value=fill)


def protected_recent(policy, caps: torch.Tensor, seen: torch.Tensor, stat_end: torch.Tensor) -> torch.Tensor:
    """[L, B] the most recent tokens each (layer, sequence) keeps before any score: the policy's recent window,
    plus the tokens fed since its statistic was last collected (they have no score yet), at most the cap."""
    unscored = seen - stat_end if policy.needs_statistic else torch.zeros_like(seen)
    return torch.minimum(policy.recent_count(caps) + unscored, caps)


def slots_to_keep(state: LoopState, layers, caps: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per layer of `layers` (a cache's, or the same tokens stored elsewhere): (slot index, keep) [B, H_kv, N]
    each, the slots the policy keeps at `caps[l, b]` tokens per head, or None when it holds no more.

    Tokens fed since the last statistic was collected have no score: a policy that needs one
    keeps them, as the most recent tokens (docs/policies.md). Each layer is scored on its own;
    selection never mixes the rows of a batch, so the layers' rows are selected in one call. A sliding
    layer's caps are `sliding_caps`'s, and the policy chooses among the tokens `in_window` leaves it.
    """
    policy = state.policy
    caps = sliding_caps(state, caps)
    recents = protected_recent(policy, caps, state.seen, state.stat_end)  # [L, B]
    over = []  # (layer index, slot index, positions, scores; [B, H_kv, N] each) of the layers over their caps
    fewest_kept = caps.amin(1).tolist()  # [L]
    pooled = policy.selects_across_layers  # one budget for all layers: every layer is selected, or none
    whole = [layer.read(trim=True) for layer in layers]
    views = [in_window(state, view, layer_idx) for layer_idx, view in enumerate(whole)]
    # A layer holding tokens its window lost drops them whatever the policy keeps.
    chosen: list[tuple[torch.Tensor, torch.Tensor] | None] = [
        None if view is read else (view.index, view.pos >= 0) for view, read in zip(views, whole)]
    if pooled and _within_pooled(views, caps):
        return chosen
    for layer_idx, view in enumerate(views):
        within = view.index.shape[-1] <= fewest_kept[layer_idx] if view.all_live else \
            bool(((view.pos >= 0).sum(-1).cpu() <= caps[layer_idx][:, None]).all())  # all_live: each head holds N
        if within and not pooled:
            continue
        scores = policy.score(score_input(state, view, layer_idx, caps[layer_idx], state.stat_end))
        over.append((layer_idx, view.index, view.pos, scores))  # not the view: it may hold the keys
    if over:
        layer_ids, indexes, positions, scores = (list(column) for column in zip(*over))
        width = max(index.shape[-1] for index in indexes)  # ragged layers padded with empty slots
        scores = torch.cat([_padded_to(x, width) for x in scores]).cpu()
        positions = torch.cat([_padded_to(pos, width, -1) for pos in positions]).cpu()
        if pooled:
            B = len(state.seen)
            keep = policy.select_layers(scores.view(len(over), B, *scores.shape[1:]),
                                        positions.view(len(over), B, *positions.shape[1:]), state.seen,
                                        caps[layer_ids], state.settings.page_size, recents[layer_ids]).flatten(0, 1)
        else:
            keep = policy.select(scores, positions, state.seen.repeat(len(over)), caps[layer_ids].reshape(-1),
                                 state.settings.page_size, recents[layer_ids].reshape(-1))  # [layers * B, H_kv, width]
        for layer_idx, index, rows, held in zip(layer_ids, indexes, keep.split(len(state.seen)),
                                                positions.split(len(state.seen))):
            if not pooled:  # a sequence whose heads all hold <= their cap is left alone, whatever its batch mates hold
                within = ((held >= 0).sum(-1) <= caps[layer_idx][:, None]).all(-1)  # [B]
                rows = torch.where(within[:, None, None], held >= 0, rows)
            chosen[layer_idx] = (index, rows[..., :index.shape[-1]].to(index.device))
    return chosen


def score_input(state: LoopState, view, layer_idx: int, caps: torch.Tensor, stat_end: torch.Tensor,
                span: int | None = None) -> ScoreInput:
    """What the policy's scorer reads of one layer's `view` (a `SlotView`): what it reads is gathered then.
    A static step (`span` given) keeps no per-token memo: it would read the host for the tokens to compute."""
    layer = view.layer
    remembered = None if span is not None else lambda name, of_values: layer.per_slot(
        name, view.index, lambda slots: of_values(layer.gather_kv(layer.v, slots)))
    return ScoreInput(None, view.pos, view.stats, layer_idx, state.settings.seed, stat_end, caps=caps, span=span,
                      remembered=remembered, memo=None if span is not None else layer.scorer_memo,
                      sources={"keys": lambda: view.k, "key_norms": lambda: view.key_norms, "values": lambda: view.v,
                               "stamps": lambda: layer.gather(layer.stamps(), view.index),
                               "queries": lambda: state.moments[0], "rope": lambda: rope_of(state.model),
                               "output_projection": lambda: output_projection(state.model, layer_idx)})


def _within_pooled(views, caps: torch.Tensor) -> bool:
    """True when no sequence holds more tokens, over all layers' `views` and KV heads, than its pooled budget
    sum_l caps[l]."""
    held = [(view.pos >= 0).sum(-1).cpu() for view in views]  # [B, H_kv] each
    return bool((sum(h.sum(-1) for h in held) <= caps.sum(0) * held[0].shape[-1]).all())
