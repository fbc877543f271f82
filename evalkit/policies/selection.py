"""Which slots survive, given scores, a budget and a granularity. Shared by every policy.

Selection works in position space (`[B, H_kv, T]`, T = tokens seen), so it is
independent of where the storage put each token: the same scores keep the same
tokens on every layout. The rules are docs/policies.md's: a unit (head, token,
page) is kept in the order sinks (ascending), other protected positions (most
recent first), then the rest by score (highest first, ties to the earlier
position), until the budget is spent — protected tokens count against it.
"""

from __future__ import annotations

import itertools
from enum import StrEnum

import torch

NEG_INF = float("-inf")


class Granularity(StrEnum):
    """What one eviction decision covers (docs/policies.md); equal to its name as a string."""

    HEAD = "head"  # each (layer, sequence, KV head) keeps its own tokens
    TOKEN = "token"  # one token set per (layer, sequence), shared by its heads
    PAGE = "page"  # whole pages per (layer, sequence), shared by its heads
    HEAD_PAGE = "head_page"  # whole pages per (layer, sequence, KV head)


GRANULARITIES = tuple(Granularity)
PAGE_GRANULARITIES = (Granularity.PAGE, Granularity.HEAD_PAGE)

# Tiers of the keep order; within a tier the secondary key decides (ascending).
SINK, PROTECTED, RANKED, ABSENT = 0, 1, 2, 3


def keep_rank(tier: torch.Tensor, secondary: torch.Tensor) -> torch.Tensor:
    """Rank (0 = kept first) of each entry along the last dim, by (tier, secondary, index), all ascending."""
    order = torch.argsort(secondary, dim=-1, stable=True)
    order = order.gather(-1, torch.argsort(tier.gather(-1, order), dim=-1, stable=True))
    steps = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, steps)


def _drop_at_most_one(scores, positions, seen, caps, sink_tokens, recent, static: bool = False) -> torch.Tensor | None:
    """`head` selection when no head holds more than one token over its budget (decode-time eviction),
    else None: the token ranked last in the keep order leaves. Worked out on the slots themselves, with
    a few reductions instead of the position-space sorts. `static`: the caller guarantees that bound, and
    nothing is read back to the host (`loop.static_decode`)."""
    live = positions >= 0
    excess = live.sum(-1) - caps[:, None]  # [B, H]
    if not static and int(excess.max()) > 1:
        return None
    over = (excess > 0)[..., None]  # [B, H, 1] heads that lose a token
    recent = torch.zeros_like(seen) if recent is None else recent
    ranked = live & (positions >= sink_tokens) & (positions < (seen - recent)[:, None, None])
    has_ranked = ranked.any(-1, keepdim=True)
    # The usual case: every head that loses a token holds an unprotected one, and the lowest score leaves.
    score = scores.float().masked_fill(~ranked, float("inf"))
    last = ranked & (score == score.amin(-1, keepdim=True))
    if static or not bool((has_ranked | ~over).all()):  # a head holding only protected tokens: the keep order decides
        sink = live & (positions < sink_tokens)
        protected = live & (positions >= (seen - recent)[:, None, None])
        last = torch.where(has_ranked, last, _last_in_keep_order(scores.float(), live, sink, protected, positions))
    last &= positions == torch.where(last, positions, -1).amax(-1, keepdim=True)  # ties: the later position
    return live & ~(last & over)


def _last_in_keep_order(scores, present, sink, protected, index) -> torch.Tensor:
    """[..., T] bool: the units ranked last in the keep order (before the tie on `index`), by reductions."""
    tier, secondary = keep_order(scores, present, sink, protected, index)
    tier = tier.masked_fill(~present, -1)
    last = present & (tier == tier.amax(-1, keepdim=True))
    secondary = secondary.masked_fill(~last, NEG_INF)
    return last & (secondary == secondary.amax(-1, keepdim=True))


def _drop_one_token(pos_scores, present, seen, caps, sink, protected) -> torch.Tensor:
    """`token` selection in position space when no sequence holds more than one token over its budget:
    [B, 1, T] bool, the tokens kept (the last in the keep order leaves)."""
    B, H, T = pos_scores.shape
    token_present = present.any(1)  # [B, T]
    token_score = pos_scores.masked_fill(~present, 0).sum(1) / present.sum(1).clamp(min=1)
    position = torch.arange(T, device=present.device).expand(B, T)
    last = _last_in_keep_order(token_score, token_present, sink, protected, position)
    last &= position == torch.where(last, position, -1).amax(-1, keepdim=True)
    over = token_present.sum(-1, keepdim=True) > caps[:, None]  # [B, 1]
    return (token_present & ~(last & over))[:, None, :]


def keep_order(scores, present, sink, protected, index):
    """(tier, secondary) of the keep order; `index` is the unit's position (or page) number."""
    tier = torch.full_like(index, RANKED).masked_fill(protected, PROTECTED).masked_fill(sink, SINK)
    tier = tier.masked_fill(~present, ABSENT)
    index = index.double()
    secondary = torch.where(sink, index, torch.where(protected, -index, -scores.double()))
    return tier, secondary.masked_fill(~present, 0.0)


def position_space(scores, positions, seen, sink_tokens, recent, span: int | None = None):
    """Scores laid out by position: (scores [B, H, T], present [B, H, T], sink, protected [B, T], col, live).
    T = `span` when given (a bound on the positions, fixed for a static decode step), else the most seen."""
    B, H, _ = scores.shape
    device = scores.device
    T = int(seen.max()) if span is None else span
    live = positions >= 0
    col = torch.where(live, positions, T)  # empty slots land in a spare column
    pos_scores = torch.full((B, H, T + 1), NEG_INF, device=device).scatter(
        2, col, scores.float().masked_fill(~live, NEG_INF))
    present = torch.zeros(B, H, T + 1, dtype=torch.bool, device=device).scatter(2, col, live)
    t = torch.arange(T, device=device)
    recent = torch.zeros_like(seen) if recent is None else recent
    sink = (t < sink_tokens).expand(B, T)
    protected = sink | (t >= (seen - recent)[:, None])  # [B, T]
    return pos_scores[..., :T], present[..., :T], sink, protected, col, live


def to_slots(keep: torch.Tensor, col: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    keep = torch.cat([keep, torch.zeros(*keep.shape[:2], 1, dtype=torch.bool, device=keep.device)], dim=2)
    return keep.gather(2, col) & live


def keep_mask(
    scores: torch.Tensor,  # [B, H_kv, N] per slot
    positions: torch.Tensor,  # [B, H_kv, N] -1 = empty
    seen: torch.Tensor,  # [B] tokens seen so far (positions are < seen)
    caps: torch.Tensor,  # [B] tokens to keep per head (rows of caps [L, B], `policies.budget`)
    granularity: str,
    page_size: int = 16,
    sink_tokens: int = 0,
    recent: torch.Tensor | None = None,  # [B] most recent positions that are always kept (within the budget)
    span: int | None = None,  # static decode (`loop.static_decode`): positions < span, at most one token over the cap
) -> torch.Tensor:
    """[B, H_kv, N] bool: the live slots to keep. With `span`, nothing is read back to the host and every
    shape is fixed by `span`: the caller guarantees no head holds more than one token over its cap."""
    if granularity == Granularity.HEAD:
        keep = _drop_at_most_one(scores, positions, seen, caps, sink_tokens, recent, static=span is not None)
        if keep is not None:
            return keep
    pos_scores, present, sink, protected, col, live = position_space(scores, positions, seen, sink_tokens, recent,
                                                                      span)
    B, H, T = pos_scores.shape
    position = torch.arange(T, device=scores.device).expand(B, H, T)
    if granularity == Granularity.TOKEN and (span is not None or int((present.any(1).sum(-1) - caps).max()) <= 1):
        keep = present & _drop_one_token(pos_scores, present, seen, caps, sink, protected)  # a decode step
    elif granularity == Granularity.HEAD:
        tier, secondary = keep_order(pos_scores, present, sink[:, None], protected[:, None], position)
        keep = present & (keep_rank(tier, secondary) < caps[:, None, None])
    elif granularity == Granularity.TOKEN:
        token_present = present.any(1)  # [B, T]
        token_score = pos_scores.masked_fill(~present, 0).sum(1) / present.sum(1).clamp(min=1)
        tier, secondary = keep_order(token_score, token_present, sink, protected, position[:, 0])
        keep = present & (keep_rank(tier, secondary) < caps[:, None])[:, None, :]
    elif granularity in PAGE_GRANULARITIES:
        keep = present & _keep_pages(pos_scores, present, sink, protected, seen, caps, page_size,
                                     per_head=granularity == Granularity.HEAD_PAGE,
                                     rounds=None if span is None else page_size + 1)
    else:
        raise ValueError(f"unknown granularity {granularity!r}")
    return to_slots(keep, col, live)


def _keep_pages(pos_scores, present, sink, protected, seen, caps, page_size, per_head: bool,
                rounds: int | None = None) -> torch.Tensor:
    """Whole pages of `page_size` consecutive positions: [B, 1, T] shared by all heads (`page`) or
    [B, H, T] per head (`head_page`), each head or sequence filled to its cap by `fill_pages`."""
    units = page_units(pos_scores, present, sink, protected, seen, page_size, per_head)
    keep = fill_pages(*units, caps, rounds).repeat_interleave(page_size, dim=-1)[..., :pos_scores.shape[-1]]
    return keep if per_head else keep[:, None, :]


def page_units(pos_scores, present, sink, protected, seen, page_size, per_head: bool):
    """The pages of position space [B, H, T] as units of selection, (score, tokens, present, sink, protected,
    index) [B, H, P] each per head (`head_page`), [B, P] shared by the heads (`page`): a page's score is the
    mean over the (head, token) pairs it holds; its tokens what it costs; it is a sink (protected) page when it
    holds a sink (protected) token, and the page being filled is protected too: the next token goes into it."""
    B, H, T = pos_scores.shape
    S = page_size
    P = -(-T // S)
    pad = P * S - T

    def by_page(x: torch.Tensor) -> torch.Tensor:  # [..., T] -> [..., P, S]
        return torch.nn.functional.pad(x, (0, pad)).view(*x.shape[:-1], P, S)

    if per_head:
        held = by_page(present)  # [B, H, P, S]
        score_sum = by_page(pos_scores.masked_fill(~present, 0)).sum(-1)
        pairs = held.sum(-1)
        tokens = pairs  # [B, H, P]
        sink_p, protected_p = by_page(sink)[:, None], by_page(protected)[:, None]  # [B, 1, P, S]
    else:
        held = by_page(present.any(1))  # [B, P, S]
        score_sum = by_page(pos_scores.masked_fill(~present, 0).sum(1)).sum(-1)
        pairs = by_page(present.sum(1)).sum(-1)  # (head, token) pairs held
        tokens = held.sum(-1)  # [B, P]
        sink_p, protected_p = by_page(sink), by_page(protected)
    page_score = score_sum / pairs.clamp(min=1)
    page_present = tokens > 0
    page_sink = (held & sink_p).any(-1)
    page_protected = (held & protected_p).any(-1)
    filling = torch.where(seen % S != 0, (seen - 1) // S, -1)  # [B]
    page = torch.arange(P, device=pos_scores.device)
    page_protected |= (page == filling[:, None]).view(B, *(1,) * (page_score.dim() - 2), P) & page_present
    return page_score, tokens, page_present, page_sink, page_protected, page.expand_as(page_score)


def fill_pages(page_score, tokens, page_present, page_sink, page_protected, page_index, caps,
               rounds: int | None = None) -> torch.Tensor:
    """[..., P] bool, the pages taken: greedy fill in the keep order (`keep_order` of the units, ties to the
    earlier along the last dim), each page whose tokens still fit in `caps` [B] (one cap per row of the
    leading dim, shared by everything after it), the others skipped. `rounds`: run the fill exactly that many
    rounds, never asking the host whether a page is left (each round rules out at least one page size, so
    page_size + 1 rounds suffice)."""
    tier, secondary = keep_order(page_score, page_present, page_sink, page_protected, page_index)
    order = torch.argsort(keep_rank(tier, secondary), dim=-1)  # page ids in keep order
    count = tokens.gather(-1, order)
    remaining = caps.view(-1, *(1,) * (count.dim() - 1)).clone()
    candidate = count > 0
    taken = torch.zeros_like(candidate)
    for _ in range(rounds) if rounds is not None else itertools.count():
        # Candidates in order whose running total still fits form a prefix; the first that does not fit
        # is skipped, and so is every later page at least as large, since the room only shrinks.
        running = torch.where(candidate, count, 0).cumsum(-1)
        fits = candidate & (running <= remaining)
        taken |= fits
        remaining = remaining - torch.where(fits, count, 0).sum(-1, keepdim=True)
        candidate &= ~fits & (count <= remaining)
        if rounds is None and not bool(candidate.any()):
            break
    return torch.zeros_like(taken).scatter(-1, order, taken)


def select_pages_across_layers(scores, positions, seen, caps, page_size: int, sink_tokens: int = 0,
                               recent=None) -> torch.Tensor:
    """Per-head pages with one budget for every layer and KV head of a sequence: [L, B, H_kv, N] bool.

    scores, positions: [L, B, H_kv, N]; caps, recent: [L, B]. The units are every (layer, KV head, page) of the
    sequence, scored, protected and filled as `head_page`'s (`page_units`, `fill_pages`), in one keep order
    up to sum_l caps[l] x H_kv tokens (ties: lower layer, lower head, earlier page).
    """
    L, B, H, N = scores.shape
    recent = torch.zeros_like(caps) if recent is None else recent
    layer_seen = seen.repeat(L)  # [L * B], layer-major as the rows below
    pos_scores, present, sink, protected, col, live = position_space(
        scores.reshape(L * B, H, N), positions.reshape(L * B, H, N), layer_seen, sink_tokens, recent.reshape(-1))
    units = page_units(pos_scores, present, sink, protected, layer_seen, page_size, per_head=True)
    P = units[0].shape[-1]
    pooled = [unit.view(L, B, H, P).transpose(0, 1).reshape(B, L * H * P) for unit in units]  # [B, L * H * P]
    taken = fill_pages(*pooled, caps.sum(0) * H).view(B, L, H, P).transpose(0, 1).reshape(L * B, H, P)
    keep = present & taken.repeat_interleave(page_size, dim=-1)[..., :pos_scores.shape[-1]]
    return to_slots(keep, col, live).view(L, B, H, N)
