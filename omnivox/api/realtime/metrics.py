"""Realtime sessions in `GET /metrics` (Prometheus text, the families of `omnivox.api.metrics`).

TTFA of a turn: from the end of the user's speech to the first audio delta handed to the socket.
The end of speech is when the server received the last voiced sample: with server VAD the append
that held speech_stopped's audio_end_ms minus silence_duration_ms (so the VAD's wait for silence
counts, as the user waits through it too); in manual mode the `input_audio_buffer.commit` (or
the `response.create` that followed it, if the buffer was already committed). Responses that
no user speech ended (a text item, `response.create` alone) are not observed.
"""
from __future__ import annotations

from omnivox.api.metrics import LATENCY_BUCKETS, Histogram, MetricFamily


class RealtimeMetrics:
    def __init__(self):
        self.ttfa = Histogram("omnivox_realtime_time_to_first_audio_seconds",
                              "End of user speech to the first audio delta of the response (per turn).",
                              LATENCY_BUCKETS)
        self.active = MetricFamily("omnivox_realtime_sessions_active", "Realtime sessions connected now.", "gauge")
        self.sessions = MetricFamily("omnivox_realtime_sessions_total", "Realtime sessions accepted.")
        self.refused = MetricFamily("omnivox_realtime_sessions_refused_total",
                                    "Realtime connections refused before the upgrade, by reason.", labelled=True)
        self.responses = MetricFamily("omnivox_realtime_responses_total", "Realtime responses by final status.",
                                      labelled=True)
        self.barge_ins = MetricFamily("omnivox_realtime_barge_ins_total",
                                      "Responses cancelled because the user started speaking (server VAD).")
        self.turns = MetricFamily("omnivox_realtime_user_turns_total", "User audio turns committed.")
        self.input_seconds = MetricFamily("omnivox_realtime_input_audio_seconds_total",
                                          "Seconds of user audio received (24 kHz pcm16).")
        self.errors = MetricFamily("omnivox_realtime_errors_total", "Error events sent to realtime clients, by code.",
                                   labelled=True)
        self.idle_turns = MetricFamily("omnivox_realtime_idle_turn_releases_total",
                                       "Open turns that gave back their KV pages after --realtime-turn-idle-s "
                                       "without audio.")
        self.underruns = MetricFamily("omnivox_realtime_audio_underruns_total",
                                      "Response audio deltas sent later than the audio before them would last.")

        # per session, set from the sessions at each scrape (`RealtimeHub.measure`)
        self.host_bytes = MetricFamily("omnivox_realtime_session_host_bytes",
                                       "Host memory a realtime session holds for its audio: the turns' log-mel pieces "
                                       "and encoded rows (host arrays) and the input history, by session.",
                                       "gauge", labelled=True)
        self.turn_pages = MetricFamily("omnivox_realtime_session_turn_kv_pages",
                                       "Thinker KV pages a session's open turn holds (its share of "
                                       "--realtime-turn-kv-share), by session.", "gauge", labelled=True)

    def render(self) -> str:
        out: list[str] = []
        for m in (self.host_bytes, self.turn_pages, self.ttfa, self.active, self.sessions, self.refused, self.responses, self.barge_ins, self.turns,
                  self.input_seconds, self.errors, self.idle_turns, self.underruns):
            out += m.render()
        return "\n".join(out) + "\n"
