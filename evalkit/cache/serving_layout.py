"""A layer of evalkit's paged cache in the layout a per-KV-head block-sparse decode kernel reads, and back.

Why: evalkit asks whether a vLLM-style paged cache can evict per KV head, and answers with one block table
per (layer, sequence, KV head). FlashInfer's `flashinfer.decode.trtllm_batch_decode_with_kv_cache(...,
enable_block_sparse_attention=True)` (PR #3955, FlashInfer 0.6.16 on; trtllm-gen backend, SM100/SM103 GPUs
only) is such a kernel: each KV head reads its own pages. `to_serving` gives one evalkit layer as exactly the
tensors that call documents, so what evalkit measures carries over to an engine built on it; `from_serving`
is the way back. Shapes: B batch, H_kv KV heads, G = H_q / H_kv, S page size, D head dim, P cells.

The kernel's tensors, as FlashInfer's docstring gives them:
- kv_cache [P, 2, H_kv, S, D], layout "HND": K is kv_cache[:, 0], V kv_cache[:, 1]; page id p of KV head h
  is kv_cache[p, :, h] (the *cell* (p, h) below).
- block_tables [H_kv, B, max_pages] int32, contiguous: row (h, b) holds the pages of KV head h of sequence b,
  packed at its front in ascending order; entries past the row's ceil(seq_len / S) pages are ignored
  (written 0 here).
- seq_lens [H_kv, B] int32, contiguous: the tokens of row (h, b). The kernel reads the first seq_len slots of
  the row's pages in order, so only a row's last page may be partly filled (its first seq_len % S slots).

Where evalkit's storage differs, and what the adapter does:
- A FlashInfer page id names a page of every KV head; an evalkit page belongs to one (sequence, KV head).
  Each KV head gets its own column of cells, kv_cache[:, :, h], numbered from 0 over the batch in order, so
  no cell is read by two rows. Back, cell (p, h) becomes evalkit page p * H_kv + h, which makes the evalkit
  layer's K slots kv_cache[:, 0] itself, flattened.
- evalkit's pages hold holes: an evicted slot stays in its page until a new token of its head fills it or
  `compact` runs, and a filled hole puts a new token among older ones in fill order. The kernel has no
  per-slot mask, only a length per row, so the adapter compacts: each head's live tokens, in ascending
  original position, packed into ceil(n / S) pages, the last one partly filled. A mask was no option: the
  call takes none, and faking one through the keys would keep the memory the eviction freed.
- `to_serving` copies the live K and V (an interface, not a decode path). Original positions travel beside
  the kernel's tensors (`ServingCache.positions`, not a kernel input) so that `from_serving` restores
  evalkit's slots; policy statistics do not (they come back as 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from evalkit.cache.layouts import PagedLayer
from evalkit.cache.storage import SlotLayer

FLASHINFER_WORKSPACE_BYTES = 256 * 2**20  # the workspace FlashInfer's own trtllm-gen decode tests allocate


@dataclass
class ServingCache:
    """One layer in the kernel's layout (module docstring)."""

    kv_cache: torch.Tensor  # [P, 2, H_kv, S, D] "HND"
    block_tables: torch.Tensor  # [H_kv, B, max_pages] int32: each row's cells at its front, ascending
    seq_lens: torch.Tensor  # [H_kv, B] int32 tokens per (KV head, sequence)
    positions: torch.Tensor  # [P, H_kv, S] int64 each cell slot's original position, -1 = empty (not a kernel input)

    @property
    def page_size(self) -> int:
        return self.kv_cache.shape[3]

    def pages_used(self) -> torch.Tensor:
        """[H_kv, B] pages each row reads: ceil(seq_len / S)."""
        return (self.seq_lens.long() + self.page_size - 1) // self.page_size


def to_serving(layer: SlotLayer, page_size: int | None = None) -> ServingCache:
    """`layer`'s live tokens in the kernel's layout, in pages of `page_size` slots (default: the layer's
    block size; a `DenseLayer` needs one). Token i of a head, by original position, goes to slot i % S of
    the head's (i // S)-th cell."""
    S = page_size or layer.page_size
    index = layer.slot_index()  # [B, H, N] fill order
    pos = layer.gather(layer.pos, index)
    live = pos >= 0
    counts = live.sum(-1)  # [B, H]
    B, H, N = index.shape
    device = index.device
    by_position = index.gather(-1, torch.sort(pos.masked_fill(~live, N + int(pos.max()) + 1), dim=-1).indices)
    pages = (counts + S - 1) // S  # [B, H]
    first = pages.cumsum(0) - pages  # [B, H] first cell of (b, h) in head h's column: sequences in batch order
    width = torch.arange(max(1, int(pages.max())), device=device)
    tables = torch.where(width < pages[..., None], first[..., None] + width, 0)  # [B, H, max_pages]
    cells = max(1, int(pages.sum(0).max()))
    kv_cache = layer.k.new_zeros(cells, 2, H, S, layer.head_dim)
    positions = torch.full((cells, H, S), -1, dtype=torch.long, device=device)
    b, h, i = (torch.arange(N, device=device) < counts[..., None]).nonzero(as_tuple=True)
    src = by_position[b, h, i]  # [M] the live slots, head by head in position order
    cell, slot = first[b, h] + i // S, i % S
    kv_cache[cell, 0, h, slot] = layer.k[src]
    kv_cache[cell, 1, h, slot] = layer.v[src]
    positions[cell, h, slot] = layer.pos[src]
    return ServingCache(kv_cache, tables.transpose(0, 1).to(torch.int32).contiguous(),
                        counts.T.to(torch.int32).contiguous(), positions)


def page_lists(serving: ServingCache) -> list[list[list[int]]]:
    """[B][H_kv] the evalkit page ids of each (sequence, KV head) in table order: cell (p, h) is page
    p * H_kv + h. Refuses a cell outside the pool."""
    cells, H = serving.kv_cache.shape[0], serving.kv_cache.shape[2]
    used, rows = serving.pages_used().tolist(), serving.block_tables.tolist()
    lists = [[[p * H + h for p in rows[h][b][:used[h][b]]] for h in range(H)] for b in range(len(rows[0]))]
    if any(not 0 <= page < cells * H for row in lists for table in row for page in table):
        raise ValueError(f"a block table names a page outside the pool's {cells} pages")
    return lists


def from_serving(serving: ServingCache, spare_pages: int = 0) -> PagedLayer:
    """The way back: a `PagedLayer` whose head (b, h) holds row (h, b)'s tokens as its first slots, in the
    pages `page_lists(serving)[b][h]` (packed, as after `compact`); statistics 0; `spare_pages` free pages
    after the cells' for tokens to come. Refuses a cell read by two rows, and positions that do not put
    exactly seq_len tokens at the front of each row."""
    cells, _, H, S, D = serving.kv_cache.shape
    tables = page_lists(serving)
    layer = PagedLayer(len(tables), H, D, cells * H + spare_pages, S, serving.kv_cache.dtype,
                       serving.kv_cache.device)
    layer.pool.take([page for row in tables for table in row for page in table])  # a page twice: ValueError
    layer.tables = tables
    slots = cells * H * S  # page p * H + h's slots are cell (p, h)'s: the storage is the cache, flattened
    layer.k[:slots] = serving.kv_cache[:, 0].reshape(slots, D)
    layer.v[:slots] = serving.kv_cache[:, 1].reshape(slots, D)
    layer.pos[:slots] = serving.positions.reshape(slots)
    counts = serving.seq_lens.T.long()  # [B, H]
    index = layer.slot_index()
    front = torch.arange(index.shape[-1], device=index.device) < counts[..., None]
    if not torch.equal(layer.gather(layer.pos, index) >= 0, front):
        raise ValueError("positions do not match seq_lens: each row's live slots must be its first seq_len")
    layer.packed = counts
    return layer


def serving_decode_reference(q: torch.Tensor, serving: ServingCache, scale: float) -> torch.Tensor:
    """What the kernel computes, in float64 torch: q [B, H_q, D] -> out [B, H_q, D]. Each row's pages are
    gathered from its own cells, its first seq_len slots attended (SDPA), query heads h * G .. h * G + G - 1
    on KV head h (FlashInfer's grouping and evalkit's). A row holding no token gives zeros, as evalkit's
    kernel does."""
    B, H_q, D = q.shape
    H = serving.kv_cache.shape[2]
    heads = torch.arange(H, device=q.device)[:, None, None]
    pages = serving.kv_cache[serving.block_tables.long(), :, heads].double()  # [H, B, max_pages, 2, S, D]
    k, v = pages[:, :, :, 0].flatten(2, 3), pages[:, :, :, 1].flatten(2, 3)  # [H, B, N, D]
    readable = torch.arange(k.shape[2], device=q.device) < serving.seq_lens[..., None]  # [H, B, N]
    q = q.double().view(B, H, H_q // H, D).transpose(0, 1)  # [H, B, G, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=readable[:, :, None, :], scale=scale)
    out = out.masked_fill(serving.seq_lens[..., None, None] == 0, 0.0)  # SDPA's NaN over an empty row
    return out.transpose(0, 1).reshape(B, H_q, D)


def flashinfer_decode(q: torch.Tensor, serving: ServingCache, scale: float,
                      workspace: torch.Tensor | None = None) -> torch.Tensor:
    """FlashInfer's per-KV-head block-sparse decode on the adapter's tensors: q [B, H_q, D] (fp16/bf16, on an
    SM100/SM103 GPU, with the cache) -> out [B, H_q, D]. flashinfer-python is imported here only: evalkit does
    not depend on it."""
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    if workspace is None:
        workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.int8, device=q.device)
    return trtllm_batch_decode_with_kv_cache(
        q, serving.kv_cache, workspace, serving.block_tables, serving.seq_lens,
        max(1, int(serving.seq_lens.max())), bmm1_scale=scale, bmm2_scale=1.0, kv_layout="HND",
        backend="trtllm-gen", enable_block_sparse_attention=True)
