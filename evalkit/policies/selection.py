"""Which slots survive, given scores, a budget and a granularity. Shared by every policy.

Selection works in position space (`[B, H_kv, T]`, T = tokens seen), so it is
independent of where the storage put each token: the same scores keep the same
tokens on every layout. Ties go to the earlier position.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _rank_keep(key: torch.Tensor, present: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """Keep the `budget[b]` highest keys of each row among present entries; key: [B, ..., T]."""
    key = key.masked_fill(~present, NEG_INF)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(key.shape[-1]).expand_as(order))
    shape = (-1,) + (1,) * (key.dim() - 1)
    return present & (rank < budget.view(shape))


def _position_space(scores, positions, seen, sink_tokens, recent):
    """Scores laid out by position: (scores [B, H, T], present [B, H, T], protected [B, T], col, live)."""
    B, H, _ = scores.shape
    T = int(seen.max())
    live = positions >= 0
    col = torch.where(live, positions, T)  # empty slots land in a spare column
    pos_scores = torch.full((B, H, T + 1), NEG_INF).scatter(2, col, scores.float().masked_fill(~live, NEG_INF))
    present = torch.zeros(B, H, T + 1, dtype=torch.bool).scatter(2, col, live)
    t = torch.arange(T)
    recent = torch.zeros_like(seen) if recent is None else recent
    protected = (t < sink_tokens) | (t >= (seen - recent)[:, None])  # [B, T]
    return pos_scores[..., :T], present[..., :T], protected, col, live


def _to_slots(keep: torch.Tensor, col: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    keep = torch.cat([keep, torch.zeros(*keep.shape[:2], 1, dtype=torch.bool)], dim=2)
    return keep.gather(2, col) & live


def select_keep(
    scores: torch.Tensor,  # [B, H_kv, N] per slot
    positions: torch.Tensor,  # [B, H_kv, N] -1 = empty
    seen: torch.Tensor,  # [B] tokens seen so far (positions are < seen)
    budget: torch.Tensor,  # [B] tokens to keep per head
    granularity: str,
    block_size: int = 16,
    sink_tokens: int = 0,
    recent: torch.Tensor | None = None,  # [B] most recent positions that are always kept
) -> torch.Tensor:
    """[B, H_kv, N] bool: the live slots to keep."""
    pos_scores, present, protected, col, live = _position_space(scores, positions, seen, sink_tokens, recent)
    if granularity == "head":
        key = pos_scores.masked_fill(protected[:, None, :], float("inf"))
        keep = _rank_keep(key, present, budget) | (present & protected[:, None, :])
    elif granularity == "token":
        token_present = present.any(1)  # [B, T]
        token_score = pos_scores.masked_fill(~present, 0).sum(1) / present.sum(1).clamp(min=1)
        key = token_score.masked_fill(protected, float("inf"))
        keep_token = _rank_keep(key, token_present, budget) | (token_present & protected)
        keep = present & keep_token[:, None, :]
    elif granularity == "page":
        keep = present & _keep_pages(pos_scores, present, protected, budget, block_size)[:, None, :]
    else:
        raise ValueError(f"unknown granularity {granularity!r}")
    return _to_slots(keep, col, live)


def select_adaptive(scores, positions, seen, budget, alpha_safeguard: float = 0.2, sink_tokens: int = 0,
                    recent=None) -> torch.Tensor:
    """Ada-KV's allocation: a layer keeps `budget[b] * H_kv` tokens in all, split across heads by score.

    Each head first keeps its best ceil(alpha_safeguard * budget) tokens and its protected ones;
    the rest of the layer's budget goes to the highest remaining scores of any head.
    """
    pos_scores, present, protected, col, live = _position_space(scores, positions, seen, sink_tokens, recent)
    B, H, T = pos_scores.shape
    key = pos_scores.masked_fill(protected[:, None, :], float("inf"))
    floor = torch.ceil(budget.double() * alpha_safeguard).long()
    forced = _rank_keep(key, present, floor) | (present & protected[:, None, :])
    left = (budget * H - forced.sum((1, 2))).clamp(min=0)
    chosen = _rank_keep(key.masked_fill(forced, NEG_INF).view(B, H * T), (present & ~forced).view(B, H * T), left)
    return _to_slots(forced | chosen.view(B, H, T), col, live)


def _keep_pages(pos_scores, present, protected, budget, block_size) -> torch.Tensor:
    """[B, T] keep whole pages of `block_size` consecutive positions, shared by all heads.

    Pages are ranked by mean token score (protected pages first) and taken while the
    tokens they hold fit in the budget.
    """
    B, H, T = pos_scores.shape
    n_pages = -(-T // block_size)
    pad = n_pages * block_size - T
    token_present = torch.nn.functional.pad(present.any(1), (0, pad))  # [B, T']
    token_sum = torch.nn.functional.pad(pos_scores.masked_fill(~present, 0).sum(1), (0, pad))
    heads = torch.nn.functional.pad(present.sum(1), (0, pad))
    page_tokens = token_present.view(B, n_pages, block_size).sum(-1)
    page_score = token_sum.view(B, n_pages, block_size).sum(-1) / heads.view(B, n_pages, block_size).sum(-1).clamp(min=1)
    page_protected = (torch.nn.functional.pad(protected, (0, pad)) & token_present).view(B, n_pages, block_size).any(-1)
    page_present = page_tokens > 0

    key = page_score.masked_fill(page_protected, float("inf")).masked_fill(~page_present, NEG_INF)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    taken = page_tokens.gather(1, order).cumsum(1)  # tokens held if pages are taken in rank order
    fits = torch.zeros_like(page_present).scatter(1, order, taken <= budget[:, None])
    keep_page = page_present & (fits | page_protected)
    return keep_page.repeat_interleave(block_size, dim=1)[:, :T]
