"""Page bookkeeping for one layer: integers only, no tensors (vLLM's BlockPool split)."""

from __future__ import annotations

import heapq

from evalkit.errors import EvalkitError


class PoolExhausted(EvalkitError):
    pass


class PagePool:
    """Free list of `num_pages` page ids. A request takes the pages right after a given one while they are
    free (so a head's pages stay one run of ids), then the lowest free ids: runs are reproducible."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages))  # a heap; may still hold pages taken as a run (skipped when popped)
        self._is_free = [True] * num_pages
        self._num_free = num_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    def free_pages(self) -> list[int]:
        return [page for page in range(self.num_pages) if self._is_free[page]]

    def check_room(self, count: int) -> None:
        if count > self._num_free:
            raise PoolExhausted(
                f"KV page pool exhausted: asked for {count} more pages of {self.page_size} tokens, "
                f"{self._num_free} of {self.num_pages} free (raise --pool-pages or lower the batch size)"
            )

    def allocate(self, count: int, after: int | None = None) -> list[int]:
        """`count` pages: after + 1, after + 2, ... while free (when `after` is given), then the lowest free."""
        self.check_room(count)
        pages = []
        page = self.num_pages if after is None else after + 1
        while len(pages) < count and page < self.num_pages and self._is_free[page]:
            pages.append(page)
            self._is_free[page] = False
            page += 1
        while len(pages) < count:
            page = heapq.heappop(self._free)
            if self._is_free[page]:
                pages.append(page)
                self._is_free[page] = False
        self._num_free -= count
        return pages

    def is_free(self, page: int) -> bool:
        return self._is_free[page]

    def take(self, pages: list[int]) -> None:
        """Hand out these free pages (they stay in the heap, skipped when popped)."""
        for page in pages:
            if not self._is_free[page]:
                raise ValueError(f"page {page} is not free")
            self._is_free[page] = False
        self._num_free -= len(pages)

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if self._is_free[page]:
                raise ValueError(f"page {page} freed twice")
            self._is_free[page] = True
            self._num_free += 1
            heapq.heappush(self._free, page)
