"""Per-request state shared by the Fish S2 stages (Dual-AR, then vocoder)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from omnivox.engine.events import AudioChunk, Event, Failed, Finished
from omnivox.engine.scheduler import Seq
from omnivox.models.fish_s2.sampler import FishSamplingParams, SemanticState

SAMPLE_RATE = 44100


@dataclass(frozen=True)
class SpeechPrompt:
    """What `FishTTS.prepare` hands the engine: the text and its exact prompt matrix."""

    text: str
    matrix: torch.Tensor  # [1 + num_codebooks, T] long (prompt.build_prompt)

    @property
    def length(self) -> int:
        return int(self.matrix.shape[1])


@dataclass(frozen=True)
class TTSOptions:
    sampling: FishSamplingParams = field(default_factory=FishSamplingParams)
    max_frames: int = 1024  # codec frames (21.5 per second); clipped to the context left
    ignore_eos: bool = False  # benchmarks: never stop on <|im_end|>, run to max_frames


@dataclass(eq=False)
class FishRequest:
    rid: str
    order: int
    prompt: SpeechPrompt
    opts: TTSOptions
    push: Callable[[Event], None]
    arrival: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None  # semantic and residual draws of this request only
    sem_state: SemanticState | None = None  # [1, ...] rows: RAS window, history, step count
    budget: int = 0  # frames this request may emit
    # dual AR
    seq: Seq | None = None
    frames: list[list[int]] = field(default_factory=list)  # emitted frames, [num_codebooks] each
    ar_done: bool = False
    finish_reason: str = "length"
    ar_done_time: float | None = None
    # vocoder
    voc_state: object = None
    vocoded: int = 0
    audio_samples: int = 0
    first_audio_time: float | None = None
    done: bool = False

    def columns(self, a: int, b: int, semantic_begin: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slow-AR inputs of positions [a, b): ids [n] and codes [n, num_codebooks]. The prompt's
        columns, then one column per emitted frame (token semantic_begin + c0, codes c0..)."""
        T = self.prompt.length
        m = self.prompt.matrix
        ids, codes = [m[0, a:min(b, T)]], [m[1:, a:min(b, T)].T]
        if b > T:
            fr = torch.tensor(self.frames[max(a, T) - T:b - T], dtype=torch.long)  # [n, N]
            ids.append(fr[:, 0] + semantic_begin)
            codes.append(fr)
        return torch.cat(ids), torch.cat(codes)

    def finished(self) -> bool:
        return self.ar_done and self.vocoded == len(self.frames)

    def finish_event(self, reason: str | None = None) -> Finished:
        n = self.prompt.matrix.shape[0] - 1
        return Finished(
            finish_reason=reason or self.finish_reason, text=self.prompt.text, text_ids=[],
            codes=np.asarray(self.frames, dtype=np.int64).reshape(len(self.frames), n),
            prompt_tokens=self.prompt.length, audio_seconds=self.audio_samples / SAMPLE_RATE,
            transcript=self.prompt.text, arrival=self.arrival, time=time.monotonic(),
            first_audio_time=self.first_audio_time, thinker_done_time=self.ar_done_time)

    def emit_audio(self, samples: np.ndarray, frames: int) -> None:
        """The whole text is reported as the transcript of the first chunk (S2 has no alignment)."""
        now = time.monotonic()
        transcript = self.prompt.text if self.first_audio_time is None else ""
        if self.first_audio_time is None:
            self.first_audio_time = now
        self.audio_samples += samples.shape[0]
        self.push(AudioChunk(samples, SAMPLE_RATE, frames, transcript, now))

    def fail(self, message: str, status: int = 500) -> None:
        if not self.done:
            self.done = True
            self.push(Failed(message, status, time.monotonic()))
