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
from omnivox.media_budget import DecodeBudget

_READ_ERRORS = (RuntimeError, ValueError, TypeError, EOFError, OSError)
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 4000, 384000  # what a clip may declare (a 1 Hz header is a bomb)
MAX_CHANNELS = 8
BLOCK_FRAMES = 1 << 16  # decoded per read: the only multi-channel array ever held
# a declared format (OpenAI's `input_audio.format`) and the containers it may be
MAGIC = {
    "wav": lambda h: h[:4] in (b"RIFF", b"RF64") and h[8:12] == b"WAVE",
    "flac": lambda h: h[:4] == b"fLaC",
    "ogg": lambda h: h[:4] == b"OggS",
    "mp3": lambda h: h[:3] == b"ID3" or (len(h) > 1 and h[0] == 0xFF and h[1] & 0xE0 == 0xE0),
}
CONTAINERS = {"wav": "RIFF/WAVE", "flac": "FLAC (fLaC)", "ogg": "Ogg (OggS)", "mp3": "MP3 (ID3 tag or MPEG frame)"}
SOUNDFILE_FORMATS = {"wav": ("WAV", "WAVEX", "RF64"), "flac": ("FLAC",), "ogg": ("OGG",), "mp3": ("MP3", "MPEG")}


def _soundfile():
    # NOTE: imported on first use, so the model and engine code imports where libsndfile's
    # wheel is absent (the GPU machine: scripts/gpu_verify.py); only decoding and encoding need it
    import soundfile
    return soundfile


def load_audio(source: str | Path | bytes, target_sr: int = 16000, max_seconds: float | None = None, *,
               format: str | None = None, budget: DecodeBudget | None = None) -> np.ndarray:
    """Decode a file path or in-memory bytes to float32 mono at `target_sr`. # [N]

    Channels are averaged; other sample rates go through a polyphase (Kaiser-windowed FIR)
    resampler. `format` ("wav", "flac", "ogg", "mp3"): what the caller declared, refused unless
    the container is that (RIFF/RF64 WAVE, fLaC, OggS, an ID3 tag or MPEG frame sync). `budget`:
    the request's `DecodeBudget` (None: a fresh one of the defaults, 512 MiB and 30 s).
    Raises `InputError` for missing, unreadable, corrupt, mislabelled, empty or non-finite audio
    and for a clip whose decode would pass the budget.
    NOTE: the header (rate, channels, duration vs `max_seconds`, the decode's cost) is checked
    before anything is decoded; decoding then goes block by block into mono, stops after
    `max_seconds` whatever the header claims, and re-checks the budget if the stream runs past
    the length its header declared, so a small upload never allocates more than the budget.
    """
    if target_sr <= 0:
        raise InputError(f"target sample rate must be positive, got {target_sr}")
    budget = budget if budget is not None else DecodeBudget()
    mono, sr = _decode(source, target_sr, max_seconds, format and format.lower(), budget)  # [N]
    if sr != target_sr:
        mono = resample(mono, sr, target_sr)
    return np.clip(mono, -1.0, 1.0).astype(np.float32, copy=False)


def resample(samples: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Polyphase resampling of a 1-D signal; output length is ceil(N * target_sr / orig_sr)."""
    g = gcd(int(orig_sr), int(target_sr))
    up, down = int(target_sr) // g, int(orig_sr) // g
    out = resample_poly(samples.astype(np.float64), up, down)  # default Kaiser(beta=5) anti-alias FIR
    return out.astype(np.float32)


def decode_cost(frames: int, sr: int, channels: int, target_sr: int) -> tuple[int, int]:
    """(kept, transient) bytes of decoding `frames` at `sr` to mono at `target_sr`: the mono
    float32 wave kept, plus while working one decoded block of every channel, and when
    resampling the float64 input and output copies (and the float32 mono it came from)."""
    out = -(-frames * target_sr // sr)
    block = min(frames, BLOCK_FRAMES) * channels * 4
    if sr == target_sr:
        return out * 4, block + frames * 4  # the clipped copy
    return out * 4, block + frames * (4 + 8) + out * (8 + 4)


def _decode(source: str | Path | bytes, target_sr: int, max_seconds: float | None, declared: str | None,
            budget: DecodeBudget) -> tuple[np.ndarray, int]:
    """(mono [N] float32, sample_rate); raises InputError on any decode failure or a header
    outside the limits (checked before decoding)."""
    what = _describe(source)
    handle = _open(source, what, declared)
    try:
        with _soundfile().SoundFile(handle) as f:
            sr, channels, frames = int(f.samplerate), int(f.channels), int(f.frames)
            _check_header(what, sr, channels, frames, max_seconds)
            if declared is not None and f.format not in SOUNDFILE_FORMATS[declared]:
                raise InputError(f"{what} is declared {declared} but holds {f.format} audio")
            kept, transient = decode_cost(frames, sr, channels, target_sr)
            budget.reserve(f"{what} ({frames / sr:.1f} s at {sr} Hz, {channels} channels)", kept, transient)
            limit = None if max_seconds is None else int(max_seconds * sr) + 1  # never trust the header alone
            mono = _read_mono(f, frames, limit, what, budget)
    except InputError:
        raise
    except _READ_ERRORS as e:
        reason = getattr(e, "error_string", None) or (str(e).splitlines() or [type(e).__name__])[0]
        raise InputError(f"cannot decode {what} as audio (wav/flac/ogg/mp3 expected): {reason}") from None
    if mono.shape[0] == 0:
        raise InputError(f"{what} holds no audio samples")
    if max_seconds is not None and mono.shape[0] > max_seconds * sr:
        raise InputError(f"{what} is longer than {max_seconds:g} s")
    return mono, sr


def _open(source: str | Path | bytes, what: str, declared: str | None) -> object:
    """What SoundFile opens (a BytesIO or a path), after the declared format's magic bytes."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise InputError("audio input is empty (0 bytes)")
        head, handle = bytes(source[:12]), io.BytesIO(bytes(source))
    elif isinstance(source, (str, Path)):
        path = Path(source)
        if not path.exists():
            raise InputError(f"audio file not found: {path}")
        if not path.is_file():
            raise InputError(f"audio path is not a regular file: {path}")
        with open(path, "rb") as f:
            head = f.read(12)
        handle = str(path)
    else:
        raise InputError(f"audio source must be a path or bytes, got {type(source).__name__}")
    if declared is not None:
        if declared not in MAGIC:
            raise InputError(f"audio format {declared!r} is not supported; use one of: {', '.join(MAGIC)}")
        if not MAGIC[declared](head):
            raise InputError(f"{what} is declared {declared} but is not a {CONTAINERS[declared]} file "
                             f"(it starts with {head[:4]!r})")
    return handle


def _read_mono(f, frames: int, limit: int | None, what: str, budget: DecodeBudget) -> np.ndarray:
    """Block by block into one mono float32 array sized from the header (grown, with the budget
    checked again, only if the stream is longer than its header says). # [N]"""
    mono, n = np.empty(frames, np.float32), 0
    while limit is None or n < limit:
        want = BLOCK_FRAMES if limit is None else min(BLOCK_FRAMES, limit - n)
        block = f.read(frames=want, dtype="float32", always_2d=True)  # [b, C]
        if block.shape[0] == 0:
            break
        part = block.mean(axis=1) if block.shape[1] > 1 else block[:, 0]  # [b]
        if not np.isfinite(part).all():
            raise InputError(f"{what} contains NaN or infinite samples")
        if n + part.shape[0] > mono.shape[0]:  # the stream runs past its header's length
            grown = max(2 * mono.shape[0], n + part.shape[0])
            budget.check(f"{what} (longer than its header declares)", (grown + mono.shape[0]) * 4 * 3)
            mono = np.concatenate((mono[:n], np.empty(grown - n, np.float32)))
        mono[n:n + part.shape[0]] = part
        n += part.shape[0]
        budget.tick(what)
    return mono[:n]


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
