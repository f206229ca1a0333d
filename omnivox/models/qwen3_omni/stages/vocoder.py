"""The vocoder stage: streams every request's frames through Code2Wav with its own carried
state (no overlap re-decoding, no seams). The first chunk is one frame, so audio starts as
soon as the first frame exists; later chunks take `vocoder_chunk_frames` frames (or what is
left once the Talker is done). Requests with the same chunk length are decoded in one call."""
from __future__ import annotations

from collections import defaultdict

import torch

from omnivox.engine.config import EngineConfig
from omnivox.engine.events import StageStats
from omnivox.models.qwen3_omni.code2wav import Code2WavState
from omnivox.models.qwen3_omni.model import Qwen3OmniModel
from omnivox.models.qwen3_omni.stages.request import QwenRequest


class VocoderStage:
    name = "vocoder"

    def __init__(self, model: Qwen3OmniModel, cfg: EngineConfig, tokenizer=None):
        self.model, self.cfg = model, cfg
        self.c2w = model.code2wav
        self.device = model.thinker.lm_head.weight.device
        self.reqs: dict[str, QwenRequest] = {}
        self.tokenizer = tokenizer
        self.stats = StageStats()

    def track(self, req: QwenRequest) -> None:
        self.reqs[req.rid] = req

    def _chunk(self, req: QwenRequest) -> int:
        pending = len(req.frames) - req.vocoded
        if pending <= 0:
            return 0
        if req.vocoded == 0:
            return 1
        if pending >= self.cfg.vocoder_chunk_frames:
            return self.cfg.vocoder_chunk_frames
        return pending if req.talker_done else 0

    def has_work(self) -> bool:
        return any(self._chunk(r) for r in self.reqs.values())

    @torch.no_grad()
    def step(self) -> list[QwenRequest]:
        groups: dict[tuple[int, bool], list[QwenRequest]] = defaultdict(list)
        for req in self.reqs.values():
            n = self._chunk(req)
            if n:
                groups[(n, req.vocoded == 0)].append(req)
        touched = []
        for (n, fresh), reqs in groups.items():
            self.stats.record(len(reqs))
            states = [r.voc_state if r.voc_state is not None else self.c2w.init_state(1) for r in reqs]
            state = Code2WavState.concat(states) if len(states) > 1 else states[0]
            codes = torch.tensor([r.frames[r.vocoded:r.vocoded + n] for r in reqs], device=self.device)  # [B, n, Q]
            wav = self.c2w.decode_step(codes.transpose(1, 2), state).float().cpu().numpy()  # [B, L]
            for b, req in enumerate(reqs):
                req.voc_state = state.select([b]) if len(reqs) > 1 else state
                req.vocoded += n
                req.emit_audio(wav[b], n, self._transcript(req, req.vocoded + 1))
                touched.append(req)
        return touched

    def _transcript(self, req: QwenRequest, end: int) -> str:
        """Text voiced up to these frames: frame s consumes voiced token s+1 (frame 0 also token 0).
        A cursor per request makes every voiced token appear exactly once."""
        if self.tokenizer is None:
            return ""
        if req.transcript_decoder is None:
            req.transcript_decoder = self.tokenizer.incremental_decoder()
        end = min(end, len(req.voiced) - 1)  # the last voiced entry is never fed (tts_eos replaces it)
        text = "".join(req.transcript_decoder.push(t) for t in req.voiced[req.transcript_cursor:end])
        req.transcript_cursor = max(req.transcript_cursor, end)
        if req.talker_done and req.vocoded == len(req.frames):
            text += req.transcript_decoder.flush()
        return text

    def remove(self, req: QwenRequest) -> None:
        self.reqs.pop(req.rid, None)
        req.voc_state = None
