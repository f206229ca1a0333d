"""Moshi's sampling knobs (`LMGen`: temp, temp_text, top_k, top_k_text) over omnivox's batched
sampler and counter-based noise.

moshi draws `softmax(logits / temp)` restricted to the top k (k = 0: all) with
`torch.multinomial`-style noise; here the same distribution is drawn by Gumbel-max with
`noise.gumbel(seed, stream, step)`: stream `MOSHI_TEXT` for the text token, `moshi_audio(cb)`
for codebook cb, step = the session's frame index. So a session's draws depend only on its
seed and its own frames, never on the batch. Greedy (`use_sampling=False`, or temp <= 0 as in
moshi's `sample_token`) is exactly argmax of the fp32 logits.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from omnivox.sampling import noise
from omnivox.sampling.batched import SamplingTensors, sample
from omnivox.sampling.params import SamplingParams


@dataclass(frozen=True)
class MoshiSamplingParams:
    """One session's knobs, with `LMGen`'s defaults (a checkpoint's `lm_gen_config` may set others)."""

    use_sampling: bool = True
    temp: float = 0.8
    temp_text: float = 0.7
    top_k: int = 250
    top_k_text: int = 25

    def _params(self, temp: float, top_k: int) -> SamplingParams:
        greedy = not self.use_sampling or temp <= 0.0
        return SamplingParams(greedy=greedy, temperature=max(temp, 0.0), top_k=top_k)

    @property
    def text(self) -> SamplingParams:
        return self._params(self.temp_text, self.top_k_text)

    @property
    def audio(self) -> SamplingParams:
        return self._params(self.temp, self.top_k)


GREEDY = MoshiSamplingParams(use_sampling=False)


@dataclass
class MoshiSampler:
    """The per-row sampling tensors of a batch of sessions; rebuild it when the batch changes.

    `text(logits, step)` / `audio(logits, cb, step)`: logits [B, V], step [B] long (each row's
    frame index) -> ids [B] (-1 on a row whose logits hold NaN/inf; greedy rows never fail on
    finite logits)."""

    text_tensors: SamplingTensors
    audio_tensors: SamplingTensors

    @classmethod
    def build(cls, params: Sequence[MoshiSamplingParams], seeds: Sequence[int],
              device: torch.device | str) -> "MoshiSampler":
        zeros = [0] * len(params)
        return cls(SamplingTensors.build([p.text for p in params], seeds, zeros, device),
                   SamplingTensors.build([p.audio for p in params], seeds, zeros, device))

    @property
    def greedy(self) -> bool:
        return not (self.text_tensors.any_sampled or self.audio_tensors.any_sampled)

    def text(self, logits: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        return sample(logits, replace(self.text_tensors, step=step), noise.MOSHI_TEXT)

    def audio(self, logits: torch.Tensor, cb: int, step: torch.Tensor) -> torch.Tensor:
        return sample(logits, replace(self.audio_tensors, step=step), noise.moshi_audio(cb))
