"""What a layer keeps derived from each slot's token, so a decode step does not recompute it over every kept
token: the keys' norms (`key_norms`: written with every key once asked for, so a static step reads them too)
and quantities that also depend on the slot's KV head (`per_slot`: computed lazily for the slots written
since the last ask), and each slot's stamp (`stamps`: kept from the first ask on, new with every write, carried
when the token moves), by which a scorer's memo knows a token it saw before. `KeptPerSlot` holds these methods of
`SlotLayer` (evalkit/cache/storage.py); every write of a slot calls `_kept_written`, every write through a
packed layer's view `_kept_after_packed`.
Forks of one shared prefill that store its whole prompt share what `per_slot` computes first (`share_kept`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


# Per device, the next stamp; a tensor, so that a CUDA graph's replay (a static decode step) takes new ones too.
_NEXT_STAMP: dict[torch.device, torch.Tensor] = {}


def new_stamps(n: int, device: torch.device) -> torch.Tensor:
    """[n] int64 stamps never handed out before in this process: one per slot written, so a token written again
    at the same position, in the same slot or in another sequence or head, never looks like one seen before."""
    if device not in _NEXT_STAMP:
        with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode
            _NEXT_STAMP[device] = torch.zeros((), dtype=torch.long, device=device)
    counter = _NEXT_STAMP[device]
    stamps = torch.arange(n, dtype=torch.long, device=device) + counter
    counter += n
    return stamps


def key_norms_of(k: torch.Tensor) -> torch.Tensor:
    """[...] float64 L2 norms of keys [..., D] (float32 would order near-equal norms by rounding noise)."""
    return torch.linalg.vector_norm(k, dim=-1, dtype=torch.float64)


def first_where(mask: torch.Tensor, m: int) -> torch.Tensor:
    """[..., m] the indices of the first m places of `mask` [..., N] that hold, in order along the last dimension
    (padded with places that do not, where fewer hold): a head's lowest free slots, or its stale ones."""
    if m == 1:  # decoding: argmax returns the first place that holds
        return mask.to(torch.int8).argmax(-1, keepdim=True)
    return torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices[..., :m]


@dataclass
class KeptOfPrompt:
    """What a layer's `per_slot` computed first while it held a shared prefill's prompt and nothing else, for the
    later forks whose layer holds the same tokens in the same slots (`KeptPerSlot.share_kept`)."""

    index: torch.Tensor  # the layer's slot_index() then
    pos: torch.Tensor  # [slots] its positions then
    dtype: torch.dtype  # its K and V's
    kept: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # `per_slot`'s memo

    def held_by(self, layer: "KeptPerSlot") -> bool:
        """Whether `layer` holds exactly these tokens in these slots (every fork stores the same K, V)."""
        index = layer.slot_index()
        return self.dtype == layer.v.dtype and self.pos.shape == layer.pos.shape and \
            self.index.shape == index.shape and torch.equal(self.pos, layer.pos) and torch.equal(self.index, index)


class KeptPerSlot:
    """`SlotLayer`'s kept per-slot quantities, mixed into it: uses its slot arrays (`k`, `pos`) and `gather`."""

    def _init_kept(self) -> None:
        self._stamps: torch.Tensor | None = None  # [slots] int64, kept from the first `stamps()` on
        self._key_norms: torch.Tensor | None = None  # [slots] float64, kept from the first `key_norms()` on
        # name -> (each slot's value [slots], fresh [slots] bool: not written since): `per_slot`'s memo
        self._remembered: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._of_prompt: KeptOfPrompt | None = None  # where a shared prefill's fork gives what it computes first

    def stamps(self) -> torch.Tensor:
        """[slots] int64 each slot's token's stamp (`new_stamps`): new for every slot written from the first ask on,
        carried when the token moves (compaction, a page slide, `fill`), so the same stamp seen twice is the same
        token with the same K and V bits (`ScoreInput.stamps`: LagKV's memo keeps the ranks of the partitions it
        saw). Until a scorer asks, no write pays for them."""
        if self._stamps is None:
            self._stamps = new_stamps(self.pos.shape[0], self.pos.device)
        return self._stamps

    def key_norms(self) -> torch.Tensor:
        """[slots] float64 L2 norm of each slot's key. Computed for every slot when first asked for, then
        kept by every write: a key-norm scorer reads it each decode step instead of every kept key."""
        if self._key_norms is None:
            self._key_norms = key_norms_of(self.k)
        return self._key_norms

    def per_slot(self, name: str, index: torch.Tensor,
                 compute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """[B, H_kv, N] a quantity of each slot's own token, `compute(slots [B, H_kv, n]) -> [B, H_kv, n]`,
        for the slots `index` of a view: kept per slot until the slot is written again, so a scorer asking
        every decode step pays for the new tokens only. Unlike `key_norms` it may depend on the slot's KV
        head (its place in `slots`), and it is made on the host's schedule (a static step reads none).
        `compute` must give a slot the same value whatever slots it is asked with."""
        shared = self._of_prompt if name not in self._remembered else None
        if shared is not None and not shared.held_by(self):  # written since the fork: its own tokens now
            shared = self._of_prompt = None
        if shared is not None and name in shared.kept:  # an earlier fork computed it
            self._remembered[name] = tuple(memo.clone() for memo in shared.kept[name])
        elif name not in self._remembered:
            rows = compute(index)
            kept = torch.zeros(self.pos.shape[0], dtype=rows.dtype, device=rows.device)
            kept.index_copy_(0, index.reshape(-1), rows.reshape(-1))  # padding repeats the sentinel: any value
            fresh = torch.zeros(self.pos.shape[0], dtype=torch.bool, device=rows.device)
            self._remembered[name] = (kept, fresh.index_fill_(0, index.reshape(-1), True))
            if shared is not None:
                shared.kept[name] = (kept.clone(), fresh.clone())
            return rows
        kept, fresh = self._remembered[name]
        stale = ~self.gather(fresh, index) & (self.gather(self.pos, index) >= 0)  # [B, H_kv, N]; empty: no value
        most = int(stale.sum(-1).max())
        if most:  # decoding: each head's new token alone
            first = first_where(stale, most)
            slots, taken = index.gather(-1, first), stale.gather(-1, first)  # [B, H_kv, most] each head's stale first
            kept.index_copy_(0, slots[taken], compute(slots)[taken])
            fresh.index_fill_(0, slots[taken], True)
        return self.gather(kept, index)

    def share_kept(self, forks: list[KeptOfPrompt]) -> None:
        """This layer just stored a shared prefill's prompt (`SharedPrefill.fork_into`), as did the other forks
        (`forks`: one entry per way of placing it). While it holds nothing else, `per_slot` takes a copy of what
        a fork that placed the prompt in the same slots computed, or computes it for the later ones: the
        question-unseen cells of a sweep compute CriticalKV's value norms of the prompt once."""
        same = next((fork for fork in forks if fork.held_by(self)), None)
        if same is None:
            same = KeptOfPrompt(self.slot_index().clone(), self.pos.clone(), self.v.dtype)
            forks.append(same)
        self._of_prompt = same

    def _kept_written(self, slots: torch.Tensor, k: torch.Tensor) -> None:
        """Keys k [n, D] were written to `slots` [n]: their norms kept, whatever else was kept of them stale."""
        if self._stamps is not None:
            self._stamps.index_copy_(0, slots, new_stamps(slots.shape[0], self._stamps.device))
        if self._key_norms is not None:
            self._key_norms.index_copy_(0, slots, key_norms_of(k))
        for _, fresh in self._remembered.values():
            fresh.index_fill_(0, slots, False)

    def _kept_of(self, src: torch.Tensor) -> tuple[torch.Tensor | None,
                                                   dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """The stamps of the tokens in slots `src` [n] (None: never asked for) and what `per_slot` keeps of them,
        read before they move (compaction, `fill`)."""
        stamps = None if self._stamps is None else self._stamps.index_select(0, src)
        return stamps, {name: (kept.index_select(0, src), fresh.index_select(0, src))
                        for name, (kept, fresh) in self._remembered.items()}

    def _kept_moved(self, dst: torch.Tensor,
                    moved: tuple[torch.Tensor | None, dict[str, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """The tokens `_kept_of` read were just written to slots `dst` [n]: each keeps its stamp (the same bits;
        where it had none, the write's new one) and what was kept of it, as its KV head does not change."""
        stamps, moved = moved
        if stamps is not None:
            self.stamps().index_copy_(0, dst, stamps)
        for name, (kept, fresh) in moved.items():
            if name not in self._remembered:
                self._remembered[name] = (kept.new_zeros(self.pos.shape), fresh.new_zeros(self.pos.shape))
            to_kept, to_fresh = self._remembered[name]
            to_kept.index_copy_(0, dst, kept)
            to_fresh.index_copy_(0, dst, fresh)

    def _kept_after_packed(self, k: torch.Tensor) -> list[tuple[torch.Tensor, object]]:
        """(per-slot array, what the new tokens' slots take) for keys k [B, H_kv, T, D] written through a
        packed layer's view (`_write_after_packed`)."""
        written = [] if self._stamps is None else \
            [(self._stamps, new_stamps(k[..., 0].numel(), self._stamps.device).view(k.shape[:3]))]
        if self._key_norms is not None:
            written.append((self._key_norms, key_norms_of(k)))
        return written + [(fresh, False) for _, fresh in self._remembered.values()]
