"""Audio decode/encode: whatever `soundfile` reads in, 16-bit wav / raw PCM / flac out.

Decoded audio is float32 mono in [-1, 1] at the requested rate. Every failure to read a clip
surfaces as `InputError` with a one-line message; callers never see a libsndfile traceback.
"""
from __future__ import annotations

import io
from math import gcd
from pathlib import Path

import numpy as np
from scipy.signal import resample_poly

from omnivox.errors import InputError

_READ_ERRORS = (RuntimeError, ValueError, TypeError, EOFError, OSError)
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 4000, 384000  # what a clip may declare (a 1 Hz header is a bomb)
MAX_CHANNELS = 8


def _soundfile():
    # NOTE: imported on first use, so the model and engine code imports where libsndfile's
    # wheel is absent (the GPU machine: scripts/gpu_verify.py); only decoding and encoding need it
    import soundfile
    return soundfile


def load_audio(source: str | Path | bytes, target_sr: int = 16000, max_seconds: float | None = None) -> np.ndarray:
    """Decode a file path or in-memory bytes to float32 mono at `target_sr`. # [N]

    Channels are averaged; other sample rates go through a polyphase (Kaiser-windowed FIR)
    resampler. Raises `InputError` for missing, unreadable, corrupt, empty or non-finite audio.
    NOTE: the header (rate, channels, duration vs `max_seconds`) is checked before anything is
    decoded or resampled, and decoding stops after `max_seconds` whatever the header claims,
    so a small upload can never allocate more than its declared, bounded length.
    """
    if target_sr <= 0:
        raise InputError(f"target sample rate must be positive, got {target_sr}")
    samples, sr = _decode(source, max_seconds)
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]  # [N]
    if not np.isfinite(mono).all():
        raise InputError(f"{_describe(source)} contains NaN or infinite samples")
    if sr != target_sr:
        mono = resample(mono, sr, target_sr)
    return np.clip(mono, -1.0, 1.0).astype(np.float32, copy=False)


def resample(samples: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Polyphase resampling of a 1-D signal; output length is ceil(N * target_sr / orig_sr)."""
    g = gcd(int(orig_sr), int(target_sr))
    up, down = int(target_sr) // g, int(orig_sr) // g
    out = resample_poly(samples.astype(np.float64), up, down)  # default Kaiser(beta=5) anti-alias FIR
    return out.astype(np.float32)


def _decode(source: str | Path | bytes, max_seconds: float | None = None) -> tuple[np.ndarray, int]:
    """(samples [N, C] float32, sample_rate); raises InputError on any decode failure or a
    header outside the limits (checked before decoding)."""
    what = _describe(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise InputError("audio input is empty (0 bytes)")
        handle: object = io.BytesIO(bytes(source))
    elif isinstance(source, (str, Path)):
        path = Path(source)
        if not path.exists():
            raise InputError(f"audio file not found: {path}")
        if not path.is_file():
            raise InputError(f"audio path is not a regular file: {path}")
        handle = str(path)
    else:
        raise InputError(f"audio source must be a path or bytes, got {type(source).__name__}")
    try:
        with _soundfile().SoundFile(handle) as f:
            sr, channels, frames = int(f.samplerate), int(f.channels), int(f.frames)
            _check_header(what, sr, channels, frames, max_seconds)
            limit = -1 if max_seconds is None else int(max_seconds * sr) + 1  # never trust the header alone
            samples = f.read(frames=limit, dtype="float32", always_2d=True)
    except InputError:
        raise
    except _READ_ERRORS as e:
        reason = getattr(e, "error_string", None) or (str(e).splitlines() or [type(e).__name__])[0]
        raise InputError(f"cannot decode {what} as audio (wav/flac/ogg/mp3 expected): {reason}") from None
    if samples.shape[0] == 0 or samples.shape[1] == 0:
        raise InputError(f"{what} holds no audio samples")
    if max_seconds is not None and samples.shape[0] > max_seconds * sr:
        raise InputError(f"{what} is longer than {max_seconds:g} s")
    return samples, sr


def _check_header(what: str, sr: int, channels: int, frames: int, max_seconds: float | None) -> None:
    if not MIN_SAMPLE_RATE <= sr <= MAX_SAMPLE_RATE:
        raise InputError(f"{what} declares a sample rate of {sr} Hz; accepted: {MIN_SAMPLE_RATE}-{MAX_SAMPLE_RATE} Hz")
    if not 1 <= channels <= MAX_CHANNELS:
        raise InputError(f"{what} declares {channels} channels; accepted: 1-{MAX_CHANNELS}")
    if max_seconds is not None and frames > max_seconds * sr:
        raise InputError(f"{what} is {frames / sr:.1f} s long; the limit is {max_seconds:g} s")


def _describe(source: object) -> str:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"audio input ({len(source)} bytes)"
    return f"audio file {source}"


def _to_int16(samples: np.ndarray) -> np.ndarray:
    """Clip to [-1, 1] and scale by 32767 with rounding. # [N] int16"""
    x = np.asarray(samples, dtype=np.float32).reshape(-1)
    x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    return np.round(np.clip(x, -1.0, 1.0) * 32767.0).astype(np.int16)


def encode_pcm16(samples: np.ndarray) -> bytes:
    """Raw little-endian signed 16-bit PCM, no header."""
    return _to_int16(samples).astype("<i2").tobytes()


def _encode(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    buf = io.BytesIO()
    _soundfile().write(buf, _to_int16(samples), int(sample_rate), format=fmt, subtype="PCM_16")
    return buf.getvalue()


def encode_wav(samples: np.ndarray, sample_rate: int) -> bytes:
    """A complete mono 16-bit PCM RIFF/WAVE file."""
    return _encode(samples, sample_rate, "WAV")


def encode_flac(samples: np.ndarray, sample_rate: int) -> bytes:
    """A complete mono 16-bit FLAC file (lossless for the int16-quantised signal)."""
    return _encode(samples, sample_rate, "FLAC")


def write_wav(path: str | Path, samples: np.ndarray, sample_rate: int) -> None:
    Path(path).write_bytes(encode_wav(samples, sample_rate))
