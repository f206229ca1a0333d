"""Frame deadlines of full-duplex sessions in `GET /metrics`, whichever protocol carries them
(`/api/chat`, `/v1/realtime`): a duplex session is always playing, and each output frame is due
one frame (80 ms) after its input frame arrived (`AudioChunk.due`, set by the engine). A frame
emitted after its deadline is late by the difference.

Per session (gauges labelled `session`, while it is connected): its late frames and the seconds
they were late, summed. Over all sessions: frames, late frames and late seconds (counters), the
frame latency (input frame's arrival to its output frame, a histogram), and the sessions that
ended with and without a late frame (the share of sessions that never missed a deadline).
"""
from __future__ import annotations

from omnivox.api.metrics import Histogram, MetricFamily
from omnivox.engine.events import AudioChunk

FRAME_LATENCY_BUCKETS = (0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.12, 0.16, 0.24, 0.32, 0.5, 1.0, 2.0)


class DuplexFrames:
    def __init__(self, frame_s: float):
        self.frame_s = frame_s
        self.frames = MetricFamily("omnivox_duplex_frames_total", "Output frames of full-duplex sessions.")
        self.late = MetricFamily("omnivox_duplex_frames_late_total",
                                 "Output frames of full-duplex sessions emitted after their deadline (input "
                                 "frame's arrival + one frame).")
        self.late_s = MetricFamily("omnivox_duplex_late_seconds_total",
                                   "Seconds full-duplex output frames were late, summed.")
        self.latency = Histogram("omnivox_duplex_frame_latency_seconds",
                                 "Input frame's arrival to its output frame, full-duplex sessions.",
                                 FRAME_LATENCY_BUCKETS)
        self.ended = MetricFamily("omnivox_duplex_sessions_ended_total",
                                  "Full-duplex sessions ended, by whether any frame was late (late=yes|no).",
                                  labelled=True)
        self.session_late = MetricFamily("omnivox_duplex_session_frames_late",
                                         "Late output frames of a connected full-duplex session, by session.",
                                         "gauge", labelled=True)
        self.session_late_s = MetricFamily("omnivox_duplex_session_late_seconds",
                                           "Seconds a connected full-duplex session's frames were late, summed, "
                                           "by session.", "gauge", labelled=True)
        self.sessions: dict[str, tuple[int, float]] = {}  # session -> (late frames, late seconds)

    def start(self, session: str) -> None:
        self.sessions[session] = (0, 0.0)

    def observe(self, session: str, chunk: AudioChunk) -> None:
        """One output frame of `session` handed to its socket (on the event loop)."""
        self.frames.inc()
        if chunk.due is None:
            return
        self.latency.observe(max(0.0, chunk.time - (chunk.due - self.frame_s)))
        late = chunk.time - chunk.due
        if late > 0:
            frames, seconds = self.sessions.get(session, (0, 0.0))
            self.sessions[session] = (frames + 1, seconds + late)
            self.late.inc()
            self.late_s.inc(late)

    def end(self, session: str) -> None:
        frames, _ = self.sessions.pop(session, (0, 0.0))
        self.ended.inc(late="yes" if frames else "no")

    def render(self) -> str:
        self.session_late.values.clear()
        self.session_late_s.values.clear()
        for sid, (frames, seconds) in list(self.sessions.items()):
            self.session_late.set(frames, session=sid)
            self.session_late_s.set(seconds, session=sid)
        out: list[str] = []
        for m in (self.session_late, self.session_late_s, self.frames, self.late, self.late_s, self.latency,
                  self.ended):
            out += m.render()
        return "\n".join(out) + "\n"
