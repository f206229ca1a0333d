"""The serving surface of a full-duplex model (Moshi's family): the model listens and speaks at
once, one frame of audio in and one out (`frame_size` samples at `sample_rate`: 1920 at 24 kHz,
80 ms). Part of `omnivox.serving`'s contract (kept in its own module for size): the server and the
offline `Duplex` API use a duplex model only through these; `isinstance(served, DuplexModel)` is
the capability check.

A session is one engine request whose input stays open: the caller pushes the user's audio as it
arrives (`DuplexInput.push`; `DuplexInput.update` changes its sampling), the engine steps the session one frame per step as whole frames
arrive, and the handle yields, per output frame, the text token's piece (`TextDelta`, none for a
padding token) and the frame's audio (`AudioChunk`, `frame_size` samples, `frames=1`). A session
outputs one frame per input frame but its first `max_delay` (1 in Moshi's release), which the
model never outputs. `close` ends the user's audio (a partial frame is zero-padded); the session
finishes (`Finished`, "stop") after its last frame, or with "length" at its maximum length.
Each `AudioChunk.due` is when the frame was due: its input frame's arrival plus one frame (80 ms);
a frame emitted after it is late (`api/duplex_frames.py` counts them per session).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from typing_extensions import Protocol, runtime_checkable

from omnivox.serving import MAX_SEED, ServedModel, _integer, _number
from omnivox.errors import InputError

if TYPE_CHECKING:
    from omnivox.engine.handle import RequestHandle


@dataclass(frozen=True)
class DuplexParams:
    """How one session samples and how long it may last. None: the checkpoint's own (Moshi: its
    `lm_gen_config`, else moshi's LMGen defaults). greedy: argmax for text and audio."""

    greedy: bool = False
    seed: int | None = None
    temp: float | None = None  # the audio codebooks' temperature
    temp_text: float | None = None
    top_k: int | None = None
    top_k_text: int | None = None
    max_seconds: float | None = None  # the session's most input audio (None: the model's maximum)

    def __post_init__(self) -> None:
        if not isinstance(self.greedy, bool):
            raise InputError(f"greedy must be a boolean, got {self.greedy!r}", param="greedy")
        _integer("seed", self.seed, 0, MAX_SEED)
        for name in ("temp", "temp_text", "max_seconds"):
            _number(name, getattr(self, name))
            v = getattr(self, name)
            if v is not None and v < 0:
                raise InputError(f"{name} must be non-negative, got {v!r}", param=name)
        if self.max_seconds is not None and not (self.max_seconds > 0 and math.isfinite(self.max_seconds)):
            raise InputError(f"max_seconds must be positive, got {self.max_seconds!r}", param="max_seconds")
        _integer("top_k", self.top_k, 0)
        _integer("top_k_text", self.top_k_text, 0)


class DuplexInput(Protocol):
    """The user's side of a session. Thread-safe; cheap (the event loop may call it)."""

    def push(self, pcm: np.ndarray) -> None:
        """Append float32 mono samples at the model's `sample_rate`, any length: each whole frame
        goes to the engine; a partial frame waits for the next push. InputError for a bad array
        (not 1-D, not finite) or after `close`."""

    def update(self, params: DuplexParams) -> None:
        """New sampling values (`params` whole: a None field is the checkpoint's own; `seed` None
        keeps the session's), from the session's next frame on. InputError for values the model
        refuses, or a `max_seconds` (fixed when the session opens)."""

    def close(self) -> None:
        """The user's audio has ended: a partial frame is zero-padded and the session finishes after
        its last frame. Idempotent."""


@runtime_checkable
class DuplexModel(ServedModel, Protocol):
    """A full-duplex model. Of `ServedModel` it answers the facts (sample rate, frame rate, model
    card, engine); text to speech it refuses with an InputError."""

    @property
    def frame_size(self) -> int: ...  # samples of one frame, in and out
    @property
    def max_session_seconds(self) -> float: ...  # the longest session it serves (its KV budget holds)
    @property
    def default_params(self) -> DuplexParams: ...  # the checkpoint's sampling: what a None field of params means

    def check_duplex(self, params: DuplexParams) -> None:
        """Refuse what the model cannot do with `params` (InputError naming the field)."""

    def open_duplex(self, params: DuplexParams = DuplexParams(), *, loop=None,
                    request_id: str | None = None) -> tuple["RequestHandle", DuplexInput]:
        """A new session in the engine (see the module docstring for its events). Cheap: the event
        loop may call it. Overloaded when the engine is full."""
