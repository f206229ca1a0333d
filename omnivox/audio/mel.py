"""Whisper-style 128-bin log-mel front end of Qwen3-Omni (spec sections 3.5, 5.1, 5.2).

Numbers are those of the reference processor (`WhisperFeatureExtractor(feature_size=128,
sampling_rate=16000, hop_length=160, n_fft=400)` called with `padding=True, truncation=False,
return_attention_mask=True`): periodic Hann, reflect-centred STFT, power spectrum, last frame
dropped, Slaney mel filters 0-8 kHz, log10 clamped at 1e-10, floor at (max - 8), (x + 4) / 4.
The float32 operation order mirrors the reference so the valid frames match it bit for bit.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from omnivox.errors import InputError

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
N_MELS = 128
F_MAX = 8000.0


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz, logarithmic above."""
    mel = 3.0 * hz / 200.0
    log_region = hz >= 1000.0
    mel[log_region] = 15.0 + np.log(hz[log_region] / 1000.0) * (27.0 / np.log(6.4))
    return mel


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    hz = 200.0 * mel / 3.0
    log_region = mel >= 15.0
    hz[log_region] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel[log_region] - 15.0))
    return hz


@lru_cache(maxsize=4)
def mel_filters(n_mels: int = N_MELS, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE,
                f_max: float = F_MAX) -> np.ndarray:
    """Slaney-normalised triangular filters, float64. # [n_fft // 2 + 1, n_mels]"""
    fft_hz = np.linspace(0, sample_rate // 2, n_fft // 2 + 1)
    edges = np.linspace(_hz_to_mel(np.array([0.0]))[0], _hz_to_mel(np.array([f_max]))[0], n_mels + 2)
    edge_hz = _mel_to_hz(edges)  # [n_mels + 2]
    width = np.diff(edge_hz)
    offset = edge_hz[None, :] - fft_hz[:, None]  # [F, n_mels + 2]
    rising = -offset[:, :-2] / width[:-1]
    falling = offset[:, 2:] / width[1:]
    tri = np.maximum(0.0, np.minimum(rising, falling))  # [F, n_mels]
    return tri * (2.0 / (edge_hz[2:] - edge_hz[:-2]))[None, :]


def num_frames(num_samples: int) -> int:
    """Mel frames of a clip of `num_samples` 16 kHz samples (the last STFT frame is dropped)."""
    return num_samples // HOP_LENGTH


def conv_stem_len(frames: int) -> int:
    """Time length after the encoder's three stride-2 convolutions: n -> (n - 1) // 2 + 1, thrice."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1
    return frames


def num_audio_tokens(num_frames: int, n_window: int = 50) -> int:
    """Audio tokens for a clip of `num_frames` valid mel frames (spec 5.2).

    The clip is cut into chunks of 2 * n_window frames (the last keeps the remainder) and each
    chunk yields `conv_stem_len(chunk)` tokens: 13 per full 100-frame chunk for n_window = 50.
    """
    full, rest = divmod(int(num_frames), 2 * n_window)
    return full * conv_stem_len(2 * n_window) + (conv_stem_len(rest) if rest else 0)


def log_mel(wave: np.ndarray, pad_to: int | None = None) -> torch.Tensor:
    """Log-mel features of one 16 kHz mono clip. # [n_mels, T] float32, T = len(wave) // 160

    `pad_to` (samples) reproduces the reference processor when it featurises several clips in one
    call: the clip is zero-padded to the longest clip before the STFT, the (max - 8) floor spans
    the padded matrix, and min(ceil(len / 160), pad_to // 160) frames are marked valid. Leave it
    None for a clip featurised on its own (or for the longest clip of a call).
    """
    x = np.asarray(wave, dtype=np.float32)
    if x.ndim != 1:
        raise InputError(f"log_mel expects a 1-D mono waveform, got shape {tuple(x.shape)}")
    length = x.shape[0]
    if length <= N_FFT // 2:
        raise InputError(f"audio clip too short: {length} samples; need more than {N_FFT // 2} (12.5 ms at 16 kHz)")
    valid = num_frames(length)
    if pad_to is not None and pad_to > length:
        valid = min(-(-length // HOP_LENGTH), num_frames(pad_to))
        x = np.pad(x, (0, pad_to - length))
    feats = _log_mel_batch(torch.from_numpy(np.ascontiguousarray(x))[None])  # [1, n_mels, T_all]
    return feats[0, :, :valid].contiguous()


def _log_mel_batch(waves: torch.Tensor) -> torch.Tensor:
    """[B, N] float32 -> [B, n_mels, N // 160] float32, floor per batch row."""
    window = torch.hann_window(N_FFT)  # periodic
    spec = torch.stft(waves, N_FFT, HOP_LENGTH, window=window, center=True, pad_mode="reflect",
                      return_complex=True)  # [B, F, N // 160 + 1]
    # NOTE: |z| ** 2 (not re^2 + im^2) and a contiguous copy keep the float32 rounding of the reference.
    power = (spec[..., :-1].abs() ** 2).contiguous()  # [B, F, T]
    filters = torch.from_numpy(mel_filters()).to(torch.float32)  # [F, n_mels]
    mel = filters.T @ power  # [B, n_mels, T]
    log_spec = torch.clamp(mel, min=1e-10).log10()
    peak = log_spec.amax(dim=(1, 2), keepdim=True)  # [B, 1, 1]
    log_spec = torch.maximum(log_spec, peak - 8.0)
    return (log_spec + 4.0) / 4.0
