"""KV storage bookkeeping against exact state: PagePool, PagedLayer, DenseLayer.

Hand-written cases check exact page ids, slots, positions, K/V/stats and byte counts;
a random-sequence test runs append / evict / add_stats / compact on both layouts next to
a plain-Python model of the paged layout (pages, fill order, pool) and of the tokens each
head must hold, with an invariant checker after every operation.
"""

import math

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from evalkit.cache import PagePool, DenseLayer, PagedLayer, PoolExhausted
from evalkit.errors import EvalkitError

D = 4
TOKEN_BYTES = 2 * D * 4  # K and V rows of float32


def paged(batch, heads, pages, block):
    return PagedLayer(batch, heads, D, pages, block, torch.float32, "cpu")


def dense(batch, heads, capacity):
    return DenseLayer(batch, heads, D, capacity, torch.float32, "cpu")


def tokens(positions, heads, valid=None, tag=0):
    """k, v [B, H, T, D] with a distinct value per (batch row, head, token index); pos, valid [B, T]."""
    pos = torch.tensor(positions, dtype=torch.long)
    B, T = pos.shape
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(heads).view(1, heads, 1, 1)
    t = torch.arange(T).view(1, 1, T, 1)
    k = (tag * 10000 + b * 1000 + h * 100 + t * 10 + torch.arange(D)).float()
    v = -k - 0.5
    valid = torch.ones(B, T, dtype=torch.bool) if valid is None else torch.tensor(valid)
    return k, v, pos, valid


def append(layer, positions, valid=None, tag=0):
    k, v, pos, valid_t = tokens(positions, layer.kv_heads, valid, tag)
    layer.append(k, v, pos, valid_t)
    return k, v


def evict_positions(layer, drop):
    """Evict, per (b, h), the positions listed in drop[b][h]."""
    view = layer.read()
    keep = torch.ones_like(view.pos, dtype=torch.bool)
    for b, row in enumerate(drop):
        for h, positions in enumerate(row):
            for p in positions:
                keep[b, h] &= view.pos[b, h] != p
    layer.evict(view.index, keep)


def live_stats(view):
    """The statistic of live slots, 0 on empty ones (an empty slot's statistic is never read)."""
    return torch.where(view.pos >= 0, view.stats, 0.0)


# --- PagePool ---------------------------------------------------------------------------------

def test_pool_hands_out_the_lowest_free_ids_first():
    pool = PagePool(6, page_size=4)
    assert (pool.num_free, pool.num_used) == (6, 0)
    assert pool.allocate(3) == [0, 1, 2]
    assert (pool.num_free, pool.num_used) == (3, 3)
    pool.free([1, 0])
    assert (pool.num_free, pool.num_used) == (5, 1)
    assert pool.allocate(3) == [0, 1, 3]
    assert pool.allocate(0) == []
    assert pool.allocate(2) == [4, 5]
    assert (pool.num_free, pool.num_used) == (0, 6)


def test_pool_continues_a_run_after_a_given_page_while_free_then_takes_the_lowest():
    pool = PagePool(8, page_size=4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3, after=4) == [5, 6, 7]
    assert pool.allocate(2, after=1) == [2, 3]
    assert pool.allocate(1, after=7) == [4]  # nothing after page 7: the lowest free
    assert (pool.num_free, pool.free_pages()) == (0, [])
    pool.free([2, 6])
    assert pool.allocate(2, after=5) == [6, 2] and pool.num_free == 0


def test_pool_double_free_raises():
    pool = PagePool(4, page_size=2)
    pages = pool.allocate(2)
    pool.free([pages[0]])
    with pytest.raises(ValueError, match="page 0 freed twice"):
        pool.free([0])
    with pytest.raises(ValueError, match="page 3 freed twice"):  # never handed out
        pool.free([3])
    assert (pool.num_free, pool.num_used) == (3, 1)


def test_pool_exhaustion_names_the_pool_size_and_the_amount_asked():
    pool = PagePool(5, page_size=16)
    pool.allocate(3)
    with pytest.raises(PoolExhausted, match=r"asked for 3 more pages of 16 tokens, 2 of 5 free"):
        pool.allocate(3)
    assert (pool.num_free, pool.num_used) == (2, 3)  # a refused request takes nothing
    assert issubclass(PoolExhausted, EvalkitError)
    assert pool.allocate(2) == [3, 4]


# --- PagedLayer, exact state -------------------------------------------------------------------

def test_paged_append_evict_and_hole_reuse():
    layer = paged(1, 2, pages=8, block=2)
    k, v = append(layer, [[0, 1, 2]])
    # 3 tokens, block 2 -> 2 pages per head; an empty layer starts head i at its equal share of the pool,
    # page i * (8 // 2): h0 takes 0, 1; h1 takes 4, 5 (room to grow in place)
    assert layer.tables == [[[0, 1], [4, 5]]]
    view = layer.read()
    assert view.index.tolist() == [[[0, 1, 2, 3], [8, 9, 10, 11]]]
    assert view.pos.tolist() == [[[0, 1, 2, -1], [0, 1, 2, -1]]]
    assert torch.equal(view.k[0, 0, :3], k[0, 0]) and torch.equal(view.v[0, 1, :3], v[0, 1])
    assert (layer.pool.num_free, layer.pool.num_used) == (4, 4)
    assert layer.live_counts().tolist() == [[3, 3]]
    assert layer.bytes_held().tolist() == [8 * TOKEN_BYTES]  # 4 pages of 2 slots
    assert layer.bytes_ideal().tolist() == [6 * TOKEN_BYTES]

    # per-head eviction: head 0 drops position 1, head 1 drops 0 and 1 (its page 4 empties); head 1's pages
    # were one run, so page 5's slots slide down into page 4 and page 5 goes back: still a run from page 4
    evict_positions(layer, [[[1], [0, 1]]])
    assert layer.tables == [[[0, 1], [4]]]
    assert layer.pool.num_free == 5
    view = layer.read()
    assert view.index.tolist() == [[[0, 1, 2, 3], [8, 9, 16, 17]]]  # h1 padded with the sentinel page 8
    assert view.pos.tolist() == [[[0, -1, 2, -1], [2, -1, -1, -1]]]
    assert torch.equal(layer.k[8], k[0, 1, 2]) and torch.equal(layer.v[8], v[0, 1, 2])  # moved from slot 10
    assert (layer.pos[10:12] == -1).all()  # the page given back holds nothing
    assert layer.live_counts().tolist() == [[2, 1]]
    assert layer.bytes_held().tolist() == [6 * TOKEN_BYTES]
    assert layer.bytes_ideal().tolist() == [3 * TOKEN_BYTES]

    # head 0 reuses its holes (slots 1 then 3); head 1 fills slot 9, then takes the page after its last
    # one, 5, free, rather than the lowest free page, 2: its pages stay one run
    k2, v2 = append(layer, [[3, 4]], tag=1)
    assert layer.tables == [[[0, 1], [4, 5]]]
    view = layer.read()
    assert view.index.tolist() == [[[0, 1, 2, 3], [8, 9, 10, 11]]]
    assert view.pos.tolist() == [[[0, 3, 2, 4], [2, 3, 4, -1]]]
    assert torch.equal(layer.k[1], k2[0, 0, 0]) and torch.equal(layer.k[3], k2[0, 0, 1])
    assert torch.equal(layer.k[9], k2[0, 1, 0]) and torch.equal(layer.v[10], v2[0, 1, 1])
    assert torch.equal(layer.k[0], k[0, 0, 0]) and torch.equal(layer.k[8], k[0, 1, 2])
    assert layer.pool.num_free == 4


def test_paged_compact_packs_each_head_and_moves_k_v_pos_stats():
    layer = paged(1, 2, pages=8, block=2)
    k, v = append(layer, [[0, 1, 2, 3, 4, 5]])
    assert layer.tables == [[[0, 1, 2], [4, 5, 6]]]  # head i from page i * (8 // 2)
    evict_positions(layer, [[[0, 2, 3, 5], [1, 2, 4]]])  # head 0 keeps 1, 4; head 1 keeps 0, 3, 5
    assert layer.tables == [[[0, 1], [4, 5, 6]]]  # page 1 held positions 2, 3 only: page 2's slots slid into it
    view = layer.read()
    assert view.pos.tolist() == [[[-1, 1, 4, -1, -1, -1], [0, -1, -1, 3, -1, 5]]]
    stats = torch.where(view.pos >= 0, view.pos * 10 + torch.tensor([0, 1]).view(1, 2, 1), 0).float()
    layer.add_stats(view.index, stats)  # h0: pos1 -> 10, pos4 -> 40; h1: pos0 -> 1, pos3 -> 31, pos5 -> 51

    layer.compact()
    # head 0: 2 live -> ceil(2/2) = 1 page (its first, page 0); head 1: 3 live -> 2 pages (4, 5)
    assert layer.tables == [[[0], [4, 5]]]
    assert layer.pool.num_free == 5
    view = layer.read()
    assert view.index.tolist() == [[[0, 1, 16, 17], [8, 9, 10, 11]]]
    assert view.pos.tolist() == [[[1, 4, -1, -1], [0, 3, 5, -1]]]  # fill order kept
    assert live_stats(view).tolist() == [[[10, 40, 0, 0], [1, 31, 51, 0]]]
    assert torch.equal(view.k[0, 0, :2], k[0, 0, [1, 4]]) and torch.equal(view.v[0, 0, :2], v[0, 0, [1, 4]])
    assert torch.equal(view.k[0, 1, :3], k[0, 1, [0, 3, 5]]) and torch.equal(view.v[0, 1, :3], v[0, 1, [0, 3, 5]])
    assert layer.bytes_held().tolist() == [6 * TOKEN_BYTES]
    assert layer.bytes_ideal().tolist() == [5 * TOKEN_BYTES]

    # next token: head 0's only page is full -> the page after it, 1, free; head 1 fills slot 11 (new stats 0)
    append(layer, [[6]], tag=1)
    assert layer.tables == [[[0, 1], [4, 5]]]
    view = layer.read()
    assert view.pos.tolist() == [[[1, 4, 6, -1], [0, 3, 5, 6]]]
    # a new token starts at 0 even in slot 11, which held position 3 (stat 31) before the compact
    assert live_stats(view).tolist() == [[[10, 40, 0, 0], [1, 31, 51, 0]]]


def test_paged_compact_with_block_four_keeps_ceil_kept_over_block_pages():
    layer = paged(1, 1, pages=4, block=4)
    append(layer, [list(range(13))])  # 4 pages: 0..3
    evict_positions(layer, [[[0, 1, 2, 4, 5, 8, 9, 10]]])  # keeps 3 | 6 7 | 11 | 12: 5 tokens on 4 pages
    assert layer.tables == [[[0, 1, 2, 3]]]
    layer.compact()
    assert layer.tables == [[[0, 1]]]  # ceil(5 / 4) = 2
    assert layer.read().pos.tolist() == [[[3, 6, 7, 11, 12, -1, -1, -1]]]
    assert layer.pool.num_free == 2
    evict_positions(layer, [[[3, 6, 7, 11, 12]]])  # everything: every page back to the pool
    assert layer.tables == [[[]]] and layer.pool.num_free == 4
    assert layer.read().pos.tolist() == [[[-1, -1, -1, -1]]]  # only the sentinel page
    assert layer.bytes_held().tolist() == [0]


def test_paged_padding_is_not_stored_and_rows_allocate_in_order():
    layer = paged(2, 2, pages=8, block=2)
    # row 0: 3 tokens then padding; row 1: left padding then 1 token
    k, v = append(layer, [[0, 1, 2, 9], [7, 8, 9, 0]], valid=[[True, True, True, False], [False, False, False, True]])
    # (0,0): 2 pages, (0,1): 2 pages, (1,0): 1 page, (1,1): 1 page, head i of that order from page i * (8 // 4)
    assert layer.tables == [[[0, 1], [2, 3]], [[4], [6]]]
    view = layer.read()
    assert view.pos.tolist() == [[[0, 1, 2, -1], [0, 1, 2, -1]], [[0, -1, -1, -1], [0, -1, -1, -1]]]
    assert torch.equal(layer.k[8], k[1, 0, 3]) and torch.equal(layer.v[12], v[1, 1, 3])
    assert layer.live_counts().tolist() == [[3, 3], [1, 1]]
    assert layer.bytes_held().tolist() == [8 * TOKEN_BYTES, 4 * TOKEN_BYTES]
    assert layer.bytes_ideal().tolist() == [6 * TOKEN_BYTES, 2 * TOKEN_BYTES]
    # a step where only row 1 has a token: row 0 is untouched
    append(layer, [[5], [1]], valid=[[False], [True]], tag=1)
    assert layer.tables == [[[0, 1], [2, 3]], [[4], [6]]]
    assert layer.read().pos.tolist()[1] == [[0, 1, -1, -1], [0, 1, -1, -1]]
    # an all-padding step changes nothing
    append(layer, [[5], [2]], valid=[[False], [False]], tag=2)
    assert layer.live_counts().tolist() == [[3, 3], [2, 2]]
    assert layer.pool.num_free == 2


def test_paged_pool_too_small_raises_and_changes_nothing():
    layer = paged(1, 2, pages=3, block=2)
    with pytest.raises(PoolExhausted, match=r"asked for 4 more pages of 2 tokens, 3 of 3 free"):
        append(layer, [[0, 1, 2]])  # 2 heads x ceil(3/2) pages = 4 > 3
    assert layer.tables == [[[], []]]
    assert layer.pool.num_free == 3
    assert layer.live_counts().tolist() == [[0, 0]]
    append(layer, [[0, 1]])
    assert layer.tables == [[[0], [1]]]


def test_a_full_cache_keeps_its_k_and_v_views_through_decoding():
    """A prefill into an empty layer starts each head at its share of the pool, so the pages decoding adds
    follow each head's run and K/V stay strided views (before, the next head's pages followed directly)."""
    layer = paged(1, 3, pages=30, block=4)
    append(layer, [list(range(30))])  # 8 pages a head, the last one half full
    assert layer.tables == [[list(range(0, 8)), list(range(10, 18)), list(range(20, 28))]]
    for position in range(30, 37):  # crosses into a ninth page a head
        append(layer, [[position]], tag=position)
    assert layer.tables == [[list(range(0, 10)), list(range(10, 20)), list(range(20, 30))]]
    view = layer.read()
    assert layer._runs == (0, 40) and view.k.data_ptr() == layer.k.data_ptr()
    assert view.pos.tolist() == [[list(range(37)) + [-1, -1, -1]] * 3]


# --- DenseLayer, exact state -------------------------------------------------------------------

def check_trimmed_read(layer) -> None:
    """`read(trim=True)` is `read()` cut to every head's first n slots when the layer is packed with n tokens
    in each head (then every slot it shows is live), else `read()` itself."""
    full, trimmed = layer.read(), layer.read(trim=True)
    counts = (full.pos >= 0).sum(-1)
    if not (layer.packed is not None and bool((counts == counts.max()).all()) and int(counts.max()) > 0):
        assert not trimmed.all_live and torch.equal(trimmed.index, full.index)
        return
    n = int(counts.max())
    assert trimmed.all_live and bool((trimmed.pos >= 0).all())
    assert torch.equal(trimmed.index, full.index[..., :n]) and torch.equal(trimmed.pos, full.pos[..., :n])
    for name in ("k", "v", "stats"):
        assert torch.equal(getattr(trimmed, name), getattr(full, name)[:, :, :n]), name


def test_a_packed_layer_reads_only_its_live_slots_in_place_and_evicts_through_that_view():
    """Decoding over a packed cache (every head holding the same n tokens in its first n slots) reads those
    n slots as views of the storage: no empty slot, so attention needs no positions and no mask; evicting
    one token a head through that view leaves the hole the next decode token fills, as through `read()`."""
    from evalkit.attention_ops import attention_reference

    for layer in (paged(1, 3, pages=30, block=4), dense(1, 3, capacity=40)):
        append(layer, [list(range(30))])
        evict_positions(layer, [[list(range(0, 30, 3)), list(range(1, 30, 2))[:10], list(range(10, 20))]])
        layer.compact()  # 20 tokens a head, packed
        view = layer.read(trim=True)
        assert view.all_live and view.index.shape[-1] == 20 and not layer.read().all_live
        assert view.k.data_ptr() == layer.k.data_ptr() and view.pos._base is layer.pos  # views, not copies
        check_trimmed_read(layer)
        q = torch.randn(1, 6, 1, D, generator=torch.Generator().manual_seed(0))
        q_pos, valid = torch.tensor([[30]]), torch.ones(1, 1, dtype=torch.bool)
        full = layer.read()
        for collect in (None, "attention"):  # without positions, as with them (and their mask) over every slot
            out, stats = attention_reference(q, q_pos, valid, view.k, view.v, None, 0.3, None, collect)
            masked, masked_stats = attention_reference(q, q_pos, valid, full.k, full.v, full.pos, 0.3, None, collect)
            assert torch.allclose(out, masked, atol=1e-6)
            assert collect is None or torch.allclose(stats, masked_stats[..., :20], atol=1e-6)
        keep = torch.ones(1, 3, 20, dtype=torch.bool)
        keep[0, 0, 4] = keep[0, 2, 19] = False  # heads 0 and 2 lose one token, head 1 none
        layer.evict(view.index, keep)
        hole, end = layer.single_hole
        assert hole.tolist() == [[4, 20, 19]] and end.tolist() == [[20, 20, 20]]
        append(layer, [[30]], tag=30)
        assert layer.live_counts().tolist() == [[20, 21, 20]] and not layer.read(trim=True).all_live  # ragged
        check_trimmed_read(layer)


def test_a_packed_layer_takes_new_tokens_through_a_view_exactly_where_the_scatter_puts_them(monkeypatch):
    """Appending several tokens to every head of a packed layer whose heads hold the same n (a prompt into
    an empty layer; a question after a compression) writes them through a view of the storage, from the
    forward's strided K/V, with no gathered copy: the storage then equals, bit for bit, what the scatter
    by slot ids writes (k, v, positions, statistics, kept key norms), on both layouts."""
    from evalkit.cache import storage

    through_view_writes = []
    write_after_packed = storage.SlotLayer._write_after_packed

    def counted(self, k, v, pos):
        through_view_writes.append(write_after_packed(self, k, v, pos))
        return through_view_writes[-1]

    def build(through_view: bool):
        layers = [paged(2, 3, pages=40, block=4), dense(2, 3, capacity=24)]
        k_forward = torch.randn(2, 4, 3, D, generator=torch.Generator().manual_seed(1)).transpose(1, 2)  # [B, H, T, D]
        views = []
        for layer in layers:
            layer.add_stats(layer.slot_index(), torch.ones(layer.slot_index().shape))  # stale statistics to clear
            with monkeypatch.context() as patch:
                patch.setattr(storage.SlotLayer, "_write_after_packed",
                              counted if through_view else lambda self, k, v, pos: False)
                append(layer, [list(range(12)), list(range(100, 112))])  # the prompt, into an empty layer
                layer.key_norms()  # kept from here on, by every write
                evict_positions(layer, [[[0, 5], [1, 2], [3, 11]], [[100, 101], [104, 111], [102, 110]]])
                layer.compact()  # 10 tokens a head, packed
                packed_before = layer.packed.clone()
                layer.append(k_forward, -k_forward, torch.tensor([[12, 13, 14, 15], [112, 113, 114, 115]]),
                             torch.ones(2, 4, dtype=torch.bool))  # the question: 4 tokens, a strided view
            views.append((packed_before.tolist(), layer.packed.tolist()))
        return layers, views

    scattered, scattered_counts = build(through_view=False)
    viewed, viewed_counts = build(through_view=True)
    assert viewed_counts == scattered_counts == [([[10] * 3] * 2, [[14] * 3] * 2)] * 2
    assert through_view_writes == [True, True] * 2  # prompt and question, both layouts: through the view
    for by_view, by_scatter in zip(viewed, scattered):
        for name in ("k", "v", "pos", "stats", "_key_norms"):
            assert torch.equal(getattr(by_view, name), getattr(by_scatter, name)), (type(by_view).__name__, name)
        check_trimmed_read(by_view)


def test_paged_k_and_v_of_heads_in_runs_are_a_view_that_attends_like_the_gathered_copy():
    """A head whose pages are consecutive ids is read as a strided view of the storage, no copy (decode's
    K/V read); its padding slots hold other slots' rows, which attention masks: the same output, bit for bit."""
    from evalkit.attention_ops import attention_reference

    layer = paged(1, 3, pages=30, block=4)
    append(layer, [list(range(30))])  # 8 pages a head, from its share of the pool: 0-7, 10-17, 20-27
    evict_positions(layer, [[list(range(0, 30, 3)), list(range(1, 30, 2)), [4, 5, 6, 7, 8, 9, 10, 11, 12]]])
    layer.compact()  # heads keep their first pages; the rest go back to the pool
    for position in (30, 31, 32):  # decode: a head that fills its last page takes the next one, still a run
        append(layer, [[position]], tag=position)
    view = layer.read()
    assert layer._runs == (0, 40)  # heads start at slots 0, 40, 80
    assert view.k.data_ptr() == layer.k.data_ptr() and view.v._base is layer.v  # views, not copies
    gathered_k, gathered_v = layer.gather(layer.k, view.index), layer.gather(layer.v, view.index)
    live = view.pos >= 0
    assert torch.equal(view.k[live], gathered_k[live]) and torch.equal(view.v[live], gathered_v[live])
    assert not torch.equal(view.k, gathered_k)  # padding: another head's rows, not the sentinel's zeros
    q = torch.randn(1, 6, 1, D, generator=torch.Generator().manual_seed(0))
    q_pos, valid = torch.tensor([[33]]), torch.ones(1, 1, dtype=torch.bool)
    for collect in (None, "attention"):
        out, stats = attention_reference(q, q_pos, valid, view.k, view.v, view.pos, 0.3, None, collect)
        out_copy, stats_copy = attention_reference(q, q_pos, valid, gathered_k, gathered_v, view.pos, 0.3, None, collect)
        assert torch.equal(out, out_copy) and (collect is None or torch.equal(stats, stats_copy))
    # head 2's second page empties: its later pages slide down over it, in order, and it stays a run read in place
    evict_positions(layer, [[[], [], [13, 14, 15, 16]]])
    view = layer.read()
    assert layer._runs == (0, 40) and view.k.data_ptr() == layer.k.data_ptr()
    assert view.pos[0, 2][view.pos[0, 2] >= 0].tolist() == [0, 1, 2, 3, *range(17, 33)]  # in fill order
    live = view.pos >= 0
    assert torch.equal(view.k[live], layer.gather(layer.k, view.index)[live])


def test_a_run_that_loses_a_page_slides_its_later_pages_down_with_what_is_kept_of_them():
    """Decode eviction of a whole page mid-run (page granularity) keeps the head one run: its later pages' slots
    move down over the lost page, in order, with their statistics, key norms and `per_slot` values (nothing
    recomputed), and its last page goes back to the pool; a head that is not one run gives back the page it lost."""
    from evalkit.cache.kept_per_slot import key_norms_of

    layer = paged(1, 2, pages=16, block=4)
    k, v = append(layer, [list(range(20))])  # 5 pages a head: 0-4 and 8-12
    asked = []

    def value_norms(slots):
        asked.append(int((layer.gather(layer.pos, slots) >= 0).sum()))
        return layer.gather(layer.v, slots).norm(dim=-1)

    view = layer.read()
    layer.add_stats(view.index, torch.where(view.pos >= 0, view.pos + 1, 0).float())
    layer.per_slot("value norms", view.index, value_norms)
    layer.key_norms()
    evict_positions(layer, [[[4, 5, 6, 7, 13], []]])  # head 0's second page empties, and one token of its fourth
    assert layer.tables == [[[0, 1, 2, 3], [8, 9, 10, 11, 12]]] and layer.pool.num_free == 7
    view = layer.read()
    assert layer._runs == (0, 32) and view.k.data_ptr() == layer.k.data_ptr()  # still read in place
    held = [*range(4), *range(8, 13), *range(14, 20)]
    assert view.pos[0, 0].tolist() == [*range(4), *range(8, 13), -1, *range(14, 20), *[-1] * 4]  # fill order kept
    live = view.pos >= 0
    assert torch.equal(view.k[0, 0][live[0, 0]], k[0, 0, held]) and torch.equal(view.v[0, 0][live[0, 0]], v[0, 0, held])
    assert torch.equal(live_stats(view)[0, 0][live[0, 0]], torch.tensor(held) + 1.0)
    assert (layer.pos[16:20] == -1).all() and (layer.stats[16:20] == 0).all()  # page 4, given back, is empty
    assert torch.equal(view.key_norms[live], key_norms_of(view.k)[live])
    asked.clear()
    assert torch.equal(layer.per_slot("value norms", view.index, value_norms)[live], view.v.norm(dim=-1)[live])
    assert asked == []  # moved with their tokens, not recomputed

    layer.tables[0][1] = [8, 9, 10, 12, 11]  # not one run (as pages taken from the pool's lowest ids leave it)
    layer._index = None
    evict_positions(layer, [[[], [4, 5, 6, 7]]])  # its second page (9) empties: given back, nothing moves
    assert layer.tables == [[[0, 1, 2, 3], [8, 10, 12, 11]]] and torch.equal(layer.k[40:44], k[0, 1, 8:12])


def test_whole_pages_evicted_leave_the_layer_packed_so_appends_need_no_scan():
    """Decode eviction of whole pages (page granularity) leaves each head's live tokens the first of its fill
    order: the eviction finds it out once (`packed`), so the appends until the next eviction take their slot
    without a scan (`_next_free`) and `read(trim=True)` hands out the live slots only; a head that lost tokens
    from the middle of a page is not packed."""
    layer = paged(1, 2, pages=16, block=4)
    append(layer, [list(range(10))])  # 3 pages a head, the last one half full
    evict_positions(layer, [[[4, 5, 6, 7], [0, 1, 2, 3]]])  # a whole page each
    assert layer.packed.tolist() == [[6, 6]] and layer._next_free() is not None
    append(layer, [[10]], tag=1)
    view = layer.read(trim=True)
    assert view.all_live and view.pos.tolist() == [[[0, 1, 2, 3, 8, 9, 10], [4, 5, 6, 7, 8, 9, 10]]]
    evict_positions(layer, [[[1, 2], [5]]])  # two from the middle of head 0's first page: holes
    assert layer.packed is None and layer.single_hole is None
    assert layer.read().pos.tolist() == [[[0, -1, -1, 3, 8, 9, 10, -1], [4, -1, 6, 7, 8, 9, 10, -1]]]


def test_dense_fills_lowest_free_slot_and_compacts():
    layer = dense(1, 2, capacity=4)
    k, v = append(layer, [[0, 1, 2]])
    assert layer.read().pos.tolist() == [[[0, 1, 2, -1], [0, 1, 2, -1]]]
    evict_positions(layer, [[[1], [0]]])
    assert layer.read().pos.tolist() == [[[0, -1, 2, -1], [-1, 1, 2, -1]]]
    k2, v2 = append(layer, [[3, 4]], tag=1)
    view = layer.read()
    assert view.pos.tolist() == [[[0, 3, 2, 4], [3, 1, 2, 4]]]
    assert torch.equal(view.k[0, 0, 1], k2[0, 0, 0]) and torch.equal(view.v[0, 1, 0], v2[0, 1, 0])
    assert layer.bytes_held().tolist() == [2 * 4 * TOKEN_BYTES]  # the whole buffer, whatever is live
    assert layer.bytes_ideal().tolist() == [8 * TOKEN_BYTES]

    with pytest.raises(PoolExhausted, match=r"capacity 4 tokens per head, 1 more asked"):
        append(layer, [[5]], tag=2)
    assert layer.read().pos.tolist() == [[[0, 3, 2, 4], [3, 1, 2, 4]]]  # unchanged

    evict_positions(layer, [[[2, 3], [3]]])  # head 0 keeps 0, 4; head 1 keeps 1, 2, 4
    view = layer.read()
    layer.add_stats(view.index, torch.where(view.pos >= 0, view.pos + 1, 0).float())
    layer.compact()
    view = layer.read()
    assert view.pos.tolist() == [[[0, 4, -1, -1], [1, 2, 4, -1]]]
    assert live_stats(view).tolist() == [[[1, 5, 0, 0], [2, 3, 5, 0]]]
    assert torch.equal(view.k[0, 0, 1], k2[0, 0, 1]) and torch.equal(view.k[0, 1, 0], k[0, 1, 1])
    assert layer.bytes_held().tolist() == [2 * 4 * TOKEN_BYTES]
    assert layer.bytes_ideal().tolist() == [5 * TOKEN_BYTES]


def test_dense_padding_is_not_stored():
    layer = dense(2, 1, capacity=3)
    k, _ = append(layer, [[0, 1, 2], [4, 0, 1]], valid=[[True, True, False], [False, True, True]])
    view = layer.read()
    assert view.pos.tolist() == [[[0, 1, -1]], [[0, 1, -1]]]
    assert torch.equal(view.k[1, 0, 0], k[1, 0, 1])
    # row 0 has 1 free slot, row 1 too: 1 more token each fits, 2 do not
    with pytest.raises(PoolExhausted, match=r"capacity 3 tokens per head, 1 more asked"):
        append(layer, [[2, 3], [2, 3]], tag=1)


# --- random operation sequences against a model ------------------------------------------------

class PagedModel:
    """Plain-Python paged layout: pool (an empty layer's head i from page i * (pages // heads), where every
    head's need fits that share; later the page after a head's last one if free, else the lowest free id),
    block tables, page contents, fill order."""

    def __init__(self, B, H, S, num_pages):
        self.B, self.H, self.S, self.num_pages = B, H, S, num_pages
        self.free = list(range(num_pages))
        self.tables = [[[] for _ in range(H)] for _ in range(B)]
        self.pages = {}  # page id -> [position or None] * S

    def slots(self, b, h):
        return [(p, o) for p in self.tables[b][h] for o in range(self.S)]

    def live(self, b, h):
        return [self.pages[p][o] for p, o in self.slots(b, h) if self.pages[p][o] is not None]

    def append(self, new):
        """new[b] = positions stored for row b; False if the pool cannot serve them (nothing changes)."""
        need = [[math.ceil(max(0, len(new[b]) - (len(self.slots(b, h)) - len(self.live(b, h)))) / self.S)
                 for h in range(self.H)] for b in range(self.B)]
        if sum(map(sum, need)) > len(self.free):
            return False
        share = self.num_pages // (self.B * self.H)
        if not any(t for row in self.tables for t in row) and max(map(max, need)) <= share:
            for i in range(self.B * self.H):
                b, h = divmod(i, self.H)
                self.tables[b][h] = list(range(i * share, i * share + need[b][h]))
                for page in self.tables[b][h]:
                    self.free.remove(page)
                    self.pages[page] = [None] * self.S
            need = [[0] * self.H for _ in range(self.B)]
        for b in range(self.B):
            for h in range(self.H):
                for _ in range(need[b][h]):
                    table = self.tables[b][h]
                    after = table[-1] + 1 if table else None  # the page after the head's last one, if free
                    page = self.free.pop(self.free.index(after) if after in self.free else 0)
                    table.append(page)
                    self.pages[page] = [None] * self.S
                holes = [(p, o) for p, o in self.slots(b, h) if self.pages[p][o] is None]
                for (p, o), position in zip(holes, new[b]):
                    self.pages[p][o] = position
        return True

    def evict(self, keep):
        for b in range(self.B):
            for h in range(self.H):
                for p, o in self.slots(b, h):
                    if self.pages[p][o] is not None and not keep(b, h, self.pages[p][o]):
                        self.pages[p][o] = None
        self._release()

    def compact(self):
        for b in range(self.B):
            for h in range(self.H):
                live, table = self.live(b, h), self.tables[b][h]
                run = list(range(table[0], table[0] + math.ceil(len(live) / self.S))) if table else []
                if run and run[-1] < self.num_pages and all(p in table or p in self.free for p in run):
                    for p in run:  # the head's kept tokens go to one run of pages from its first one
                        if p in self.free:
                            self.free.remove(p)
                            self.pages[p] = [None] * self.S
                    self.tables[b][h] = run + [p for p in table if p not in run]
                for i, (p, o) in enumerate(self.slots(b, h)):
                    self.pages[p][o] = live[i] if i < len(live) else None
        self._release()

    def _release(self):
        """Pages left with no live slot go back to the pool; a head whose pages were consecutive ids moves its
        live pages' contents down over them, in order, and gives back its last pages instead."""
        for row in self.tables:
            for h, table in enumerate(row):
                kept = [p for p in table if any(x is not None for x in self.pages[p])]
                if table and table == list(range(table[0], table[0] + len(table))):
                    contents = [self.pages[p] for p in kept]
                    row[h], gone = table[:len(kept)], table[len(kept):]
                    self.pages.update(zip(row[h], contents))
                else:
                    row[h], gone = kept, [p for p in table if p not in kept]
                for p in gone:
                    self.free.append(p)
                    del self.pages[p]
        self.free.sort()

    def view_pos(self):
        width = max(1, max(len(t) for row in self.tables for t in row)) * self.S
        return [[[-1 if self.pages[p][o] is None else self.pages[p][o] for p, o in self.slots(b, h)]
                 + [-1] * (width - len(self.slots(b, h))) for h in range(self.H)] for b in range(self.B)]


class DenseModel:
    def __init__(self, B, H, capacity):
        self.slots = [[[None] * capacity for _ in range(H)] for _ in range(B)]

    def append(self, new):
        for b, row in enumerate(self.slots):
            for slots in row:
                holes = [i for i, x in enumerate(slots) if x is None]
                for i, position in zip(holes, new[b]):
                    slots[i] = position

    def evict(self, keep):
        for b, row in enumerate(self.slots):
            for h, slots in enumerate(row):
                for i, x in enumerate(slots):
                    if x is not None and not keep(b, h, x):
                        slots[i] = None

    def compact(self):
        for row in self.slots:
            for slots in row:
                live = [x for x in slots if x is not None]
                slots[:] = live + [None] * (len(slots) - len(live))

    def view_pos(self):
        return [[[-1 if x is None else x for x in slots] for slots in row] for row in self.slots]


def head_tokens(layer, b, h):
    """{position: (k, v, stat)} held by (b, h)."""
    view = layer.read()
    live = view.pos[b, h] >= 0
    positions = view.pos[b, h][live].tolist()
    assert len(set(positions)) == len(positions), "a position stored twice in one head"
    return {p: (view.k[b, h][live][i], view.v[b, h][live][i], float(view.stats[b, h][live][i]))
            for i, p in enumerate(positions)}


def check_stamps(layer, stamped: dict, used: set) -> None:
    """Each live token's stamp (`SlotLayer.stamps`) is the one it got when written, wherever it moved since, and
    a token new since the last check has one no token of this layer had before. `stamped`: {(b, h, position):
    stamp} of the tokens held at the last check, `used`: every stamp seen so far; both kept across calls."""
    view = layer.read()
    stamps = layer.gather(layer.stamps(), view.index)
    live = {(b, h, int(view.pos[b, h, i])): int(stamps[b, h, i]) for b, h, i in (view.pos >= 0).nonzero().tolist()}
    assert len(set(live.values())) == len(live), "two tokens share a stamp"
    for token, stamp in live.items():
        if token in stamped:
            assert stamped[token] == stamp, f"token {token} changed its stamp"
        else:
            assert stamp not in used, f"token {token} got a stamp an earlier token had"
    stamped.clear()
    stamped.update(live)
    used.update(live.values())


def check_paged(layer, model, data, peak, after_compact):
    S, pool = layer.page_size, layer.pool
    # pool bookkeeping
    assert pool.num_free + pool.num_used == pool.num_pages
    free = pool.free_pages()
    assert set(free) <= set(pool._free)  # every free page can be handed out (the heap may hold taken ones)
    assert free == model.free
    in_tables = [p for row in layer.tables for t in row for p in t]
    assert len(in_tables) == len(set(in_tables)), "a page in two block tables"
    assert not set(in_tables) & set(free), "a page both free and in a table"
    assert len(in_tables) == pool.num_used
    # exact layout: same tables, same positions slot by slot (fill order, lowest free slot first)
    assert layer.tables == model.tables
    view = layer.read()
    assert view.pos.tolist() == model.view_pos()
    assert (layer.pos[layer.null_page * S:] == -1).all(), "the sentinel page holds a token"
    live = layer.live_counts()
    for b in range(layer.batch):
        for h in range(layer.kv_heads):
            n, pages = int(live[b, h]), len(layer.tables[b][h])
            for p in layer.tables[b][h]:  # a page exists only while it holds a live slot
                assert (layer.pos[p * S:(p + 1) * S] >= 0).any(), f"page {p} held with no live slot"
            assert math.ceil(n / S) <= pages <= min(n, math.ceil(peak[b][h] / S))
            if after_compact:
                assert pages == math.ceil(n / S)
    assert layer.bytes_held().tolist() == [sum(len(t) for t in row) * S * TOKEN_BYTES for row in layer.tables]
    check_tokens(layer, data)


def check_tokens(layer, data):
    """The tokens held per head, with their K, V and statistic, equal the model's."""
    for b in range(layer.batch):
        for h in range(layer.kv_heads):
            held = head_tokens(layer, b, h)
            expected = data[b][h]
            assert sorted(held) == sorted(expected)
            for p, (k, v, stat) in expected.items():
                assert torch.equal(held[p][0], k) and torch.equal(held[p][1], v)
                assert held[p][2] == stat
    view = layer.read()  # key norms, kept by every write from the first check on, equal fresh ones
    live = view.pos >= 0
    assert torch.equal(view.key_norms[live], view.k[live].double().norm(dim=-1))
    check_per_slot_memo(layer)
    assert layer.bytes_ideal().tolist() == [sum(len(d) for d in row) * TOKEN_BYTES for row in data]


def check_per_slot_memo(layer):
    """`per_slot`, kept from the first check on and asked through both reads, equals a fresh computation on
    every live slot: a value that depends on the slot's own V row and on its KV head."""
    def of_slots(slots):  # [B, H_kv, n] -> [B, H_kv, n]
        heads = torch.arange(1, slots.shape[1] + 1, dtype=torch.float64)[None, :, None]
        return layer.gather(layer.v, slots).double().sum(-1) * heads

    for view in (layer.read(), layer.read(trim=True)):
        live = view.pos >= 0
        assert torch.equal(layer.per_slot("probe", view.index, of_slots)[live], of_slots(view.index)[live])


@pytest.mark.parametrize("make", [lambda: paged(2, 3, 40, 4), lambda: dense(2, 3, 24)])
def test_a_filled_layer_keeps_what_its_source_kept_of_each_token(make):
    """`fill` (a shared prefill's branch taking the tokens its policy kept) carries `per_slot`'s values and the
    stamps with the tokens: the branch's first ask computes nothing, and equals a fresh computation."""
    source, branch = make(), make()
    append(source, [list(range(20)), list(range(100, 120))], valid=[[True] * 20, [True] * 17 + [False] * 3])
    asked = []

    def of_slots(layer):
        def compute(slots):
            asked.append(int((layer.gather(layer.pos, slots) >= 0).sum()))
            heads = torch.arange(1, slots.shape[1] + 1, dtype=torch.float64)[None, :, None]
            return layer.gather(layer.v, slots).double().sum(-1) * heads
        return compute

    view = source.read()
    source.per_slot("probe", view.index, of_slots(source))
    source.stamps()  # kept from here on
    keep = torch.rand(view.pos.shape, generator=torch.Generator().manual_seed(0)) < 0.5
    branch.fill(source, view.index, keep & (view.pos >= 0))
    asked.clear()
    view = branch.read()
    live = view.pos >= 0
    assert int(live.sum()) == int((keep & (source.read().pos >= 0)).sum()) > 0
    assert torch.equal(branch.per_slot("probe", view.index, of_slots(branch))[live], of_slots(branch)(view.index)[live])
    assert asked == [int(live.sum())]  # only the fresh computation above read a token
    stamps = {}  # layer -> {(b, h, position): stamp}
    for layer in (source, branch):
        view = layer.read()
        live, held = view.pos >= 0, layer.gather(layer.stamps(), view.index)
        stamps[layer] = {(b, h, int(view.pos[b, h, i])): int(held[b, h, i]) for b, h, i in live.nonzero().tolist()}
    assert stamps[branch].items() <= stamps[source].items()  # each token's K and V bits, as its stamp says


@pytest.mark.parametrize("make", [lambda: paged(2, 3, 40, 4), lambda: dense(2, 3, 24)])
def test_forks_that_store_the_same_prompt_compute_per_slot_values_once(make):
    """`share_kept`: the layers of a shared prefill's forks that store its prompt in the same slots compute
    `per_slot`'s values of it once, each fork's equal to a fresh computation. A fork written to before it first
    asks (it holds a token of its own) and one that placed the prompt elsewhere compute their own."""
    forks, asked = [], []

    def of_slots(layer):
        def compute(slots):
            asked.append(int((layer.gather(layer.pos, slots) >= 0).sum()))  # tokens read, over every head
            heads = torch.arange(1, slots.shape[1] + 1, dtype=torch.float64)[None, :, None]
            return layer.gather(layer.v, slots).double().sum(-1) * heads
        return compute

    def fork(before=False, after=False):
        layer = make()
        if before:  # a token of its own first: the prompt lands in other slots
            append(layer, [[500], [600]], tag=1)
        append(layer, [list(range(20)), list(range(100, 120))], valid=[[True] * 20, [True] * 17 + [False] * 3])
        layer.share_kept(forks)
        if after:
            append(layer, [[20], [120]], tag=1)
        return layer

    def ask(layer):
        view = layer.read()
        live = view.pos >= 0
        assert torch.equal(layer.per_slot("probe", view.index, of_slots(layer))[live],
                           of_slots(layer)(view.index)[live])

    for layer in (fork(), fork()):
        ask(layer)
    assert asked == [111, 111, 111]  # 37 tokens × 3 heads: the first fork's, then the fresh computations
    asked.clear()
    for layer in (fork(after=True), fork(before=True)):
        ask(layer)
    assert asked == [117] * 4 and len(forks) == 2  # two placements of the prompt


def add_random_stats(seed, layers, data):
    """Add a small integer (exact in float32) to every live token's statistic, on each layer and in `data`."""
    g = torch.Generator().manual_seed(seed)
    add = {(b, h, p): float(torch.randint(1, 8, (), generator=g))
           for b, row in enumerate(data) for h, head in enumerate(row) for p in sorted(head)}
    for layer in layers:
        view = layer.read()
        stats = torch.zeros(view.pos.shape)
        for (b, h, p), x in add.items():
            stats[b, h][view.pos[b, h] == p] = x
        layer.add_stats(view.index, stats)
    for (b, h, p), x in add.items():
        k, v, stat = data[b][h][p]
        data[b][h][p] = (k, v, stat + x)


op = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 4), st.integers(0, 2**31 - 1), st.sampled_from([1.0, 0.7, 0.4, 0.0])),
    # "one": each head loses at most one token, as decode eviction does
    st.tuples(st.just("evict"), st.integers(0, 2**31 - 1), st.sampled_from([0.8, 0.5, 0.2, 1.0, 0.0, "one"])),
    st.tuples(st.just("stats"), st.integers(0, 2**31 - 1)),
    st.tuples(st.just("compact")),
)
# A decode step with decode eviction: each head loses at most one token, then every row appends one.
decode_step = st.integers(0, 2**31 - 1).map(lambda seed: [("evict", seed, "one"), ("append", 1, seed, 1.0)])
operations = st.lists(st.one_of(op.map(lambda o: [o]), decode_step), min_size=1, max_size=10).map(
    lambda steps: [o for step in steps for o in step])


@pytest.mark.slow  # 400 Hypothesis examples
@settings(max_examples=400, deadline=None)
@given(B=st.integers(1, 3), H=st.integers(1, 3), S=st.sampled_from([1, 2, 4]), extra_pages=st.integers(0, 12),
       ops=operations)
def test_random_operations_match_the_model_on_both_layouts(B, H, S, extra_pages, ops):
    num_pages = B * H + extra_pages  # small pools run out: the model predicts exactly when
    capacity = 4 * len(ops)
    pl, dl = paged(B, H, num_pages, S), dense(B, H, capacity)
    model, dmodel = PagedModel(B, H, S, num_pages), DenseModel(B, H, capacity)
    data = [[{} for _ in range(H)] for _ in range(B)]  # position -> (k, v, stat) per head
    peak = [[0] * H for _ in range(B)]  # most tokens a head held since the last compact
    stamped, used = ({}, {}), (set(), set())  # each layout's tokens' stamps, and all it handed out (`check_stamps`)
    seen = [0] * B

    for step in ops:
        kind = step[0]
        compacted = False
        if kind == "append":
            _, T, seed, p_valid = step
            g = torch.Generator().manual_seed(seed)
            valid = torch.rand(B, T, generator=g) < p_valid
            pos = torch.full((B, T), 999, dtype=torch.long)  # padding positions are junk
            for b in range(B):
                n = int(valid[b].sum())
                pos[b][valid[b]] = torch.arange(seen[b], seen[b] + n)
            k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
            new = [pos[b][valid[b]].tolist() for b in range(B)]
            if model.append(new):
                if T == 1 and bool(valid.all()) and pl.packed is not None:
                    event("decode append into a packed layer (no scan)")
                if T == 1 and bool(valid.all()) and pl.single_hole is not None:
                    event("decode append into a layer with a single hole per head (no scan)")
                pl.append(k, v, pos, valid)
                dl.append(k, v, pos, valid)
                dmodel.append(new)
                for b in range(B):
                    seen[b] += len(new[b])
                    for h in range(H):
                        for t in range(T):
                            if valid[b, t]:
                                data[b][h][int(pos[b, t])] = (k[b, h, t], v[b, h, t], 0.0)
                        peak[b][h] = max(peak[b][h], len(data[b][h]))
            else:
                event("pool exhausted")
                with pytest.raises(PoolExhausted):
                    pl.append(k, v, pos, valid)
        elif kind == "evict":
            _, seed, p_keep = step
            add_random_stats(seed + 1, (pl, dl), data)  # as H2O does: statistics, then eviction
            g = torch.Generator().manual_seed(seed)
            view = pl.read()
            if p_keep == "one":  # a random live slot per head, dropped when a coin says so
                pick = torch.rand(view.pos.shape, generator=g).masked_fill(view.pos < 0, -1).argmax(-1, keepdim=True)
                keep = torch.ones(view.pos.shape, dtype=torch.bool)
                keep.scatter_(-1, pick, torch.rand(pick.shape, generator=g) < 0.5)
            else:
                keep = torch.rand(view.pos.shape, generator=g) < p_keep  # random bits on empty slots too
            decision = {(b, h, int(view.pos[b, h, i])): bool(keep[b, h, i])
                        for b in range(B) for h in range(H) for i in range(view.pos.shape[-1]) if view.pos[b, h, i] >= 0}
            pl.evict(view.index, keep)
            dview = dl.read()
            dkeep = torch.rand(dview.pos.shape, generator=g) < 0.5
            for (b, h, p), kept in decision.items():
                dkeep[b, h][dview.pos[b, h] == p] = kept
            dl.evict(dview.index, dkeep)
            model.evict(lambda b, h, p: decision[(b, h, p)])
            dmodel.evict(lambda b, h, p: decision[(b, h, p)])
            for (b, h, p), kept in decision.items():
                if not kept:
                    del data[b][h][p]
        elif kind == "stats":
            add_random_stats(step[1], (pl, dl), data)
        else:
            pl.compact()
            dl.compact()
            model.compact()
            dmodel.compact()
            peak = [[len(d) for d in row] for row in data]
            compacted = True
            event("compact")

        check_paged(pl, model, data, peak, compacted)
        assert dl.read().pos.tolist() == dmodel.view_pos()
        for layer in (pl, dl):  # a layer that calls itself packed is: each head's live slots come first
            if layer.packed is not None:
                live = layer.read().pos >= 0
                assert torch.equal(layer.packed, live.sum(-1))
                assert bool((live.long().cumprod(-1).sum(-1) == layer.packed).all())
            if layer.single_hole is not None:  # ... or its first `end` slots but the one at `hole`
                assert layer.packed is None
                live = layer.read().pos >= 0
                hole, end = layer.single_hole
                slot = torch.arange(live.shape[-1])
                assert torch.equal(live, (slot < end[..., None]) & (slot != hole[..., None])), (live, hole, end)
            check_trimmed_read(layer)
        for layer, held, handed_out in zip((pl, dl), stamped, used):
            check_stamps(layer, held, handed_out)
        check_tokens(dl, data)
        assert dl.bytes_held().tolist() == [H * capacity * TOKEN_BYTES] * B
        assert torch.equal(pl.live_counts(), dl.live_counts())
        for b in range(B):  # both layouts hold the same tokens with the same K, V, statistic
            for h in range(H):
                paged_tokens, dense_tokens = head_tokens(pl, b, h), head_tokens(dl, b, h)
                assert sorted(paged_tokens) == sorted(dense_tokens)
                for p, (k, v, stat) in paged_tokens.items():
                    assert torch.equal(dense_tokens[p][0], k) and torch.equal(dense_tokens[p][1], v)
                    assert dense_tokens[p][2] == stat


# --- decode eviction: the pages held are the pages the tokens need --------------------------------

def check_pages_held(layer, hole_per_head: bool) -> None:
    """Every page a head holds has a live token, and the pool counts exactly the pages in the tables. With no
    hole (after a decode append) a head holds ceil(live / S) pages; with the one a decode eviction leaves, the
    lost token's page may stay (its other tokens live): at most ceil((live + 1) / S)."""
    S, pool = layer.page_size, layer.pool
    live = layer.live_counts()
    for b in range(layer.batch):
        for h in range(layer.kv_heads):
            table, n = layer.tables[b][h], int(live[b, h])
            empty = [p for p in table if not bool((layer.pos[p * S:(p + 1) * S] >= 0).any())]
            assert not empty, f"sequence {b}, head {h}: pages {empty} held with no live token ({n} live, {table})"
            most = math.ceil((n + 1) / S) if hole_per_head else math.ceil(n / S)
            assert math.ceil(n / S) <= len(table) <= most, (b, h, n, table)
    assert pool.num_used == sum(len(t) for row in layer.tables for t in row) == pool.num_pages - pool.num_free
    assert layer.held_slots().tolist() == [sum(len(t) for t in row) * S for row in layer.tables]


@pytest.mark.parametrize("S", [1, 2, 3, 4])
@pytest.mark.parametrize("prompt", range(4, 13))
def test_decode_eviction_holds_only_the_pages_its_tokens_need(S, prompt):
    """The loop's decode eviction at head granularity: each step every head appends a token, then loses one
    through `read(trim=True)`'s view of its first n slots. There `PagedLayer._release_empty` knows each head
    held n slots and lost one, so only n % S == 1 can empty a page (the last slot's, alone on it; any page
    when S = 1): a prompt that is a multiple of S (n = prompt + 1) must give that page back, the others
    keep every page that still holds a token. Half the time a head loses its last live slot in fill order."""
    B, H, steps = 2, 2, 6
    layer = paged(B, H, B * H * math.ceil((prompt + steps) / S) + 2, S)
    g = torch.Generator().manual_seed(S * 100 + prompt)
    append(layer, [list(range(prompt))] * B)
    check_pages_held(layer, hole_per_head=False)
    released_from_the_view = 0
    for step in range(steps):
        position = prompt + step
        append(layer, [[position]] * B, tag=position)
        check_pages_held(layer, hole_per_head=False)
        view = layer.read(trim=True)  # every head's first n slots while packed (no page released yet)
        live = view.pos >= 0
        slot = torch.arange(live.shape[-1])
        last = slot == torch.where(live, slot, -1).amax(-1, keepdim=True)  # [B, H, N] each head's last live slot
        other = torch.rand(live.shape, generator=g).masked_fill(~live | last, -1).argmax(-1, keepdim=True)
        lose_last = torch.rand(B, H, 1, generator=g) < 0.5
        dropped = torch.where(lose_last, last, torch.zeros_like(last).scatter(-1, other, True))
        used = layer.pool.num_used
        layer.evict(view.index, ~dropped)
        released_from_the_view += view.all_live and layer.pool.num_used < used
        check_pages_held(layer, hole_per_head=True)
        assert layer.live_counts().tolist() == [[prompt] * H] * B
    if prompt % S == 0:  # n = prompt + 1 = 1 (mod S): the shortcut's one case that frees a page was reached
        assert released_from_the_view, "no page emptied through the packed view: the test misses its case"
