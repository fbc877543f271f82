from dataclasses import dataclass

import torch

from evalkit.policies.arguments import arg
from evalkit.policies.base import Policy
from evalkit.policies.names import POLICIES, register_wrapper
from evalkit.policies.scorers import SCORERS
from evalkit.policies.selection import (ABSENT, RANKED, Granularity, keep_order, keep_rank, position_space,
                                         to_slots)


def adakv_of(wrapped: type[Policy]) -> type[Policy]:
    """`wrapped`'s scores with Ada-KV's allocation (kvpress's AdaKVPress(press))."""

    @dataclass
    class AdaKV(wrapped):
        """Any scorer's scores with Ada-KV's allocation: one budget per layer, split across KV heads by score.

        A layer keeps budget x H_kv tokens in all; each head first keeps its protected tokens and its
        best `alpha_safeguard` x budget tokens, the rest go to the highest scores of any head. Heads that
        attend sharply give up slots to heads that attend broadly, so heads hold different numbers of
        tokens, and with the paged cache the pages they give up are really freed.
        """

        granularity: Granularity = Granularity.HEAD
        alpha_safeguard: float = arg(0.2, 0.0, 1.0)
        description = f"{wrapped.scorer} scores; one budget per layer split across KV heads by score (adaptive)"
        scorer = f"{wrapped.scorer}, adaptive head budgets"
        paper = "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation (arXiv:2407.11550)"
        kvpress = f"AdaKVPress({wrapped.kvpress.split(' ')[0]})" if wrapped.kvpress else ""
        differs = "at token and page granularity there is one set for all heads, nothing to reallocate: it is the scorer alone"
        cannot_run_at = {Granularity.HEAD_PAGE: "Ada-KV allocates single tokens across heads; it has no per-head page variant"}

        not_static = "Ada-KV reallocates each layer's budget across its heads on the host"

        def select(self, scores, positions, seen, caps, page_size, recent, span=None):
            if self.granularity != Granularity.HEAD:  # one token set for all heads: nothing to reallocate
                return super().select(scores, positions, seen, caps, page_size, recent, span)
            return select_adaptive(scores, positions, seen, caps, self.alpha_safeguard, self.sink_tokens, recent)

    AdaKV.__name__ = AdaKV.__qualname__ = f"Ada{wrapped.__name__}"
    return AdaKV


def select_adaptive(scores, positions, seen, caps, alpha_safeguard: float = 0.2, sink_tokens: int = 0,
                    recent=None) -> torch.Tensor:
    """Ada-KV's allocation: a layer keeps `budget[b] * H_kv` tokens in all, split across heads by score.

    Each head first keeps its protected tokens (at most its cap, in the keep order) and its best
    ceil(alpha_safeguard * cap); the rest of the layer's budget goes to the highest remaining
    scores of any head (ties: lower head, earlier position).
    """
    keep = _drop_the_last_few(scores, positions, seen, caps, alpha_safeguard, sink_tokens, recent)
    if keep is None:
        keep = _select_adaptive_by_sorting(scores, positions, seen, caps, alpha_safeguard, sink_tokens, recent)
    return keep


# Up to this many tokens over a layer's budget (a decode step brings one per head), the pool's last tokens are
# found by one reduction each instead of sorting the whole layer's tokens twice.
_FEW = 8


def _drop_the_last_few(scores, positions, seen, caps, alpha_safeguard, sink_tokens, recent) -> torch.Tensor | None:
    """`select_adaptive` where no layer row holds more than `_FEW` tokens over its budget, every head's protected
    tokens fit its cap and no live score is NaN, else None. Then each head's pool is its lowest-scored unprotected
    tokens after its safeguard, and the tokens leaving are the pool's last in its order, taken one at a time:
    the lowest score (ties: the later head, then the later position), from a head whose pool is not spent."""
    H = positions.shape[1]
    live = positions >= 0
    recent = torch.zeros_like(seen) if recent is None else recent
    protected = live & ((positions < sink_tokens) | (positions >= (seen - recent)[:, None, None]))
    held, n_protected = live.sum(-1), protected.sum(-1)  # [B, H]
    over = held.sum(-1) - caps * H  # [B] tokens that leave each row
    score = scores.float()
    most_over, protected_overflow, nan = torch.stack(
        [over.max(), (n_protected > caps[:, None]).any(), score.isnan().logical_and(live).any()]).tolist()
    if most_over > _FEW or protected_overflow or nan:
        return None
    floor = torch.ceil(caps.double() * alpha_safeguard).long()[:, None]
    pool = held - torch.maximum(n_protected, torch.minimum(floor, caps[:, None]))  # [B, H] (none if <= 0)
    ranked = live & ~protected
    order = torch.arange(H, device=positions.device)[:, None] * (positions.amax() + 1) + positions  # the pool's ties
    left = torch.zeros_like(live)
    for step in range(most_over):
        open_ = ranked & ~left & (left.sum(-1) < pool)[..., None] & (step < over)[:, None, None]
        lowest = score.masked_fill(~open_, float("inf"))
        lowest = open_ & (lowest == lowest.amin((1, 2), keepdim=True))
        left |= lowest & (order == order.masked_fill(~lowest, -1).amax((1, 2), keepdim=True))
    return live & ~left


def _select_adaptive_by_sorting(scores, positions, seen, caps, alpha_safeguard, sink_tokens, recent) -> torch.Tensor:
    """`select_adaptive` in position space, by the keep order's and the pool's sorts: any case."""
    pos_scores, present, sink, protected, col, live = position_space(scores, positions, seen, sink_tokens, recent)
    B, H, T = pos_scores.shape
    tier, secondary = keep_order(pos_scores, present, sink[:, None], protected[:, None], torch.arange(T, device=scores.device).expand(B, H, T))
    n_protected = (present & protected[:, None]).sum(-1)  # [B, H]
    head_cap = caps[:, None]
    floor = torch.ceil(caps.double() * alpha_safeguard).long()[:, None]
    forced_count = torch.maximum(torch.minimum(n_protected, head_cap), torch.minimum(floor, head_cap))
    forced = present & (keep_rank(tier, secondary) < forced_count[..., None])
    left = (caps * H - forced.sum((1, 2))).clamp(min=0)  # [B]
    pool = present & ~forced
    pool_tier = torch.where(pool, RANKED, ABSENT).view(B, H * T)
    pool_rank = keep_rank(pool_tier, (-pos_scores.double()).masked_fill(~pool, 0.0).view(B, H * T))
    chosen = pool & (pool_rank < left[:, None]).view(B, H, T)
    return to_slots(forced | chosen, col, live)


for _base, _scorer in SCORERS.items():
    POLICIES.register(f"adakv_{_base}", lambda c=adakv_of(_scorer), n=f"adakv_{_base}": c(name=n),
                      aliases=("adakv",) if _base == "snapkv" else ())
register_wrapper("adakv", tuple(SCORERS))
