"""evalkit's paged cache in a per-KV-head block-sparse decode kernel's layout (evalkit/cache/serving_layout.py).

Each case is a layer as evalkit leaves it: a prompt (left-padded, lengths not multiples of the page) evicted
to a budget at one granularity, then three decode steps of append-then-evict, never compacted, so pages hold
holes and refilled holes. At `head` and `head_page` every KV head has its own budget (as an adaptive
allocator gives), so heads of one sequence hold different numbers of tokens and pages. Scores are drawn per
position, so the paged and dense layouts keep the same tokens.
"""

import importlib.util
import zlib

import pytest
import torch

from evalkit.cache import DenseLayer, PagedLayer
from evalkit.cache.serving_layout import (ServingCache, flashinfer_decode, from_serving, page_lists,
                                          serving_decode_reference, to_serving)
from evalkit.kernels.paged_attention import paged_attention, paged_attention_reference
from evalkit.policies.selection import GRANULARITIES, PAGE_GRANULARITIES, keep_mask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernel's; on a CPU, its interpreter
B, H_KV = 2, 2
PROMPTS = [45, 38]  # tokens per sequence: partly filled last pages
CAPS = torch.tensor([[21, 9], [14, 30]])  # [B, H_kv] tokens kept per head (`head`, `head_page`); column 0 otherwise
DECODE_STEPS = 3


def evict(layer, granularity, seen, S, position_scores):
    """Evict each head down to its cap, scores [B, H_kv, positions] looked up by position."""
    view = layer.read()
    scores = position_scores.gather(2, view.pos.clamp(min=0))
    if granularity in ("head", "head_page"):  # a budget per KV head
        keep = torch.cat([keep_mask(scores[:, h:h + 1], view.pos[:, h:h + 1], seen, CAPS[:, h], granularity,
                                    page_size=S) for h in range(H_KV)], dim=1)
    else:
        keep = keep_mask(scores, view.pos, seen, CAPS[:, 0], granularity, page_size=S)
    layer.evict(view.index, keep)


def evicted_layer(granularity, S, layout="paged", D=16, dtype=torch.float32, seed=0):
    """(layer, seen [B]): a prompt evicted at `granularity`, then DECODE_STEPS appends, each followed by eviction."""
    gen = torch.Generator().manual_seed(seed)
    T = max(PROMPTS)
    total = T + DECODE_STEPS
    layer = (PagedLayer(B, H_KV, D, B * H_KV * -(-total // S), S, dtype, "cpu") if layout == "paged"
             else DenseLayer(B, H_KV, D, total, dtype, "cpu"))
    seen = torch.tensor(PROMPTS)
    pad = T - seen[:, None]
    position_scores = torch.rand(B, H_KV, total, generator=gen)
    k, v = torch.randn(2, B, H_KV, total, D, generator=gen).to(dtype)
    layer.append(k[:, :, :T], v[:, :, :T], (torch.arange(T) - pad).clamp(min=0), torch.arange(T) >= pad)
    evict(layer, granularity, seen, S, position_scores)
    for step in range(DECODE_STEPS):
        layer.append(k[:, :, T + step:T + step + 1], v[:, :, T + step:T + step + 1], seen[:, None],
                     torch.ones(B, 1, dtype=torch.bool))
        seen = seen + 1
        evict(layer, granularity, seen, S, position_scores)
    return layer, seen


def head_tokens(layer):
    """[B][H_kv] (positions, K, V) of each head's live tokens, by position."""
    view = layer.read()
    heads = []
    for b in range(B):
        row = []
        for h in range(H_KV):
            live = view.pos[b, h] >= 0
            order = torch.argsort(view.pos[b, h][live])
            row.append((view.pos[b, h][live][order], view.k[b, h][live][order], view.v[b, h][live][order]))
        heads.append(row)
    return heads


def assert_same_tokens(a, b):
    for row_a, row_b in zip(a, b, strict=True):
        for head_a, head_b in zip(row_a, row_b, strict=True):
            for x, y in zip(head_a, head_b, strict=True):
                assert torch.equal(x, y)


def check_contract(serving: ServingCache, layer) -> None:
    """The tensors are what the kernel documents and hold exactly the layer's live tokens."""
    cells, two, H, S, D = serving.kv_cache.shape
    assert two == 2 and H == H_KV and serving.block_tables.shape[:2] == (H_KV, B)
    assert serving.block_tables.dtype == serving.seq_lens.dtype == torch.int32
    assert serving.block_tables.is_contiguous() and serving.seq_lens.is_contiguous()
    assert torch.equal(serving.seq_lens.T.long(), layer.live_counts())
    used = serving.pages_used()
    for h in range(H):
        taken = []
        for b in range(B):
            row = serving.block_tables[h, b, :used[h, b]].tolist()
            assert row == sorted(row) and len(set(row)) == len(row)  # packed at the front, ascending
            taken += row
            pos = serving.positions[row, h].reshape(-1)  # the row's slots in the order the kernel reads them
            n = int(serving.seq_lens[h, b])
            assert bool((pos[:n] >= 0).all()) and bool((pos[n:] == -1).all())  # only the last page partly filled
            assert bool((pos[:n].diff() > 0).all())  # ascending original positions
        assert len(set(taken)) == len(taken)  # no cell read by two rows
        untouched = torch.ones(cells, dtype=torch.bool)
        untouched[taken] = False
        assert bool((serving.positions[untouched, h] == -1).all())
    assert_same_tokens(head_tokens(from_serving(serving)), head_tokens(layer))


def has_holes(layer) -> bool:
    """Whether some head has an empty slot before a live one in its fill order."""
    live = layer.read().pos >= 0
    return bool((live.long().cumprod(-1).sum(-1) != live.sum(-1)).any())


@pytest.mark.parametrize("S", [4, 16])
@pytest.mark.parametrize("G", [1, 3, 4])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_serving_decode_equals_evalkits_paged_attention_and_its_kernel(granularity, G, S):
    seed = zlib.crc32(f"{granularity}-{G}-{S}".encode())
    layer, seen = evicted_layer(granularity, S, seed=seed)
    serving = to_serving(layer)
    check_contract(serving, layer)
    assert bool((serving.seq_lens % S != 0).any())  # partly filled last pages
    if granularity in ("head", "head_page"):
        assert bool((serving.pages_used()[0] != serving.pages_used()[1]).any())  # heads with different page counts
    if granularity not in PAGE_GRANULARITIES:
        assert has_holes(layer)  # what the adapter compacts

    D = layer.head_dim
    q = torch.randn(B, H_KV * G, 1, D, generator=torch.Generator().manual_seed(seed))
    q_pos = (seen - 1)[:, None]  # the newest token's: every kept token is visible
    table, page_size, scanned = layer.page_table()
    inputs = (q, q_pos, layer.k, layer.v, layer.pos, table, scanned)
    scale = D ** -0.5
    expected, _ = paged_attention_reference(*inputs, page_size, scale)  # [B, 1, H_q, D] float64
    poisoned = torch.full((B, 1, H_KV * G, D), float("nan"), device=DEVICE)
    kernel, _ = paged_attention(*(t.to(DEVICE) for t in inputs), page_size, scale, out=poisoned)

    out = serving_decode_reference(q[:, :, 0], serving, scale)  # [B, H_q, D] float64
    torch.testing.assert_close(out, expected[:, 0], rtol=1e-12, atol=1e-12)
    assert not kernel.isnan().any()
    torch.testing.assert_close(kernel[:, 0].cpu().double(), out, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_the_way_back_gives_each_head_its_tokens_packed_in_the_cells_own_pages(granularity):
    S = 4
    layer, seen = evicted_layer(granularity, S)
    serving = to_serving(layer)
    back = from_serving(serving)
    assert_same_tokens(head_tokens(back), head_tokens(layer))
    cells = serving.kv_cache.shape[0]
    assert back.tables == page_lists(serving)
    assert [[len(t) for t in row] for row in back.tables] == serving.pages_used().T.tolist()  # ceil(n / S) each
    assert back.pool.num_used == int(serving.pages_used().sum()) and not has_holes(back)
    assert torch.equal(back.k[:cells * H_KV * S].view(cells, H_KV, S, -1), serving.kv_cache[:, 0])
    again = to_serving(back)
    for name in ("kv_cache", "block_tables", "seq_lens", "positions"):
        assert torch.equal(getattr(again, name), getattr(serving, name)), name

    dense, _ = evicted_layer(granularity, S, layout="dense")  # the same tokens, elsewhere in storage
    from_dense = to_serving(dense, page_size=S)
    for name in ("kv_cache", "block_tables", "seq_lens", "positions"):
        assert torch.equal(getattr(from_dense, name), getattr(serving, name)), name

    roomy = from_serving(serving, spare_pages=B * H_KV)  # a layer that takes new tokens after its own
    k = torch.randn(B, H_KV, 1, roomy.head_dim)
    roomy.append(k, k, seen[:, None], torch.ones(B, 1, dtype=torch.bool))
    assert torch.equal(roomy.live_counts(), serving.seq_lens.T.long() + 1)


def test_the_way_back_refuses_tensors_that_break_the_layout():
    serving = to_serving(evicted_layer("head", 4)[0])
    shared = serving.block_tables.clone()
    shared[0, 1, 0] = shared[0, 0, 0]  # one cell in two rows of a column
    with pytest.raises(ValueError, match="not free"):
        from_serving(ServingCache(serving.kv_cache, shared, serving.seq_lens, serving.positions))
    outside = serving.block_tables.clone()
    outside[1, 1, 0] = serving.kv_cache.shape[0]
    with pytest.raises(ValueError, match="outside the pool"):
        from_serving(ServingCache(serving.kv_cache, outside, serving.seq_lens, serving.positions))
    with pytest.raises(ValueError, match="do not match seq_lens"):
        from_serving(ServingCache(serving.kv_cache, serving.block_tables, serving.seq_lens - 1, serving.positions))


def flashinfer_missing() -> str | None:
    """Why FlashInfer's block-sparse decode cannot run here, or None."""
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer-python is not installed (optional, not an evalkit dependency)"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if major != 10:
        return f"FlashInfer's block-sparse decode (trtllm-gen) needs an SM100/SM103 GPU; this one is sm_{major}{minor}"
    return None


@pytest.mark.skipif(flashinfer_missing() is not None, reason=flashinfer_missing() or "")
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_flashinfer_block_sparse_decode_reads_the_adapters_tensors_like_the_reference(granularity):
    layer, _ = evicted_layer(granularity, 16, D=128, dtype=torch.bfloat16)
    serving = to_serving(layer)
    q = torch.randn(B, H_KV * 4, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    on_gpu = ServingCache(*(t.cuda() for t in (serving.kv_cache, serving.block_tables, serving.seq_lens,
                                                serving.positions)))
    out = flashinfer_decode(q.cuda(), on_gpu, 128 ** -0.5)
    expected = serving_decode_reference(q, serving, 128 ** -0.5)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-2, atol=1e-2)
