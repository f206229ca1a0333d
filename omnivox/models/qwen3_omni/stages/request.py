"""Per-request state shared by the Qwen3-Omni stages, and the voiced-text stream between
the Thinker and the Talker."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from omnivox.engine.events import AudioChunk, Event, Failed, Finished, TextDelta
from omnivox.engine.scheduler import Seq
from omnivox.models.qwen3_omni.pipeline import GenerationOptions, PreparedPrompt

# A text hook gets each new text delta of the Thinker (and, once, final=True with the rest)
# and returns the text to voice now: the same, a rewrite, or "" / None to withhold it.
TextHook = Callable[[str, bool], "str | None"]


@dataclass(eq=False)
class QwenRequest:
    rid: str
    order: int
    prompt: PreparedPrompt
    opts: GenerationOptions
    push: Callable[[Event], None]
    hook: TextHook | None = None
    arrival: float = field(default_factory=time.monotonic)
    want_audio: bool = False
    num_code_groups: int = 0
    gen_thinker: torch.Generator | None = None
    gen_talker: torch.Generator | None = None
    # thinker
    embeds: torch.Tensor | None = None  # [P, H] prompt embeddings, media scattered in
    visual_mask: torch.Tensor | None = None  # [P] bool
    deepstack: list[torch.Tensor] = field(default_factory=list)  # per level [N_visual, H]
    visual_index: torch.Tensor | None = None  # [P] long: row of each visual position in deepstack
    positions: torch.Tensor | None = None  # [3, P]
    delta: float = 0.0
    hk: torch.Tensor | None = None  # [P, H] accept-layer hidden states (talker input)
    hk_done: int = 0  # prompt positions whose hk is known
    thinker_seq: Seq | None = None
    text_ids: list[int] = field(default_factory=list)
    thinker_done: bool = False
    finish_reason: str = "length"
    decoder: object = None  # incremental detokenizer
    text: str = ""
    # the voiced stream (thinker ids, or the hook's re-tokenized text + an end marker)
    voiced: list[int] = field(default_factory=list)
    voiced_final: bool = False
    # talker
    talker_seq: Seq | None = None
    talker_rows: list[torch.Tensor] = field(default_factory=list)  # inputs: prefill rows then one per frame
    talker_positions: torch.Tensor | None = None  # [3, L] prefill positions
    talker_delta: float = 0.0
    talker_started: bool = False
    talker_done: bool = False
    pending_frame: torch.Tensor | None = None  # frame embedding awaiting its text input
    code_history: list[int] = field(default_factory=list)
    frames: list[list[int]] = field(default_factory=list)
    # vocoder
    voc_state: object = None
    vocoded: int = 0
    audio_samples: int = 0
    first_audio_time: float | None = None
    thinker_done_time: float | None = None
    transcript: str = ""
    transcript_decoder: object = None
    transcript_cursor: int = 0
    done: bool = False

    # ---- the voiced stream -------------------------------------------------------------
    def text_for_frame(self, s: int) -> tuple[bool, int | None, bool]:
        """(available, token, is_final) of the text input of frame s: voiced[s+1], `tts_eos`
        in place of the final token, `tts_pad` (token None) once the text is used up."""
        i = s + 1
        if i < len(self.voiced) and (i + 1 < len(self.voiced) or self.voiced_final):
            return True, self.voiced[i], self.voiced_final and i == len(self.voiced) - 1
        if self.voiced_final:
            return True, None, False
        return False, None, False

    def audio_impossible(self) -> bool:
        """The Talker needs a first token plus at least one more (the reference crashes otherwise)."""
        return self.voiced_final and len(self.voiced) < 2

    def finished(self) -> bool:
        if not self.thinker_done:
            return False
        if not self.want_audio:
            return True
        return self.talker_done and self.vocoded == len(self.frames)

    def finish_event(self, reason: str | None = None) -> Finished:
        q = self.num_code_groups
        return Finished(
            finish_reason=reason or self.finish_reason, text=self.text, text_ids=list(self.text_ids),
            codes=np.asarray(self.frames, dtype=np.int64).reshape(len(self.frames), q),
            prompt_tokens=len(self.prompt.ids), audio_seconds=self.audio_samples / 24000,
            transcript=self.transcript, arrival=self.arrival, time=time.monotonic(),
            first_audio_time=self.first_audio_time, thinker_done_time=self.thinker_done_time)

    def emit_text(self, text: str, ids: list[int]) -> None:
        self.push(TextDelta(text, ids, time.monotonic()))

    def emit_audio(self, samples: np.ndarray, frames: int, transcript: str) -> None:
        now = time.monotonic()
        if self.first_audio_time is None:
            self.first_audio_time = now
        self.audio_samples += samples.shape[0]
        self.transcript += transcript
        self.push(AudioChunk(samples, 24000, frames, transcript, now))

    def fail(self, message: str, status: int = 500) -> None:
        if not self.done:
            self.done = True
            self.push(Failed(message, status, time.monotonic()))
