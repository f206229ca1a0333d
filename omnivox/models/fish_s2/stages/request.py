"""A Fish S2 request in the engine: the prompt matrix, its options, and its seed."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnivox.engine.request import Request
from omnivox.models.fish_s2.sampler import FishSamplingParams

SAMPLE_RATE = 44100


@dataclass(frozen=True)
class SpeechPrompt:
    """What `FishTTS.build_prompt` hands the engine: the text and its exact prompt matrix."""

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
    playing: bool = False  # a listener plays its audio as it streams (serving.PLAYING)


@dataclass(eq=False)
class FishRequest(Request):
    prompt: SpeechPrompt = None
    opts: TTSOptions = None
    seed: int = 0  # every draw's noise is keyed on it

    @property
    def prompt_tokens(self) -> int:
        return self.prompt.length

    def finish(self, reason: str | None = None) -> None:
        self.transcript = self.prompt.text  # S2 voices the whole text (no alignment to report)
        super().finish(reason)

    def columns(self, a: int, b: int, semantic_begin: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slow-AR inputs of positions [a, b): ids [n] and codes [n, num_codebooks]. The prompt's
        columns, then one column per emitted frame (token semantic_begin + c0, codes c0..)."""
        T = self.prompt.length
        m = self.prompt.matrix
        ids, codes = [m[0, a:min(b, T)]], [m[1:, a:min(b, T)].T]
        if b > T:
            fr = torch.tensor(self.frames.frames[max(a, T) - T:b - T], dtype=torch.long)  # [n, N]
            ids.append(fr[:, 0] + semantic_begin)
            codes.append(fr)
        return torch.cat(ids), torch.cat(codes)
