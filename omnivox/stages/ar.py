"""One paged autoregressive stage for every family: continuous batching, chunked prefill, the
prefix cache, preemption and the batch step. A family's `ARAdapter` supplies what differs, in
two halves: admission (`stages.admission.ARAdmission`: when a request's inputs exist, its `Seq`,
how they grow, when it is over) and the step (`stages.step.ARStep`: the step's inputs for a
`StepBatch`, the forward and the sampling over them, and what a sampled token does: emit text,
feed the next stage, end).

Admission (`admit`) runs the adapter's host-side preparation of a request; then each step:
1. start waiting requests whose inputs now exist (their sequences join the scheduler);
2. `ARScheduler.schedule` picks rows under the token budget (running first, then admissions,
   preempting the newest when pages run out);
3. one `StepBatch`: the rows, which of them sample, and one `AttentionMetadata` (write slots,
   block tables, lengths and the sampling rows' last-token indices: one host-side pass and one
   copy to the device); then the adapter's inputs (`adapter.inputs`, host side);
4. `adapter.compute`: one device-only function, the forward of every scheduled token and the
   sampling of the rows that finish their inputs; for a decode step a CUDA graph of it may
   replay instead (`stages.graphs`, padded to a batch-size bucket); with tensor parallelism the
   stage's `mirror` first broadcasts the step to the other ranks (`parallel/launch.py`), which
   compute their shards of it;
5. `adapter.apply` reads the sampled ids (the step's one read of the device), records, streams,
   extends or ends each request and says how many tokens each row accepted; computed counts
   advance by that, full keyed blocks enter the prefix cache, pages behind an attention window
   go back (`ARScheduler.slide`), finished requests release pages.

An adapter's attention `window` (`ARAdmission.window`) reaches every step's metadata; its
sequences then hold a bounded number of pages (engine/scheduler.py: sliding windows), whose table
starts at their `first_page`. The metadata sees each such row shifted back by its freed pages
(a multiple of the page size): causal and window masks depend only on the distance between a
query and a key, and the freed keys lie before every window, so no backend needs to know. Under
CUDA graphs the captured table width is then bounded by the window, not the session's length.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from omnivox.attention.backends import AttentionBackend, make_backend
from omnivox.attention.metadata import AttentionMetadata, build_metadata
from omnivox.engine.config import EngineConfig
from omnivox.engine.events import StageStats
from omnivox.engine.request import Request
from omnivox.engine.scheduler import ARScheduler, Seq, window_pages
from omnivox.engine.stage import Failures, KVStats, Stage
from omnivox.errors import KVStarved
from omnivox.kv_cache.block_allocator import BlockAllocator
from omnivox.kv_cache.pool import KVPool
from omnivox.stages.admission import S, ARAdmission
from omnivox.stages.graphs import GraphRunner, make_runner
from omnivox.stages.step import ARStep, PagedContext, Row, StepBatch



class Mirror(Protocol):
    """Other ranks computing a stage's steps with it (`parallel/launch.py`'s TensorParallel)."""

    def step(self, bucket: int | None, inputs, meta: AttentionMetadata) -> None:
        """Hand them this step (before this rank computes its own shard); raises if they failed."""

    def profile_begin(self) -> None:
        """The profiling run starts: each rank starts measuring its device's peak (engine/memory.py)."""

    def rank_memory(self) -> list[tuple[int, int, int]]:
        """The profiling run is over: each other rank's (total, held, peak) bytes, in rank order
        (0, 0, 0 for a device not measured)."""


class ARAdapter(ARAdmission[S], ARStep):
    """A family's adapter: both halves in one object. They share the per-request state `S` (a
    dataclass extending `SeqState`: what admission builds, `inputs` reads and `apply` advances), so
    one object holds it; the stage uses each half only through its own contract."""


class PagedARStage(Stage):
    def __init__(self, name: str, adapter: ARAdapter, pool: KVPool, cfg: EngineConfig,
                 backend: AttentionBackend | None = None, mirror: Mirror | None = None):
        """`mirror`: the tensor-parallel ranks that compute this stage's steps with it (the
        Thinker's), each on its shard; CUDA graphs are off then (their collectives run eagerly)."""
        self.name, self.adapter, self.pool, self.cfg = name, adapter, pool, cfg
        self.mirror = mirror
        self.device = pool.k.device
        self.backend = backend or make_backend(cfg.attention_backend, self.device)
        self.alloc = BlockAllocator(pool.num_blocks, cfg.block_size)
        self.sched = ARScheduler(self.alloc, cfg.max_running, cfg.token_budget,
                                 on_free=pool.poison if cfg.poison_freed_pages else None,
                                 prefix_limit=adapter.prefix_limit, urgency=self._urgency, yields=self._yields)
        self.waiting: list[Request] = []  # admitted, inputs not there yet
        self.seqs: dict[str, Seq] = {}
        self.reqs: dict[str, Request] = {}
        self.batch_stats = StageStats()
        adapter.bind(self)
        width = min(pool.num_blocks, -(-adapter.max_len() // cfg.block_size))  # pages a row can ever hold
        if adapter.window is not None:
            if cfg.speculative is not None:  # drafters read a sequence's pages from position 0
                raise ValueError(f"speculative decoding does not run on a stage with an attention window ({name})")
            width = min(width, window_pages(adapter.window, 1, cfg.block_size))  # a decode row, slid
        self.graphs: GraphRunner | None = None if mirror is not None else make_runner(  # CUDA graphs (stages.graphs)
            cfg, self.device, adapter.compute, lambda meta: PagedContext(pool, meta, self.backend), width,
            neutralize=self._neutralize)

    # ---- the protocol ---------------------------------------------------------------------
    def admit(self, req: Request) -> None:
        self.adapter.on_admit(req)
        self.reqs[req.rid] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return (any(self.adapter.can_start(r) for r in self.waiting) or self.sched.has_work()
                or self.adapter.inputs_arrived() or bool(self.sched.starved()))

    def done(self, req: Request) -> bool:
        return req.rid not in self.reqs or self.adapter.done(req)

    def remove(self, req: Request) -> None:
        seq = self.seqs.pop(req.rid, None)
        if seq is not None:
            self.sched.remove(seq)
            self._settle_gone(seq)
        if self.reqs.pop(req.rid, None) is not None:
            self.adapter.forget(req)
        if req in self.waiting:
            self.waiting.remove(req)

    def stats(self) -> dict[str, StageStats]:
        return {self.name: self.batch_stats, **self.adapter.stats()}

    def kv_stats(self) -> KVStats:
        return KVStats(self.alloc.num_blocks, self.alloc.num_free, self.sched.preemptions, self.sched.prefix_hit_tokens)

    def running_rows(self, playing: bool) -> int:
        """Requests of that kind here that will decode: not done, not listening (a realtime turn
        whose user speaks; a live session always computes)."""
        return sum(1 for r in self.reqs.values()
                   if r.playing == playing and (r.live or not r.listening) and not self.adapter.done(r))

    def is_waiting(self, req: Request) -> bool:
        """Not running yet here: inputs missing, or queued for pages / a running slot."""
        seq = self.seqs.get(req.rid)
        return req in self.waiting or (seq is not None and seq in self.sched.waiting)

    # ---- stepping -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> Failures:
        failures = self._start_waiting()
        failures += self.adapter.prepare_step()
        self._draft()
        batch = self.sched.schedule(self.scheduling.prefill_tokens(self.name, self.cfg.block_size))
        if batch.preempted and self.cfg.speculative is not None:
            self.adapter.settle({seq.rid: 0 for seq in batch.preempted})
        failures += [(self.reqs[seq.rid], KVStarved(self.alloc.num_blocks - self.alloc.num_free))
                     for seq in self.sched.starved()]
        self.last_step = (sum(n for _, n in batch.items), len(batch.items))
        if not batch.items:
            return failures
        self.batch_stats.record(len(batch.items))
        step = self._batch([Row(self.reqs[seq.rid], seq, seq.num_computed, n, seq.draft) for seq, n in batch.items])
        inputs = self.adapter.inputs(step)
        if self.mirror is not None:
            self.mirror.step(step.bucket, inputs, step.meta)
        if step.bucket:
            outputs = self.graphs.run(step.bucket, inputs, step.meta)
        else:
            outputs = self.adapter.compute(inputs, PagedContext(self.pool, step.meta, self.backend))
        result = self.adapter.apply(step, outputs)
        sampled = set(step.sampled)
        verified: dict[str, int] = {}
        for i, r in enumerate(step.rows):
            # a sampling row keeps its last input's K/V and its confirmed drafts' (accepted - 1)
            r.seq.num_computed += r.n - len(r.draft) - 1 + result.accepted[i] if i in sampled else r.n
            if r.draft:
                self.batch_stats.record_draft(len(r.draft), result.accepted[i])
                self.sched.trim(r.seq)  # pages wholly past the known tokens (rejected drafts) go back
                r.seq.draft = []
                verified[r.seq.rid] = r.seq.num_computed
            if r.seq.prefix_keys:
                self.sched.register_prefix(r.seq)
            self.sched.slide(r.seq)
        if verified:
            self.adapter.settle(verified)
        for req in result.finished:
            self._release(req)
        return failures + result.failures

    def _urgency(self, seq: Seq) -> float | None:
        return self.scheduling.urgency(self.reqs[seq.rid], self.clock.now())

    def _yields(self, seq: Seq) -> bool:
        return self.scheduling.yields(self.reqs[seq.rid], self.clock.now())

    def _batch(self, rows: list[Row]) -> StepBatch:
        """The step's rows, its sampling rows and its metadata, padded to a graph's bucket when
        one replays it."""
        sampled = [i for i, r in enumerate(rows)
                   if r.end == r.seq.num_tokens + len(r.draft) and self.adapter.samples(r)]
        bucket = self.graphs.bucket(rows, sampled) if self.graphs is not None else None  # drafts: eager
        pad = bucket - len(rows) if bucket else 0
        bs = self.cfg.block_size  # a windowed row's table starts at its first_page (module docstring)
        meta = build_metadata([r.seq.block_table for r in rows], [r.start - r.seq.first_page * bs for r in rows],
                              [r.n for r in rows],
                              block_size=self.cfg.block_size, dummy_slot=self.pool.dummy_slot, device=self.device,
                              pad_rows=pad, width=self.graphs.width if bucket else None, sampled=sampled,
                              sample_counts=[1 + len(rows[i].draft) for i in sampled], window=self.adapter.window)
        return StepBatch(rows, sampled, meta, bucket)

    def _draft(self) -> None:
        """Speculative decoding: each decoding sequence (one pending input) drafts the ids after it,
        unless more than `disable_by_batch_size` sequences compute this step (drafts stop paying)."""
        spec = self.cfg.speculative
        if spec is None:
            return
        live = [s for s in self.sched.running if s.pending > 0]
        for s in live:
            s.draft = []
        if len(live) > spec.disable_by_batch_size:
            return
        drafting = [s for s in live if s.pending == 1]
        if drafting:
            for s, ids in zip(drafting, self.adapter.draft(drafting), strict=True):
                s.draft = ids

    def profile_steps(self) -> dict[str, Callable[[], object]]:
        """A prefill chunk (`token_budget` tokens) and a decode step (`max_running` rows), as padding
        rows: the forward and sampling of every token (engine/memory.py)."""
        return {"prefill": lambda: self._dummy_step(self.cfg.token_budget),
                "decode": lambda: self._dummy_step(self.cfg.max_running)}

    @torch.no_grad()
    def _dummy_step(self, rows: int) -> None:
        """One eager step of `rows` padding rows (one token each, one page wide): they write the
        pool's dummy slot and the adapter's scratch rows only; the other ranks compute it too."""
        meta = build_metadata([], [], [], block_size=self.cfg.block_size, dummy_slot=self.pool.dummy_slot,
                              device=self.device, pad_rows=rows, width=1, window=self.adapter.window)
        inputs = self.adapter.inputs(StepBatch([], [], meta, rows))
        self._neutralize(inputs, meta)
        if self.mirror is not None:
            self.mirror.step(rows, inputs, meta)
        self.adapter.compute(inputs, PagedContext(self.pool, meta, self.backend))

    def warmup(self) -> int:
        """Capture the decode step's graphs (greedy rows), largest bucket first: padding rows only."""
        if self.graphs is None:
            return 0
        for b in sorted(self.graphs.buckets, reverse=True):
            meta = build_metadata([], [], [], block_size=self.cfg.block_size, dummy_slot=self.pool.dummy_slot,
                                  device=self.device, pad_rows=b, width=self.graphs.width, window=self.adapter.window)
            self.graphs.run(b, self.adapter.inputs(StepBatch([], [], meta, b)), meta)
        return len(self.graphs.graphs)

    def _neutralize(self, inputs, meta: AttentionMetadata) -> None:
        """A copy of a step's inputs that writes only scratch state (for capturing a graph)."""
        meta.write_slots.fill_(self.pool.dummy_slot)
        self.adapter.neutralize(inputs)

    def _start_waiting(self) -> Failures:
        failures: Failures = []
        for req in list(self.waiting):
            try:
                seq = self.adapter.start(req) if self.adapter.can_start(req) else None
                if seq is None:
                    continue
                seq.window = self.adapter.window
                self.sched.add(seq)  # raises CannotFit for a request that could never fit
            except Exception as e:  # this request only
                failures.append((req, e))
                continue
            self.waiting.remove(req)
            self.seqs[req.rid] = seq
        return failures

    def _release(self, req: Request) -> None:
        """The request's sequence is over here: its pages go back (cached blocks stay cached)."""
        seq = self.seqs.pop(req.rid, None)
        if seq is not None:
            self.sched.remove(seq)
            self._settle_gone(seq)

    def _settle_gone(self, seq: Seq) -> None:
        if self.cfg.speculative is not None:
            self.adapter.settle({seq.rid: 0})
