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

Served, the model work is the encoder stage's (stages/encoder.py, the front of a listening
request's route): `AudioStreamBatch` is its adapter, each request's clip states are its data, and
one step encodes every request's new pieces together: one `embed_chunks` call
over all their new chunks (one per chunk length: a clip shorter than a chunk keeps its own length),
one `encode_windows` call over all their complete windows. The encoder's attention is
block-diagonal by window, so a session's rows do not depend on who shared its step (up to
round-off). A clip's state (`AudioStreamState`) carries its own window size, so sessions with
different windows batch too.

Contract: a clip's rows, concatenated in order, are `num_audio_tokens(frames)` rows equal to
`AudioEncoder.forward([clip], window_chunks=window_chunks)` up to floating-point round-off (the
stream runs the same ops in other batches), whatever the sizes of the pushed pieces.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from omnivox.audio.mel import HOP_LENGTH, SAMPLE_RATE, conv_stem_len
from omnivox.models.qwen3_omni.audio_encoder import AudioEncoder
from omnivox.models.qwen3_omni.config import AudioEncoderConfig
from omnivox.errors import InputError
from omnivox.stages.encoder import EncoderAdapter


def window_chunks_for(seconds: float, cfg: AudioEncoderConfig) -> int:
    """An attention window of about `seconds` of audio, in whole chunks (at least one)."""
    chunk_seconds = 2 * cfg.n_window * HOP_LENGTH / SAMPLE_RATE
    return max(1, round(seconds / chunk_seconds))


@dataclass
class AudioStreamState:
    """One clip's progress. frames: the open chunk's frames [n_mels, < 2 * n_window]; window: the
    embedded chunks of the open attention window, each [tokens, d_model]."""
    frames: torch.Tensor
    window_chunks: int  # the clip's attention window, in chunks
    window: list[torch.Tensor] = field(default_factory=list)
    full_chunks: int = 0  # complete chunks embedded so far
    frames_in: int = 0
    tokens_out: int = 0
    done: bool = False


@dataclass
class AudioPush:
    """One piece: frames [n_mels, t] (host or device) appended to a clip; `final` ends the clip (flush)."""
    state: AudioStreamState
    features: torch.Tensor | np.ndarray
    final: bool = False


@dataclass(frozen=True)
class AudioWindow:
    """What the host side of a realtime session knows of the AuT (no tensors): the window, the
    chunk, and how many rows a clip's frames make final. Pure arithmetic equal to the stream's."""
    window_chunks: int  # the clip's attention window, in chunks
    chunk_frames: int  # log-mel frames per chunk (2 * n_window)

    def rows(self, frames: int, final: bool) -> int:
        """Rows final after `frames` frames of a clip (`final`: after the clip's end)."""
        full, rest = divmod(frames, self.chunk_frames)
        if not final:
            return full // self.window_chunks * self.window_chunks * conv_stem_len(self.chunk_frames)
        return full * conv_stem_len(self.chunk_frames) + (conv_stem_len(rest) if rest else 0)


@dataclass(frozen=True)
class AudioStreamBatch(EncoderAdapter):
    """Every clip's pushes of one step through one AuT, batched (the encoder stage's adapter).
    Equal for the same encoder, so every window size's clips batch together."""
    encoder: AudioEncoder

    @property
    def chunk_frames(self) -> int:
        return 2 * self.encoder.cfg.n_window

    @property
    def device(self) -> torch.device:
        return self.encoder.conv2d1.weight.device

    def new_state(self, window_chunks: int | None = None) -> AudioStreamState:
        enc = self.encoder
        return AudioStreamState(frames=enc.conv2d1.weight.new_zeros(enc.cfg.num_mel_bins, 0),
                                window_chunks=window_chunks or enc.chunks_per_window)

    def check(self, frames) -> None:
        n_mels = self.encoder.cfg.num_mel_bins
        if frames.ndim != 2 or frames.shape[0] != n_mels:  # here: it would fail the whole batch
            raise InputError(f"audio input must be [{n_mels}, t] log-mel frames, got {tuple(frames.shape)}")

    def encode(self, pushes: list) -> list[torch.Tensor]:
        """The encoder stage's call: (state, frames, final) pieces -> their rows."""
        return self.encode_pushes([AudioPush(st, f, final) for st, f, final in pushes])

    @torch.no_grad()
    def encode_pushes(self, items: list[AudioPush]) -> list[torch.Tensor]:
        """Each push's final rows [n, output_dim], in order. A clip pushed twice in one step is
        encoded in two rounds, in the order it came. `AudioStreamEncoder` checks each push before
        it is queued: an exception here (a bug, the device) fails the whole step's pushes."""
        out: list[torch.Tensor | None] = [None] * len(items)
        for batch in _rounds(items):
            for i, rows in zip(batch, self._round([items[i] for i in batch])):
                out[i] = rows
        return out

    def _round(self, pushes: list[AudioPush]) -> list[torch.Tensor]:
        """Pushes of distinct clips: new chunks embedded together, complete windows encoded together."""
        if any(p.state.done for p in pushes):
            raise RuntimeError("AudioStreamEncoder.push after flush")
        chunks = [self._cut(p) for p in pushes]  # per push: [(chunk frames, tokens)]
        embedded = iter(self._embed([c for cs in chunks for c in cs]))
        tokens, lengths, counts = [], [], []  # every window's embedded chunks and size; each push's rows
        for p, cs in zip(pushes, chunks):
            p.state.window += [next(embedded) for _ in cs]
            ready = self._ready(p)
            mine = [sum(c.shape[0] for c in w) for w in ready]
            tokens += [c for w in ready for c in w]
            lengths += mine
            counts.append(sum(mine))
            p.state.tokens_out += counts[-1]
        if not lengths:
            return [self.empty() for _ in pushes]
        return list(self.encoder.encode_windows(torch.cat(tokens), lengths).split(counts))  # [n_i, output_dim]

    def _cut(self, p: AudioPush) -> list[tuple[torch.Tensor, int]]:
        """The push's frames into the clip; the chunks that became complete (all of them when
        final, the last one zero-padded like `forward` pads a clip's short chunk)."""
        s, n = p.state, self.chunk_frames
        frames = torch.cat([s.frames, torch.as_tensor(p.features).to(s.frames)], dim=1)  # on the encoder's device
        s.frames_in += p.features.shape[1]
        n_full = frames.shape[1] // n
        s.frames = frames[:, n_full * n:]
        chunks = [(c, conv_stem_len(n)) for c in frames[:, :n_full * n].split(n, dim=1)] if n_full else []
        s.full_chunks += n_full
        if p.final:
            s.done = True
            rest = s.frames.shape[1]
            if rest:  # NOTE: like forward(), a short chunk is zero-padded to the longest chunk of the clip
                last = torch.nn.functional.pad(s.frames, (0, n - rest)) if s.full_chunks else s.frames
                chunks.append((last, conv_stem_len(rest)))
                s.frames = s.frames[:, :0]
        return chunks

    def _embed(self, chunks: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        """Each chunk's embedded tokens [tokens, d_model]: one `embed_chunks` call per chunk length
        (a chunk is zero-padded to the longest of its call, which only a whole-chunk length leaves exact)."""
        out: list[torch.Tensor | None] = [None] * len(chunks)
        by_len: dict[int, list[int]] = {}
        for i, (c, _) in enumerate(chunks):
            by_len.setdefault(c.shape[1], []).append(i)
        for idx in by_len.values():
            tokens = [chunks[i][1] for i in idx]
            for i, x in zip(idx, self.encoder.embed_chunks([chunks[i][0] for i in idx], tokens).split(tokens)):
                out[i] = x
        return out

    @staticmethod
    def _ready(p: AudioPush) -> list[list[torch.Tensor]]:
        """The clip's windows that are complete (with `final`, the open one too), out of its state."""
        s = p.state
        n = len(s.window) // s.window_chunks * s.window_chunks
        ready = [s.window[i:i + s.window_chunks] for i in range(0, n, s.window_chunks)]
        s.window = s.window[n:]
        if p.final and s.window:
            ready.append(s.window)
            s.window = []
        return ready

    def empty(self) -> torch.Tensor:
        return self.encoder.proj2.weight.new_zeros(0, self.encoder.cfg.output_dim)


def _rounds(items: list[AudioPush]) -> list[list[int]]:
    """Item indices in rounds where each clip appears at most once, its pushes in order."""
    rounds: list[list[int]] = []
    seen: dict[int, int] = {}
    for i, p in enumerate(items):
        r = seen.get(id(p.state), 0)
        seen[id(p.state)] = r + 1
        if r == len(rounds):
            rounds.append([])
        rounds[r].append(i)
    return rounds


class AudioStreamEncoder:
    """Incremental, windowed AuT over one encoder's weights with one window size, in the caller's
    thread (offline use and tests; served, the encoder stage drives `AudioStreamBatch`); the
    per-clip state is data."""

    def __init__(self, encoder: AudioEncoder, window_chunks: int | None = None):
        if window_chunks is not None and window_chunks < 1:
            raise ValueError(f"window_chunks must be >= 1, got {window_chunks}")
        self.batch = AudioStreamBatch(encoder)
        self.window_chunks = window_chunks or encoder.chunks_per_window

    def new_state(self) -> AudioStreamState:
        return self.batch.new_state(self.window_chunks)

    def push(self, state: AudioStreamState, features: torch.Tensor) -> torch.Tensor:
        """Append log-mel frames [n_mels, t] -> the rows that became final. # [n, output_dim]"""
        if state.done:
            raise RuntimeError("AudioStreamEncoder.push after flush")
        if features.ndim != 2 or features.shape[0] != state.frames.shape[0]:
            raise ValueError(f"features must be [{state.frames.shape[0]}, t] log-mel frames, got {tuple(features.shape)}")
        return self.batch.encode_pushes([AudioPush(state, features)])[0]

    def flush(self, state: AudioStreamState) -> torch.Tensor:
        """End of the clip: the partial last chunk and the open window. # [n, output_dim]"""
        if state.done:
            raise RuntimeError("AudioStreamEncoder.flush called twice")
        return self.batch.encode_pushes([AudioPush(state, state.frames[:, :0], final=True)])[0]

    def empty(self) -> torch.Tensor:
        return self.batch.empty()
