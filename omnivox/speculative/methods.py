"""The configured speculative method -> its drafter."""
from __future__ import annotations

from omnivox.engine.config import SpeculativeConfig
from omnivox.speculative.drafter import Drafter
from omnivox.speculative.ngram import NgramDrafter


def make_drafter(spec: SpeculativeConfig | None, model) -> Drafter | None:
    """The drafter of `spec` for a Qwen3-Omni model's Thinker (None: no speculation)."""
    if spec is None:
        return None
    device = model.thinker.lm_head.weight.device
    return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max, device)
