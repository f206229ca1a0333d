"""Continuous batching for one autoregressive stage. Pure Python: ints and lists.

Each step the scheduler picks, under a token budget, which sequences run and how many of
their known-but-uncomputed input tokens they compute (1 for a decoding sequence, up to the
budget for a prefill: chunked prefill). Running sequences go first, in arrival order (or, under
streaming-aware scheduling, by `urgency`: `engine/slack.py`), skipping those that `yields` (none
does while the head of the queue cannot start: a yielding row may hold the slot or the pages it
waits for, and only its steps free them); then
waiting ones are admitted while pages, budget, the running limit and the step's prefill cap allow. When a running
sequence needs a page and none is free, the most recently arrived running sequence (a batch one
first, under streaming-aware scheduling) is
preempted: its pages are freed and it is recomputed from scratch later (never truncated).

Starvation: a waiting sequence can wait for pages only while something will free them. When
nothing computes (every running sequence is a parked streamed prompt, waiting for its user) and
the head of the queue does not fit, no step will ever free a page until a user speaks again:
`starved` names the waiting requests that are stuck so (the stage fails them: 503, at once).

Sliding windows: a sequence with an attention `window` W (its stage's adapter sets it) gives back
the pages no later token can see as it advances (`slide`): once `num_computed` tokens are computed,
every future query sees keys from num_computed - W + 1 on, so the pages wholly before that go back
to the allocator (poisoned like any freed page). Its block table stays positional from
`first_page`, the count of pages freed from its front: position p's page is
`block_table[p // block_size - first_page]`. It then holds at most `window_pages(W, chunk)` pages
at once, whatever its length, and admission (`CannotFit`) uses that bound. Its early pages are gone,
so it neither takes nor offers cached prefixes. Preempted, it is recomputed from its first token,
chunk by chunk, sliding as it goes: the same computation as its first run (every position's keys
depend, layer over layer, on positions back to the first, so no shorter recompute is exact).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from omnivox.errors import CannotFit
from omnivox.kv_cache.block_allocator import BlockAllocator, OutOfBlocks
from omnivox.kv_cache.prefix import ROOT, prefix_digests


@dataclass(eq=False)
class Seq:
    rid: str
    order: int  # arrival order (preemption picks the largest)
    num_tokens: int  # input tokens known so far
    max_tokens: int  # the most tokens this sequence can ever hold
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    # Prefix cache: one chained key per full block of the sequence's tokens, prompt AND generated
    # ones, so a follow-up turn repeating the conversation reuses its whole KV. `key_items` holds
    # the identity of each input token seen so far (kv_cache/prefix.py: key items); None = no
    # prefix cache. `prefix_keys` are the blocks' chained digests.
    key_items: list | None = None
    prefix_keys: list[bytes] = field(default_factory=list)
    block_size: int = 16
    prefix_hit: int = 0  # tokens taken from the prefix cache at the last admission
    # a streamed prompt still open (a realtime turn): its next input is the user's, which may never
    # come, so while it has nothing to compute it holds its pages but not a running slot
    parked: bool = False
    # speculative decoding: ids proposed to follow the one pending input, computed with it in the
    # next step and verified there (never in `num_tokens`: they are guesses, not inputs)
    draft: list[int] = field(default_factory=list)
    # sliding-window attention (None: unbounded): pages wholly behind the window of every future
    # query are freed (`ARScheduler.slide`); `first_page` of them so far, the table starts there
    window: int | None = None
    first_page: int = 0

    def __post_init__(self) -> None:
        if self.key_items is not None:
            items, self.key_items = self.key_items, []
            self.extend_keys(items)

    @property
    def pending(self) -> int:
        """Known inputs not computed yet (0 while the next input is unknown: the Talker waiting on
        text, a streamed prompt waiting on the user)."""
        return self.num_tokens - self.num_computed

    def extend_keys(self, items: list) -> None:
        """Record the identities of the next input tokens; chain a key for every block they fill."""
        if self.key_items is None:
            return
        self.key_items.extend(items)
        done = len(self.prefix_keys) * self.block_size
        parent = self.prefix_keys[-1] if self.prefix_keys else ROOT
        self.prefix_keys.extend(prefix_digests(self.key_items[done:], self.block_size, parent))


def window_pages(window: int, chunk: int, block_size: int) -> int:
    """The most pages a sequence with attention `window` holds at once when it computes at most
    `chunk` tokens a step: the pages from its next query's window start (num_computed - window + 1)
    through its last new token (num_computed + chunk - 1), i.e. window + chunk - 1 positions, which
    span at most ceil((window + chunk - 2) / block_size) + 1 pages."""
    return -(-(window + chunk - 2) // block_size) + 1


@dataclass
class ScheduledBatch:
    items: list[tuple[Seq, int]]  # (sequence, new tokens this step)
    preempted: list[Seq]


class ARScheduler:
    def __init__(self, allocator: BlockAllocator, max_running: int, token_budget: int,
                 on_free: Callable[[list[int]], None] | None = None,
                 prefix_limit: Callable[[Seq, int], int] | None = None,
                 urgency: Callable[[Seq], float | None] | None = None, yields: Callable[[Seq], bool] | None = None):
        self.alloc, self.max_running, self.token_budget = allocator, max_running, token_budget
        self.urgency = urgency  # a running sequence's sort key (smaller first); None: arrival order
        self.yields = yields  # a running sequence that skips this step although it has work
        self._blocked = False  # the queue's head cannot start now: no row yields (`_check_blocked`)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.on_free = on_free  # pages that became free (tests poison them)
        self.prefix_limit = prefix_limit  # how many cached blocks the stage can use for a sequence
        self.preemptions = 0
        self.prefix_hit_tokens = 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.alloc.block_size)

    def pages_needed(self, seq: Seq) -> int:
        """The most pages `seq` holds at once: its whole length, or with a window the window's
        bound at this scheduler's largest chunk (`window_pages`)."""
        pages = self.blocks_for(seq.max_tokens)
        if seq.window is not None:
            pages = min(pages, window_pages(seq.window, self.token_budget, self.alloc.block_size))
        return pages

    def add(self, seq: Seq) -> None:
        pages = self.pages_needed(seq)
        if pages > self.alloc.num_blocks:
            need = f"{seq.max_tokens} tokens" if seq.window is None else \
                f"{pages} pages of {self.alloc.block_size} tokens at once (attention window {seq.window})"
            raise CannotFit(f"request too large for the KV cache: it needs {need} of KV cache; "
                            f"this stage holds {self.alloc.num_blocks * self.alloc.block_size}")
        if seq.window is not None:  # its early pages are freed: no prefix to offer or to take
            seq.key_items, seq.prefix_keys = None, []
        self.waiting.append(seq)

    def has_work(self) -> bool:
        """Would `schedule` compute anything? Running sequences with known inputs, or a waiting
        one that fits now: a waiting sequence blocked by running ones (all of --max-running) or by
        pages is no work until one of them changes."""
        self._check_blocked()
        return any(s.pending > 0 and not self._yields(s) for s in self.running) or self._head_fits()

    def _check_blocked(self) -> None:
        self._blocked = self.yields is not None and bool(self.waiting) and not self._head_fits()

    def _yields(self, seq: Seq) -> bool:
        return self.yields is not None and not self._blocked and self.yields(seq)

    def _ordered(self) -> list[Seq]:
        """Running sequences in the order they get the step's budget."""
        if self.urgency is None:
            return list(self.running)
        keys = {id(s): self.urgency(s) for s in self.running}
        if all(k is None for k in keys.values()):
            return list(self.running)
        return sorted(self.running, key=lambda s: (keys[id(s)] is None, keys[id(s)] or 0.0, s.order))

    def _victim(self) -> Seq:
        """The running sequence a preemption takes: the most recently arrived, those without an
        urgency (batch rows under slack scheduling) before the others."""
        if self.urgency is None:
            return max(self.running, key=lambda s: s.order)
        return max(self.running, key=lambda s: (self.urgency(s) is None, s.order))

    def starved(self) -> list[Seq]:
        """Waiting sequences that no step can admit: the head does not fit and nothing running
        computes (only parked prompts hold pages). The head if it is a request, else every request
        behind the parked head (streamed prompts are not named: their user may speak)."""
        if not self.waiting or self.slots_used() > 0 or self._head_fits():
            return []
        if not self.waiting[0].parked:
            return [self.waiting[0]]
        return [s for s in self.waiting if not s.parked]

    def slots_used(self) -> int:
        """Running slots taken: parked sequences with nothing to compute take none."""
        return sum(1 for s in self.running if not (s.parked and s.pending == 0))

    def _head_fits(self) -> bool:
        if not self.waiting or self.slots_used() >= self.max_running:
            return False
        seq = self.waiting[0]
        self._admit_prefix(seq)  # what schedule() would take from the prefix cache; undone below
        fits = self._missing(seq, seq.num_computed + min(seq.pending, self.token_budget)) <= self.alloc.num_free
        self._release(seq)
        self.prefix_hit_tokens -= seq.prefix_hit
        return fits

    def remove(self, seq: Seq) -> None:
        """Finished or aborted: give its pages back."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def _release(self, seq: Seq) -> None:
        self._give_back(seq.block_table)
        seq.block_table = []
        seq.first_page = 0
        seq.num_computed = 0
        seq.draft = []

    def _give_back(self, blocks: list[int]) -> None:
        """Drop one reference on each of `blocks`; those now free and holding no cached prefix go to `on_free`."""
        if not blocks:
            return
        gone = [b for b in blocks if self.alloc.ref[b] == 1 and self.alloc.hash_of[b] is None]
        self.alloc.free(blocks)
        if self.on_free and gone:
            self.on_free(gone)

    def trim(self, seq: Seq) -> None:
        """Give back the pages wholly beyond seq's known tokens (a step's rejected drafts). They were
        allocated for this step, hold no cached prefix, and their slots are never read: the next
        step recomputes from `num_computed`."""
        keep = self.blocks_for(seq.num_tokens) - seq.first_page
        extra = seq.block_table[keep:]
        del seq.block_table[keep:]
        self._give_back(extra)

    def slide(self, seq: Seq) -> None:
        """A windowed sequence advanced: give back its pages wholly before the window of its next
        query (position num_computed sees keys from num_computed - window + 1 on; later ones later)."""
        if seq.window is None:
            return
        gone = max(0, seq.num_computed - seq.window + 1) // self.alloc.block_size - seq.first_page
        if gone > 0:
            behind = seq.block_table[:gone]
            del seq.block_table[:gone]
            seq.first_page += gone
            self._give_back(behind)

    def _missing(self, seq: Seq, tokens: int) -> int:
        """Pages seq's table lacks to cover positions up to `tokens` (its table starts at `first_page`)."""
        return self.blocks_for(tokens) - seq.first_page - len(seq.block_table)

    def _grow(self, seq: Seq, tokens: int) -> None:
        """Make seq's block table cover `tokens` tokens (raises OutOfBlocks, leaving it unchanged)."""
        need = self._missing(seq, tokens)
        if need > self.alloc.num_free:
            raise OutOfBlocks
        seq.block_table.extend(self.alloc.allocate() for _ in range(need))

    def _preempt(self, victim: Seq) -> None:
        self.running.remove(victim)
        self._release(victim)
        self.preemptions += 1
        # back to the waiting queue, keeping arrival order
        i = 0
        while i < len(self.waiting) and self.waiting[i].order < victim.order:
            i += 1
        self.waiting.insert(i, victim)

    def _admit_prefix(self, seq: Seq) -> None:
        keys = seq.prefix_keys[: (seq.num_tokens - 1) // self.alloc.block_size]  # keep >= 1 token to compute
        if self.prefix_limit is not None:
            keys = keys[: self.prefix_limit(seq, len(keys))]
        hit = self.alloc.lookup(keys)
        seq.block_table = hit
        seq.num_computed = seq.prefix_hit = len(hit) * self.alloc.block_size
        self.prefix_hit_tokens += seq.prefix_hit

    def _fit_draft(self, seq: Seq, n: int, budget: int) -> int:
        """How many of seq's drafts run with its `n` inputs this step: those within the budget, and
        none unless its whole pending input runs and free pages hold them (drafts never preempt)."""
        keep = seq.draft[:budget] if n == seq.pending else []
        if keep and self._missing(seq, seq.num_computed + n + len(keep)) > self.alloc.num_free:
            keep = []
        seq.draft = keep
        return len(keep)

    def schedule(self, prefill_cap: int | None = None) -> ScheduledBatch:
        """`prefill_cap`: the most tokens of prefill (rows with more than one input to compute, and
        admissions) this step may carry; None: only the token budget bounds them."""
        budget = self.token_budget
        prefill = budget if prefill_cap is None else min(budget, prefill_cap)
        self._check_blocked()
        items: list[tuple[Seq, int]] = []
        preempted: list[Seq] = []
        for seq in self._ordered():
            if seq not in self.running or seq.pending == 0 or budget == 0 or self._yields(seq):
                continue
            if seq.pending > 1 and prefill == 0:
                continue
            n = min(seq.pending, budget, prefill) if seq.pending > 1 else 1
            n += self._fit_draft(seq, n, budget - n)
            while True:
                try:
                    self._grow(seq, seq.num_computed + n)
                    break
                except OutOfBlocks:
                    victim = self._victim()
                    if any(victim is s for s, _ in items):  # never undo work already scheduled
                        victim = seq
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is seq:
                        break
            if seq in self.running:
                items.append((seq, n))
                budget -= n
                if seq.pending > 1:
                    prefill -= n
        while self.waiting and budget > 0 and prefill > 0 and self.slots_used() < self.max_running:
            seq = self.waiting[0]
            self._admit_prefix(seq)
            n = min(seq.pending, budget, prefill)
            try:
                self._grow(seq, seq.num_computed + n)
            except OutOfBlocks:
                self._release(seq)
                self.prefix_hit_tokens -= seq.prefix_hit
                break
            self.waiting.popleft()
            self.running.append(seq)
            items.append((seq, n))
            budget -= n
            prefill -= n
        return ScheduledBatch(items, preempted)

    def register_prefix(self, seq: Seq) -> None:
        """Offer seq's fully computed, keyed blocks to the prefix cache."""
        full = min(seq.num_computed // self.alloc.block_size, len(seq.prefix_keys))
        for i in range(full):
            self.alloc.register(seq.block_table[i], seq.prefix_keys[i])
