"""Server-side turn detection for realtime sessions: Silero VAD on audio time.

`SileroVAD` is the 16 kHz network that the `silero-vad` package ships as its default model
(`silero_vad.jit`, v6), written as a plain module with its recurrent state passed in and out, so
one copy serves every session and runs wherever torch runs (the TorchScript file is only read for
its weights; no onnxruntime, no torchaudio). `TurnDetector` feeds it 32 ms frames of one
session's audio (resampled to 16 kHz by `audio.input_stream.StreamResampler`) and turns the speech
probabilities into OpenAI's server-VAD events:
  - `speech_started`: the first frame with probability >= `threshold`; audio_ms (OpenAI's
    audio_start_ms) is that frame's start minus `prefix_padding_ms` (never before the previous
    turn's end, nor before 0), i.e. where the audio sent to the model begins;
  - `speech_stopped`: once `silence_duration_ms` of audio has followed the last frame still above
    the release threshold (`threshold - 0.15`, Silero's own hysteresis); audio_ms (OpenAI's
    audio_end_ms) is that frame's end plus `silence_duration_ms`, so it includes the silence.
Every time is counted in samples, never read from a clock: appending faster than real time, or in
any chunk sizes, gives the same events at the same audio times.
"""
from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from omnivox.audio.input_stream import StreamResampler

VAD_RATE = 16000
FRAME = 512  # samples per probability at 16 kHz (32 ms)
CONTEXT = 64  # samples of the previous frame the network also reads
HYSTERESIS = 0.15  # Silero's release threshold is threshold - 0.15


class SileroVAD(nn.Module):
    """Silero VAD (v6, 16 kHz): a learned STFT, four convolutions, one LSTM cell, a sigmoid head.

    forward(x [B, 64 + 512], h [B, 128], c [B, 128]) -> (speech probability [B], h, c).
    """

    def __init__(self):
        super().__init__()
        self.stft_conv = nn.Conv1d(1, 258, 256, stride=128, bias=False)  # real | imaginary bases
        self.conv1 = nn.Conv1d(129, 128, 3, padding=1)
        self.conv2 = nn.Conv1d(128, 64, 3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(64, 64, 3, stride=2, padding=1)
        self.conv4 = nn.Conv1d(64, 128, 3, padding=1)
        self.lstm_cell = nn.LSTMCell(128, 128)
        self.final_conv = nn.Conv1d(128, 1, 1)

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, ...]:
        spec = self.stft_conv(F.pad(x[:, None], (0, CONTEXT), mode="reflect"))  # [B, 258, 4]
        re, im = spec.chunk(2, dim=1)
        z = torch.sqrt(re ** 2 + im ** 2)  # [B, 129, 4] magnitudes
        for conv in (self.conv1, self.conv2, self.conv3, self.conv4):
            z = F.relu(conv(z))  # time 4 -> 4 -> 2 -> 1 -> 1
        h, c = self.lstm_cell(z[..., 0], (h, c))
        prob = torch.sigmoid(self.final_conv(F.relu(h)[..., None]))  # [B, 1, 1]
        return prob[:, 0, 0], h, c


def silero_data_dir() -> Path:
    """The installed `silero_vad` package's data folder, found without importing the package.

    NOTE: importing `silero_vad` runs `torch.set_num_threads(1)` (in its model.py) for the whole
    process, which would throttle every other CPU op of the server; so only its files are read.
    """
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("turn detection needs the silero-vad package (pip install silero-vad==6.2.3)")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


# our name -> the name inside the package's TorchScript model (its 16 kHz branch, `_model`)
_JIT_NAMES = {
    "stft_conv.weight": "stft.forward_basis_buffer",
    **{f"conv{i + 1}.{p}": f"encoder.{i}.reparam_conv.{p}" for i in range(4) for p in ("weight", "bias")},
    **{f"lstm_cell.{p}": f"decoder.rnn.{p}" for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")},
    "final_conv.weight": "decoder.decoder.2.weight", "final_conv.bias": "decoder.decoder.2.bias",
}


@lru_cache(maxsize=1)
def load_silero_vad() -> SileroVAD:
    """The package's default model (`silero_vad.jit`, v6) in a float32 CPU module shared by every
    TurnDetector. Only the weights are taken from the TorchScript file; our module runs them.

    NOTE: not `silero_vad_16k.safetensors` from the same package: it holds other (older) weights
    (conv weights differ by O(1)), while `load_silero_vad()` of the package gives the TorchScript.
    NOTE: torch 2.13 marks `torch.jit.load` deprecated (a warning, silenced here); the day it goes,
    the weights are the archive's plain tensors and another reader takes its place.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        jit = torch.jit.load(str(silero_data_dir() / "silero_vad.jit"), map_location="cpu")
    tensors = dict(jit._model.named_parameters()) | dict(jit._model.named_buffers())
    model = SileroVAD()
    model.load_state_dict({ours: tensors[theirs].detach().clone() for ours, theirs in _JIT_NAMES.items()},
                          strict=True)
    return model.eval().requires_grad_(False)


@dataclass(frozen=True)
class TurnEvent:
    """type and audio_ms as OpenAI's `input_audio_buffer.speech_started` (audio_start_ms) /
    `speech_stopped` (audio_end_ms); detected_ms: the audio time at which it was decided."""
    type: Literal["speech_started", "speech_stopped"]
    audio_ms: int
    detected_ms: int


class TurnDetector:
    """One session's server VAD: push pcm chunks (any size, any rate), get turn events back."""

    def __init__(self, threshold: float = 0.5, prefix_padding_ms: int = 300, silence_duration_ms: int = 500,
                 sample_rate: int = 24000, model: SileroVAD | None = None):
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {threshold}")
        if prefix_padding_ms < 0 or silence_duration_ms < 0:
            raise ValueError("prefix_padding_ms and silence_duration_ms must be >= 0")
        self.threshold = float(threshold)
        self.release = max(self.threshold - HYSTERESIS, 0.01)
        self.prefix_padding_ms = int(prefix_padding_ms)
        self.silence_duration_ms = int(silence_duration_ms)
        self.model = model or load_silero_vad()
        self.resampler = StreamResampler(sample_rate, VAD_RATE)
        self._pending = np.zeros(0, np.float32)  # 16 kHz samples not yet in a frame
        # the carried state as host arrays (a session's objects hold no tensor)
        self._context = np.zeros((1, CONTEXT), np.float32)
        self._h, self._c = np.zeros((1, 128), np.float32), np.zeros((1, 128), np.float32)
        self.frames = 0
        self.speaking = False
        self.last_prob = 0.0
        self._speech_end_ms = 0  # end of the last frame above the release threshold
        self._turn_end_ms = 0  # audio_end_ms of the previous turn

    @property
    def audio_ms(self) -> int:
        """Audio time the detector has judged (whole frames)."""
        return self.frames * FRAME * 1000 // VAD_RATE

    def push(self, audio: bytes | np.ndarray) -> list[TurnEvent]:
        """Append audio (pcm16 little-endian bytes, or int16 / float samples at `sample_rate`)."""
        if isinstance(audio, (bytes, bytearray, memoryview)):
            x = self.resampler.push_pcm16(bytes(audio))
        else:
            x = self.resampler.push(audio)
        self._pending = np.concatenate([self._pending, x])
        events = []
        n = len(self._pending) // FRAME
        for k in range(n):
            event = self._step(self._pending[k * FRAME:(k + 1) * FRAME])
            if event is not None:
                events.append(event)
        self._pending = self._pending[n * FRAME:]
        return events

    @torch.no_grad()
    def _step(self, frame: np.ndarray) -> TurnEvent | None:
        x = torch.cat([torch.from_numpy(self._context), torch.from_numpy(frame)[None]], dim=1)  # [1, 576]
        prob, h, c = self.model(x, torch.from_numpy(self._h), torch.from_numpy(self._c))
        self._h, self._c = h.numpy().copy(), c.numpy().copy()
        self._context = x[:, -CONTEXT:].numpy().copy()
        self.last_prob = float(prob)
        start_ms = self.audio_ms
        self.frames += 1
        end_ms = self.audio_ms
        if not self.speaking:
            if self.last_prob < self.threshold:
                return None
            self.speaking, self._speech_end_ms = True, end_ms
            audio_start = max(start_ms - self.prefix_padding_ms, self._turn_end_ms, 0)
            return TurnEvent("speech_started", audio_start, end_ms)
        if self.last_prob >= self.release:
            self._speech_end_ms = end_ms
        elif end_ms - self._speech_end_ms >= self.silence_duration_ms:
            self.speaking = False
            self._turn_end_ms = self._speech_end_ms + self.silence_duration_ms
            return TurnEvent("speech_stopped", self._turn_end_ms, end_ms)
        return None
