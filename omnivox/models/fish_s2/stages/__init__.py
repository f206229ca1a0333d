"""Fish S2 Pro as engine stages: Dual-AR (slow AR + per-frame fast AR) -> streaming codec."""
from omnivox.models.fish_s2.stages.graph import FishStages
from omnivox.models.fish_s2.stages.request import SAMPLE_RATE, FishRequest, SpeechPrompt, TTSOptions

__all__ = ["FishStages", "FishRequest", "SpeechPrompt", "TTSOptions", "SAMPLE_RATE"]
