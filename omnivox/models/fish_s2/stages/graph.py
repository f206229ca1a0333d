"""Fish S2 Pro's stage graph: the Dual-AR (slow AR + nested fast AR) -> the vocoder. The prefix
cache is keyed on whole prompt columns, so a reused reference voice skips its prefill."""
from __future__ import annotations

from omnivox.engine.config import EngineConfig
from omnivox.engine.graph import StageGraph
from omnivox.engine.request import FrameStream
from omnivox.kv_cache.pool import KVPool
from omnivox.models.fish_s2.codec import FishCodec
from omnivox.models.fish_s2.fast_ar import FastAR
from omnivox.models.fish_s2.slow_ar import SlowAR
from omnivox.models.fish_s2.stages.dual_ar import DualARAdapter, kv_blocks
from omnivox.models.fish_s2.stages.request import FishRequest, SpeechPrompt, TTSOptions
from omnivox.models.fish_s2.stages.vocoder import CodecAdapter
from omnivox.sampling import noise
from omnivox.stages.ar import PagedARStage
from omnivox.stages.vocoder import VocoderStage


def build(slow: SlowAR, fast: FastAR, codec: FishCodec, cfg: EngineConfig) -> StageGraph:
    t = slow.cfg.text
    pool = KVPool(t.n_layer, kv_blocks(slow, cfg), cfg.block_size, t.n_local_heads, t.head_dim,
                  slow.norm.weight.dtype, slow.norm.weight.device)
    stages = [PagedARStage("slow_ar", DualARAdapter(slow, fast, cfg, residual_size=codec.cfg.codebook_size), pool, cfg),
              VocoderStage(CodecAdapter(codec), cfg)]
    width = slow.cfg.num_codebooks

    def make_request(prompt: SpeechPrompt, opts: TTSOptions, **fields) -> FishRequest:
        """The graph's `RequestFactory` (`FishTTS.build_prompt` and `options` validated its inputs)."""
        seed = noise.draw_seed() if opts.sampling.seed is None else opts.sampling.seed
        return FishRequest(**fields, route=("slow_ar", "vocoder"), frames=FrameStream(width), text=prompt.text,
                           prompt=prompt, opts=opts, seed=seed, playing=opts.playing)

    return StageGraph(stages, make_request)


def served_graph(tts, cfg: EngineConfig) -> StageGraph:
    """A loaded model's stages under `cfg` (its engine's, and the family's `graph`: the profiling run's copy)."""
    return build(tts.slow, tts.fast, tts.codec, cfg)
