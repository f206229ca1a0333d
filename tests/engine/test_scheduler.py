"""The pure-Python block allocator and scheduler: invariants under random workloads."""
import random

import pytest

from omnivox.engine.scheduler import ARScheduler, CannotFit, Seq
from omnivox.kv_cache.block_allocator import BlockAllocator, OutOfBlocks


def test_allocator_refcounts_and_prefix_reuse():
    a = BlockAllocator(4, 2)
    b0, b1 = a.allocate(), a.allocate()
    a.register(b0, 111)
    a.free([b0, b1])
    assert a.num_free == 4
    hit = a.lookup([111, 222])
    assert hit == [b0] and a.ref[b0] == 1 and a.num_free == 3
    with pytest.raises(RuntimeError):
        a.free([b1])  # double free
    others = [a.allocate() for _ in range(3)]
    assert b0 not in others  # a referenced block is never handed out
    with pytest.raises(OutOfBlocks):
        a.allocate()


@pytest.mark.parametrize("seed", range(20))
def test_random_workload_keeps_invariants(seed):
    rng = random.Random(seed)
    alloc = BlockAllocator(rng.randint(6, 20), rng.choice([1, 2, 4]))
    s = ARScheduler(alloc, max_running=rng.randint(1, 5), token_budget=rng.randint(1, 12))
    seqs, idle, order = [], [], 0
    for step in range(300):
        if rng.random() < 0.3 and len(seqs) < 12:
            prompt = rng.randint(1, 20)
            seq = Seq(f"r{order}", order, num_tokens=prompt, max_tokens=prompt + rng.randint(1, 10),
                      prefix_keys=[rng.randint(0, 3) * 100 + i for i in range(prompt // alloc.block_size)])
            order += 1
            try:
                s.add(seq)
                seqs.append(seq)
            except CannotFit:
                assert -(-seq.max_tokens // alloc.block_size) > alloc.num_blocks
        for seq in [q for q in idle if rng.random() < 0.3]:  # its next input arrives
            idle.remove(seq)
            seq.num_tokens += 1
        work = s.has_work()
        batch = s.schedule()
        assert work == bool(batch.items or batch.preempted)  # no work: the engine may sleep
        assert sum(n for _, n in batch.items) <= s.token_budget
        assert len(s.running) <= s.max_running
        for seq, n in batch.items:
            assert len(seq.block_table) * alloc.block_size >= seq.num_computed + n
            seq.num_computed += n
            s.register_prefix(seq)
            if seq.num_computed == seq.num_tokens:
                if seq.num_tokens >= seq.max_tokens or rng.random() < 0.1:
                    s.remove(seq)
                    seqs.remove(seq)
                elif rng.random() < 0.5:
                    seq.num_tokens += 1
                else:  # waits for its next input (a streamed prompt, the Talker waiting on text)
                    idle.append(seq)
        # every block is either free or referenced exactly by the running sequences that hold it
        held = [b for q in s.running for b in q.block_table]
        for b in range(alloc.num_blocks):
            assert alloc.ref[b] == held.count(b)
            assert (alloc.ref[b] == 0) == (b in alloc._free)
        assert all(not q.block_table for q in s.waiting)
        if not work and not idle:
            assert not s.waiting and not any(q.pending for q in s.running)  # nothing left but idle holders
    for q in list(seqs):
        s.remove(q)
    assert alloc.num_free == alloc.num_blocks


def test_a_parked_sequence_holds_its_pages_but_no_running_slot():
    """An open streamed prompt with nothing to compute (a realtime turn waiting for the user) takes
    no running slot, so it never blocks another request; once its input arrives it runs again."""
    alloc = BlockAllocator(16, 4)
    s = ARScheduler(alloc, max_running=1, token_budget=8)
    turn = Seq("turn", 0, num_tokens=4, max_tokens=40)
    s.add(turn)
    assert [q.rid for q, _ in s.schedule().items] == ["turn"]
    turn.num_computed, turn.parked = 4, True  # prefilled; waits for the user
    other = Seq("chat", 1, num_tokens=4, max_tokens=8)
    s.add(other)
    assert s.has_work() and [q.rid for q, _ in s.schedule().items] == ["chat"]
    assert turn in s.running and turn.block_table  # still holds its pages
    turn.parked = False  # an unparked sequence counts again: the slot is taken
    s.add(Seq("third", 2, num_tokens=4, max_tokens=8))
    other.num_computed = 4
    batch = s.schedule()
    assert "third" not in [q.rid for q, _ in batch.items]


def test_a_request_that_only_parked_prompts_block_is_starved():
    """Pages held only by parked prompts (open turns waiting for their users) free on no step: a
    request that cannot fit is named at once (the stage fails it, 503), never left waiting; while
    anything computes, or once it fits, it waits as usual; parked sequences are never named."""
    alloc = BlockAllocator(8, 4)
    s = ARScheduler(alloc, max_running=4, token_budget=64)
    turns = [Seq(f"turn{i}", i, num_tokens=12, max_tokens=24) for i in range(2)]
    for t in turns:
        s.add(t)
    s.schedule()
    for t in turns:
        t.num_computed, t.parked = 12, True  # 6 of 8 pages held by two prefilled, idle turns
    chat = Seq("chat", 5, num_tokens=12, max_tokens=16)  # needs 3 pages
    s.add(chat)
    assert s.starved() == [chat] and not s.schedule().items
    small = Seq("small", 6, num_tokens=4, max_tokens=8)
    s.remove(chat)
    s.add(small)
    assert s.starved() == [] and [q.rid for q, _ in s.schedule().items] == ["small"]  # it fits: no starvation
    s.add(Seq("big", 7, num_tokens=12, max_tokens=16))
    assert s.starved() == []  # `small` computes (it will finish and free its page): the big one waits
    s.remove(small)
    s.remove(turns[0])  # the user spoke, answered, left: pages free
    assert s.starved() == [] and [q.rid for q, _ in s.schedule().items] == ["big"]
    parked_head = Seq("turn9", 8, num_tokens=24, max_tokens=24, parked=True)  # a turn preempted back to waiting
    s.add(parked_head)
    s.add(late := Seq("late", 9, num_tokens=4, max_tokens=8))
    next(q for q in s.running if q.rid == "big").num_computed = 12
    next(q for q in s.running if q.rid == "big").parked = True
    assert s.starved() == [late]  # the parked head is never named; the request behind it is




def test_batch_rows_are_preempted_first_and_a_yielding_row_steps_when_the_queue_head_waits_for_it():
    """Under slack scheduling a batch row has no urgency: a playing row that needs a page takes it
    from the batch row, though the batch row arrived first. And a row that yields still steps while
    the head of the queue cannot start (only its steps free what the head waits for)."""
    alloc = BlockAllocator(4, 2)
    kinds = {"batch": None, "play": 0.5}
    yielding: set[str] = set()
    s = ARScheduler(alloc, max_running=2, token_budget=8, urgency=lambda q: kinds[q.rid],
                    yields=lambda q: q.rid in yielding)
    batch, play = Seq("batch", 0, num_tokens=4, max_tokens=8), Seq("play", 1, num_tokens=4, max_tokens=8)
    s.add(batch)
    s.add(play)
    s.schedule()  # both prefill: 2 pages each, none free
    for q in (batch, play):
        q.num_computed, q.num_tokens = 4, 5
    out = s.schedule()
    assert [q.rid for q in out.preempted] == ["batch"] and [q.rid for q, _ in out.items] == ["play"]
    play.num_computed, play.num_tokens = 5, 6
    yielding.add("play")  # batch (2 pages) waits for play's pages (3 of 4)
    assert s.has_work() and [q.rid for q, _ in s.schedule().items] == ["play"]
    s.remove(batch)
    play.num_computed, play.num_tokens = 6, 7
    assert not s.has_work() and s.schedule().items == []  # nothing waits on it: it yields
