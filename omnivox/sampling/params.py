"""Sampling parameters, validated at construction so bad values fail with a clear message.

Every accepted value gives a finite distribution: temperatures below `GREEDY_TEMPERATURE`
are taken as 0 (greedy, the limit of sampling as the temperature goes to 0: dividing fp32
logits by 1e-45 would overflow to inf and NaN), and the repetition penalty is bounded to
[MIN_PENALTY, MAX_PENALTY] so penalised logits stay finite.
"""
from __future__ import annotations

from dataclasses import dataclass

from omnivox.errors import InputError

GREEDY_TEMPERATURE = 1e-5  # below this, argmax
MAX_TEMPERATURE = 100.0
MIN_PENALTY, MAX_PENALTY = 0.01, 100.0


@dataclass(frozen=True)
class SamplingParams:
    """greedy=True means argmax after logits processing (repetition penalty, suppression)."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature > MAX_TEMPERATURE:
            raise InputError(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise InputError(f"top_k must be a non-negative integer, got {self.top_k}")
        if not (MIN_PENALTY <= self.repetition_penalty <= MAX_PENALTY):
            raise InputError(f"repetition_penalty must be in [{MIN_PENALTY:g}, {MAX_PENALTY:g}], "
                             f"got {self.repetition_penalty}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature < GREEDY_TEMPERATURE
