"""The AuT encoder over a growing clip: log-mel frames in as they arrive, audio embeddings out once final.

A realtime session cannot wait for the end of speech to encode: with the reference's 8 s
attention window (spec 5.3) no token is final before 8 s of audio. `AudioStreamEncoder` runs the
same encoder with a window of `window_chunks` chunks of 2 * n_window frames (1 s each for the real
model; the Qwen3-Omni report trains AuT with windows of 1 to 8 s) and, per clip:
  - embeds each chunk (conv stem, conv_out, positions) as soon as its last frame arrives;
  - runs the encoder layers and head on a window once all its chunks are in, and returns its rows;
  - on `flush` (end of the clip) embeds the partial last chunk and encodes the last, shorter window.
So while the user speaks, rows come out one window at a time; at the end only the open window
(at most `window_chunks` chunks) is left to encode.

Contract: a clip's rows, concatenated in order, are `num_audio_tokens(frames)` rows equal to
`AudioEncoder.forward([clip], window_chunks=window_chunks)` up to floating-point round-off (the
stream runs the same ops in smaller batches), whatever the sizes of the pushed pieces.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from omnivox.audio.mel import HOP_LENGTH, SAMPLE_RATE, conv_stem_len
from omnivox.models.qwen3_omni.audio_encoder import AudioEncoder
from omnivox.models.qwen3_omni.config import AudioEncoderConfig


def window_chunks_for(seconds: float, cfg: AudioEncoderConfig) -> int:
    """An attention window of about `seconds` of audio, in whole chunks (at least one)."""
    chunk_seconds = 2 * cfg.n_window * HOP_LENGTH / SAMPLE_RATE
    return max(1, round(seconds / chunk_seconds))


@dataclass
class AudioStreamState:
    """One clip's progress. frames: the open chunk's frames [n_mels, < 2 * n_window]; window: the
    embedded chunks of the open attention window, each [tokens, d_model]."""
    frames: torch.Tensor
    window: list[torch.Tensor] = field(default_factory=list)
    full_chunks: int = 0  # complete chunks embedded so far
    frames_in: int = 0
    tokens_out: int = 0
    done: bool = False


class AudioStreamEncoder:
    """Incremental, windowed AuT over one encoder's weights; the per-clip state is data. `run`
    runs its model work (`push`, `flush`) where the model's device is owned: `Engine.run` when
    serving (the engine thread), in the caller's thread by default."""

    def __init__(self, encoder: AudioEncoder, window_chunks: int | None = None,
                 run: Callable[..., Any] | None = None):
        if window_chunks is not None and window_chunks < 1:
            raise ValueError(f"window_chunks must be >= 1, got {window_chunks}")
        self.encoder = encoder
        self.run = run or (lambda fn, *args: fn(*args))
        self.window_chunks = window_chunks or encoder.chunks_per_window
        self.chunk_frames = 2 * encoder.cfg.n_window

    def new_state(self) -> AudioStreamState:
        w = self.encoder.conv2d1.weight
        return AudioStreamState(frames=w.new_zeros(self.encoder.cfg.num_mel_bins, 0))

    def push(self, state: AudioStreamState, features: torch.Tensor) -> torch.Tensor:
        """Append log-mel frames [n_mels, t] -> the rows that became final. # [n, output_dim]"""
        return self.run(self._push, state, features)

    def flush(self, state: AudioStreamState) -> torch.Tensor:
        """End of the clip: the partial last chunk and the open window. # [n, output_dim]"""
        return self.run(self._flush, state)

    @torch.no_grad()
    def _push(self, state: AudioStreamState, features: torch.Tensor) -> torch.Tensor:
        if state.done:
            raise RuntimeError("AudioStreamEncoder.push after flush")
        frames = torch.cat([state.frames, features.to(state.frames)], dim=1)  # on the encoder's device
        state.frames_in += features.shape[1]
        n_full = frames.shape[1] // self.chunk_frames
        state.frames = frames[:, n_full * self.chunk_frames:]
        if n_full == 0:
            return self.empty()
        chunks = list(frames[:, :n_full * self.chunk_frames].split(self.chunk_frames, dim=1))
        tokens = conv_stem_len(self.chunk_frames)
        state.window += list(self.encoder.embed_chunks(chunks, [tokens] * n_full).split(tokens))
        state.full_chunks += n_full
        n_windows = len(state.window) // self.window_chunks
        if n_windows == 0:
            return self.empty()
        ready = state.window[:n_windows * self.window_chunks]
        state.window = state.window[n_windows * self.window_chunks:]
        return self._encode(state, ready, [self.window_chunks * tokens] * n_windows)

    @torch.no_grad()
    def _flush(self, state: AudioStreamState) -> torch.Tensor:
        if state.done:
            raise RuntimeError("AudioStreamEncoder.flush called twice")
        state.done = True
        rest = state.frames.shape[1]
        if rest:
            chunk = state.frames
            if state.full_chunks:  # NOTE: like forward(), a short chunk is zero-padded to the longest
                chunk = torch.nn.functional.pad(chunk, (0, self.chunk_frames - rest))  # chunk of the clip
            state.window.append(self.encoder.embed_chunks([chunk], [conv_stem_len(rest)]))
            state.frames = state.frames[:, :0]
        if not state.window:
            return self.empty()
        ready, state.window = state.window, []
        return self._encode(state, ready, [sum(w.shape[0] for w in ready)])

    def _encode(self, state: AudioStreamState, chunks: list[torch.Tensor], lengths: list[int]) -> torch.Tensor:
        out = self.encoder.encode_windows(torch.cat(chunks), lengths)  # [sum(lengths), output_dim]
        state.tokens_out += out.shape[0]
        return out

    def empty(self) -> torch.Tensor:
        return self.encoder.proj2.weight.new_zeros(0, self.encoder.cfg.output_dim)
