"""Whole-file encoders (libsndfile): every format decodes back, with soundfile and with ffmpeg
(PyAV), to the right rate, mono, the exact length and the input's waveform."""
import io

import numpy as np
import pytest
import soundfile as sf

from omnivox.audio.encode import MEDIA_TYPES, encode, encode_mp3, encode_opus, opus_rate
from omnivox.audio.io import resample
from omnivox.errors import InputError

from codec_helpers import av_decode, snr_db, speech


@pytest.mark.parametrize("rate", [24000, 44100, 16000])
def test_mp3_round_trip(rate):
    x = speech(rate)
    data = encode_mp3(x, rate)
    assert data[:2] in (b"\xff\xfb", b"\xff\xf3") and b"Info" in data[:64]  # a CBR LAME/Info tag frame first
    y, r = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    assert r == rate and y.shape == (len(x), 1)  # the LAME tag's delay/padding trims it exactly
    assert snr_db(x, y[:, 0]) > 15
    z, r2, channels = av_decode(data)
    assert (r2, channels, len(z)) == (rate, 1, len(x))
    assert snr_db(x, z) > 15
    kbps = len(data) * 8 / (len(x) / rate) / 1000
    assert 60 < kbps < 75  # CBR 64 kbps (+ the tags)


@pytest.mark.parametrize("rate", [24000, 44100, 16000])
def test_opus_round_trip(rate):
    x = speech(rate)
    data = encode_opus(x, rate)
    assert data[:4] == b"OggS" and b"OpusHead" in data[:64]
    out = opus_rate(rate)
    assert out == (48000 if rate == 44100 else rate)
    ref = x if out == rate else resample(x, rate, out)
    y, r = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    assert r == out and y.shape == (len(ref), 1)  # pre-skip and the final granule trim it exactly
    assert snr_db(ref, y[:, 0]) > 6  # a perceptual codec at 32 kbps: the waveform is only close
    z, r2, channels = av_decode(data)  # ffmpeg always decodes Opus at 48 kHz
    assert (r2, channels) == (48000, 1) and len(z) == len(ref) * 48000 // out
    assert snr_db(resample(x, rate, 48000), z) > 10
    kbps = len(data) * 8 / (len(x) / rate) / 1000
    assert 20 < kbps < 40  # 32 kbps target (VBR)


def test_snr_tells_signals_apart():
    """The SNR thresholds above mean something: another clip scores far below them."""
    x = speech(24000)
    y, _ = sf.read(io.BytesIO(encode_mp3(np.roll(x, 4000), 24000)), dtype="float32")
    assert snr_db(x, y) < 3


@pytest.mark.parametrize("fmt", sorted(MEDIA_TYPES))
def test_dispatch_clips_and_zeroes_bad_samples(fmt):
    noisy = np.sin(np.linspace(0, 400, 24000)).astype(np.float32) * 1.5
    noisy[10:20] = np.nan
    data = encode(fmt, noisy, 24000)
    clipped = np.nan_to_num(np.clip(noisy, -1, 1))
    if fmt == "pcm":
        np.testing.assert_array_equal(np.frombuffer(data, "<i2"), np.round(clipped * 32767).astype(np.int16))
        return
    y, _ = sf.read(io.BytesIO(data), dtype="float32")
    assert np.isfinite(y).all() and len(y) == 24000
    if fmt in ("wav", "flac"):
        np.testing.assert_allclose(y, clipped, atol=1e-4)  # int16: x * 32767 stored, read / 32768
    else:  # lossy: the decoder may overshoot a clipped waveform a little
        assert snr_db(clipped, y) > 6


def test_unknown_format_is_an_input_error():
    with pytest.raises(InputError, match="unknown audio format 'aac'") as e:
        encode("aac", np.zeros(10), 24000)
    assert e.value.param == "response_format"
