"""Helpers of the encoder tests: a speech clip at any rate, SNR, decoding with soundfile and ffmpeg."""
from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import soundfile as sf

from omnivox.audio.io import load_audio

MEDIA = Path(__file__).resolve().parents[1] / "media"


def speech(rate: int) -> np.ndarray:
    return load_audio(MEDIA / "speech_16k.wav", target_sr=rate)  # 2.5 s of espeak-ng speech


def snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    n = min(len(ref), len(got))
    return float(10 * np.log10(np.sum(ref[:n] ** 2) / np.sum((ref[:n] - got[:n]) ** 2)))


def av_decode(data: bytes) -> tuple[np.ndarray, int, int]:
    """(samples [N] float32, rate, channels) as ffmpeg decodes `data`."""
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.audio[0]
        frames = [f.to_ndarray() for f in c.decode(stream)]
        channels, rate = stream.codec_context.layout.nb_channels, stream.codec_context.sample_rate
    x = np.concatenate(frames, axis=1)  # [C, N] planar, or [1, N * C] packed (the same for mono)
    if x.dtype == np.int16:
        x = x / 32768.0
    return x[0].astype(np.float32), rate, channels


def sf_decode(data: bytes) -> tuple[np.ndarray, int]:
    """(mono samples [N] float32, rate) as libsndfile decodes `data`."""
    y, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    assert y.shape[1] == 1
    return y[:, 0], rate
