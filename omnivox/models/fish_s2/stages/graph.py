"""Fish S2 Pro's stage graph: Dual-AR (slow AR + nested fast AR) -> vocoder.

Each engine step runs one batched Dual-AR step (continuous batching over the slow AR's paged
KV cache; the prefix cache keyed on whole prompt columns, so a reused reference voice skips
its prefill) and one batched vocoder step for every request with frames to decode.
"""
from __future__ import annotations

from omnivox.engine.config import EngineConfig
from omnivox.engine.events import EngineStats
from omnivox.models.fish_s2.codec import FishCodec
from omnivox.models.fish_s2.fast_ar import FastAR
from omnivox.models.fish_s2.slow_ar import SlowAR
from omnivox.models.fish_s2.stages.dual_ar import DualARStage
from omnivox.models.fish_s2.stages.request import FishRequest, SpeechPrompt, TTSOptions
from omnivox.models.fish_s2.stages.vocoder import VocoderStage


class FishStages:
    """The `stages` object the generic `Engine` drives (see `QwenStages` for the protocol)."""

    def __init__(self, slow: SlowAR, fast: FastAR, codec: FishCodec, cfg: EngineConfig):
        self.cfg = cfg
        self.ar = DualARStage(slow, fast, cfg, residual_size=codec.cfg.codebook_size)
        self.vocoder = VocoderStage(codec, cfg)
        self.active: dict[str, FishRequest] = {}

    def new_request(self, rid: str, order: int, prompt: SpeechPrompt, opts: TTSOptions, push,
                    hook=None) -> FishRequest:
        """`hook` (a Thinker text hook) has no meaning for TTS and is ignored."""
        return FishRequest(rid, order, prompt, opts, push)

    def admit(self, req: FishRequest) -> None:
        self.ar.admit(req)  # may raise CannotFit (413) or InputError (400)
        self.active[req.rid] = req
        self.vocoder.track(req)

    def has_work(self) -> bool:
        return self.ar.has_work() or self.vocoder.has_work()

    def step(self) -> list[FishRequest]:
        """One step of each stage with work; returns the requests that completed."""
        if self.ar.has_work():
            self.ar.step()
        if self.vocoder.has_work():
            self.vocoder.step()
        done = [r for r in self.active.values() if r.finished() and not r.done]
        for req in done:
            self.remove(req)
        return done

    def remove(self, req: FishRequest) -> None:
        """Free the request's pages and streaming state (finished, failed or aborted)."""
        self.ar.remove(req)
        self.vocoder.remove(req)
        req.sem_state = None
        self.active.pop(req.rid, None)

    def fill_stats(self, s: EngineStats) -> None:
        sched = self.ar.sched
        s.stages["slow_ar"] = self.ar.stats
        s.stages["fast_ar"] = self.ar.fast_stats
        s.stages["vocoder"] = self.vocoder.stats
        s.kv_pages_total["slow_ar"] = sched.alloc.num_blocks
        s.kv_pages_free["slow_ar"] = sched.alloc.num_free
        s.preemptions += sched.preemptions
        s.running += len(sched.running)
        s.waiting += len(sched.waiting)
        s.prefix_hit_tokens = sched.prefix_hit_tokens
