"""One paged autoregressive stage for every family: continuous batching, chunked prefill, the
prefix cache, preemption and the batch step. A family's `ARAdapter` supplies what differs: when
a request's inputs exist (its `Seq`), the step's inputs for a set of rows, the forward and the
sampling over them, and what a sampled token does (emit text, feed the next stage, end).

Admission (`admit`) runs the adapter's host-side preparation of a request; then each step:
1. start waiting requests whose inputs now exist (their sequences join the scheduler);
2. `ARScheduler.schedule` picks rows under the token budget (running first, then admissions,
   preempting the newest when pages run out);
3. one `AttentionMetadata` for the step (write slots, block tables, lengths: one host-side pass
   and one copy to the device) and the adapter's inputs (`adapter.inputs`, host side);
4. `adapter.compute`: one device-only function, the forward of every scheduled token and the
   sampling of the rows that finish their inputs; for a decode step a CUDA graph of it may
   replay instead (`stages.graphs`, padded to a batch-size bucket);
5. computed counts advance, full keyed blocks enter the prefix cache; `adapter.apply` reads the
   sampled ids (the step's one read of the device) and records, streams, extends or ends each
   request.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from omnivox.attention.backends import AttentionBackend, make_backend
from omnivox.attention.metadata import AttentionMetadata, build_metadata
from omnivox.engine.config import EngineConfig
from omnivox.engine.events import StageStats
from omnivox.engine.request import Request
from omnivox.engine.scheduler import ARScheduler, Seq
from omnivox.errors import KVStarved
from omnivox.kv_cache.block_allocator import BlockAllocator
from omnivox.kv_cache.pool import KVPool
from omnivox.stages.base import Failures, KVStats, Stage
from omnivox.stages.graphs import GraphRunner, make_runner



@dataclass
class Row:
    """One scheduled sequence of a step: tokens [start, start + n) are computed now."""

    req: Request
    seq: Seq
    start: int
    n: int

    @property
    def end(self) -> int:
        return self.start + self.n


class PagedContext:
    """The attention seam for one step of a paged stage: every layer's `attend` writes this step's
    K/V into the pool and attends through the step's metadata with the chosen backend."""

    def __init__(self, pool: KVPool, meta: AttentionMetadata, backend: AttentionBackend):
        self.pool, self.meta, self.backend = pool, meta, backend

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, H, D], k/v [N, Hkv, D] (the step's flattened tokens) -> [N, H, D]."""
        return self.backend.forward(q, k, v, self.pool.k[layer], self.pool.v[layer], self.meta)


class ARAdapter(ABC):
    """What a family's AR stage computes; `PagedARStage` schedules, batches and pages it."""

    stage: "PagedARStage"  # set by the stage (its allocator, scheduler and sequences)

    def bind(self, stage: "PagedARStage") -> None:
        self.stage = stage

    def prepare(self, req: Request) -> None:
        """At admission, before any step: host-side work on the request's own inputs (media
        encoding, positions). May raise OmnivoxError: the request then fails at admission."""

    @abstractmethod
    def start(self, req: Request) -> Seq | None:
        """The request's sequence once its inputs exist (None: not yet). May raise OmnivoxError."""

    def can_start(self, req: Request) -> bool:
        """Would `start` do something now (a sequence, or the request's end)? A waiting request
        that cannot start is no work: the engine sleeps instead of retrying it (default: yes)."""
        return True

    def samples(self, row: Row) -> bool:
        """Does a row whose known inputs are all computed after this step sample its next token?"""
        return True

    @abstractmethod
    def inputs(self, rows: list[Row], sampled: list[int], pad: int) -> dict:
        """Host side: the step's inputs as device tensors (and host flags), built in one pass for
        `rows` plus `pad` padding rows (a CUDA graph's batch size); `sampled`: the rows whose last
        token is sampled."""

    @abstractmethod
    def compute(self, inputs: dict, ctx: PagedContext) -> dict:
        """Device only: the forward over every token of the step and the sampling of the sampled
        rows. Reads nothing back and has fixed shapes for fixed input shapes, so a CUDA graph can
        replay it."""

    @abstractmethod
    def apply(self, rows: list[Row], sampled: list[int], outputs: dict) -> tuple[list[Request], Failures]:
        """Host side: the step's one device read (the sampled ids) and what they do: record and
        stream them, extend each sequence (`seq.num_tokens += 1` once the next input is known:
        until then it has nothing to compute) or end it. Returns (requests this stage is done
        with, failed requests)."""

    states: dict  # rid -> the adapter's per-request state, which has a `done` flag

    def done(self, req: Request) -> bool:
        st = self.states.get(req.rid)
        return st is not None and st.done

    def forget(self, req: Request) -> None:
        """Drop the adapter's per-request state (the stage frees the pages)."""
        self.states.pop(req.rid, None)

    def prepare_step(self) -> Failures:
        """Before scheduling: take inputs that became known (default: nothing); returns the
        requests that failed in doing so."""
        return []

    def inputs_arrived(self) -> bool:
        """Would `prepare_step` make a waiting sequence ready now? (default: no)"""
        return False

    def neutralize(self, inputs: dict) -> None:
        """Point the inputs' writes to per-request state at scratch rows (default: none)."""

    def max_len(self) -> int:
        """The most tokens a sequence can hold (its block-table width under CUDA graphs)."""
        return self.stage.alloc.num_blocks * self.stage.cfg.block_size

    def prefix_limit(self, seq: Seq, blocks: int) -> int:
        """How many cached prefix blocks `seq` may take (default: all)."""
        return blocks

    def stats(self) -> dict[str, StageStats]:
        return {}


class PagedARStage(Stage):
    def __init__(self, name: str, adapter: ARAdapter, pool: KVPool, cfg: EngineConfig,
                 backend: AttentionBackend | None = None):
        self.name, self.adapter, self.pool, self.cfg = name, adapter, pool, cfg
        self.device = pool.k.device
        self.backend = backend or make_backend(cfg.attention_backend, self.device)
        self.alloc = BlockAllocator(pool.num_blocks, cfg.block_size)
        self.sched = ARScheduler(self.alloc, cfg.max_running, cfg.token_budget,
                                 on_free=pool.poison if cfg.poison_freed_pages else None,
                                 prefix_limit=adapter.prefix_limit)
        self.waiting: list[Request] = []  # admitted, inputs not there yet
        self.seqs: dict[str, Seq] = {}
        self.reqs: dict[str, Request] = {}
        self.batch_stats = StageStats()
        adapter.bind(self)
        width = min(pool.num_blocks, -(-adapter.max_len() // cfg.block_size))  # pages a row can ever hold
        self.graphs: GraphRunner | None = make_runner(  # CUDA graphs of the decode step (stages.graphs)
            cfg, self.device, adapter.compute, lambda meta: PagedContext(pool, meta, self.backend), width,
            neutralize=self._neutralize)

    # ---- the protocol ---------------------------------------------------------------------
    def admit(self, req: Request) -> None:
        self.adapter.prepare(req)
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
        if self.reqs.pop(req.rid, None) is not None:
            self.adapter.forget(req)
        if req in self.waiting:
            self.waiting.remove(req)

    def stats(self) -> dict[str, StageStats]:
        return {self.name: self.batch_stats, **self.adapter.stats()}

    def kv_stats(self) -> KVStats:
        return KVStats(self.alloc.num_blocks, self.alloc.num_free, self.sched.preemptions, self.sched.prefix_hit_tokens)

    def is_waiting(self, req: Request) -> bool:
        """Not running yet here: inputs missing, or queued for pages / a running slot."""
        seq = self.seqs.get(req.rid)
        return req in self.waiting or (seq is not None and seq in self.sched.waiting)

    # ---- stepping -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> Failures:
        failures = self._start_waiting()
        failures += self.adapter.prepare_step()
        batch = self.sched.schedule()
        failures += [(self.reqs[seq.rid], KVStarved(self.alloc.num_blocks - self.alloc.num_free))
                     for seq in self.sched.starved()]
        if not batch.items:
            return failures
        self.batch_stats.record(len(batch.items))
        rows = [Row(self.reqs[seq.rid], seq, seq.num_computed, n) for seq, n in batch.items]
        sampled = [i for i, r in enumerate(rows) if r.end == r.seq.num_tokens and self.adapter.samples(r)]
        bucket = self.graphs.bucket(rows, sampled) if self.graphs is not None else None
        pad = bucket - len(rows) if bucket else 0
        meta = build_metadata([r.seq.block_table for r in rows], [r.start for r in rows], [r.n for r in rows],
                              block_size=self.cfg.block_size, dummy_slot=self.pool.dummy_slot, device=self.device,
                              pad_rows=pad, width=self.graphs.width if bucket else None)
        inputs = self.adapter.inputs(rows, sampled, pad)
        if bucket:
            outputs = self.graphs.run(bucket, inputs, meta)
        else:
            outputs = self.adapter.compute(inputs, PagedContext(self.pool, meta, self.backend))
        for r in rows:
            r.seq.num_computed += r.n
            if r.seq.prefix_keys:
                self.sched.register_prefix(r.seq)
        finished, failed = self.adapter.apply(rows, sampled, outputs)
        for req in finished:
            self._release(req)
        return failures + failed

    def warmup(self) -> int:
        """Capture the decode step's graphs (greedy rows), largest bucket first: padding rows only."""
        if self.graphs is None:
            return 0
        for b in sorted(self.graphs.buckets, reverse=True):
            meta = build_metadata([], [], [], block_size=self.cfg.block_size, dummy_slot=self.pool.dummy_slot,
                                  device=self.device, pad_rows=b, width=self.graphs.width)
            self.graphs.run(b, self.adapter.inputs([], [], b), meta)
        return len(self.graphs.graphs)

    def _neutralize(self, inputs: dict, meta: AttentionMetadata) -> None:
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
