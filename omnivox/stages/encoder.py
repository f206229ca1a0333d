"""The encoder stage: the front of a listening request's route (`encoder`, then the prompt stage),
the mirror of the vocoder stage at the other end. The API appends HOST audio to the request's
prompt stream (`engine.prompt.AudioPiece`: log-mel frames of a clip, with the rows' prefix keys);
each step this stage takes every request's new segments, encodes every new piece of audio in one
batched call (the family's `EncoderAdapter`: Qwen's AuT, `models/qwen3_omni/audio_stream.py`) and
appends the rows, in order with the text segments it passes through, to the request's `encoded`
stream, which the prompt stage absorbs in the same engine step. It reads the stream while it is
open and emits as input comes (one piece in, its rows out: `reads_open_stream`), so a listening
request needs no other mechanism; the stream's end is passed on (`encoded` closed) and the stage
is done with the request.

Streaming state as data: each request holds one adapter state per clip (keyed by the clip's
`HostRows`), created at the clip's first piece and dropped with the request. The rows of each
clip are also kept on the host (`HostRows`, one device read per step, `engine.host.rows`): the
first computation of a row wins, so a request that replays a clip (a re-opened turn) reads the
rows already computed instead of its own (which could differ in round-off: its batch differs),
and one set of prefix-cache keys never names two different rows.

Errors: a piece the adapter cannot take (wrong shape, too many rows for its ids) fails its
request alone; an exception of the batched call (a bug, the device) fails every request of it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

from omnivox.engine import host
from omnivox.engine.events import StageStats
from omnivox.engine.prompt import AudioPiece, HostRows, Segment
from omnivox.engine.request import Request
from omnivox.engine.stage import Failures, Stage
from omnivox.errors import InputError


class EncoderAdapter(ABC):
    """A family's streaming encoder as the encoder stage drives it."""

    device: torch.device

    @abstractmethod
    def new_state(self, window: int) -> Any:
        """A fresh clip's streaming state (data the stage keeps per request and clip); `window`:
        the piece's `AudioPiece.window`."""

    @abstractmethod
    def check(self, frames: np.ndarray) -> None:
        """Raise InputError for frames this encoder cannot take (checked before the batch)."""

    @abstractmethod
    def encode(self, pushes: list[tuple[Any, np.ndarray, bool]]) -> list[torch.Tensor]:
        """A step's pieces (state, frames [n_mels, t], final), in the order they came (a clip's in
        its order) -> the rows each made final [n_i, H], in order, the states advanced."""

    def forget(self, state: Any) -> None:
        """A clip's state is dropped with its request: free what the adapter holds for it (e.g. a
        row of a state pool; default: nothing, the state is the stage's data)."""


class EncoderStage(Stage):
    name = "encoder"
    reads_open_stream = True
    passes_input = True

    def __init__(self, adapter: EncoderAdapter):
        self.adapter = adapter
        self.device = torch.device(adapter.device)
        self.reqs: dict[str, Request] = {}
        self.clips: dict[str, dict[HostRows, Any]] = {}  # rid -> clip -> the adapter's state
        self.batch_stats = StageStats()  # pieces encoded per step

    # ---- the protocol ---------------------------------------------------------------------
    def admit(self, req: Request) -> None:
        if req.stream is None or req.encoded is None:
            raise RuntimeError("the encoder stage takes requests with a prompt stream")
        self.reqs[req.rid] = req
        self.clips[req.rid] = {}

    def has_work(self) -> bool:
        return any(r.stream.pending() for r in self.reqs.values())

    def done(self, req: Request) -> bool:
        return req.encoded is None or req.encoded.closed

    def remove(self, req: Request) -> None:
        self.reqs.pop(req.rid, None)
        for state in self.clips.pop(req.rid, {}).values():
            self.adapter.forget(state)

    def stats(self) -> dict[str, StageStats]:
        return {self.name: self.batch_stats}

    # ---- stepping -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> Failures:
        taken = [(req, *req.stream.take()) for req in list(self.reqs.values()) if req.stream.pending()]
        failures: Failures = []
        pushes, owners = [], []  # one per audio piece: (state, frames, final); (request, piece)
        for req, segs, _ in taken:
            try:
                for seg in segs:
                    if seg.audio is not None:
                        self.adapter.check(seg.audio.frames)
                        clips = self.clips[req.rid]
                        if seg.audio.rows not in clips:  # the clip's first piece in this request
                            clips[seg.audio.rows] = self.adapter.new_state(seg.audio.window)
                        pushes.append((clips[seg.audio.rows], seg.audio.frames, seg.audio.final))
                        owners.append(req)
            except InputError as e:
                failures.append((req, e))
        failed = {r.rid for r, _ in failures}
        pushes = [p for p, r in zip(pushes, owners) if r.rid not in failed]
        self.last_step = (len(pushes), len({r.rid for r in owners} - failed))
        rows = iter([])
        if pushes:
            self.batch_stats.record(len(pushes))
            try:
                rows = iter(self.adapter.encode(pushes))
            except Exception as e:  # noqa: BLE001 - every request of the call fails with it
                return failures + [(r, e) for r in {r.rid: r for r in owners if r.rid not in failed}.values()]
        out = [(req, segs, closed) for req, segs, closed in taken if req.rid not in failed]
        pieces = [(req, seg, next(rows)) for req, segs, _ in out for seg in segs if seg.audio is not None]
        embeds = self._keep(pieces)
        at = iter(embeds)
        for req, segs, closed in out:
            try:
                req.encoded.extend([seg if seg.audio is None else Segment(seg.ids, next(at), seg.keys) for seg in segs])
            except ValueError as e:
                failures.append((req, e))
                continue
            if closed:
                req.encoded.close()
        return failures

    def _keep(self, pieces: list[tuple[Request, Segment, torch.Tensor]]) -> list:
        """Each piece's rows for the prompt stage, the first computation of a row winning: rows the
        clip's host record already holds come from it (host arrays); new ones are appended to it
        (one device read for the step) and go on as computed (the same values, on the device)."""
        old = []  # per piece: how many of its rows the host record held before it
        have: dict[HostRows, int] = {}  # each clip's rows on the host once this step's pieces before are in
        for req, seg, rows in pieces:
            a, n = seg.audio, len(seg.ids)
            known = have.get(a.rows, a.rows.n)
            if rows.shape[0] != n:
                raise RuntimeError(f"the encoder gave {rows.shape[0]} rows for a piece of {n} audio ids")
            if known < a.start:
                raise RuntimeError(f"a clip's rows from {a.start} came before its rows from {known}")
            old.append(min(n, known - a.start))
            have[a.rows] = max(known, a.start + n)
        fresh = [rows[k:] for (_, _, rows), k in zip(pieces, old) if k < rows.shape[0]]
        if fresh:
            copies = iter(np.split(host.rows(torch.cat(fresh)), np.cumsum([t.shape[0] for t in fresh])[:-1]))
            for (_, seg, rows), k in zip(pieces, old):
                if k < rows.shape[0]:
                    seg.audio.rows.append(next(copies))
        out = []
        for (_, seg, rows), k in zip(pieces, old):
            a = seg.audio
            if k == 0:
                out.append(rows)
            elif k == rows.shape[0]:
                out.append(a.rows.rows(a.start, a.start + k))
            else:
                out.append(torch.cat([torch.from_numpy(a.rows.rows(a.start, a.start + k)).to(rows), rows[k:]]))
        return out
