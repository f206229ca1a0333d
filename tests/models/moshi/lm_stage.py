"""The LM stage alone on a stage graph (no Mimi, no engine thread): a test feeds each session's
user codes one frame at a time, as the encoder stage would, and steps the graph; a session's
per-frame outputs are what LMGen.step returns (None on its first max_delay frames)."""
from __future__ import annotations

import numpy as np
import torch

from omnivox.engine.config import EngineConfig
from omnivox.engine.graph import StageGraph
from omnivox.engine.prompt import PromptStream, Segment
from omnivox.engine.request import FrameStream
from omnivox.kv_cache.pool import KVPool
from omnivox.models.moshi.lm import MoshiLM
from omnivox.models.moshi.lm_sampling import GREEDY, MoshiSamplingParams
from omnivox.models.moshi.stages.graph import SessionOptions
from omnivox.models.moshi.stages.lm import MoshiLMAdapter
from omnivox.models.moshi.stages.request import DuplexRequest
from omnivox.stages.ar import PagedARStage


class _NoText:
    def piece(self, token: int) -> str:
        return ""


class LMStage:
    def __init__(self, lm: MoshiLM, block_size: int = 4, pages: int = 64):
        t = lm.cfg.transformer
        per = KVPool.bytes_per_block(t.num_layers, block_size, t.kv_heads, t.head_dim, lm.dtype)
        cfg = EngineConfig(cuda_graphs="off", block_size=block_size, kv_cache_mb=pages * per / 2**20)
        pool = KVPool(t.num_layers, pages, block_size, t.kv_heads, t.head_dim, lm.dtype, lm.device)
        self.stage = PagedARStage("lm", MoshiLMAdapter(lm, _NoText(), cfg), pool, cfg)
        self.max_delay = lm.cfg.max_delay
        dep_q = lm.cfg.dep_q

        def make(prompt, opts: SessionOptions, **fields) -> DuplexRequest:
            return DuplexRequest(**fields, route=("lm",), frames=FrameStream(dep_q), stream=PromptStream(),
                                 encoded=PromptStream(), params=opts.params, seed=opts.seed,
                                 max_frames=opts.max_frames)

        self.graph = StageGraph([self.stage], make)
        self.events: list = []

    def open(self, params: MoshiSamplingParams = GREEDY, seed: int = 0) -> DuplexRequest:
        req = self.graph.new_request(None, SessionOptions(params, seed, 200))
        req.push = self.events.append
        self.graph.admit(req, gate=False)
        return req

    def push(self, req: DuplexRequest, codes: torch.Tensor) -> None:
        """One frame's user codes [>= user_q] (extra codebooks are ignored, as LMGen does)."""
        req.user.append(np.asarray(codes, dtype=np.int64)[None])
        req.encoded.extend([Segment([0])])

    def step(self) -> list[DuplexRequest]:
        return self.graph.step()

    def outputs(self, req: DuplexRequest) -> list[torch.Tensor | None]:
        """Per input frame so far: None (not ready) or [1 + dep_q] (text, then the model's codes)."""
        made = [torch.tensor([t, *f]) for t, f in zip(req.text_ids, req.frames.frames)]
        return [None] * min(self.max_delay, len(req.user.codes)) + made

    def run(self, codes: torch.Tensor, params: MoshiSamplingParams = GREEDY, seed: int = 0) -> list:
        """One session over codes [T, >= user_q], a frame per step -> its outputs per frame."""
        req = self.open(params, seed)
        for t in range(codes.shape[0]):
            self.push(req, codes[t])
            self.step()
        req.encoded.close()
        self.step()  # takes the end: the session finishes
        assert req.rid not in self.graph.active, self.events[-1:]
        return self.outputs(req)
