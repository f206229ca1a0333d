"""A request as the stages see it, shared by every family: its identity, the typed stream of
codec frames between its speech stage and the vocoder, what it has emitted, and the one way it
ends (`finish` or `fail`). A family's request type adds its own inputs and streams.

Requests are typed from the start: a family's graph declares a `RequestFactory` that builds
and validates its request on the caller's thread (`StageGraph.new_request`); `Engine.submit`
takes that request and only queues it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from omnivox.engine.clock import Clock
from omnivox.engine.events import AudioChunk, Event, Failed, Finished, TextDelta
from omnivox.engine.playback import PlaybackClock
from omnivox.engine.prompt import PromptStream


@dataclass(eq=False)
class FrameStream:
    """Codec frames written by a speech stage and read by the vocoder. `final`: no more will come."""

    width: int  # codebooks per frame
    frames: list[list[int]] = field(default_factory=list)
    final: bool = False

    def __len__(self) -> int:
        return len(self.frames)

    def append(self, frame: list[int]) -> None:
        self.frames.append(frame)

    def codes(self) -> np.ndarray:
        """[frames, width] int64 (one read of the list: its writer may be another loop)."""
        frames = list(self.frames)
        return np.asarray(frames, dtype=np.int64).reshape(len(frames), self.width)


def _unqueued(event: Event) -> None:
    raise RuntimeError("an event for a request nobody queued (Engine.submit sets where its events go)")


@dataclass(eq=False)
class Request:
    rid: str
    order: int  # arrival order (the schedulers' tie-break and preemption order)
    sample_rate: int  # of the audio its vocoder stage writes (0: its graph has no vocoder)
    # where its events go: set by whoever queues it (`Engine.submit`: its caller's handle)
    push: Callable[[Event], None] = field(default=_unqueued, repr=False)
    clock: Clock = field(default_factory=Clock, repr=False)  # its graph's (`StageGraph.set_clock`)
    arrival: float = -1.0  # when the engine accepted it (set from the clock at creation)
    route: tuple[str, ...] = ()  # the stages this request passes, in order (set by the family's graph)
    # a listener plays its audio as it streams (a streamed spoken reply): `--scheduling slack` paces
    # it; False: batch work nobody plays in real time (offline, non-streamed, text only), stepped for
    # throughput in the time playing streams leave (engine/slack.py). Set by the family's graph from
    # the caller's options, False for a request that does not speak.
    playing: bool = False
    frames: FrameStream = field(default_factory=lambda: FrameStream(0))
    # the tail of its prompt that still grows while it runs (a realtime turn whose user speaks);
    # the family's prompt stage absorbs it (`stages/streamed_prompt.py`). None: the prompt is whole
    stream: PromptStream | None = None
    # the same prompt after the route's encoder stage (audio encoded into rows, in order): what the
    # prompt stage absorbs. Set by the family's graph for a streamed request (None: no stream)
    encoded: PromptStream | None = None
    # what it produced
    text: str = ""
    text_ids: list[int] = field(default_factory=list)
    transcript: str = ""  # the text voiced so far
    finish_reason: str = "length"
    limit: str | None = None  # the output limit that cut it: "tokens" (text) or "audio" (frames); None: none did
    audio_samples: int = 0
    audio_frames: int = 0  # the codec frames its audio chunks completed so far
    latest: tuple[float, float] | None = None  # a live session's last chunk: (emitted, the engine's latency)
    playback: PlaybackClock = field(default_factory=PlaybackClock, repr=False)  # its listener's, as emitted
    text_done_time: float | None = None
    started: bool = False  # text or audio was pushed: its caller may be streaming it
    done: bool = False  # a final event was pushed

    def __post_init__(self) -> None:
        if self.arrival < 0:
            self.arrival = self.clock.now()

    @property
    def first_audio_time(self) -> float | None:
        return self.playback.first

    @property
    def speaks(self) -> bool:
        """Does it stream audio (its route ends in a vocoder)?"""
        return "vocoder" in self.route

    @property
    def kind(self) -> str:
        """"playing" or "batch" (`playing`; the /metrics label)."""
        return "playing" if self.playing else "batch"

    @property
    def listening(self) -> bool:
        """Is its prompt still streaming in (a realtime turn whose user speaks)?"""
        return self.stream is not None and not self.stream.closed

    @property
    def prompt_tokens(self) -> int:
        return 0

    @property
    def live(self) -> bool:
        """A full-duplex session: each output frame is due a frame after its input frame arrived
        (`frame_due`); its prompt stream stays open for its whole life, yet it speaks all along."""
        return False

    def frame_due(self, frame: int) -> float | None:
        """When output frame `frame` is due on the engine clock (`AudioChunk.due`); None: no
        deadline (a reply's chunks: its listener's slack is the playback clock's) or not known yet."""
        return None

    def emit_text(self, text: str, ids: list[int]) -> None:
        self.started = True
        self.push(TextDelta(text, ids, self.clock.now()))

    def emit_audio(self, samples: np.ndarray, frames: int, transcript: str) -> None:
        now = self.clock.now()
        self.started = True
        self.playback.on_chunk(samples.shape[0] / self.sample_rate, now)
        self.audio_samples += samples.shape[0]
        self.transcript += transcript
        due = self.frame_due(self.audio_frames)  # a chunk is due when its first frame is
        self.audio_frames += frames
        if due is not None:  # the engine's latency: since its input frame arrived, or since the previous
            came = due - samples.shape[0] / self.sample_rate / frames  # chunk if later (a backlog of the
            self.latest = (now, now - max(came, self.latest[0] if self.latest else came))  # session's own)
        self.push(AudioChunk(samples, self.sample_rate, frames, transcript, now, due))

    def finish(self, reason: str | None = None) -> None:
        """Push `Finished` (once). A reply an output limit cut ends with "length", whichever
        part the limit cut (`limit`: its text or its audio)."""
        if self.done:
            return
        self.done = True
        self.push(Finished(
            finish_reason=reason or ("length" if self.limit else self.finish_reason), limit=self.limit,
            text=self.text, text_ids=list(self.text_ids), codes=self.frames.codes(), prompt_tokens=self.prompt_tokens,
            audio_seconds=self.audio_samples / self.sample_rate if self.audio_samples else 0.0, transcript=self.transcript,
            arrival=self.arrival, time=self.clock.now(), first_audio_time=self.first_audio_time,
            text_done_time=self.text_done_time))

    def fail(self, message: str, status: int = 500, code: str | None = None) -> None:
        """Push `Failed` (once). Call it through the engine's graph (`StageGraph.fail`), which first
        frees what every stage holds for the request."""
        if not self.done:
            self.done = True
            self.push(Failed(message, status, self.clock.now(), code))


class RequestFactory(Protocol):
    """What a family's graph declares (`StageGraph(stages, factory)`): its typed request for a
    prompt and options, built and validated on the caller's thread, never under the engine's
    lock. It raises the caller's error for a request it cannot serve (InputError: a 400), sets the
    route, and takes the fields every request shares as keywords from the graph (`rid`, `order`,
    `clock`, `sample_rate`) beside the family's own (a Qwen text hook, a prompt stream, ...)."""

    def __call__(self, prompt: Any, options: Any, **fields: Any) -> Request: ...
