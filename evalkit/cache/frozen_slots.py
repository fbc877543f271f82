"""A layer frozen for a static decode (`loop.static_decode`): fixed shapes, nothing read back to the host.

`SlotLayer.freeze` gives each head room for the rest of the generation and fixes the slots it owns
(`DecodeSlots`); from then on a token goes into its head's lowest free slot and an emptied slot stays its
head's, so the slots, the page tables and every shape stay as they are. `FrozenSlots` holds these methods
of `SlotLayer` (evalkit/cache/storage.py); a layout says how much storage a reservation takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DecodeSlots:
    """The slots a frozen layer's heads own for a whole static decode (`SlotLayer.freeze`): every shape fixed."""

    index: torch.Tensor  # [B, H_kv, N] each head's slots in fill order, padded with the always-empty sentinel
    table: torch.Tensor  # [B, H_kv, P] int32 page ids: what the kernels read (`page_table`)
    page_size: int
    head_tokens: torch.Tensor  # [B, H_kv] int32 table positions the kernels scan


class FrozenSlots:
    """`SlotLayer`'s static decode, mixed into it: uses its slot arrays (`pos`, `stats`), its writes (`gather`,
    `_write`, `_real`) and its layout's reservations (`slot_index`, `_reserve`, `page_table`)."""

    def room_for(self, most: torch.Tensor) -> bool:
        """Whether `freeze(most)` fits in this layer's storage."""
        missing = (most - self.owned_slots()).clamp(min=0)
        return self._pages_for(missing) <= self._free_storage()

    def freeze(self, most: torch.Tensor) -> DecodeSlots:
        """Give each head room for `most` [B, H_kv] tokens, then fix the slots it owns: from here on a token goes
        into its head's lowest free slot (`append_static`) and an emptied slot stays its head's (`evict_static`),
        so the slots, the page tables and every shape stay as they are for the rest of the generation."""
        self._reserve((most - self.owned_slots()).clamp(min=0))
        self.packed, self.single_hole, self._trimmed, self.frozen = None, None, None, True
        table, page_size, head_tokens = self.page_table()
        return DecodeSlots(self.slot_index(), table, page_size, head_tokens)

    def append_static(self, slots: DecodeSlots, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One new token per head (k, v [B, H_kv, 1, D], positions [B, 1]) into its lowest free slot among
        `slots`; returns the slots [B, H_kv, 1]. `freeze` made sure every head has one."""
        B, H, _, D = k.shape
        free = self._real(slots.index, self.gather(self.pos, slots.index) < 0)
        dest = slots.index.gather(2, free.to(torch.int8).argmax(-1, keepdim=True))  # [B, H, 1]
        self._write(dest.reshape(-1), k.reshape(-1, D), v.reshape(-1, D), pos.expand(B, H).reshape(-1))
        return dest

    def evict_static(self, index: torch.Tensor, keep: torch.Tensor, pos: torch.Tensor) -> None:
        """`evict` for a frozen layer: empty every live slot of `index` [B, H_kv, N] where `keep` is False, by
        rewriting every slot of `index` (the sentinel's with its own empty value). `pos`: the slots' positions
        as stored, `gather(self.pos, index)`, which the caller has already read."""
        flat = index.reshape(-1)
        pos = pos.reshape(-1)
        dropped = ~keep.reshape(-1) & (pos >= 0)
        self.pos.index_copy_(0, flat, pos.masked_fill(dropped, -1))
        self.stats.index_copy_(0, flat, self.stats.index_select(0, flat).masked_fill(dropped, 0.0))

    def owned_slots(self) -> torch.Tensor:
        """[B, H_kv] slots each head owns (empty or not)."""
        raise NotImplementedError

    def _pages_for(self, missing: torch.Tensor) -> int:
        """Units of storage `_reserve(missing)` would take."""
        return 0

    def _free_storage(self) -> int:
        return 0
