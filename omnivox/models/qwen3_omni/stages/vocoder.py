"""Code2Wav as the vocoder stage's adapter; its transcript follows the voiced stream."""
from __future__ import annotations

import torch

from omnivox.engine.request import Request
from omnivox.layers.streaming_conv import BatchedState
from omnivox.models.qwen3_omni.code2wav import SAMPLE_RATE
from omnivox.models.qwen3_omni.model import Qwen3OmniModel
from omnivox.models.qwen3_omni.stages.request import QwenRequest
from omnivox.stages.vocoder import VocoderAdapter


class Code2WavAdapter(VocoderAdapter):
    sample_rate = SAMPLE_RATE

    def __init__(self, model: Qwen3OmniModel, tokenizer=None):
        self.c2w = model.code2wav
        self.device = model.device_of("vocoder")
        self.codebooks = model.cfg.code2wav.num_quantizers
        self.lead = self.c2w.trim  # 555 samples: a fresh stream's transposed convs look ahead
        self.tokenizer = tokenizer
        self.cursor: dict[str, tuple[object, int]] = {}  # rid -> (incremental decoder, voiced ids reported)

    def new_state(self, batch: int) -> BatchedState:
        return self.c2w.init_state(batch)

    def decode(self, codes: torch.Tensor, state: BatchedState) -> torch.Tensor:
        return self.c2w.decode_step_padded(codes.transpose(1, 2), state)[0]

    def transcript(self, req: QwenRequest, frames: int) -> str:
        """Text voiced by the first `frames` frames: frame s consumes voiced token s+1 (frame 0 also
        token 0); a cursor per request makes every voiced token appear exactly once."""
        if self.tokenizer is None:
            return ""
        decoder, cursor = self.cursor.get(req.rid) or (self.tokenizer.incremental_decoder(), 0)
        end = min(frames + 1, len(req.voiced.ids) - 1)  # the last voiced entry is never fed (tts_eos replaces it)
        text = "".join(decoder.push(t) for t in req.voiced.ids[cursor:end])
        self.cursor[req.rid] = (decoder, max(cursor, end))
        if req.frames.final and frames == len(req.frames):
            text += decoder.flush()
        return text

    def forget(self, req: Request) -> None:
        self.cursor.pop(req.rid, None)
