"""What /api/chat's Opus costs the event loop per 80 ms frame (omnivox/api/moshi_chat.py runs it
there): decoding one client message (`audio.opus.OpusStreamDecoder`, sphn-written like moshi's
client) and encoding one output frame (`audio.output_stream.OpusStream`), beside sphn's own reader
and writer (Rust) on the same frames as the baseline. Microseconds per frame, median of 5 passes
over 10 s of speech.

    .venv/bin/python benchmarks/opus_frames.py
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import sphn

from omnivox.audio.io import load_audio
from omnivox.audio.opus import OpusStreamDecoder
from omnivox.audio.output_stream import OpusStream

F = 1920
SPEECH = load_audio(Path(__file__).resolve().parents[1] / "tests" / "media" / "question_24k.wav", target_sr=24000)
FRAMES = [np.ascontiguousarray(np.resize(SPEECH, 125 * F)[i:i + F], dtype=np.float32) for i in range(0, 125 * F, F)]


def per_frame_us(run) -> float:
    times = []
    for _ in range(5):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) / len(FRAMES) * 1e6)
    return statistics.median(times)


def main() -> None:
    writer = sphn.OpusStreamWriter(24000)
    messages = [writer.append_pcm(f) for f in FRAMES]

    def feed(make, call, items):
        """A run: a fresh codec `make()` fed every item with `call`."""
        def run():
            codec = make()
            for x in items:
                call(codec, x)
        return run

    ours_decode = feed(lambda: OpusStreamDecoder(24000), OpusStreamDecoder.push, messages)
    sphn_decode = feed(lambda: sphn.OpusStreamReader(24000), lambda r, m: r.append_bytes(m), messages)
    ours_encode = feed(lambda: OpusStream(24000), OpusStream.push, FRAMES)
    sphn_encode = feed(lambda: sphn.OpusStreamWriter(24000), lambda w, f: w.append_pcm(f), FRAMES)

    print(f"{len(FRAMES)} frames of 80 ms, us per frame (median of 5)")
    print(f"{'':8}{'omnivox':>10}{'sphn':>10}")
    print(f"{'decode':8}{per_frame_us(ours_decode):10.0f}{per_frame_us(sphn_decode):10.0f}")
    print(f"{'encode':8}{per_frame_us(ours_encode):10.0f}{per_frame_us(sphn_encode):10.0f}")


if __name__ == "__main__":
    main()
