"""Helpers of the speech/voices API tests: the S2 demo's id, tiny reference clips, wav parsing."""
from __future__ import annotations

import io
import struct

import numpy as np
import soundfile as sf

FISH = "omnivox-demo-fish-s2"
FISH_RATE = 44100


def reference_wav(samples: int = 800, seed: int = 0) -> bytes:
    """A short 44.1 kHz clip (the tiny demo codec makes ~1 frame per 16 samples: keep it short)."""
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / FISH_RATE
    x = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(samples)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), FISH_RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def split_wav(data: bytes) -> tuple[int, int, int, bytes]:
    """(riff size, sample rate, data size, pcm bytes) of a 44-byte-header mono pcm16 wav."""
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt " and data[36:40] == b"data", data[:44]
    riff = struct.unpack("<I", data[4:8])[0]
    fmt = struct.unpack("<IHHIIHH", data[16:36])
    assert fmt[:3] == (16, 1, 1) and fmt[5:] == (2, 16)
    return riff, fmt[3], struct.unpack("<I", data[40:44])[0], data[44:]


def decode(data: bytes) -> tuple[np.ndarray, int]:
    x, rate = sf.read(io.BytesIO(data), dtype="int16")
    return x.astype(np.int32), rate
