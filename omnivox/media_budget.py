"""What one request's media may cost to decode: memory held at once, wall time, context tokens.

Every media loader (`audio.io.load_audio`, `qwen3_omni.video`, `qwen3_omni.image_processor`)
prices its input from the container's header before it decodes a sample or a frame, and reserves
that price from the request's `DecodeBudget`:

    kept       what stays after the loader returns (float32 patches, the resampled wave), held
               until the request's other media are done too;
    transient  what exists only while the loader works (the full-resolution frame being
               decoded, the float64 copy the resampler takes, one temporal patch group).

A reservation fails when the request's kept bytes so far plus this item's kept and transient
bytes pass `max_bytes`, or when the request's vision tokens so far plus this item's pass the
model's context; either raises an `InputError` (`ContextTooLong` for tokens) naming the limit,
which the API answers with a 400. Decoding then checks the clock between frames and blocks, so
a request spends at most `max_seconds` of a worker's time decoding.
NOTE: the budget is per request; --media-workers requests decode at once, so the server's media
memory is at most that many budgets.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from omnivox.errors import ContextTooLong, InputError

MAX_DECODE_BYTES = 512 << 20
MAX_DECODE_SECONDS = 30.0
OPTION = "--max-media-decode-mb"  # the server option that sets max_decode_bytes


def size(n: int) -> str:
    """Bytes for a message: '900 bytes', '12.5 MiB', '1.9 GiB'."""
    if n < 1 << 20:
        return f"{n} bytes"
    return f"{n / (1 << 20):.1f} MiB" if n < 1 << 30 else f"{n / (1 << 30):.1f} GiB"


@dataclass(frozen=True)
class MediaLimits:
    """The per-request media limits a server applies (`omnivox serve --max-media-decode-mb`)."""

    max_decode_bytes: int = MAX_DECODE_BYTES
    max_decode_seconds: float = MAX_DECODE_SECONDS

    def __post_init__(self):
        if self.max_decode_bytes <= 0 or not self.max_decode_seconds > 0:
            raise ValueError(f"media limits must be positive, got {self}")

    def budget(self, max_tokens: int | None = None) -> "DecodeBudget":
        """A fresh budget for one request (its clock starts now)."""
        return DecodeBudget(self.max_decode_bytes, self.max_decode_seconds, max_tokens)


class DecodeBudget:
    """One request's media decode budget: bytes and tokens reserved so far, and a deadline."""

    def __init__(self, max_bytes: int = MAX_DECODE_BYTES, max_seconds: float = MAX_DECODE_SECONDS,
                 max_tokens: int | None = None, clock: Callable[[], float] = time.monotonic):
        self.max_bytes, self.max_seconds, self.max_tokens = int(max_bytes), float(max_seconds), max_tokens
        self.kept = self.tokens = 0
        self._clock = clock
        self._deadline = clock() + self.max_seconds

    def reserve(self, what: str, kept: int, transient: int = 0, tokens: int = 0) -> None:
        """Refuse `what` (before it is decoded) if it passes the context or the byte budget; else
        count its `kept` bytes and `tokens` against the rest of the request."""
        if self.max_tokens and self.tokens + tokens > self.max_tokens:
            others = f" (with {self.tokens} from this request's other media)" if self.tokens else ""
            raise ContextTooLong(f"{what} would be {tokens} tokens{others}, more than the model's context of "
                                 f"{self.max_tokens} tokens")
        self.check(what, kept + transient)
        self.kept += kept
        self.tokens += tokens

    def check(self, what: str, nbytes: int) -> None:
        """Refuse `what` if `nbytes` more than the request keeps already would pass the budget."""
        if self.kept + nbytes > self.max_bytes:
            others = f" on top of {size(self.kept)} for this request's other media" if self.kept else ""
            raise InputError(f"{what} needs {size(nbytes)} of memory to decode and preprocess{others}; the "
                             f"per-request media decode budget is {size(self.max_bytes)} (server option "
                             f"{OPTION}): send smaller, shorter or fewer media", code="media_too_large")

    def tick(self, what: str) -> None:
        """Refuse to go on once the request has decoded for `max_seconds`."""
        if self._clock() > self._deadline:
            raise InputError(f"decoding {what} took longer than {self.max_seconds:g} s, the per-request media "
                             "decode time limit: send smaller or shorter media", code="media_too_large")
