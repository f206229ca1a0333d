"""Prometheus text exposition (format 0.0.4) for `GET /metrics`, written by hand.

Definitions (as in the README's Benchmarking section, measured in the server process with `time.monotonic()`):
- TTFA: from the HTTP request's arrival to its first audio bytes (streaming: when the first audio
  delta is handed to the socket; non-streaming: when the engine produced the first audio).
- RTF: (finish time - arrival) / seconds of audio produced; requests without audio are skipped.
- Playback (`omnivox.engine.playback`, the engine's scheduler uses the same): it starts with a
  stream's first chunk and runs at 1x; a chunk's **slack** is the audio the listener still had
  when it was sent. Underrun (a stall): a chunk sent after all audio before it had played
  (negative slack); the listener hears that much silence, then playback resumes with it. A stream
  with at least one underrun counts once in `omnivox_audio_streams_stalled_total`.
Gauges (queue length, running requests, KV pages per stage) are read from the engine's stats at
scrape time. All observations happen on the event loop thread, so no locking is needed.
"""
from __future__ import annotations

import bisect
import math

from omnivox.engine.events import EngineStats

LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
SLACK_BUCKETS = (-1.0, -0.5, -0.25, -0.1, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


def _num(v: float) -> str:
    f = float(v)
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    return str(int(f)) if f.is_integer() and abs(f) < 2**53 else repr(f)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    esc = (str(v).replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n") for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, esc)) + "}"


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for le, c in zip((*self.buckets, math.inf), self.counts):
            total += c
            out.append(f'{self.name}_bucket{{le="{_num(le)}"}} {total}')
        out += [f"{self.name}_sum {_num(self.sum)}", f"{self.name}_count {self.count}"]
        return out


class CountHistogram:
    """A labelled histogram of small integers from their counts (`counts[n]`: observations of n),
    one bucket per integer."""

    def __init__(self, name: str, help: str):
        self.name, self.help = name, help
        self.series: list[tuple[dict[str, str], list[int]]] = []

    def add(self, counts: list[int], **labels: str) -> None:
        self.series.append((dict(sorted(labels.items())), list(counts)))

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for labels, counts in self.series:
            total = 0
            for n, c in enumerate(counts):
                total += c
                if n:
                    out.append(f"{self.name}_bucket{_labels({**labels, 'le': str(n)})} {total}")
            out.append(f"{self.name}_bucket{_labels({**labels, 'le': '+Inf'})} {total}")
            out.append(f"{self.name}_sum{_labels(labels)} {sum(n * c for n, c in enumerate(counts))}")
            out.append(f"{self.name}_count{_labels(labels)} {total}")
        return out


class MetricFamily:
    """A counter or gauge with optional labels."""

    def __init__(self, name: str, help: str, kind: str = "counter", labelled: bool = False):
        self.name, self.help, self.kind = name, help, kind
        self.values: dict[tuple[tuple[str, str], ...], float] = {} if labelled else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def set(self, value: float, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] = value

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        out += [f"{self.name}{_labels(dict(k))} {_num(v)}" for k, v in sorted(self.values.items())]
        return out


class ServerMetrics:
    def __init__(self):
        self.ttfa = Histogram("omnivox_time_to_first_audio_seconds",
                              "Request arrival to its first audio bytes (TTFA).", LATENCY_BUCKETS)
        self.ttft = Histogram("omnivox_time_to_first_token_seconds",
                              "Request arrival to its first text token.", LATENCY_BUCKETS)
        self.rtf = Histogram("omnivox_real_time_factor",
                             "Generation wall time / seconds of audio produced (RTF), per request.", RTF_BUCKETS)
        self.requests = MetricFamily("omnivox_http_requests_total", "HTTP requests by route and status code.",
                                     labelled=True)
        self.completions = MetricFamily("omnivox_chat_completions_total", "Chat completions by finish reason.",
                                        labelled=True)
        self.speech = MetricFamily("omnivox_speech_requests_total",
                                   "Speech (/v1/audio/speech) requests by finish reason.", labelled=True)
        self.prompt_tokens = MetricFamily("omnivox_prompt_tokens_total", "Prompt tokens of finished completions.")
        self.completion_tokens = MetricFamily("omnivox_completion_tokens_total", "Generated text tokens.")
        self.audio_seconds = MetricFamily("omnivox_audio_seconds_total",
                                          "Seconds of audio produced (at the model's own sample rate).")
        self.chunks = MetricFamily("omnivox_audio_chunks_total", "Audio chunks streamed to clients.")
        self.underruns = MetricFamily("omnivox_audio_underruns_total",
                                      "Streamed audio chunks sent later than the audio before them would last.")
        self.stalled = MetricFamily("omnivox_audio_streams_stalled_total", "Audio streams with at least one underrun.")
        self.stall_seconds = MetricFamily("omnivox_audio_stall_seconds_total",
                                          "Seconds of silence listeners heard before late chunks (stalls), summed.")
        self.slack = Histogram("omnivox_audio_slack_seconds", "Audio a listener still had when a streamed chunk "
                               "(after the first) was sent; negative: a stall that long.", SLACK_BUCKETS)
        self.disconnects = MetricFamily("omnivox_client_disconnects_total",
                                        "Requests whose client went away before the end (request aborted).")
        self.clamped = MetricFamily("omnivox_requests_clamped_total",
                                    "Requests whose \"at most\" field (the peers' max_new_tokens, talker_max_new_tokens) "
                                    "was above the server's limit and clamped to it, by field.", labelled=True)
        # NOTE: every path that drops a client for not reading counts here, HTTP and realtime alike
        self.slow_readers = MetricFamily("omnivox_slow_readers_dropped_total",
                                         "Clients dropped for reading nothing of their reply, by api (http: a streamed "
                                         "reply, --stream-send-timeout-s; realtime: a session, "
                                         "--realtime-send-timeout-s; moshi_chat: an /api/chat session, the same) and by reason (send_timeout; keepalive: no answer "
                                         "to the WebSocket's pings).", labelled=True)

        self.weights = MetricFamily("omnivox_weight_bytes", "Bytes of the model's weights in this process, by stage "
                                    "and dtype (float8_e4m3fn: block-FP8 weights; their float32 scales count as float32).",
                                    "gauge", labelled=True)

    def render(self, stats: EngineStats) -> str:
        out: list[str] = []
        for m in (self.ttfa, self.ttft, self.rtf, self.requests, self.completions, self.speech, self.prompt_tokens,
                  self.completion_tokens, self.audio_seconds, self.chunks, self.underruns, self.stalled,
                  self.stall_seconds, self.slack, self.disconnects, self.clamped, self.slow_readers, self.weights):
            out += m.render()
        for fam in _engine_families(stats):
            out += fam.render()
        return "\n".join(out) + "\n"


def _engine_families(s: EngineStats) -> list[MetricFamily]:
    def gauge(name: str, help: str, value: float | None = None, kind: str = "gauge") -> MetricFamily:
        f = MetricFamily(name, help, kind, labelled=value is None)
        if value is not None:
            f.set(value)
        return f

    waiting = gauge("omnivox_requests_waiting", "Queue length: requests admitted but waiting for their first stage "
                    "(or for capacity), by kind (playing: streamed to a listener; batch: the rest).")
    running = gauge("omnivox_requests_running", "Requests being worked on by some stage, by kind (playing: streamed "
                    "to a listener; batch: the rest).")
    for kind in ("playing", "batch"):
        waiting.set(s.waiting_by_kind.get(kind, 0), kind=kind)
        running.set(s.running_by_kind.get(kind, 0), kind=kind)
    fams = [
        waiting,
        gauge("omnivox_requests_waiting_capacity", "Of the waiting: requests queued until the engine can make "
              "their audio in time (--scheduling slack).", s.waiting_capacity),
        running,
        gauge("omnivox_requests_in_flight", "Requests accepted and not yet finished.", s.in_flight),
        gauge("omnivox_engine_requests_finished_total", "Requests the engine completed.", s.finished, "counter"),
        gauge("omnivox_engine_requests_aborted_total", "Requests aborted (client gone or cancelled).",
              s.aborted, "counter"),
        gauge("omnivox_prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache.",
              s.prefix_hit_tokens, "counter"),
        gauge("omnivox_preemptions_total", "Requests preempted for lack of KV pages.", s.preemptions, "counter"),
    ]
    if s.live_capacity is not None:  # a full-duplex model under slack, once measured
        fams.append(gauge("omnivox_live_sessions_capacity", "The most full-duplex sessions whose frames stay within "
                          "their deadline, as measured now (--scheduling slack admits a new one below it).",
                          s.live_capacity))
    total = gauge("omnivox_kv_cache_pages_total", "KV cache pages per stage.")
    free = gauge("omnivox_kv_cache_pages_free", "Free KV cache pages per stage (cached prefixes count as free).")
    usage = gauge("omnivox_kv_cache_usage_ratio", "Share of KV cache pages in use per stage.")
    for stage, n in s.kv_pages_total.items():
        f = s.kv_pages_free.get(stage, 0)
        total.set(n, stage=stage)
        free.set(f, stage=stage)
        usage.set((n - f) / n if n else 0.0, stage=stage)
    steps = gauge("omnivox_stage_steps_total", "Batched steps run per stage.", kind="counter")
    mean = gauge("omnivox_stage_batch_mean", "Mean requests per step per stage.")
    peak = gauge("omnivox_stage_batch_max", "Largest batch per stage.")
    for stage, st in s.stages.items():
        steps.set(st.steps, stage=stage)
        mean.set(st.mean_batch, stage=stage)
        peak.set(st.max_batch, stage=stage)
    return fams + [total, free, usage, steps, mean, peak] + _speculative_families(s, gauge)


def _speculative_families(s: EngineStats, gauge) -> list:
    """Speculative decoding per stage and method: drafts proposed and confirmed (also per draft
    position), the tokens a verifying row took (a histogram: 1 = no draft confirmed) and its
    mean, and the draft's own KV bytes."""
    drafted = gauge("omnivox_spec_draft_tokens_total", "Speculative decoding: ids drafted per stage.", kind="counter")
    taken = gauge("omnivox_spec_accepted_tokens_total",
                  "Speculative decoding: drafted ids the model's own draws confirmed, per stage.", kind="counter")
    length = gauge("omnivox_spec_mean_accepted_length",
                   "Speculative decoding: tokens a row with drafts took per step (1 + confirmed drafts), mean.")
    at_drafted = gauge("omnivox_spec_position_drafted_total",
                       "Speculative decoding: ids drafted at each draft position (0 = right after the input).",
                       kind="counter")
    at_taken = gauge("omnivox_spec_position_accepted_total",
                     "Speculative decoding: drafted ids confirmed at each draft position.", kind="counter")
    hist = CountHistogram("omnivox_spec_acceptance_length", "Speculative decoding: tokens a row with drafts took "
                          "in one step (1 + confirmed drafts).")
    kv = gauge("omnivox_spec_draft_kv_bytes", "Speculative decoding: bytes of the drafter's KV cache (DFlash, "
               "EAGLE-3 with its fused features: in the Thinker's pages, counted in its budget).")
    for stage, st in s.stages.items():
        if not st.draft_method:
            continue
        lab = dict(stage=stage, method=st.draft_method)
        kv.set(st.draft_kv_bytes, **lab)
        drafted.set(st.drafted, **lab)
        taken.set(st.draft_accepted, **lab)
        length.set(st.mean_accepted_length, **lab)
        for j, (d, a) in enumerate(zip(st.drafted_at, st.accepted_at)):
            at_drafted.set(d, position=str(j), **lab)
            at_taken.set(a, position=str(j), **lab)
        hist.add(st.taken_counts, **lab)
    return [drafted, taken, length, at_drafted, at_taken, hist, kv]
