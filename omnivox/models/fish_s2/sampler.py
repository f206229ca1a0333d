"""S2's sampling parameters (spec 10): fish-speech behaviour by default, SGLang-Omni 0.1.9
selectable (`mode`). The rules themselves, batched on counter noise, are
`omnivox.sampling.fish_rules`, shared by the engine and the reference loop."""
from __future__ import annotations

from dataclasses import dataclass

from omnivox.errors import InputError
from omnivox.sampling.params import GREEDY_TEMPERATURE

MODES = ("fish", "sglang")
SGL_TOPK_WIDTH = 30


@dataclass(frozen=True)
class FishSamplingParams:
    temperature: float = 0.8
    top_p: float = 0.8
    top_k: int = 30
    mode: str = "fish"
    seed: int | None = None
    ras_window: int = 10  # fish: last-N window
    ras_temperature: float = 1.0
    ras_top_p: float = 0.9
    sgl_ras_window: int = 4  # sglang: duplicate among the last N
    repetition_penalty: float = 1.1  # sglang only (fish accepts and ignores it)
    penalty_window: int = 16
    greedy_residual: bool | None = None  # None: fish samples, sglang argmax
    mask_residual_overflow: bool = False  # opt-in deviation: forbid residual codes >= codec size

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"sampling mode must be one of {MODES}, got {self.mode!r}")
        if not (0.0 <= self.temperature <= 100):
            raise InputError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise InputError(f"top_k must be a non-negative integer (0 = off), got {self.top_k}")
        if self.mode == "sglang" and self.top_k > SGL_TOPK_WIDTH:
            raise InputError(f"sglang mode supports top_k <= {SGL_TOPK_WIDTH}, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        """A temperature below GREEDY_TEMPERATURE (0 included) is greedy in both ARs: the argmax of
        the constrained (and, in sglang mode, penalised) logits, no RAS, residual codes by argmax."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def residual_is_greedy(self) -> bool:
        if self.greedy:
            return True
        return self.mode == "sglang" if self.greedy_residual is None else self.greedy_residual
