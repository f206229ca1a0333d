"""Qwen3-Omni's stage graph: encode+think -> talk (code predictor per step) -> vocode.

Each engine step runs one batched step of every stage that has work. The Thinker and the
Talker are independent loops joined by the voiced-text stream: the Talker admits a request
as soon as its prefill inputs exist and waits for the Thinker only when it needs a token
that does not exist yet.
"""
from __future__ import annotations

import time

from omnivox.engine.config import EngineConfig
from omnivox.engine.events import EngineStats
from omnivox.kv_cache.pool import KVPool
from omnivox.models.qwen3_omni.model import Qwen3OmniModel
from omnivox.models.qwen3_omni.pipeline import GenerationOptions, PreparedPrompt
from omnivox.models.qwen3_omni.stages.request import QwenRequest, TextHook
from omnivox.models.qwen3_omni.stages.talker import TalkerStage
from omnivox.models.qwen3_omni.stages.thinker import ThinkerStage
from omnivox.models.qwen3_omni.stages.vocoder import VocoderStage
from omnivox.sampling.sampler import request_generators


def split_kv_budget(model: Qwen3OmniModel, cfg: EngineConfig) -> tuple[int, int]:
    """KV pages for (Thinker, Talker) from the memory budget: half of the bytes each."""
    dtype = model.thinker.lm_head.weight.dtype
    th, budget = model.cfg.thinker.text, cfg.kv_cache_mb * 2**20
    per_th = KVPool.bytes_per_block(th.num_hidden_layers, cfg.block_size, th.num_key_value_heads, th.head_dim, dtype)
    if not model.cfg.has_audio_output:
        return max(1, int(budget // per_th)), 0
    tk = model.cfg.talker.text
    per_tk = KVPool.bytes_per_block(tk.num_hidden_layers, cfg.block_size, tk.num_key_value_heads, tk.head_dim, dtype)
    return max(1, int(budget / 2 // per_th)), max(1, int(budget / 2 // per_tk))


class QwenStages:
    def __init__(self, model: Qwen3OmniModel, cfg: EngineConfig, tokenizer=None):
        self.model, self.cfg, self.tokenizer = model, cfg, tokenizer
        th_blocks, tk_blocks = split_kv_budget(model, cfg)
        self.thinker = ThinkerStage(model, cfg, th_blocks, tokenizer)
        self.talker = TalkerStage(model, cfg, tk_blocks) if model.cfg.has_audio_output else None
        self.vocoder = VocoderStage(model, cfg, tokenizer) if model.cfg.has_audio_output else None
        self.active: dict[str, QwenRequest] = {}

    def new_request(self, rid: str, order: int, prompt: PreparedPrompt, opts: GenerationOptions, push,
                    hook: TextHook | None) -> QwenRequest:
        req = QwenRequest(rid, order, prompt, opts, push, hook=hook,
                          want_audio=opts.return_audio and self.model.cfg.has_audio_output,
                          num_code_groups=self.model.cfg.talker.num_code_groups if self.model.cfg.has_audio_output else 0)
        req.gen_thinker, req.gen_talker = request_generators(opts.seed, self.thinker.device)
        if self.tokenizer is not None:
            req.decoder = self.tokenizer.incremental_decoder()
        return req

    def admit(self, req: QwenRequest) -> None:
        self.thinker.admit(req)
        self.active[req.rid] = req
        if req.want_audio:
            self.vocoder.track(req)

    def has_work(self) -> bool:
        return self.thinker.has_work() or (self.talker is not None and (self.talker.has_work() or self.vocoder.has_work()))

    def step(self) -> list[QwenRequest]:
        """One step of every stage with work; returns the requests that completed."""
        if self.thinker.has_work():
            for req in self.thinker.step():
                req.thinker_done_time = req.thinker_done_time or time.monotonic()
            for req, message in self.thinker.failed:
                self.remove(req)
                req.fail(message, 400)
            self.thinker.failed.clear()
        if self.talker is not None:
            for req in list(self.active.values()):
                if req.want_audio and not req.done:
                    try:
                        self.talker.try_admit(req)
                        self.talker.feed_text(req)
                    except Exception as e:  # one bad request must not take the others down
                        self.remove(req)
                        status = 413 if type(e).__name__ == "CannotFit" else 500
                        req.fail(f"talker: {e}", status)
            if self.talker.has_work():
                self.talker.step()
            for req, message in self.talker.failed:
                self.remove(req)
                req.fail(message, 400)
            self.talker.failed.clear()
            if self.vocoder.has_work():
                self.vocoder.step()
        done = [r for r in self.active.values() if r.finished() and not r.done]
        for req in done:
            self.remove(req)
        return done

    def remove(self, req: QwenRequest) -> None:
        """Free every stage's pages and state of a request (finished or aborted)."""
        self.thinker.remove(req)
        if self.talker is not None:
            self.talker.remove(req)
            self.vocoder.remove(req)
        self.active.pop(req.rid, None)

    def fill_stats(self, s: EngineStats) -> None:
        s.stages["encode"] = self.thinker.encode_stats
        s.stages["thinker"] = self.thinker.stats
        pools = {"thinker": self.thinker.sched}
        if self.talker is not None:
            s.stages["talker"] = self.talker.stats
            s.stages["code_predictor"] = self.talker.cp_stats
            s.stages["vocoder"] = self.vocoder.stats
            pools["talker"] = self.talker.sched
        for name, sched in pools.items():
            s.kv_pages_total[name] = sched.alloc.num_blocks
            s.kv_pages_free[name] = sched.alloc.num_free
            s.preemptions += sched.preemptions
            s.running += len(sched.running) if name == "thinker" else 0
            s.waiting += len(sched.waiting) if name == "thinker" else 0
        s.prefix_hit_tokens = self.thinker.sched.prefix_hit_tokens
