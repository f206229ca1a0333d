"""A prompt that grows while the engine already computes it (realtime input): the caller's thread
appends segments, the engine thread takes them at each step. Family-neutral: a request holds one
(`Request.stream`); the first stage of its route reads it (`Stage.reads_open_stream`).

A segment is token ids with, optionally, their input rows (`embeds`) or the HOST audio the rows
are to be encoded from (`audio`: log-mel frames, encoded by the encoder stage, `stages/encoder.py`,
which appends the rows to the next stage's stream). Nothing here imports torch: the API builds
segments from host arrays only.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    import torch


class HostRows:
    """A clip's encoded rows as host arrays, in order, written by the encoder stage the first time
    each row is computed (`append`) and read by whoever renders the clip again (`rows`). The first
    computation wins: a replay of the clip reads the rows already here instead of its own, so one
    set of prefix-cache keys never names two differently rounded computations. Appended by the
    engine thread, read by any thread (`n` only grows; a list append is atomic)."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []  # [n_i, H] each
        self.n = 0

    def append(self, rows: np.ndarray) -> None:
        if len(rows):
            self._parts.append(rows)
            self.n += len(rows)

    def rows(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """Rows [start, end) (end: all there are now). # [n, H]"""
        parts = list(self._parts)
        if not parts:
            return np.zeros((0, 0), np.float32)
        return (np.concatenate(parts) if len(parts) > 1 else parts[0])[start:end]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in list(self._parts))


@dataclass(eq=False)
class AudioPiece:
    """Host audio for the encoder stage: log-mel frames [n_mels, t] appended to a clip (`final`:
    the clip ends after them). Its rows are `start` .. `start + len(segment.ids)` of the clip,
    kept in `rows` (the clip's identity: one encoder state per clip and request)."""

    frames: np.ndarray  # [n_mels, t] float32
    rows: HostRows
    start: int
    final: bool = False
    window: int = 0  # the clip's attention window in the family's unit (Qwen: AuT chunks); 0: its default


@dataclass
class Segment:
    """Positions appended to a streamed prompt: their ids, optionally their input rows (None: the
    ids' token embeddings; host arrays or tensors) or the host audio they are encoded from, and
    their prefix-cache identities (None: the ids)."""

    ids: list[int]
    embeds: "np.ndarray | torch.Tensor | None" = None  # [n, H]
    keys: list | None = None  # prefix key items (omnivox/kv_cache/prefix.py)
    audio: AudioPiece | None = None  # encoded by the encoder stage into `embeds`


class PromptStream:
    """The tail of a prompt that grows while the user is still speaking (realtime input). The
    caller's thread appends segments and finally closes the turn with the ids that end it; the
    engine thread takes what is new at each step. Thread-safe. What a stage does with an open
    stream is the stage's (`Stage.reads_open_stream`): the Thinker prefills what came and answers
    once the stream is closed; the encoder stage encodes each step's audio and passes it on while
    the stream stays open (lockstep). Positions are sequential (text and audio only).
    `wake`: tells the engine that computes it there is new input to take (`Engine.wake`)."""

    def __init__(self, wake: Callable[[], None] = lambda: None):
        self._lock = threading.Lock()
        self._pending: list[Segment] = []
        self._closed = False
        self._wake = wake

    def append(self, ids: list[int], embeds: Any = None, keys: list | None = None,
               audio: AudioPiece | None = None) -> None:
        if embeds is not None and embeds.shape[0] != len(ids):
            raise ValueError(f"{embeds.shape[0]} embedding rows for {len(ids)} ids")
        if embeds is not None and audio is not None:
            raise ValueError("a segment carries rows or the audio they are encoded from, not both")
        self.extend([Segment(list(ids), embeds, keys, audio)])

    def extend(self, segs: list[Segment]) -> None:
        with self._lock:
            if self._closed:
                raise ValueError("the prompt stream is closed")
            self._pending.extend(segs)
        self._wake()

    def close(self, ids: list[int] = ()) -> None:
        """End the turn with `ids` (e.g. the end of the user turn and the assistant header)."""
        with self._lock:
            if not self._closed:
                self._pending.append(Segment(list(ids)))
                self._closed = True
        self._wake()

    def pending(self) -> bool:
        with self._lock:
            return bool(self._pending)

    @property
    def closed(self) -> bool:
        return self._closed

    def take(self) -> tuple[list[Segment], bool]:
        """(segments appended since the last take, whether the stream is closed)."""
        with self._lock:
            segs, self._pending = self._pending, []
            return segs, self._closed
