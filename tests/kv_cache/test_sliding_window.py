"""Pages behind a sliding attention window go back to the allocator (engine/scheduler.py: sliding
windows): the arithmetic of `slide` and `window_pages`, admission by the window's bound, the
prefix cache kept out, and every page returned exactly once."""
import random

import pytest

from omnivox.engine.scheduler import ARScheduler, CannotFit, Seq, window_pages
from omnivox.kv_cache.block_allocator import BlockAllocator


def _scheduler(blocks: int, bs: int, budget: int, max_running: int = 4):
    freed: list[int] = []
    s = ARScheduler(BlockAllocator(blocks, bs), max_running=max_running, token_budget=budget, on_free=freed.extend)
    return s, freed


def _count_allocations(alloc: BlockAllocator) -> list[int]:
    got, allocate = [], alloc.allocate
    alloc.allocate = lambda: got.append(allocate()) or got[-1]
    return got


def _step(s: ARScheduler, check=lambda seq, n: None) -> list[tuple[Seq, int]]:
    """One step as the stage runs it: schedule, compute, advance, slide; a finished input grows by one."""
    batch = s.schedule()
    for seq, n in batch.items:
        check(seq, n)
        seq.num_computed += n
        s.slide(seq)
        if seq.num_computed == seq.num_tokens and seq.num_tokens < seq.max_tokens:
            seq.num_tokens += 1  # decode: its sampled token is the next input
    return batch.items


@pytest.mark.parametrize("bs", [1, 3, 4])
@pytest.mark.parametrize("window", [1, 2, 5, 8, 9])
@pytest.mark.parametrize("budget", [1, 4, 7])
def test_slide_frees_exactly_the_pages_no_query_can_see(bs, window, budget):
    """A 13-token prompt (chunked prefill crossing the window's edge when budget < 13) then decode
    to 60 tokens: before each step the table starts at the page of the next query's window start
    and covers every key this step's queries see; it never holds more than `window_pages`; the
    bound is reached; every page goes back exactly once."""
    s, freed = _scheduler(64, bs, budget)
    seq = Seq("a", 0, num_tokens=13, max_tokens=60, window=window)
    s.add(seq)
    bound, most = window_pages(window, budget, bs), 0
    allocated = _count_allocations(s.alloc)

    def check(seq, n):
        nonlocal most
        c = seq.num_computed
        lo = max(0, c - window + 1)  # the first key this step's first query sees
        assert seq.first_page == lo // bs  # every page wholly before it is gone, no other
        assert seq.first_page + len(seq.block_table) == -(-(c + n) // bs)  # covers the step's last key
        assert s.alloc.num_free == 64 - len(seq.block_table)
        most = max(most, len(seq.block_table))

    while seq.num_computed < seq.max_tokens:
        assert _step(s, check)
    assert most <= bound
    if budget == 1:
        assert most == bound  # the bound is tight: decoding reaches it
    assert len(freed) == len(allocated) - len(seq.block_table)  # freed while sliding, each once
    s.remove(seq)
    assert s.alloc.num_free == 64 and seq.first_page == 0 and seq.block_table == []
    assert len(freed) == len(allocated)


def test_admission_counts_the_window_not_the_length():
    """8 pages of 4: a session of 10,000 tokens with a window of 6 fits (it holds at most 3 pages,
    with 4-token chunks too); without a window, or with one wider than the pool, it cannot."""
    s, _ = _scheduler(8, 4, budget=4)
    long = Seq("long", 0, num_tokens=9, max_tokens=10_000, window=6)
    s.add(long)
    with pytest.raises(CannotFit, match="needs 10000 tokens of KV cache"):
        s.add(Seq("plain", 1, num_tokens=9, max_tokens=10_000))
    with pytest.raises(CannotFit, match=r"needs 9 pages of 4 tokens at once \(attention window 30\)"):
        s.add(Seq("wide", 2, num_tokens=9, max_tokens=10_000, window=30))
    for _ in range(300):
        _step(s)
        assert len(long.block_table) <= window_pages(6, 4, 4) == 3
    assert long.num_computed == 9 + 297 and long.first_page == (306 - 6 + 1) // 4  # 3 prefill steps


def test_windowed_sequences_neither_take_nor_offer_cached_prefixes():
    s, _ = _scheduler(32, 2, budget=16)
    items = list(range(100, 110))
    plain = Seq("plain", 0, num_tokens=10, max_tokens=12, key_items=list(items), block_size=2)
    s.add(plain)
    _step(s)
    s.register_prefix(plain)
    cached = dict(s.alloc.by_hash)
    assert len(cached) == 5
    win = Seq("win", 1, num_tokens=10, max_tokens=40, key_items=list(items), block_size=2, window=3)
    s.add(win)
    assert win.key_items is None and win.prefix_keys == []
    for _ in range(20):
        _step(s)
        s.register_prefix(win)
    assert win.prefix_hit == 0 and s.prefix_hit_tokens == 0
    assert s.alloc.by_hash == cached  # nothing of the windowed sequence entered the cache
    assert set(win.block_table).isdisjoint(cached.values())


@pytest.mark.parametrize("seed", range(12))
def test_windowed_sessions_under_preemption_return_every_page_once(seed):
    """Random windowed sessions on a tight pool: preempted ones restart from their first token with
    a fresh table; each holds at most its bound; aborts mid-session and ends return everything."""
    rng = random.Random(seed)
    bs, window, budget = rng.choice([1, 2, 4]), rng.randint(1, 9), rng.randint(1, 6)
    bound = window_pages(window, budget, bs)
    s, freed = _scheduler(bound + rng.randint(0, 6), bs, budget, max_running=rng.randint(1, 4))
    allocated = _count_allocations(s.alloc)
    live: list[Seq] = []
    for step in range(250):
        if rng.random() < 0.2 and len(live) < 6:
            seq = Seq(f"r{step}", step, num_tokens=rng.randint(1, 12), max_tokens=rng.randint(20, 400), window=window)
            s.add(seq)  # never CannotFit: the pool holds one session's bound
            live.append(seq)
        if live and rng.random() < 0.05:  # an abort, mid-session or while waiting
            gone = live.pop(rng.randrange(len(live)))
            s.remove(gone)
            assert gone.block_table == [] and gone.first_page == 0

        def check(seq, n):
            assert seq.first_page == max(0, seq.num_computed - window + 1) // bs
            assert seq.first_page + len(seq.block_table) == -(-(seq.num_computed + n) // bs)
            assert len(seq.block_table) <= bound

        _step(s, check)
        for seq in s.waiting:
            assert seq.block_table == [] and seq.first_page == 0 and seq.num_computed == 0
        for seq in [q for q in live if q.num_computed == q.max_tokens]:
            live.remove(seq)
            s.remove(seq)
        held = sum(len(q.block_table) for q in s.running)
        assert s.alloc.num_free == s.alloc.num_blocks - held
    for seq in live:
        s.remove(seq)
    assert s.alloc.num_free == s.alloc.num_blocks
    assert len(freed) == len(allocated)  # every page handed out came back once
