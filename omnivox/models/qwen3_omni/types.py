"""What a Qwen3-Omni request is made of, shared by the serving path and the reference loop: the
prepared prompt (ids with one placeholder per media token, and the media) and the options."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnivox.sampling.params import SamplingParams


@dataclass
class VisualItem:
    kind: str  # "image" | "video"
    pixel_values: torch.Tensor  # [N_patches, C*tp*p*p]
    grid: tuple[int, int, int]
    second_per_grid: float = 1.0


@dataclass(frozen=True, eq=False)
class AudioFeatures:
    """A clip already through a front end: log-mel frames [n_mels, T] (e.g. a realtime session's
    causal front end, `omnivox.audio.input_stream`) and the AuT attention window to encode it with, in
    chunks (None: the model's own). `Omni.generate(prompt_ids=..., audio=[AudioFeatures(...)])`
    replays a session's turns offline through the same front end and window."""

    features: torch.Tensor  # [n_mels, T]
    window_chunks: int | None = None


@dataclass
class PreparedPrompt:
    """Token ids with one placeholder per media token, and the media in placeholder order.
    For a request with a prompt stream (`Request.stream`), `ids` are the prompt so far: the
    stream's segments extend it."""

    ids: list[int]
    audio_features: list[torch.Tensor] = field(default_factory=list)  # [n_mels, T] per clip
    audio_token_counts: list[int] = field(default_factory=list)
    audio_window_chunks: int | None = None  # the AuT attention window of every clip (None: the model's)
    visual: list[VisualItem] = field(default_factory=list)  # images and videos in prompt order


@dataclass(frozen=True)
class GenerationOptions:
    max_tokens: int = 1024
    max_frames: int = 4095
    thinker: SamplingParams = SamplingParams(greedy=True)
    talker: SamplingParams = SamplingParams(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)
    code_predictor: SamplingParams = SamplingParams(temperature=1.0, top_k=50, top_p=0.8)
    speaker_id: int | None = None
    return_audio: bool = True
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    talker_instruction_ids: tuple[int, ...] = ()  # a Talker-only user turn (voice, style)
    ignore_eos: bool = False  # benchmarks: run to the length limits (no end token, no codec EOS)
    speech_ids: tuple[int, ...] = ()  # text to speech: the Talker voices these ids; no Thinker runs
    speculative: bool = True  # False: the Thinker drafts nothing for this request
    playing: bool = False  # a listener plays its audio as it streams (serving.PLAYING)

    def thinker_stops(self, im_end: int) -> set[int]:
        return set() if self.ignore_eos else {im_end, *self.stop_token_ids}
