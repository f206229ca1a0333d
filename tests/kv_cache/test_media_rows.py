"""The Thinker's media rows follow the prefix cache through the allocator's reports: kept while
their block is cached or about to be offered to it, dropped when it is evicted or never cached."""
import torch

from omnivox.kv_cache.block_allocator import BlockAllocator
from omnivox.models.qwen3_omni.stages.media_rows import MediaRows

MEDIA = 7  # a media placeholder id
BS = 2


def _store(blocks: int = 2) -> tuple[BlockAllocator, MediaRows]:
    alloc, rows = BlockAllocator(blocks, BS), MediaRows(BS, {MEDIA})
    alloc.watch(rows)
    return alloc, rows


def test_rows_of_a_cached_block_live_until_the_block_is_evicted():
    alloc, rows = _store()
    ids, keys, hidden = [1, MEDIA, 3, 4], [b"k0", b"k1"], torch.arange(8.0).view(4, 2)
    rows.keep("a", ids, keys, hidden, 2)
    assert set(rows.rows) == {b"k0"}  # only the block with media
    block = alloc.allocate()
    alloc.register(block, b"k0")
    alloc.register(block, b"k0")  # offered again at the next step: nothing is evicted
    rows.release("a")  # the request ends: its block is cached, so its rows stay
    assert rows.usable(ids, keys, 2) == 2
    got = torch.zeros(4, 2)
    rows.restore(ids, keys, 2, got)
    assert torch.equal(got[:2], hidden[:2])
    alloc.free([block])
    alloc.allocate()  # the other, never used block
    assert len(rows) == 1
    assert alloc.allocate() == block  # ours, re-used: its prefix is forgotten
    assert len(rows) == 0 and rows.usable(ids, keys, 2) == 0


def test_rows_whose_block_never_entered_the_cache_go_with_their_request():
    alloc, rows = _store()
    ids, keys = [MEDIA, 2], [b"k0"]
    rows.keep("a", ids, keys, torch.ones(1, 3), 1)  # the prompt's end cuts the block: padded with zeros
    assert torch.equal(rows.rows[b"k0"], torch.tensor([[1.0] * 3, [0.0] * 3]))
    rows.keep("b", ids, keys, torch.full((2, 3), 5.0), 1)  # kept already: the first rows stay
    rows.release("b")
    assert len(rows) == 1
    rows.release("a")
    assert len(rows) == 0


def test_a_prefix_cached_in_another_block_counts_as_cached():
    alloc, rows = _store()
    first, second = alloc.allocate(), alloc.allocate()
    alloc.register(first, b"k0")
    rows.keep("a", [MEDIA, 1], [b"k0"], torch.ones(2, 1), 1)
    alloc.register(second, b"k0")  # the same prefix computed again: the cache keeps the first
    rows.release("a")
    assert len(rows) == 1
