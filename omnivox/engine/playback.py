"""A listener's playback of one audio stream: the one definition of a stall, shared by the
engine's scheduler (how much slack a stream has), the API's metrics (underruns as the client
sees them) and the benchmarks (gap-free streams).

Playback starts when the first audio arrives and runs at 1x. At any moment the listener has
`first + received + stalled - now` seconds of audio left: the stream's **slack**. A chunk that
arrives when the slack is below zero comes after everything received so far has played: a
**stall**, during which the listener hears `-slack` seconds of silence; playback resumes with that
chunk. A stream with no stall is **gap-free** (no jitter allowance).

(The benchmarks' share of on-time chunks, `measure.RequestResult.on_time`, is ANCHORS.md's
cumulative measure, which does not resume: once behind, every later chunk counts late.)
"""
from __future__ import annotations

import time


class PlaybackClock:
    def __init__(self):
        self.first: float | None = None  # when the first audio arrived
        self.received = 0.0  # seconds of audio received
        self.chunks = 0
        self.underruns = 0  # chunks that came after the audio before them had played
        self.stall_s = 0.0  # seconds of silence the listener heard, summed

    @classmethod
    def replay(cls, chunks) -> "PlaybackClock":
        """A listener's playback of `chunks`, (arrival time, seconds of audio) in order."""
        clock = cls()
        for t, seconds in chunks:
            clock.on_chunk(seconds, t)
        return clock

    def slack(self, now: float) -> float:
        """Seconds of audio the listener still has to play at `now` (negative: stalled that long);
        inf before playback starts."""
        return float("inf") if self.first is None else self.first + self.received + self.stall_s - now

    def on_chunk(self, seconds: float, now: float | None = None) -> bool:
        """Record a chunk of `seconds` of audio arriving at `now`; True when it is a stall."""
        now = time.monotonic() if now is None else now
        slack = self.slack(now)
        late = slack < 0
        if self.first is None:
            self.first = now
        elif late:
            self.stall_s -= slack
        self.received += seconds
        self.chunks += 1
        self.underruns += late
        return late

    @property
    def gap_free(self) -> bool:
        return self.underruns == 0
