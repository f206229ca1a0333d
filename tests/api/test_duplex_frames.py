"""`/metrics`' frame deadlines of full-duplex sessions (`api/duplex_frames.py`): per session its late
frames and their seconds while it is connected; over all sessions frames, late frames, the latency
histogram and the sessions ended with and without a late frame."""
from __future__ import annotations

import numpy as np

from omnivox.api.duplex_frames import DuplexFrames
from omnivox.engine.events import AudioChunk


def chunk(time: float, due: float | None) -> AudioChunk:
    return AudioChunk(np.zeros(1920, np.float32), 24000, 1, "", time, due)


def values(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_late_frames_per_session_and_in_total():
    frames = DuplexFrames(0.08)
    frames.start("a")
    frames.start("b")
    frames.observe("a", chunk(10.05, 10.08))  # in time: 50 ms after its input frame (due 80 ms after)
    frames.observe("a", chunk(10.19, 10.16))  # 30 ms late (110 ms after its input frame)
    frames.observe("a", chunk(10.29, 10.28))  # 10 ms late (90 ms)
    frames.observe("b", chunk(10.09, 10.12))  # in time (50 ms)
    frames.observe("b", chunk(10.2, None))  # no deadline known: counted, not judged
    got = values(frames.render())
    assert got['omnivox_duplex_session_frames_late{session="a"}'] == 2
    assert abs(got['omnivox_duplex_session_late_seconds{session="a"}'] - 0.04) < 1e-9
    assert got['omnivox_duplex_session_frames_late{session="b"}'] == 0
    assert got["omnivox_duplex_frames_total"] == 5 and got["omnivox_duplex_frames_late_total"] == 2
    assert got["omnivox_duplex_frame_latency_seconds_count"] == 4
    assert got['omnivox_duplex_frame_latency_seconds_bucket{le="0.06"}'] == 2  # the two of 50 ms
    assert got['omnivox_duplex_frame_latency_seconds_bucket{le="0.1"}'] == 3  # and 90 ms
    assert got['omnivox_duplex_frame_latency_seconds_bucket{le="0.12"}'] == 4  # and 110 ms
    frames.end("a")
    frames.end("b")
    got = values(frames.render())
    assert not any(k.startswith("omnivox_duplex_session_") for k in got)  # gone with their sessions
    assert got['omnivox_duplex_sessions_ended_total{late="yes"}'] == 1
    assert got['omnivox_duplex_sessions_ended_total{late="no"}'] == 1
