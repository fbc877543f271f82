"""Page bookkeeping for one layer: integers only, no tensors (vLLM's BlockPool split)."""

from __future__ import annotations

import heapq

from evalkit.errors import EvalkitError


class PoolExhausted(EvalkitError):
    pass


class BlockPool:
    """Free list of `num_pages` page ids. The lowest free id is handed out first so runs are reproducible."""

    def __init__(self, num_pages: int, block_size: int):
        self.num_pages = num_pages
        self.block_size = block_size
        self._free = list(range(num_pages))  # a heap
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise PoolExhausted(
                f"KV page pool exhausted: asked for {count} more pages of {self.block_size} tokens, "
                f"{len(self._free)} of {self.num_pages} free (raise --pool-pages or lower the batch size)"
            )
        pages = [heapq.heappop(self._free) for _ in range(count)]
        for page in pages:
            self._is_free[page] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if self._is_free[page]:
                raise ValueError(f"page {page} freed twice")
            self._is_free[page] = True
            heapq.heappush(self._free, page)
