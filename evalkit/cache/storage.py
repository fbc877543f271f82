"""KV storage for one layer: a flat array of slots, and who owns which slot.

Every slot holds one token of one KV head: K and V rows `[D]`, the token's
original position (-1 = empty) and a float32 statistic owned by the policy.
A layout (evalkit/cache/layouts.py: `PagedLayer`, `DenseLayer`) only decides
which slots belong to which (sequence, KV head).

Everything else (append, read, evict, compact, accounting; a static decode's
frozen slots, evalkit/cache/frozen_slots.py; what is kept per slot besides,
evalkit/cache/kept_per_slot.py) is shared, so the same policy
gives the same tokens on both. The last slots are a sentinel that is always
empty: views pad ragged heads with it and attention masks it out.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from evalkit.cache.frozen_slots import FrozenSlots
from evalkit.cache.kept_per_slot import KeptPerSlot, first_where


@dataclass
class SlotView:
    """A layer's slots gathered per (sequence, KV head); ragged heads padded with empty slots."""

    layer: "SlotLayer"
    index: torch.Tensor  # [B, H_kv, N] flat slot ids
    pos: torch.Tensor  # [B, H_kv, N] original positions, -1 = empty
    all_live: bool = False  # every slot holds a token (`read(trim=True)` of a packed layer)

    # Gathered on first use: eviction reads positions and statistics, attention reads K and V.
    @functools.cached_property
    def k(self) -> torch.Tensor:
        """[B, H_kv, N, D]; an empty slot's row is any finite value"""
        return self.layer.gather_kv(self.layer.k, self.index)

    @functools.cached_property
    def v(self) -> torch.Tensor:
        """[B, H_kv, N, D]; an empty slot's row is any finite value"""
        return self.layer.gather_kv(self.layer.v, self.index)

    @functools.cached_property
    def stats(self) -> torch.Tensor:
        """[B, H_kv, N] float32 policy statistic"""
        return self.layer.gather(self.layer.stats, self.index)

    @functools.cached_property
    def key_norms(self) -> torch.Tensor:
        """[B, H_kv, N] float64 L2 norm of each slot's key (`SlotLayer.key_norms`)"""
        return self.layer.gather(self.layer.key_norms(), self.index)


class SlotLayer(FrozenSlots, KeptPerSlot):
    def __init__(self, batch: int, kv_heads: int, head_dim: int, num_slots: int, sentinel_slots: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.batch, self.kv_heads, self.head_dim = batch, kv_heads, head_dim
        total = num_slots + sentinel_slots
        self.k = torch.zeros(total, head_dim, dtype=dtype, device=device)  # [slots, D]
        self.v = torch.zeros(total, head_dim, dtype=dtype, device=device)
        self.pos = torch.full((total,), -1, dtype=torch.long, device=device)
        self.stats = torch.zeros(total, dtype=torch.float32, device=device)
        # [B, H_kv] live tokens per head while every head's live slots are the first of its fill order
        # (nothing evicted since the last compaction): then a token's slot is known without a scan.
        self.packed: torch.Tensor | None = torch.zeros(batch, kv_heads, dtype=torch.long, device=device)
        # (hole, end) [B, H_kv] each: after a packed head lost at most one token (decode eviction), its live
        # slots are its first `end` minus the one at `hole` (hole == end: none lost). Decoding fills the
        # hole and the layer is packed again, so decode eviction never scans for free slots either.
        self.single_hole: tuple[torch.Tensor, torch.Tensor] | None = None
        self._init_kept()  # key norms and other per-slot quantities (evalkit/cache/kept_per_slot.py)
        self.scorer_memo: dict = {}  # what a scorer keeps between its calls on this layer (`ScoreInput.memo`)
        # (slot index, `packed`, each head's first n slots of that index or None): `read(trim=True)`'s last answer
        self._trimmed: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self.token_bytes = 2 * head_dim * self.k.element_size()  # K and V of one token of one head
        self.frozen = False  # `freeze`: each head owns a fixed set of slots; no storage taken or returned

    # layout-specific -------------------------------------------------------
    def slot_index(self) -> torch.Tensor:
        """[B, H_kv, N] the slots of each (sequence, KV head), in fill order."""
        raise NotImplementedError

    def _reserve(self, free_needed: torch.Tensor) -> None:
        """Make sure head (b, h) has `free_needed[b, h]` empty slots."""
        raise NotImplementedError

    def _release_empty(self, emptied: torch.Tensor | None = None, one_lost_of: int | None = None) -> None:
        """Return storage that holds no live token (only storage holding a slot of `emptied`, when given;
        with `one_lost_of` = n, each head held its first n slots and lost at most one of them)."""

    def held_slots(self) -> torch.Tensor:
        """[B] slots held (allocated) per sequence."""
        raise NotImplementedError

    def page_table(self) -> tuple[torch.Tensor, int, torch.Tensor]:
        """What the kernels read instead of a gathered view: (table [B, H_kv, P] int32 page ids, page size S,
        head_tokens [B, H_kv] int32 table positions to scan); page p is slots [p * S, (p + 1) * S)."""
        raise NotImplementedError

    def _prefix_rows(self, rows: torch.Tensor, n: int) -> torch.Tensor | None:
        """rows of each head's first `n` slots in fill order, [B, H_kv, n, *rows.shape[1:]], as a view of
        `rows` where the layout allows one (else None: gathered)."""
        return None

    # shared ------------------------------------------------------------------
    def read(self, trim: bool = False) -> SlotView:
        """Each (sequence, KV head)'s slots in fill order. With `trim`, while every head holds the same n
        tokens in its first n slots (packed: a full cache, or decoding after a compression), only those n:
        a view with no empty slot to mask, read in place where the layout allows."""
        index = self.slot_index()
        if trim and self.packed is not None:
            cached = self._trimmed
            if cached is None or cached[0] is not index or cached[1] is not self.packed:  # `packed` is only replaced
                n = self._equal_count()
                self._trimmed = cached = (index, self.packed, index[..., :n] if n else None)
            if cached[2] is not None:
                return SlotView(self, cached[2], self.gather(self.pos, cached[2]), all_live=True)
        return SlotView(self, index, self.gather(self.pos, index))

    def _equal_count(self) -> int | None:
        """n while every head holds the same n tokens in its first n slots (packed), else None."""
        if self.packed is None:
            return None
        fewest, most = (int(count) for count in torch.aminmax(self.packed))
        return most if fewest == most else None

    def _is_prefix(self, index: torch.Tensor) -> bool:
        """Whether `index` is the first slots `read` handed out, and the fill order is still the one they came from."""
        return self._trimmed is not None and index is self._trimmed[2] and self._trimmed[0] is self.slot_index()

    def gather(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """rows[index] for a per-slot array (k, v, pos, stats) and this layer's `slot_index()` (or the part
        of it `read` handed out): [*index.shape, *rows.shape[1:]]. May be a view of `rows`: read it before
        the next write."""
        if self._is_prefix(index):
            view = self._prefix_rows(rows, index.shape[-1])
            if view is not None:
                return view
        return rows.index_select(0, index.reshape(-1)).view(*index.shape, *rows.shape[1:])

    def gather_kv(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """`gather` for K or V, whose rows are only read where the slot is live (attention masks the rest):
        a layout may return any finite rows for empty slots."""
        return self.gather(rows, index)

    def live_counts(self) -> torch.Tensor:
        """[B, H_kv] tokens held per head."""
        return (self.gather(self.pos, self.slot_index()) >= 0).sum(-1)

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Write new tokens into each head's lowest free slots; returns their slots [B, H_kv, T] (padding:
        the always-empty sentinel slot).

        k, v: [B, H_kv, T, D]; pos: [B, T] original positions; valid: [B, T] (False = padding, not stored).
        """
        B, H, T, D = k.shape
        index = self.slot_index()
        known = self._next_free() if T == 1 and bool(valid.all()) else None
        if known is not None:  # decoding a packed cache, or one with a single hole per head: no scan
            target, packed_after = known  # [B, H] fill-order index of each head's lowest free slot
            fits = int(target.max()) < index.shape[-1]
            dest = index.gather(2, target[..., None]) if fits else None  # [B, H, 1] each head's next slot
            if fits and bool((dest < self.num_real_slots).all()):  # else a new page: the general path
                self._write(dest.reshape(-1), k.reshape(-1, D), v.reshape(-1, D), pos.expand(B, H).reshape(-1))
                self.packed, self.single_hole = packed_after, None
                return dest
        self.single_hole = None
        n_new = valid.sum(1)  # [B]
        slots = torch.full((B, H, T), self.num_real_slots, dtype=torch.long, device=self.pos.device)
        if int(n_new.max()) == 0:
            return slots
        free = self._real(index, self.gather(self.pos, index) < 0)
        missing = (n_new[:, None] - free.sum(-1)).clamp(min=0)
        if bool(missing.any()):
            self._reserve_apart(missing)
            index = self.slot_index()
            free = self._real(index, self.gather(self.pos, index) < 0)
        # The i-th new token of a head takes its i-th free slot in fill order.
        m = int(n_new.max())
        lowest_free = index.gather(2, first_where(free, m))  # [B, H, m]
        if bool(valid.all()):  # no padding (decoding; equal-length rows): token i takes free slot i
            slots = lowest_free
            if self._write_after_packed(k, v, pos):
                self.packed = self.packed + T
                return slots
            dest = lowest_free.reshape(-1)
            k, v = k.reshape(-1, D), v.reshape(-1, D)
            pos = pos[:, None, :].expand(B, H, T).reshape(-1)
        else:
            rank = (valid.cumsum(1) - 1).clamp(min=0)  # [B, T] rank of each token among its row's new ones
            store = valid[:, None, :].expand(B, H, T)
            dest = lowest_free.gather(2, rank[:, None, :].expand(B, H, T))[store]
            slots[store] = dest
            k, v, pos = k[store], v[store], pos[:, None, :].expand(B, H, T)[store]
        self._write(dest, k, v, pos)
        if self.packed is not None:  # the lowest free slots of a packed head are the next ones
            self.packed = self.packed + n_new[:, None]
        return slots

    def _write(self, slots: torch.Tensor, k, v, pos, stats=None) -> None:
        """Store tokens in `slots` [n] (distinct): K, V [n, D], positions [n], statistics [n] (default 0)."""
        self.k.index_copy_(0, slots, k)
        self.v.index_copy_(0, slots, v)
        self.pos.index_copy_(0, slots, pos)
        if stats is None:
            self.stats.index_fill_(0, slots, 0.0)
        else:
            self.stats.index_copy_(0, slots, stats)
        self._kept_written(slots, k)

    def _lift(self, src: torch.Tensor) -> tuple:
        """All that slots `src` [n] hold (K, V, positions, statistics, stamps and what `per_slot` keeps), read before
        they move."""
        return (*(rows.index_select(0, src) for rows in (self.k, self.v, self.pos, self.stats)), self._kept_of(src))

    def _set_down(self, dst: torch.Tensor, lifted: tuple) -> None:
        """`_lift`'s tokens written, in their order, to slots `dst` [n] of this layer."""
        *rows, kept = lifted
        self._write(dst, *rows)
        self._kept_moved(dst, kept)

    def _write_after_packed(self, k, v, pos) -> bool:
        """While every head holds the same n tokens in its first n slots, store k, v [B, H, T, D] (positions
        [B, T]) as fill positions n .. n + T - 1 through a view of the storage: a prompt's K/V (a strided view
        of the forward's) copied once, not gathered first. False where there is no such view."""
        n = self._equal_count()
        if n is None or self._prefix_rows(self.pos, n + k.shape[2]) is None:
            return False
        written = [(self.k, k), (self.v, v), (self.pos, pos[:, None, :]), (self.stats, 0.0),
                   *self._kept_after_packed(k)]
        for rows, new in written:
            self._prefix_rows(rows, n + k.shape[2])[:, :, n:] = new
        return True

    def _next_free(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Without a scan, when known: each head's lowest free slot (fill order) and the packed count once
        a token is written there, [B, H] each."""
        if self.packed is not None:
            return self.packed, self.packed + 1
        if self.single_hole is not None:
            hole, end = self.single_hole
            return hole, torch.where(hole < end, end, end + 1)
        return None

    def _real(self, index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return mask & (index < self.num_real_slots)

    @property
    def num_real_slots(self) -> int:
        raise NotImplementedError

    def add_stats(self, index: torch.Tensor, stats: torch.Tensor) -> None:
        """Accumulate a [B, H_kv, N] statistic into the slots of a view (H2O's running attention sums)."""
        self.stats.index_add_(0, index.reshape(-1), stats.reshape(-1).float())

    def set_stats(self, index: torch.Tensor, stats: torch.Tensor, rows: torch.Tensor) -> None:
        """Replace the statistic of the view's slots in the batch rows `rows` ([B] bool)."""
        self.stats[index[rows].reshape(-1)] = stats[rows].reshape(-1).float()

    def evict(self, index: torch.Tensor, keep: torch.Tensor) -> None:
        """Empty every live slot of the view where `keep` is False."""
        prefix = self._is_prefix(index)  # every slot of the view is live
        dropped = ~keep if prefix else ~keep & (self.gather(self.pos, index) >= 0)
        drop = index[dropped]
        self.pos.index_fill_(0, drop, -1)
        self.stats.index_fill_(0, drop, 0.0)
        hole = None
        fill_order = self.slot_index()
        if self.packed is not None and (prefix or index is fill_order):
            lost = dropped.sum(-1)  # [B, H]
            if bool((lost <= 1).all()):
                hole = (torch.where(lost > 0, dropped.to(torch.int8).argmax(-1), self.packed), self.packed)
        self.packed, self.single_hole = None, None  # holes, until the next compaction or decode append
        self._release_empty(drop, index.shape[-1] if prefix and hole is not None else None)
        if hole is not None and self.slot_index() is fill_order:  # no page returned: fill order unchanged
            self.single_hole = hole
        elif hole is None and not self.frozen:
            self.packed = self._packed_count()

    def _packed_count(self) -> torch.Tensor | None:
        """[B, H_kv] live tokens per head where they are the first slots of each head's fill order (whole pages
        evicted, a run's later ones slid down), else None: one scan here instead of one per append until the
        next eviction."""
        index = self.slot_index()
        live = self.gather(self.pos, index) >= 0
        kept = live.sum(-1)
        return kept if _leading(live, kept) else None

    def compact(self) -> None:
        """Pack each head's live tokens, in fill order, into its first slots (a paged head: one run of pages
        where the pool allows, `_into_runs`); free what is left."""
        index = self.slot_index()
        live = self.pos[index] >= 0
        kept = live.sum(-1)  # [B, H]
        self.packed, self.single_hole = kept, None
        if _leading(live, kept) and self._in_runs(kept):
            return  # already packed (nothing evicted, or whole pages only): no copy
        order = torch.sort((~live).to(torch.int8), dim=-1, stable=True).indices
        src = index.gather(2, order)[torch.arange(index.shape[-1], device=index.device) < kept[..., None]]
        lifted = self._lift(src)  # live, in fill order
        self.pos[index[live]] = -1
        index = self._into_runs(kept)
        first_slots = torch.arange(index.shape[-1], device=index.device) < kept[..., None]
        self._set_down(index[first_slots], lifted)  # each head's first slots
        self._release_empty()

    def fill(self, source: "SlotLayer", index: torch.Tensor, keep: torch.Tensor) -> None:
        """Into this empty layer: `source`'s slots `index` [B, H_kv, N] where `keep` (live ones), in their
        order, as each head's first slots: what `compact` leaves after the same tokens were appended in that
        order and the others evicted."""
        kept = keep.sum(-1)  # [B, H]
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
        src = index.gather(2, order)[torch.arange(index.shape[-1], device=index.device) < kept[..., None]]
        own = self.slot_index()
        free = self._real(own, self.gather(self.pos, own) < 0).sum(-1)
        self._reserve_apart((kept - free).clamp(min=0))
        dst = self.slot_index()
        self._set_down(dst[torch.arange(dst.shape[-1], device=dst.device) < kept[..., None]], source._lift(src))
        self.packed, self.single_hole = kept, None

    def _reserve_apart(self, free_needed: torch.Tensor) -> None:
        """`_reserve` for an empty layer, leaving each head room to grow in place where the layout can."""
        self._reserve(free_needed)

    def _in_runs(self, kept: torch.Tensor) -> bool:
        """Whether the first slots that would hold `kept` [B, H] tokens per head are already where
        `_into_runs` puts them."""
        return True

    def _into_runs(self, kept: torch.Tensor) -> torch.Tensor:
        """Before compaction writes `kept` [B, H] tokens per head into its first slots: the slot index to
        write through (a layout may regroup storage first)."""
        return self.slot_index()

    def bytes_held(self) -> torch.Tensor:
        """[B] KV bytes allocated to each sequence."""
        return self.held_slots() * self.token_bytes

    def bytes_ideal(self) -> torch.Tensor:
        """[B] KV bytes of the tokens each sequence really keeps."""
        return self.live_counts().sum(-1) * self.token_bytes


def _leading(live: torch.Tensor, kept: torch.Tensor) -> bool:
    """Whether each head's live slots (`live` [B, H_kv, N], in fill order) are its first `kept` [B, H_kv] ones."""
    return bool((live.long().cumprod(-1).sum(-1) == kept).all())
