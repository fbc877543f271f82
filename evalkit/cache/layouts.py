"""The two layouts of `SlotLayer` (evalkit/cache/storage.py): which slots belong to which (sequence, KV head).

- `PagedLayer`: pages of `S` slots from a `PagePool`, one page table per (sequence, KV head), so heads
  keep different tokens and an empty page is really returned to the pool.
- `DenseLayer`: a fixed `[B, H_kv, C]` buffer, the baseline layout.
"""

from __future__ import annotations

import torch

from evalkit.cache.pool import PagePool, PoolExhausted
from evalkit.cache.storage import SlotLayer


class PagedLayer(SlotLayer):
    """Pages of `page_size` slots, one KV head per page, a page table per (sequence, KV head)."""

    def __init__(self, batch, kv_heads, head_dim, num_pages: int, page_size: int, dtype, device):
        super().__init__(batch, kv_heads, head_dim, num_pages * page_size, page_size, dtype, device)
        self.page_size = page_size
        self.pool = PagePool(num_pages, page_size)
        self.null_page = num_pages  # the sentinel page
        self.tables: list[list[list[int]]] = [[[] for _ in range(kv_heads)] for _ in range(batch)]
        self._index: torch.Tensor | None = None
        self._runs: tuple[int, int] | None = None  # (first slot, slots between heads) when `_index` is runs
        self._table: tuple | None = None  # (the slot index it was built from, table, head_tokens)

    @property
    def num_real_slots(self) -> int:
        return self.pool.num_pages * self.page_size

    def padded_pages(self) -> torch.Tensor:
        """[B, H_kv, max_pages] int32 page ids, padded with the sentinel page."""
        width = max(1, max(len(t) for row in self.tables for t in row))
        padded = [[t + [self.null_page] * (width - len(t)) for t in row] for row in self.tables]
        return torch.tensor(padded, dtype=torch.int32, device=self.pos.device)

    def slot_index(self) -> torch.Tensor:
        if self._index is None:
            S = self.page_size
            offsets = torch.arange(S, device=self.pos.device)
            pages = self.padded_pages().long()
            self._index = (pages[..., None] * S + offsets).flatten(2)  # [B, H, pages * S]
            self._runs = self._as_runs()
        return self._index

    def _as_runs(self) -> tuple[int, int] | None:
        """(first slot, slots between heads) when each head's pages are consecutive ids and the heads' first
        pages evenly spaced, in (sequence, head) order: then `gather_kv` is a strided view, no copy."""
        tables = [table for row in self.tables for table in row]
        if not all(map(_is_run, tables)):
            return None
        firsts = [table[0] for table in tables]
        step = firsts[1] - firsts[0] if len(firsts) > 1 else 0
        if step < 0 or firsts != [firsts[0] + i * step for i in range(len(firsts))]:
            return None
        if firsts[-1] + max(map(len, tables)) > self.null_page + 1:  # a head's padding would read past the storage
            return None
        return firsts[0] * self.page_size, step * self.page_size

    def _run_wanted(self, kept: torch.Tensor):
        """(b, h, the pages a head holding kept[b, h] tokens has as one run from its first page) per head."""
        for b, (row, counts) in enumerate(zip(self.tables, kept.tolist())):
            for h, (table, count) in enumerate(zip(row, counts)):
                need = -(-count // self.page_size)
                if table and need:
                    yield b, h, list(range(table[0], table[0] + need))

    def _in_runs(self, kept: torch.Tensor) -> bool:
        return all(self.tables[b][h][:len(run)] == run for b, h, run in self._run_wanted(kept))

    def _into_runs(self, kept: torch.Tensor) -> torch.Tensor:
        """Give each head the pages first, first + 1, ... its kept tokens need, where each is its own or
        free: its slots become one run, read as a view (`gather_kv`). Its other pages follow, to be emptied."""
        for b, h, run in self._run_wanted(kept):
            table = self.tables[b][h]
            if table[:len(run)] == run or run[-1] >= self.pool.num_pages:
                continue
            mine, run_pages = set(table), set(run)
            if all(page in mine or self.pool.is_free(page) for page in run):
                self.pool.take([page for page in run if page not in mine])
                self.tables[b][h] = run + [page for page in table if page not in run_pages]
                self._index = None
        return self.slot_index()

    def gather_kv(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if index is not self._index or self._runs is None:
            return self.gather(rows, index)
        # A head's padding reads whatever slots follow its run: finite, masked (positions come from `index`).
        return self._run_rows(rows, index.shape[-1])

    def _prefix_rows(self, rows: torch.Tensor, n: int) -> torch.Tensor | None:
        return None if self._runs is None else self._run_rows(rows, n)  # within each head's own run

    def _run_rows(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        """[B, H, n, *rows.shape[1:]]: the n slots from each head's first, a strided view (tables are runs)."""
        first, step = self._runs
        row = rows.stride(0)
        return rows.as_strided((self.batch, self.kv_heads, n, *rows.shape[1:]),
                               (self.kv_heads * step * row, step * row, row, *rows.stride()[1:]),
                               rows.storage_offset() + first * row)

    def _reserve(self, free_needed: torch.Tensor) -> None:
        pages_needed = (free_needed + self.page_size - 1) // self.page_size
        self.pool.check_room(int(pages_needed.sum()))  # all or nothing
        for b, h in pages_needed.nonzero().tolist():
            table = self.tables[b][h]
            table += self.pool.allocate(int(pages_needed[b, h]), after=table[-1] if table else None)
        self._index = None

    def _reserve_apart(self, free_needed: torch.Tensor) -> None:
        """Each head's pages from the start of its equal share of a free pool (head i of the (sequence, head)
        order: from page i * share), so decoding extends them as one run and K/V stay strided views."""
        pages_needed = ((free_needed + self.page_size - 1) // self.page_size).flatten().tolist()
        share = self.pool.num_pages // len(pages_needed)
        runs = [list(range(i * share, i * share + n)) for i, n in enumerate(pages_needed)]
        if any(table for row in self.tables for table in row) or max(pages_needed) > share or \
                not all(self.pool.is_free(page) for run in runs for page in run):
            return self._reserve(free_needed)
        self.pool.take([page for run in runs for page in run])
        self.tables = [runs[b * self.kv_heads:(b + 1) * self.kv_heads] for b in range(self.batch)]
        self._index = None

    def owned_slots(self) -> torch.Tensor:
        pages = [[len(table) for table in row] for row in self.tables]
        return torch.tensor(pages, device=self.pos.device) * self.page_size

    def _pages_for(self, missing: torch.Tensor) -> int:
        return int(((missing + self.page_size - 1) // self.page_size).sum())

    def _free_storage(self) -> int:
        return self.pool.num_free

    def _release_empty(self, emptied: torch.Tensor | None = None, one_lost_of: int | None = None) -> None:
        S = self.page_size
        if self.frozen:
            return  # a frozen head keeps its pages (`freeze`)
        if one_lost_of is not None and S > 1 and one_lost_of % S != 1:
            return  # every page of those n slots holds two or more of them (the last n % S, or S): none empties
        if emptied is not None and bool((self.pos.view(-1, S)[emptied // S] >= 0).any(1).all()):
            return  # every page that lost a token still holds one
        page_live = (self.pos.view(-1, S) >= 0).any(1)
        page_live[self.null_page] = True
        table = self.slot_index()[..., ::S] // S  # [B, H, pages]: the cached view, not the Python lists
        dead = ~page_live[table]
        if not bool(dead.any()):
            return
        live = page_live.tolist()  # read per page below: a list, not a tensor op per page
        slides = []  # (from page, to page)
        for b, h in dead.any(-1).nonzero().tolist():
            table = self.tables[b][h]
            kept = [p for p in table if live[p]]
            if _is_run(table):  # its live pages slide down over the lost ones, in order: still a run, read as a view
                slides += [(page, to) for page, to in zip(kept, table) if page != to]
                self.tables[b][h], gone = table[:len(kept)], table[len(kept):]
            else:
                self.tables[b][h], gone = kept, [p for p in table if not live[p]]
            self.pool.free(gone)
        if slides:
            self._move_pages(slides)
        self._index = None

    def _move_pages(self, moves: list[tuple[int, int]]) -> None:
        """Each (from page, to page)'s slots, with what is kept of them, written to the other page; a page moved
        from and not to is left empty. A head's tokens keep their order, so attention reads the same sequence."""
        offsets = torch.arange(self.page_size, device=self.pos.device)
        src, dst = (torch.tensor(pages, device=self.pos.device)[:, None] * self.page_size + offsets
                    for pages in zip(*moves))
        src, dst = src.flatten(), dst.flatten()
        lifted = self._lift(src)
        vacated = src[~torch.isin(src, dst)]
        self.pos.index_fill_(0, vacated, -1)
        self.stats.index_fill_(0, vacated, 0.0)
        self._set_down(dst, lifted)

    def page_table(self) -> tuple[torch.Tensor, int, torch.Tensor]:
        index = self.slot_index()
        if self._table is None or self._table[0] is not index:  # every layer of every step: built once per table
            S = self.page_size
            table = index[..., ::S] // S  # tables are padded at their end with the sentinel page
            head_tokens = (table != self.null_page).sum(-1) * S
            self._table = (index, table.to(torch.int32), head_tokens.to(torch.int32))
        return self._table[1], self.page_size, self._table[2]

    def held_slots(self) -> torch.Tensor:
        pages = [sum(len(t) for t in row) for row in self.tables]
        return torch.tensor(pages, device=self.pos.device) * self.page_size


class DenseLayer(SlotLayer):
    """The baseline: a fixed `[B, H_kv, capacity]` buffer, written with scatter, read with gather."""

    def __init__(self, batch, kv_heads, head_dim, capacity: int, dtype, device):
        super().__init__(batch, kv_heads, head_dim, batch * kv_heads * capacity, 1, dtype, device)
        self.capacity = capacity
        self._index = torch.arange(batch * kv_heads * capacity, device=device).view(batch, kv_heads, capacity)
        self._table = torch.arange(batch * kv_heads, dtype=torch.int32, device=device).view(batch, kv_heads, 1)
        self._head_tokens = torch.full((batch, kv_heads), capacity, dtype=torch.int32, device=device)

    @property
    def num_real_slots(self) -> int:
        return self.batch * self.kv_heads * self.capacity

    def slot_index(self) -> torch.Tensor:
        return self._index

    def gather(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if index is self._index:  # each head's slots are one run of the buffer: a view, no copy
            return rows[:self.num_real_slots].view(*index.shape, *rows.shape[1:])
        return super().gather(rows, index)

    def _prefix_rows(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        return rows[:self.num_real_slots].view(*self._index.shape, *rows.shape[1:])[:, :, :n]

    def owned_slots(self) -> torch.Tensor:
        return torch.full((self.batch, self.kv_heads), self.capacity, device=self.pos.device)

    def _pages_for(self, missing: torch.Tensor) -> int:
        return int(missing.sum())  # a dense head cannot grow: any missing slot is too many

    def _reserve(self, free_needed: torch.Tensor) -> None:
        if bool((free_needed > 0).any()):
            raise PoolExhausted(
                f"dense KV cache full: capacity {self.capacity} tokens per head, "
                f"{int(free_needed.max())} more asked (raise the capacity)"
            )

    def page_table(self) -> tuple[torch.Tensor, int, torch.Tensor]:
        """One page per head, the size of its whole buffer."""
        return self._table, self.capacity, self._head_tokens

    def held_slots(self) -> torch.Tensor:
        return torch.full((self.batch,), self.kv_heads * self.capacity, device=self.pos.device)


def _is_run(table: list[int]) -> bool:
    """Whether a head's pages are consecutive ids in order."""
    return bool(table) and table[-1] - table[0] == len(table) - 1 and table == sorted(table)
