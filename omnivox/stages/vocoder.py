"""One vocoder stage for every family: codec frames in, audio out, streamed with exact carried
state. Each request owns a slot of a slot-indexed pool of streaming states (conv tails, window
KV, positions); a step gathers the slots of the requests with new frames, decodes them in one
call per chunk length, scatters the states back and copies the audio to the host once.

Decoding: a request's first decode is one frame, later ones `vocoder_chunk_frames` frames (or what
is left once the frames are final), always at the same boundaries, so a seeded request's audio is
the same bits in every run. The concatenated chunks equal the one-shot decode (no overlap
re-decoding, no seams). On a GPU a chunk's decode replays from a CUDA graph per batch-size bucket
(`stages.graphs`).

Emitting: a reply's first audio chunk is what a player starts on, so it must last until the next
one arrives, one engine step later. Decoded audio is held back until the first chunk holds
`first_chunk_frames` frames; None (auto, the default) sizes it from the measured time between
steps: one frame (audio as soon as a frame exists) while a step takes well under the first frame's
audio (a GPU), more when steps are slow (the demo on a CPU), so playback does not stall after it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from omnivox.engine import host
from omnivox.engine.config import EngineConfig
from omnivox.engine.events import StageStats
from omnivox.engine.request import Request
from omnivox.engine.stage import Failures, Stage
from omnivox.layers.streaming_conv import BatchedState
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


@dataclass
class VocoderInputs:
    codes: torch.Tensor  # [B, n, Q] long: each row's next n frames
    slots: torch.Tensor  # [B] long: each row's state slot (padding rows: the pool's scratch row)


@dataclass
class VocoderOutputs:
    wav: torch.Tensor  # [B, L] samples


MAX_AUTO_FIRST = 4  # auto never holds a stream's first audio for more frames than this
STEP_MARGIN = 1.5  # the first chunk lasts this many measured step intervals


def auto_first_chunk(step_s: float, frame_s: float, lead_s: float) -> int:
    """Frames of a first chunk whose audio lasts STEP_MARGIN steps: the next chunk comes one step
    later. 1 until both times are known."""
    if step_s <= 0 or frame_s <= 0:
        return 1
    n = 1
    while n < MAX_AUTO_FIRST and n * frame_s - lead_s < STEP_MARGIN * step_s:
        n += 1
    return n


class VocoderStage(Stage):
    name = "vocoder"

    def __init__(self, adapter: VocoderAdapter, cfg: EngineConfig):
        self.adapter, self.cfg = adapter, cfg
        self.device = torch.device(adapter.device)
        self.pool = SlotPool(adapter.new_state, cfg.max_running, on_grow=lambda: self.graphs and self.graphs.graphs.clear())
        self.reqs: dict[str, Request] = {}
        self.vocoded: dict[str, int] = {}
        self.batch_stats = StageStats()
        self.held: dict[str, list[tuple[np.ndarray, int, str]]] = {}  # a reply's first chunk, until it is long enough
        self.step_s = 0.0  # a moving average of the time between this stage's steps (auto first chunk)
        self.frame_s = 0.0  # seconds of audio per frame, learnt from a decoded chunk
        self._last_step: float | None = None
        self.graphs = make_runner(cfg, adapter.device, lambda inputs, ctx: self.compute(inputs), lambda meta: None,
                                  width=0, neutralize=lambda inputs, meta: inputs.slots.fill_(self.pool.scratch))

    # ---- the protocol ---------------------------------------------------------------------
    def admit(self, req: Request) -> None:
        self.reqs[req.rid] = req
        self.vocoded[req.rid] = 0
        self.held[req.rid] = []

    def has_work(self) -> bool:
        return any(self._chunk(r) for r in self.reqs.values()) or any(map(self._first_ready, self.held))

    def done(self, req: Request) -> bool:
        return req.frames.final and self.vocoded.get(req.rid, 0) == len(req.frames) and not self.held.get(req.rid)

    def remove(self, req: Request) -> None:
        if self.reqs.pop(req.rid, None) is not None:
            self.adapter.forget(req)
        self.vocoded.pop(req.rid, None)
        self.held.pop(req.rid, None)
        self.pool.release(req.rid)
        if not self.reqs:
            self._last_step = None  # e.g. the last reply was cancelled: nothing streams on

    def stats(self) -> dict[str, StageStats]:
        return {self.name: self.batch_stats}

    def running_rows(self, playing: bool) -> int:
        """Streams of that kind that will decode: not done, not listening (a realtime turn whose
        user speaks; a live session always decodes)."""
        return sum(1 for r in self.reqs.values()
                   if r.playing == playing and (r.live or not r.listening) and not self.done(r))

    # ---- stepping -------------------------------------------------------------------------
    def _chunk(self, req: Request) -> int:
        # NOTE: `final` read before the length: a speech stage in another loop appends its last
        # frame, then sets final, so a final seen here comes with every frame
        final, done = req.frames.final, self.vocoded[req.rid]
        pending = len(req.frames) - done
        if pending <= 0:
            return 0
        n = max(1, self.cfg.vocoder_chunk_frames) if done > 0 else 1
        if pending >= n:
            return n
        return pending if final else 0

    def _first_ready(self, rid: str) -> bool:
        """Is the held first chunk long enough to start playback on (or all there will be)?"""
        held = self.held[rid]
        if not held:
            return False
        want = self.cfg.first_chunk_frames or auto_first_chunk(self.scheduling.step_s(self.step_s), self.frame_s,
                                                               self.adapter.lead / self.adapter.sample_rate)
        req = self.reqs[rid]
        return sum(n for _, n, _ in held) >= want or (req.frames.final and self.vocoded[rid] == len(req.frames))

    def _emit_first(self, rid: str) -> None:
        held = self.held.pop(rid)
        self.reqs[rid].emit_audio(np.concatenate([a for a, _, _ in held]), sum(n for _, n, _ in held),
                                  "".join(t for _, _, t in held))

    def _clock(self) -> None:
        """The time since the previous step into the moving average, when a reply was still
        streaming between the two (not the idle time between replies; gaps over a second: idle)."""
        now = self.clock.now()
        if self._last_step is not None and now - self._last_step < 1.0:
            dt = now - self._last_step
            self.step_s = dt if self.step_s == 0 else 0.8 * self.step_s + 0.2 * dt
        self._last_step = now

    @torch.no_grad()
    def step(self) -> Failures:
        self._clock()
        for rid in [r for r in self.held if self._first_ready(r)]:  # e.g. the frames ended
            self._emit_first(rid)
        groups: dict[int, list[Request]] = defaultdict(list)
        for req in self.reqs.values():
            n = self._chunk(req)
            if n:
                groups[n].append(req)
        self.last_step = (sum(n * len(reqs) for n, reqs in groups.items()), sum(map(len, groups.values())))
        for n, reqs in groups.items():
            self.batch_stats.record(len(reqs))
            bucket = self.graphs.bucket_for(len(reqs)) if self.graphs is not None else None
            inputs = self.inputs(reqs, n, (bucket or len(reqs)) - len(reqs))
            out = self.graphs.run(bucket, inputs, None) if bucket else self.compute(inputs)
            self.apply(reqs, n, out)
        if all(self.done(r) for r in self.reqs.values()):
            self._last_step = None  # nothing streams on until the next reply: no interval to measure
        return []

    def inputs(self, reqs: list[Request], n: int, pad: int) -> VocoderInputs:
        """The next n frames of each request [B, n, Q] and its state slot (padding: the scratch row)."""
        slots = self.pool.slot_list([r.rid for r in reqs]) + [self.pool.scratch] * pad
        codes = [r.frames.frames[self.vocoded[r.rid]:self.vocoded[r.rid] + n] for r in reqs]
        codes += [[[0] * self.adapter.codebooks] * n] * pad
        dev = self.adapter.device
        return VocoderInputs(torch.tensor(codes, device=dev), torch.tensor(slots, dtype=torch.long, device=dev))

    def compute(self, inputs: VocoderInputs, ctx=None) -> VocoderOutputs:
        """Device only: gather the rows' states, decode, scatter the advanced states back."""
        state = self.pool.gather(inputs.slots)
        wav = self.adapter.decode(inputs.codes, state)  # [B, L]
        self.pool.scatter(inputs.slots, state)
        return VocoderOutputs(wav)

    def profile_steps(self) -> dict[str, Callable[[], object]]:
        """`max_running` streams' decode of a chunk (`vocoder_chunk_frames`), as padding rows
        (engine/memory.py); it is what the graphs hold too (an over-count when chunks exceed a frame)."""
        n = max(1, self.cfg.vocoder_chunk_frames)
        return {"decode": torch.no_grad()(lambda: self.compute(self.inputs([], n, self.cfg.max_running)))}

    def warmup(self) -> int:
        """Capture one-frame chunks' graphs, largest bucket first: padding rows only."""
        if self.graphs is None:
            return 0
        for b in sorted(self.graphs.buckets, reverse=True):
            self.graphs.run(b, self.inputs([], 1, b), None)
        return len(self.graphs.graphs)

    def apply(self, reqs: list[Request], n: int, out: VocoderOutputs) -> None:
        wav = host.audio(out.wav)  # the step's one copy of audio to the host
        self.frame_s = wav.shape[1] / n / self.adapter.sample_rate  # every row decodes n frames' samples
        self.scheduling.table.frame_s = self.frame_s
        for b, req in enumerate(reqs):
            fresh = self.vocoded[req.rid] == 0
            self.vocoded[req.rid] += n
            samples = wav[b, self.adapter.lead:] if fresh else wav[b]
            text = self.adapter.transcript(req, self.vocoded[req.rid])
            if req.rid not in self.held:
                req.emit_audio(samples, n, text)
                continue
            self.held[req.rid].append((samples, n, text))
            if self._first_ready(req.rid):
                self._emit_first(req.rid)
