"""One vocoder stage for every family: codec frames in, audio out, streamed with exact carried
state. Each request owns a slot of a slot-indexed pool of streaming states (conv tails, window
KV, positions); a step gathers the slots of the requests with new frames, decodes them in one
call per chunk length, scatters the states back and copies the audio to the host once.

Chunking: a request's first chunk is `first_chunk_frames` frames (default one, so audio starts
as soon as a frame exists; more buy a longer buffer at playback start, against a late second
chunk when steps are slow); later chunks take `vocoder_chunk_frames` frames; either is what is
left once the frames are final.
The concatenated chunks equal the one-shot decode (no overlap re-decoding, no seams). On a GPU a
chunk's decode replays from a CUDA graph per batch-size bucket (`stages.graphs`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict

import torch

from omnivox.engine import host
from omnivox.engine.config import EngineConfig
from omnivox.engine.events import StageStats
from omnivox.engine.request import Request
from omnivox.layers.streaming_conv import BatchedState
from omnivox.stages.base import Failures, Stage
from omnivox.stages.graphs import make_runner
from omnivox.stages.slots import SlotPool


class VocoderAdapter(ABC):
    """A family's codec decoder as the vocoder stage drives it."""

    sample_rate: int
    device: torch.device
    codebooks: int  # codes per frame
    lead: int = 0  # samples a fresh stream's first chunk lacks: its first `lead` outputs are placeholders

    @abstractmethod
    def new_state(self, batch: int) -> BatchedState:
        """Fresh streaming states of `batch` requests (the zeros the one-shot decode pads with)."""

    @abstractmethod
    def decode(self, codes: torch.Tensor, state: BatchedState) -> torch.Tensor:
        """codes [B, n, Q] long -> samples [B, L] (same L for every row), `state` advanced in place.
        A fresh row's first `lead` samples are placeholders the stage drops."""

    def transcript(self, req: Request, frames: int) -> str:
        """Text voiced by the request's first `frames` frames and not reported yet (default: none)."""
        return ""

    def forget(self, req: Request) -> None:
        """Drop per-request state the adapter keeps (default: none)."""


class VocoderStage(Stage):
    name = "vocoder"

    def __init__(self, adapter: VocoderAdapter, cfg: EngineConfig):
        self.adapter, self.cfg = adapter, cfg
        self.pool = SlotPool(adapter.new_state, cfg.max_running, on_grow=lambda: self.graphs and self.graphs.graphs.clear())
        self.reqs: dict[str, Request] = {}
        self.vocoded: dict[str, int] = {}
        self.batch_stats = StageStats()
        self.graphs = make_runner(cfg, adapter.device, lambda inputs, ctx: self.compute(inputs), lambda meta: None,
                                  width=0, neutralize=lambda inputs, meta: inputs["slots"].fill_(self.pool.scratch))

    # ---- the protocol ---------------------------------------------------------------------
    def admit(self, req: Request) -> None:
        self.reqs[req.rid] = req
        self.vocoded[req.rid] = 0

    def has_work(self) -> bool:
        return any(self._chunk(r) for r in self.reqs.values())

    def done(self, req: Request) -> bool:
        return req.frames.final and self.vocoded.get(req.rid, 0) == len(req.frames)

    def remove(self, req: Request) -> None:
        if self.reqs.pop(req.rid, None) is not None:
            self.adapter.forget(req)
        self.vocoded.pop(req.rid, None)
        self.pool.release(req.rid)

    def truncate(self, req: Request, keep: int) -> None:
        """Decode nothing past frame `keep` (the speech stage stops writing at the same point)."""
        if req.rid in self.reqs:
            del req.frames.frames[max(keep, self.vocoded[req.rid]):]
            req.frames.final = True

    def stats(self) -> dict[str, StageStats]:
        return {self.name: self.batch_stats}

    # ---- stepping -------------------------------------------------------------------------
    def _chunk(self, req: Request) -> int:
        done = self.vocoded[req.rid]
        pending = len(req.frames) - done
        if pending <= 0:
            return 0
        n = max(1, self.cfg.first_chunk_frames if done == 0 else self.cfg.vocoder_chunk_frames)
        if pending >= n:
            return n
        return pending if req.frames.final else 0

    @torch.no_grad()
    def step(self) -> Failures:
        groups: dict[int, list[Request]] = defaultdict(list)
        for req in self.reqs.values():
            n = self._chunk(req)
            if n:
                groups[n].append(req)
        for n, reqs in groups.items():
            self.batch_stats.record(len(reqs))
            bucket = self.graphs.bucket_for(len(reqs)) if self.graphs is not None else None
            inputs = self.inputs(reqs, n, (bucket or len(reqs)) - len(reqs))
            out = self.graphs.run(bucket, inputs, None) if bucket else self.compute(inputs)
            self.apply(reqs, n, out)
        return []

    def inputs(self, reqs: list[Request], n: int, pad: int) -> dict:
        """The next n frames of each request [B, n, Q] and its state slot (padding: the scratch row)."""
        slots = self.pool.slot_list([r.rid for r in reqs]) + [self.pool.scratch] * pad
        codes = [r.frames.frames[self.vocoded[r.rid]:self.vocoded[r.rid] + n] for r in reqs]
        codes += [[[0] * self.adapter.codebooks] * n] * pad
        dev = self.adapter.device
        return {"codes": torch.tensor(codes, device=dev), "slots": torch.tensor(slots, dtype=torch.long, device=dev)}

    def compute(self, inputs: dict, ctx=None) -> dict:
        """Device only: gather the rows' states, decode, scatter the advanced states back."""
        state = self.pool.gather(inputs["slots"])
        wav = self.adapter.decode(inputs["codes"], state)  # [B, L]
        self.pool.scatter(inputs["slots"], state)
        return {"wav": wav}

    def warmup(self) -> None:
        """Capture one-frame chunks' graphs, largest bucket first: padding rows only."""
        if self.graphs is not None:
            for b in sorted(self.graphs.buckets, reverse=True):
                self.graphs.run(b, self.inputs([], 1, b), None)

    def apply(self, reqs: list[Request], n: int, out: dict) -> None:
        wav = host.audio(out["wav"])  # the step's one copy of audio to the host
        for b, req in enumerate(reqs):
            fresh = self.vocoded[req.rid] == 0
            self.vocoded[req.rid] += n
            samples = wav[b, self.adapter.lead:] if fresh else wav[b]
            req.emit_audio(samples, n, self.adapter.transcript(req, self.vocoded[req.rid]))
