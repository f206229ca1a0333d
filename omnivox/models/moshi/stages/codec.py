"""Mimi at both ends of a duplex session's route: its streaming encoder as the encoder stage's
adapter (`stages/encoder.py`: one 1920-sample frame in, its codes out) and its streaming decoder
as the vocoder stage's (`stages/vocoder.py`: one frame's codes in, 1920 samples out).

Streaming state as data: each side keeps every session's state as a row of a slot pool
(`stages/slots.py`); a step gathers the rows of the sessions it encodes (decodes), runs one
batched call and scatters the advanced rows back, so sessions of any age step together and a
batch equals each session's own run.
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from omnivox.errors import InputError
from omnivox.layers.streaming_conv import BatchedState
from omnivox.models.moshi.mimi import Mimi
from omnivox.stages.encoder import EncoderAdapter
from omnivox.stages.slots import SlotPool
from omnivox.stages.vocoder import VocoderAdapter


class MimiEncoderAdapter(EncoderAdapter):
    """A session's audio reaches the encoder stage as one piece per frame: `AudioPiece.frames`
    [1, frame_size] float32 PCM at Mimi's rate, one position (`Segment.ids` of length 1); its row
    is the frame's codes [1, num_codebooks] (long)."""

    def __init__(self, mimi: Mimi, capacity: int):
        self.mimi = mimi
        self.device = next(mimi.parameters()).device
        self.frame_size = mimi.frame_size
        self.pool = SlotPool(lambda n: mimi.init_encoder_state(n, self.device), capacity)
        self._keys = itertools.count()

    def new_state(self, window: int) -> Any:
        """A session's key in the pool (its row is taken, fresh, at its first frame)."""
        return f"mimi-encoder-{next(self._keys)}"

    def check(self, frames: np.ndarray) -> None:
        if frames.shape != (1, self.frame_size) or frames.dtype != np.float32:
            raise InputError(f"a duplex frame is float32 [1, {self.frame_size}], got {frames.dtype} "
                             f"{list(frames.shape)}")

    def encode(self, pushes: list[tuple[Any, np.ndarray, bool]]) -> list[torch.Tensor]:
        """One batched call per round: the first frame of every session that sent any, then the
        second of those that sent two, ... (a session's frames in order)."""
        rounds: list[list[int]] = []
        seen: dict[Any, int] = defaultdict(int)
        for i, (key, _, _) in enumerate(pushes):
            r = seen[key]
            seen[key] += 1
            if r == len(rounds):
                rounds.append([])
            rounds[r].append(i)
        out: list[torch.Tensor | None] = [None] * len(pushes)
        for idx in rounds:
            slots = self.pool.slots([pushes[i][0] for i in idx]).to(self.device)
            state = self.pool.gather(slots)
            pcm = torch.from_numpy(np.stack([pushes[i][1] for i in idx])).to(self.device)  # [B, 1, F]
            codes = self.mimi.encode_step(pcm, state)  # [B, Q, 1]
            self.pool.scatter(slots, state)
            for b, i in enumerate(idx):
                out[i] = codes[b:b + 1, :, 0]
        return out

    def forget(self, state: Any) -> None:
        self.pool.release(state)


class MimiDecoderAdapter(VocoderAdapter):
    lead = 0

    def __init__(self, mimi: Mimi, codebooks: int):
        self.mimi = mimi
        self.device = next(mimi.parameters()).device
        self.sample_rate = mimi.cfg.sample_rate
        self.codebooks = codebooks

    def new_state(self, batch: int) -> BatchedState:
        return self.mimi.init_decoder_state(batch, self.device)

    def decode(self, codes: torch.Tensor, state: BatchedState) -> torch.Tensor:
        """codes [B, n, Q] -> [B, n * frame_size]."""
        return self.mimi.decode_step(codes.transpose(1, 2), state)[:, 0]
