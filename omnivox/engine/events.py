"""What a request yields while it runs: text deltas, audio chunks, then one final event.

Times are the engine clock's seconds (`engine/clock.py`: `time.monotonic()` when serving);
`arrival` is when the engine accepted the request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class TextDelta:
    text: str  # newly printable text of the Thinker's reply
    token_ids: list[int]
    time: float


@dataclass
class AudioChunk:
    samples: np.ndarray  # float32, mono
    sample_rate: int
    frames: int  # codec frames this chunk completes
    transcript: str  # the text voiced since the previous chunk (what the Talker was fed)
    time: float
    # a live (duplex) session's frame: when it was due, its input frame's arrival + one frame
    # (`DuplexModel`); None for a reply's chunk (its listener's slack is the playback clock's)
    due: float | None = None


@dataclass
class Finished:
    finish_reason: str  # "stop" | "length" | "abort"
    text: str
    text_ids: list[int]
    codes: np.ndarray  # [frames, num_code_groups]
    prompt_tokens: int
    audio_seconds: float
    transcript: str  # all text its speech stage voiced
    arrival: float
    time: float
    first_audio_time: float | None = None
    text_done_time: float | None = None  # when its text was complete (its text stage ended it)
    limit: str | None = None  # with finish_reason "length": the limit that cut it, "tokens" (text) or "audio"


@dataclass
class Failed:
    message: str
    status: int = 500  # HTTP-like: 400 bad input, 413 too large for the cache, 500 internal
    time: float = 0.0
    code: str | None = None  # machine-readable, e.g. "engine_failed" (the engine stopped for good)


Event = TextDelta | AudioChunk | Finished | Failed


@dataclass
class StageStats:
    steps: int = 0
    max_batch: int = 0
    total_batched: int = 0  # sum of requests over steps (mean = total_batched / steps)
    drafted: int = 0  # speculative decoding: ids drafted
    draft_accepted: int = 0  # drafted ids the model's own draws confirmed
    verified: int = 0  # rows that verified drafts (each took 1 + its confirmed drafts)
    draft_method: str = ""  # the speculative method ("ngram", "dflash", "eagle3"); "" without speculation
    draft_kv_bytes: int = 0  # the drafter's own KV cache (DFlash: in the Thinker's pages)
    taken_counts: list[int] = field(default_factory=list)  # [n]: verifying rows that took n tokens (1 + confirmed)
    drafted_at: list[int] = field(default_factory=list)  # [j]: drafts proposed at draft position j
    accepted_at: list[int] = field(default_factory=list)  # [j]: drafts confirmed at draft position j

    @property
    def mean_batch(self) -> float:
        return self.total_batched / self.steps if self.steps else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a row with drafts took per step (1 + its confirmed drafts), on average."""
        return 1 + self.draft_accepted / self.verified if self.verified else 0.0

    def record_draft(self, drafted: int, accepted: int) -> None:
        """A row verified `drafted` ids and took `accepted` tokens (its first draw and the confirmed drafts)."""
        confirmed = max(0, accepted - 1)
        self.drafted += drafted
        self.draft_accepted += confirmed
        self.verified += 1
        for counts, n in ((self.taken_counts, accepted + 1), (self.drafted_at, drafted), (self.accepted_at, drafted)):
            counts.extend([0] * (n - len(counts)))
        self.taken_counts[accepted] += 1
        for j in range(drafted):
            self.drafted_at[j] += 1
            self.accepted_at[j] += j < confirmed

    def record(self, n: int) -> None:
        self.steps += 1
        self.total_batched += n
        self.max_batch = max(self.max_batch, n)


@dataclass
class EngineStats:
    stages: dict[str, StageStats] = field(default_factory=dict)
    kv_pages_total: dict[str, int] = field(default_factory=dict)
    kv_pages_free: dict[str, int] = field(default_factory=dict)
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    running: int = 0
    waiting: int = 0
    waiting_capacity: int = 0  # of `waiting`: queued until the engine can make their audio in time (slack)
    # the most live (full-duplex) sessions whose frames stay in time, as slack measures it (`LiveCapacity.
    # capacity`, engine/live.py); None: not measured yet, or not slack scheduling
    live_capacity: int | None = None
    running_by_kind: dict[str, int] = field(default_factory=dict)  # `running` and `waiting` per kind:
    waiting_by_kind: dict[str, int] = field(default_factory=dict)  # "playing" | "batch" (`Request.kind`)
    finished: int = 0
    aborted: int = 0
    in_flight: int = 0
