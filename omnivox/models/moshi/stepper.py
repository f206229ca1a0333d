"""One 80 ms frame of full-duplex speech for a batch of sessions: Mimi encodes each session's
1920-sample input frame, the LM steps once (text token + the model's audio codes), Mimi decodes
the rows whose output is ready. This is moshi's plain streaming loop, batched:

    with mimi.streaming(1), lm_gen.streaming(1):
        for frame in pcm:  codes = mimi.encode(frame); tokens = lm_gen.step(codes)
                           if tokens is not None: audio = mimi.decode(tokens[:, 1:])

A session's state is data (`DuplexState`, one row per session: Mimi's encoder and decoder
states and the LM's); sessions join (`DuplexState.concat`) and leave (`select`) between steps,
and each row equals its own single run. The decoder of a row advances only on its ready frames.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from omnivox.layers.streaming_conv import BatchedState
from omnivox.models.moshi.lm import LMState, MoshiLM
from omnivox.models.moshi.lm_sampling import MoshiSampler
from omnivox.models.moshi.mimi import Mimi, MimiDecoderState, MimiEncoderState


@dataclass
class DuplexState(BatchedState):
    encoder: MimiEncoderState
    lm: LMState
    decoder: MimiDecoderState


@dataclass
class DuplexFrame:
    tokens: torch.Tensor  # [B, 1 + dep_q] long: text token, the model's audio codes (-2 where not ready)
    ready: torch.Tensor  # [B] bool: the LM's output exists for this frame (False on a session's first max_delay)
    audio: torch.Tensor  # [B, frame_size] fp32: Mimi's decode of tokens[:, 1:] (zeros where not ready)


class DuplexStepper:
    def __init__(self, lm: MoshiLM, mimi: Mimi):
        self.lm, self.mimi = lm, mimi
        self.frame_size = mimi.frame_size
        self.device = lm.device

    def init_state(self, batch: int) -> DuplexState:
        """Fresh sessions at frame 0 (concat them onto a running batch to join it)."""
        return DuplexState(self.mimi.init_encoder_state(batch, self.device), self.lm.init_state(batch),
                           self.mimi.init_decoder_state(batch, self.device))

    @torch.no_grad()
    def step(self, state: DuplexState, pcm: torch.Tensor, sampler: MoshiSampler | None = None) -> DuplexFrame:
        """pcm [B, frame_size] (each session's next input frame) -> DuplexFrame; `state` advances
        one frame. sampler None: greedy; else built for these B rows, in this order."""
        b = pcm.shape[0]
        codes = self.mimi.encode_step(pcm.to(self.device, torch.float32)[:, None], state.encoder)  # [B, n_q, 1]
        out = self.lm.step(state.lm, codes[..., 0], sampler)
        audio = torch.zeros(b, self.frame_size, device=self.device)
        ready = out.ready.nonzero()[:, 0]  # NOTE: reads the device once per frame
        if ready.numel() == b:
            audio = self.mimi.decode_step(out.tokens[:, 1:, None], state.decoder)[:, 0]
        elif ready.numel():
            dec = state.decoder.select(ready)
            audio[ready] = self.mimi.decode_step(out.tokens[ready, 1:, None], dec)[:, 0]
            state.decoder.assign(ready, dec)
        return DuplexFrame(out.tokens, out.ready, audio)
