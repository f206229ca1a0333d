"""Sampling parameters, validated at construction so bad values fail with a clear message."""
from __future__ import annotations

from dataclasses import dataclass

from omnivox.errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """greedy=True means argmax after logits processing (repetition penalty, suppression)."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature > 100:
            raise InputError(f"temperature must be between 0 and 100, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise InputError(f"top_k must be a non-negative integer, got {self.top_k}")
        if not (self.repetition_penalty > 0.0) or self.repetition_penalty > 100:
            raise InputError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0
