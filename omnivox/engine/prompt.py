"""A prompt that grows while the engine already computes it (realtime input): the caller's thread
appends segments, the engine thread takes them at each step. Family-neutral: a family's prompt
holds one (`stream`) and its prompt stage absorbs what is new."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Segment:
    """Positions appended to a streamed prompt: their ids, optionally their embedding rows (audio
    encoded as it arrived; None: the ids' token embeddings) and their prefix-cache identities
    (None: the ids)."""

    ids: list[int]
    embeds: torch.Tensor | None = None  # [n, H]
    keys: list | None = None  # prefix key items (omnivox/kv_cache/prefix.py)


class PromptStream:
    """The tail of a prompt that grows while the user is still speaking (realtime input). The
    caller's thread appends segments and finally closes the turn with the ids that end it; the
    engine thread takes what is new at each step and prefills it, so at the end of speech only
    the tail is left to compute. The model answers only once the stream is closed. Thread-safe.
    Positions are sequential (text and audio only: no images or videos in a stream).
    `wake`: tells the engine that computes it there is new input to take (`Engine.wake`)."""

    def __init__(self, wake: Callable[[], None]):
        self._lock = threading.Lock()
        self._pending: list[Segment] = []
        self._closed = False
        self._wake = wake

    def append(self, ids: list[int], embeds: torch.Tensor | None = None, keys: list | None = None) -> None:
        if embeds is not None and embeds.shape[0] != len(ids):
            raise ValueError(f"{embeds.shape[0]} embedding rows for {len(ids)} ids")
        with self._lock:
            if self._closed:
                raise ValueError("the prompt stream is closed")
            self._pending.append(Segment(list(ids), embeds, keys))
        self._notify()

    def close(self, ids: list[int] = ()) -> None:
        """End the turn with `ids` (e.g. the end of the user turn and the assistant header)."""
        with self._lock:
            if not self._closed:
                self._pending.append(Segment(list(ids)))
                self._closed = True
        self._notify()

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

    def _notify(self) -> None:
        self._wake()
