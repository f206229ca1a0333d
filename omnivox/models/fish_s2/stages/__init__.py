"""Fish S2 Pro on the engine's stages: the Dual-AR (slow AR with the fast AR nested in its step)
as an adapter of the paged AR stage, the codec as the vocoder's adapter (`graph.build`)."""
from omnivox.models.fish_s2.stages.request import SAMPLE_RATE, FishRequest, SpeechPrompt, TTSOptions

__all__ = ["FishRequest", "SpeechPrompt", "TTSOptions", "SAMPLE_RATE"]
