"""Whole-file audio encoding in every response format: wav, pcm, flac, mp3 and Ogg Opus.

mp3 and Opus go through libsndfile (soundfile), which writes the gapless metadata a streamed
file cannot carry: MP3 gets a LAME/Xing tag with the encoder delay and padding (seeking back to
the first frame at close) and Ogg Opus a final granule position, so decoders that honour them
(libsndfile, ffmpeg) return exactly the input's length. For streaming see `audio.output_stream`.

Chosen quality (mono speech): MP3 constant 64 kbps (MPEG-1 Layer III at 32 kHz and above,
MPEG-2 below), Opus a 32 kbps target. Opus runs at 8/12/16/24/48 kHz only; other rates
(S2's 44.1 kHz) are resampled to 48 kHz first, so the file then declares 48 kHz.
"""
from __future__ import annotations

import io

import numpy as np
import soundfile as sf

from omnivox.audio.io import encode_flac, encode_pcm16, encode_wav, resample
from omnivox.errors import InputError

MP3_KBPS = 64
OPUS_BPS = 32000
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg",
               "opus": "audio/ogg"}


def opus_rate(sample_rate: int) -> int:
    """The rate Opus encodes `sample_rate` audio at: itself when Opus supports it, else 48 kHz."""
    return int(sample_rate) if int(sample_rate) in OPUS_RATES else 48000


def float_mono(samples: np.ndarray) -> np.ndarray:
    """[N] float32 in [-1, 1]: flattened, NaN -> 0, +-inf -> +-1, clipped."""
    x = np.nan_to_num(np.asarray(samples, dtype=np.float32).reshape(-1), nan=0.0, posinf=1.0, neginf=-1.0)
    return np.clip(x, -1.0, 1.0)


def _mp3_compression(sample_rate: int, kbps: int) -> float:
    """libsndfile's compression level for a constant bitrate: it maps level c to
    max - c * (max - min) kbps over the MPEG version's range (truncated to an integer)."""
    low, high = (32, 320) if sample_rate >= 32000 else (8, 160) if sample_rate >= 16000 else (8, 64)
    return min(1.0, max(0.0, (high - kbps - 0.5) / (high - low)))  # -0.5: truncation lands on kbps


def encode_mp3(samples: np.ndarray, sample_rate: int) -> bytes:
    """A complete mono MP3 file (ID3v2 + LAME tag + CBR 64 kbps frames) at `sample_rate`."""
    buf = io.BytesIO()
    sf.write(buf, float_mono(samples), int(sample_rate), format="MP3", subtype="MPEG_LAYER_III",
             bitrate_mode="CONSTANT", compression_level=_mp3_compression(int(sample_rate), MP3_KBPS))
    return buf.getvalue()


def encode_opus(samples: np.ndarray, sample_rate: int) -> bytes:
    """A complete mono Ogg Opus file at `opus_rate(sample_rate)` (32 kbps target)."""
    x, rate = float_mono(samples), opus_rate(sample_rate)
    if rate != sample_rate:
        x = np.clip(resample(x, int(sample_rate), rate), -1.0, 1.0)
    # libsndfile: bitrate = (1 - level) * 250 kbps + 6 kbps per channel
    level = 1.0 - (OPUS_BPS - 6000 + 0.5) / 250000.0
    buf = io.BytesIO()
    sf.write(buf, x, rate, format="OGG", subtype="OPUS", compression_level=level)
    return buf.getvalue()


ENCODERS = {"wav": encode_wav, "flac": encode_flac, "mp3": encode_mp3, "opus": encode_opus,
            "pcm": lambda samples, _rate: encode_pcm16(samples)}


def encode(fmt: str, samples: np.ndarray, sample_rate: int) -> bytes:
    """One whole file of mono `samples` (float, [-1, 1]) in `fmt` (a key of MEDIA_TYPES)."""
    if fmt not in ENCODERS:
        raise InputError(f"unknown audio format {fmt!r}; choose one of {', '.join(ENCODERS)}",
                         param="response_format")
    return ENCODERS[fmt](samples, sample_rate)
