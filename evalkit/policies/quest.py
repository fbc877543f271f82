from dataclasses import dataclass

import torch

from evalkit.policies.arguments import arg
from evalkit.policies.base import Policy, ScoreInput
from evalkit.policies.names import POLICIES
from evalkit.policies.selection import Granularity


@dataclass
class Quest(Policy):
    """Query-aware page selection: nothing is evicted, each decode step reads only the best pages.

    Pages are `page_size` consecutive positions. A page's bound for a query is
    sum_d max(q_d * min_d, q_d * max_d) over the per-channel min and max of its keys, an
    upper bound on any q.k inside it; the query heads of a KV head add their bounds. Each
    step attends to the top max(3, ceil(budget / page_size)) pages of each KV head (at
    `token` granularity: the same pages for every head), the page of the newest token always
    among them; the first two layers read everything, as in the published code. Memory is the
    full cache; what it saves is bandwidth.
    """

    granularity: Granularity = Granularity.HEAD
    dense_layers: int = arg(2, 0)
    min_pages: int = arg(3, 1)
    description = "no eviction; each decode step attends only to the top pages by query-aware key bounds"
    scorer = "per-page key min/max bound"
    paper = "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference (arXiv:2406.10774)"
    evicts = False
    restricts_reads = True
    saves = "bandwidth"
    cannot_run_at = {g: "Quest evicts nothing and already reads whole pages; use quest (per head) or quest_token"
                     for g in (Granularity.PAGE, Granularity.HEAD_PAGE)}

    def score(self, inp: ScoreInput) -> torch.Tensor:
        return torch.zeros_like(inp.statistic)

    def attended_slots(self, layer: int, query: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                       read_tokens: torch.Tensor, page_size: int) -> torch.Tensor:
        """[B, H_kv, N] bool: the slots one decode query reads. query: [B, H_q, D]; keys: [B, H_kv, N, D]."""
        B, H_kv, N, D = keys.shape
        live = positions >= 0
        if layer < self.dense_layers:
            return live
        page = torch.where(live, positions // page_size, 0)  # [B, H_kv, N]
        n_pages = int(page.max()) + 1
        lo = torch.full((B, H_kv, n_pages, D), float("inf"), device=keys.device).scatter_reduce(
            2, page[..., None].expand(-1, -1, -1, D), keys.float().masked_fill(~live[..., None], float("inf")), "amin")
        hi = torch.full((B, H_kv, n_pages, D), float("-inf"), device=keys.device).scatter_reduce(
            2, page[..., None].expand(-1, -1, -1, D), keys.float().masked_fill(~live[..., None], float("-inf")), "amax")
        q = query.float().view(B, H_kv, -1, 1, D)  # [B, H_kv, G, 1, D]
        bound = torch.maximum(q * lo[:, :, None], q * hi[:, :, None]).sum(-1).sum(2)  # [B, H_kv, P]
        present = torch.isfinite(lo[..., 0])  # pages holding a live token
        bound = bound.masked_fill(~present, float("-inf"))
        if self.granularity != Granularity.HEAD:
            bound = bound.mean(1, keepdim=True).expand_as(bound)
        newest = positions.amax(-1) // page_size  # [B, H_kv]
        bound = bound.scatter(2, newest[..., None], float("inf"))
        order = torch.sort(bound, dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n_pages, device=keys.device).expand_as(order))
        pages_kept = (-(-read_tokens.to(keys.device) // page_size)).clamp(min=self.min_pages)  # [B]
        chosen = present & (rank < pages_kept[:, None, None])  # [B, H_kv, P]
        return live & chosen.gather(2, page)


POLICIES.register("quest", lambda: Quest(name="quest"), aliases=("quest_head",))
POLICIES.register("quest_token", lambda: Quest(granularity=Granularity.TOKEN, name="quest_token"))
