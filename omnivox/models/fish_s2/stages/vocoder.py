"""S2's causal codec decoder as the vocoder stage's adapter (44.1 kHz; no look-ahead)."""
from __future__ import annotations

import torch

from omnivox.engine.request import Request
from omnivox.layers.streaming_conv import BatchedState
from omnivox.models.fish_s2.codec import FishCodec
from omnivox.models.fish_s2.stages.request import FishRequest
from omnivox.stages.vocoder import VocoderAdapter


class CodecAdapter(VocoderAdapter):
    lead = 0

    def __init__(self, codec: FishCodec):
        self.codec = codec
        p = next(codec.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.sample_rate = codec.cfg.sample_rate
        self.codebooks = codec.cfg.num_codebooks
        self.reported: set[str] = set()

    def new_state(self, batch: int) -> BatchedState:
        return self.codec.init_stream(batch, self.device, self.dtype)

    def decode(self, codes: torch.Tensor, state: BatchedState) -> torch.Tensor:
        return self.codec.decode_step(codes.transpose(1, 2), state)[:, 0]  # [B, hop * n]

    def transcript(self, req: FishRequest, frames: int) -> str:
        """The whole text with the first chunk (S2 has no alignment)."""
        if req.rid in self.reported:
            return ""
        self.reported.add(req.rid)
        return req.prompt.text

    def forget(self, req: Request) -> None:
        self.reported.discard(req.rid)
