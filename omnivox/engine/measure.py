"""Streaming requests measured as a client sees them, for the benchmarks (`omnivox bench` and the
families' workloads): each request's arrival, audio chunk times and finish (`RequestResult`: TTFA,
RTF, on-time chunks as ANCHORS.md defines them), run closed-loop or open-loop (`run_requests`) and
summarised per system (`summarize`)."""
from __future__ import annotations

import random
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np

from omnivox.engine.events import AudioChunk, Failed, Finished
from omnivox.engine.playback import PlaybackClock


@dataclass
class RequestResult:
    arrival: float
    chunks: list[tuple[float, float]]  # (time, seconds of audio)
    finish: float
    audio_seconds: float

    @property
    def ttfa(self) -> float:
        return (self.chunks[0][0] if self.chunks else self.finish) - self.arrival

    @property
    def rtf(self) -> float:
        return (self.finish - self.arrival) / self.audio_seconds if self.audio_seconds else float("inf")

    def playback(self) -> PlaybackClock:
        """The listener's playback of this stream, chunk by chunk."""
        return PlaybackClock.replay(self.chunks)

    def on_time(self) -> list[bool]:
        """Per chunk after the first: did it arrive before the audio already received ran out?
        (ANCHORS.md: time since the first chunk against all audio before it; after a stall every
        later chunk counts late. `playback()` is the listener who resumes.)"""
        if not self.chunks:
            return []
        t0, received, flags = self.chunks[0][0], self.chunks[0][1], []
        for t, secs in self.chunks[1:]:
            flags.append(received > t - t0)
            received += secs
        return flags


def summarize(name: str, results: list[RequestResult], wall: float) -> dict:
    ttfa = sorted(r.ttfa for r in results)
    flags = [f for r in results for f in r.on_time()]
    return {
        "system": name,
        "ttfa_p50": float(np.percentile(ttfa, 50)), "ttfa_p90": float(np.percentile(ttfa, 90)),
        "rtf": statistics.mean([r.rtf for r in results if r.audio_seconds] or [float("nan")]),
        "on_time": (sum(flags) / len(flags)) if flags else float("nan"),
        "no_stall": sum(all(r.on_time()) for r in results) / len(results),
        "audio_s_per_s": sum(r.audio_seconds for r in results) / wall,
        "wall": wall,
    }


def run_requests(submit, n: int, concurrency: int, rate: float | None, seed: int) -> tuple[list[RequestResult], float]:
    """Run `submit(i)` for i < n, closed-loop (at most `concurrency` in flight) or open-loop
    (Poisson arrivals at `rate`), recording each request's audio chunk times."""
    results: list[RequestResult | None] = [None] * n
    sem = threading.Semaphore(concurrency if rate is None else n)

    def one(i: int) -> None:
        try:
            arrival = time.monotonic()
            h = submit(i)
            chunks, fin = [], None
            for ev in h:
                if isinstance(ev, AudioChunk):
                    chunks.append((ev.time, ev.samples.shape[0] / ev.sample_rate))
                elif isinstance(ev, Finished):
                    fin = ev
                elif isinstance(ev, Failed):
                    print(f"request {i} failed: {ev.message}")
            results[i] = RequestResult(fin.arrival if fin else arrival, chunks, fin.time if fin else time.monotonic(),
                                       sum(c[1] for c in chunks))
        finally:
            sem.release()

    rng = random.Random(seed)
    threads = []
    start = time.monotonic()
    for i in range(n):
        if rate is not None:
            time.sleep(rng.expovariate(rate))
        sem.acquire()
        t = threading.Thread(target=one, args=(i,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return [r for r in results if r is not None], time.monotonic() - start
