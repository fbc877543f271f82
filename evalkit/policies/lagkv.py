from dataclasses import dataclass
from typing import Callable

import torch

from evalkit.policies.arguments import PROMPT, arg
from evalkit.policies.base import Policy, ScoreInput
from evalkit.policies.names import register_presets
from evalkit.policies.selection import Granularity


@dataclass
class LagKV(Policy):
    """Lag-relative scores: each partition of `lag_size` tokens is judged against the next one.

    A head's tokens after the sinks, in position order, are cut into partitions of `lag_size`; a
    token's keys and values are min-max normalised per channel by the *next* partition's range, and
    the standard deviation over channels, softmax-ed within the partition, is its key (value) score;
    the token's score is its rank within the partition by the mean of both, over `lag_size` (kvpress's
    LagKVPress without cross scoring). The last whole partition and the remainder after it score 1
    (kept first; a cap under them keeps their earliest, so the prompt's last tokens go first); a prompt
    shorter than sinks + 2 partitions scores by recency. Decode eviction
    re-scores the tokens held, in position order. Equal means of these fractions (a token's over its heads, a
    page's over its pairs) tie exactly, as every tie, and go to the earlier position or page (`select`).
    """

    sink_tokens: int = arg(4, 0, PROMPT)
    lag_size: int = arg(128, 1, PROMPT)
    description = "rank within a 128-token partition of the keys' and values' spread, normalised by the next partition"
    scorer = "lag-relative key/value spread"
    paper = "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important (arXiv:2504.04704)"
    kvpress = "LagKVPress"
    differs = ("its rank scores tie across partitions; ties go to the earlier position, where kvpress's topk leaves "
               "their order open (at keep 0.2, 18 of 100 answers differ from kvpress's: this rule and the token count)")
    arg_aliases = {"lag": "lag_size"}
    not_static = "LagKV partitions each head's tokens by their count, read on the host head by head"

    def score(self, inp: ScoreInput) -> torch.Tensor:
        B, H, N = inp.positions.shape
        scores = torch.zeros(B, H, N, dtype=torch.float32, device=inp.positions.device)
        memo = inp.memo
        if memo is not None and inp.caps is not None and \
                bool(((inp.positions >= 0).sum((1, 2)) - inp.caps * H >= H * self.lag_size).any()):
            memo.clear()  # a prompt's compression: its partitions all move, nothing of the last call holds
            memo = None
        stamps = None if memo is None else inp.stamps
        for b in range(B):
            for h in range(H):
                held = (inp.positions[b, h] >= 0).nonzero()[:, 0]
                order = held[inp.positions[b, h].index_select(0, held).argsort()]  # slots in position order
                seen = None if stamps is None else stamps[b, h].index_select(0, order)
                scores[b, h, order] = self.sequence_scores(inp.keys[b, h], inp.values[b, h], order, seen,
                                                           memo, (b, h))
        return scores

    def sequence_scores(self, keys: torch.Tensor, values: torch.Tensor, order: torch.Tensor,
                        seen: torch.Tensor | None = None, memo: dict | None = None,
                        head: tuple | None = None) -> torch.Tensor:
        """[n] scores of one head's tokens in position order; keys, values: [N, D] the head's slots, `order` [n]
        the held ones in position order. With `seen` (their stamps [n],
        `ScoreInput.stamps`), a `memo` kept between calls (`ScoreInput.memo`) and the `head` (sequence, KV
        head), the partitions the last call for that head worked out from the same tokens keep its ranks, and
        only the rows of the partitions left to work out are gathered (`_ranks`)."""
        n = order.shape[0]
        sink, lag = self.sink_tokens, self.lag_size
        score = torch.ones(n, device=keys.device)
        if n < sink + 2 * lag:
            if n > sink:
                score[sink:] = torch.arange(n - sink, device=keys.device) / (n - sink)
            return score
        end = sink + (n - sink) // lag * lag
        judged = None if seen is None or memo is None else seen[sink:end]

        def rows(first: int) -> tuple[torch.Tensor, torch.Tensor]:
            """[P', lag, D] float32 keys and values of the tokens sink + first .. end - 1 (whole partitions)."""
            slots = order[sink + first:end]  # whole rows copied (index_select): only the partitions to work out
            return tuple(x.index_select(0, slots).float().view(-1, lag, x.shape[-1]) for x in (keys, values))

        score[sink:end - lag] = self._ranks(rows, judged, memo, head).flatten()
        return score

    def _ranks(self, rows: Callable[[int], tuple[torch.Tensor, torch.Tensor]], judged: torch.Tensor | None,
               memo: dict | None, head: tuple | None) -> torch.Tensor:
        """[P - 1, lag] each judged partition's token ranks over lag; `rows(first)`: the partitions' keys and values
        [P - first / lag, lag, D] from token `first` of the first partition on; `judged`: the partitions' tokens'
        stamps [P * lag] (None, or no `memo`: nothing remembered).

        Partition i's ranks read partitions i and i + 1 only, and decode eviction re-scores every step a head whose
        partitions changed only from the evicted token's on: the leading partitions that hold the same tokens
        (the same stamps: the same key and value bits) as in the last call for this `head` keep that call's
        ranks (a function of those bits alone, computed partition by partition), so a step gathers and works out
        the changed tail only."""
        key = ("lagkv_ranks", self.sink_tokens, self.lag_size, head)
        last = None if judged is None else memo.get(key)
        lag, reused = self.lag_size, 0
        if last is not None:
            common = min(len(judged), len(last[0]))
            moved = (judged[:common] != last[0][:common]).nonzero()
            same_partitions = (int(moved[0]) if len(moved) else common) // lag  # at most either call's partitions
            reused = max(0, same_partitions - 1)
        keys, values = rows(reused * lag)
        spread = (self._spread(keys) + self._spread(values)) / 2  # [P - 1 - reused, lag]
        ranks = spread.argsort(-1).argsort(-1) / lag
        if reused:
            ranks = torch.cat([last[1][:reused], ranks])
        if judged is not None:
            memo[key] = (judged, ranks)
        return ranks

    def select(self, scores, positions, seen, caps, page_size, recent, span=None) -> torch.Tensor:
        """The shared selection; where it averages scores (every granularity but head: a token's over its heads, a
        page's over its pairs) it gets their integer numerators instead. LagKV's scores are fractions with one
        denominator per head (`denominators`; one per sequence at token and page granularity, whose heads hold the
        same tokens), and float32 sums of them round: two equal means could differ in their last bit, and rounding
        noise, not the earlier position, would break the tie. Sums of integers are exact, and scaling by the
        denominator keeps every other order. At head granularity nothing is averaged: the scores are kvpress's, as
        they are. A wrapper that rewrites the scores (CriticalKV) selects on its own."""
        if self.granularity != Granularity.HEAD and type(self).score is LagKV.score:
            scores = (scores * self.denominators(positions)).round()
        return super().select(scores, positions, seen, caps, page_size, recent, span)

    def denominators(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, H_kv, 1] each head's score denominator (`sequence_scores`): lag_size, or n - sinks (at least 1)
        when it holds n < sinks + 2 lag_size tokens and scores by recency."""
        held = (positions >= 0).sum(-1, keepdim=True)
        return torch.where(held < self.sink_tokens + 2 * self.lag_size, (held - self.sink_tokens).clamp(min=1),
                           self.lag_size)

    def _spread(self, parts: torch.Tensor) -> torch.Tensor:
        """[P - 1, lag]: each partition's tokens normalised by the next partition's per-channel range."""
        reference, judged = parts[1:], parts[:-1]
        low, high = reference.amin(1, keepdim=True), reference.amax(1, keepdim=True)
        return channel_std((judged - low).div_(high - low)).softmax(-1)


def channel_std(x: torch.Tensor) -> torch.Tensor:
    """`x.std(-1)` as two sums in float64. Decode eviction re-scores every held token each step, and torch's
    CPU `std` over one dimension costs about eight times as much here; the float32 results are the same
    (`tests/test_policies.py::test_lagkv_channel_std_is_torchs_std_bit_for_bit`). One float64 copy, worked in
    place: allocating float64 temporaries cost more than the sums."""
    deviation = x.to(torch.float64, copy=True)
    deviation.sub_(deviation.mean(-1, keepdim=True))
    return (deviation.square_().sum(-1) / (x.shape[-1] - 1)).sqrt().to(torch.float32)


register_presets(LagKV, "lagkv")
