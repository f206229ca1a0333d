"""Moshi's stage graph: a duplex session's route is encoder (Mimi's encoder) -> lm (the temporal
transformer and the depformer) -> vocoder (Mimi's decoder), all in one engine step, lockstep: a
frame in at the encoder, the LM's frame and the vocoder's audio out in the same step."""
from __future__ import annotations

from dataclasses import dataclass

from omnivox.engine.config import EngineConfig
from omnivox.engine.graph import StageGraph
from omnivox.engine.prompt import PromptStream
from omnivox.engine.request import FrameStream
from omnivox.kv_cache.pool import KVPool
from omnivox.models.moshi.lm import MoshiLM
from omnivox.models.moshi.lm_sampling import MoshiSamplingParams
from omnivox.models.moshi.mimi import Mimi
from omnivox.models.moshi.stages.codec import MimiDecoderAdapter, MimiEncoderAdapter
from omnivox.models.moshi.stages.lm import MoshiLMAdapter
from omnivox.models.moshi.stages.request import DuplexRequest
from omnivox.models.moshi.tokenizer import MoshiTokenizer
from omnivox.stages.ar import PagedARStage
from omnivox.stages.encoder import EncoderStage
from omnivox.stages.vocoder import VocoderStage


@dataclass(frozen=True)
class SessionOptions:
    params: MoshiSamplingParams
    seed: int
    max_frames: int


def kv_blocks(lm: MoshiLM, cfg: EngineConfig) -> int:
    """The LM's pages in `kv_cache_mb`."""
    t = lm.cfg.transformer
    per = KVPool.bytes_per_block(t.num_layers, cfg.block_size, t.kv_heads, t.head_dim, lm.dtype)
    return max(1, int(cfg.kv_cache_mb * 2**20 // per))


def build(lm: MoshiLM, mimi: Mimi, tokenizer: MoshiTokenizer, cfg: EngineConfig) -> StageGraph:
    t, dep_q = lm.cfg.transformer, lm.cfg.dep_q
    frame_s = mimi.frame_size / mimi.cfg.sample_rate
    pool = KVPool(t.num_layers, kv_blocks(lm, cfg), cfg.block_size, t.kv_heads, t.head_dim, lm.dtype, lm.device)
    stages = [EncoderStage(MimiEncoderAdapter(mimi, cfg.max_running)),
              PagedARStage("lm", MoshiLMAdapter(lm, tokenizer, cfg), pool, cfg),
              VocoderStage(MimiDecoderAdapter(mimi, dep_q), cfg)]

    def make_request(prompt: None, opts: SessionOptions, *, stream: PromptStream, playing: bool = True,
                     **fields) -> DuplexRequest:
        """The graph's `RequestFactory`: a session whose input is `stream` (one segment per frame);
        `playing`: live (False: an offline session, batch work)."""
        return DuplexRequest(**fields, route=("encoder", "lm", "vocoder"), frames=FrameStream(dep_q), stream=stream,
                             encoded=PromptStream(), playing=playing, params=opts.params, seed=opts.seed,
                             max_frames=opts.max_frames, delay=lm.cfg.max_delay, frame_s=frame_s)

    return StageGraph(stages, make_request)


def served_graph(served, cfg: EngineConfig) -> StageGraph:
    """A loaded model's stages under `cfg` (its engine's, and the family's `graph`: the profiling run's copy)."""
    return build(served.lm, served.mimi, served.tokenizer, cfg)
