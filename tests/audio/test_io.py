"""Audio decode (path or bytes, any rate/channels) and wav / pcm16 / flac encode."""
import io
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from omnivox.audio.io import encode_flac, encode_pcm16, encode_wav, load_audio, write_wav
from omnivox.errors import InputError

MEDIA = Path(__file__).resolve().parents[1] / "media"


def _sine(freq: float, sr: int, seconds: float, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(sr * seconds)) / sr
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _file_bytes(data: np.ndarray, sr: int, fmt: str, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, data, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


def test_wav_16k_loads_unchanged():
    raw, sr = sf.read(MEDIA / "speech_16k.wav", dtype="int16")
    wave = load_audio(MEDIA / "speech_16k.wav")
    assert sr == 16000 and wave.dtype == np.float32 and wave.ndim == 1
    np.testing.assert_array_equal(wave, raw.astype(np.float32) / 32768.0)
    assert 2.0 < len(wave) / 16000 < 3.0


def test_path_str_and_bytes_agree():
    path = MEDIA / "speech_22k.flac"
    a, b, c = load_audio(path), load_audio(str(path)), load_audio(path.read_bytes())
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)


def test_flac_22k_resampled_to_16k():
    info = sf.info(MEDIA / "speech_22k.flac")
    assert info.samplerate == 22050 and info.format == "FLAC"
    wave = load_audio(MEDIA / "speech_22k.flac")
    assert wave.dtype == np.float32
    assert len(wave) == -(-info.frames * 16000 // 22050)  # ceil(N * 16000 / 22050)
    assert abs(len(wave) / 16000 - info.duration) < 1 / 16000
    raw, _ = sf.read(MEDIA / "speech_22k.flac", dtype="float32")
    rms_in, rms_out = np.sqrt(np.mean(raw ** 2)), np.sqrt(np.mean(wave ** 2))
    assert abs(rms_out / rms_in - 1) < 0.05  # speech energy sits below 8 kHz and survives
    assert np.abs(wave).max() <= 1.0


def test_resampling_is_accurate_and_anti_aliased():
    tone = load_audio(_file_bytes(_sine(1000.0, 22050, 1.0), 22050, "WAV", "FLOAT"))
    ideal = _sine(1000.0, 16000, 1.0)
    assert len(tone) == 16000
    np.testing.assert_allclose(tone[800:-800], ideal[800:-800], atol=2e-3)  # away from the edges
    alias = load_audio(_file_bytes(_sine(10000.0, 44100, 1.0), 44100, "WAV", "FLOAT"))
    assert np.sqrt(np.mean(alias[800:-800] ** 2)) < 0.01 * 0.5 / np.sqrt(2)  # 10 kHz is above 8 kHz Nyquist


def test_channels_are_averaged():
    left, right = _sine(440.0, 16000, 0.5), _sine(660.0, 16000, 0.5, amp=0.25)
    stereo = np.stack([left, right], axis=1)
    wave = load_audio(_file_bytes(stereo, 16000, "WAV", "FLOAT"))
    np.testing.assert_allclose(wave, (left + right) / 2, atol=1e-7)


def test_ogg_vorbis_decodes():
    x = _sine(440.0, 16000, 1.0)
    wave = load_audio(_file_bytes(x, 16000, "OGG", "VORBIS"))
    assert abs(len(wave) - len(x)) <= 16
    n = min(len(wave), len(x))
    assert np.corrcoef(wave[:n], x[:n])[0, 1] > 0.99


def test_loud_float_input_is_clipped():
    x = np.array([0.0, 1.5, -2.0] * 100, dtype=np.float32)
    wave = load_audio(_file_bytes(x, 16000, "WAV", "FLOAT"))
    assert wave.max() == 1.0 and wave.min() == -1.0


def test_encoders_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    x = np.clip(0.3 * rng.standard_normal(4000), -1, 1).astype(np.float32)
    x[:3] = [1.7, -1.2, 0.5]  # out-of-range samples clip to full scale
    q = np.round(np.clip(x, -1, 1) * 32767).astype(np.int16)

    pcm = encode_pcm16(x)
    assert len(pcm) == 2 * len(x)
    np.testing.assert_array_equal(np.frombuffer(pcm, dtype="<i2"), q)
    assert q[0] == 32767 and q[1] == -32767

    wav = encode_wav(x, 24000)
    assert wav[:4] == b"RIFF" and wav[8:12] == b"WAVE"
    data, sr = sf.read(io.BytesIO(wav), dtype="int16")
    assert sr == 24000 and sf.info(io.BytesIO(wav)).subtype == "PCM_16"
    np.testing.assert_array_equal(data, q)

    flac = encode_flac(x, 24000)
    assert flac[:4] == b"fLaC"
    data, sr = sf.read(io.BytesIO(flac), dtype="int16")
    assert sr == 24000
    np.testing.assert_array_equal(data, q)  # lossless

    path = tmp_path / "out.wav"
    write_wav(path, x, 16000)
    assert path.read_bytes() == encode_wav(x, 16000)
    np.testing.assert_array_equal(load_audio(path), q.astype(np.float32) / 32768.0)


def _corrupt_inputs() -> dict[str, bytes]:
    good = (MEDIA / "speech_16k.wav").read_bytes()
    flac = (MEDIA / "speech_22k.flac").read_bytes()
    return {
        "empty": b"",
        "garbage": np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8).tobytes(),
        "text": b"this is not audio at all, just some words" * 10,
        "truncated_wav_header": good[:30],
        "flac_magic_then_garbage": flac[:4] + bytes(2000),
        "zero_frames_wav": _file_bytes(np.zeros(0, np.float32), 16000, "WAV", "PCM_16"),
        "nan_float_wav": _file_bytes(np.array([0.0, np.nan, 0.1] * 100, np.float32), 16000, "WAV", "FLOAT"),
    }


@pytest.mark.parametrize("kind", list(_corrupt_inputs()))
def test_bad_bytes_raise_one_line_input_error(kind):
    with pytest.raises(InputError) as exc:
        load_audio(_corrupt_inputs()[kind])
    msg = str(exc.value)
    assert msg and "\n" not in msg and "Traceback" not in msg


def test_missing_and_wrong_sources_raise_input_error(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_audio(tmp_path / "nope.wav")
    with pytest.raises(InputError):
        load_audio(tmp_path)  # a directory
    with pytest.raises(InputError):
        load_audio(12345)  # type: ignore[arg-type]
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    with pytest.raises(InputError):
        load_audio(empty)


def test_header_is_checked_before_decoding():
    """A declared rate outside 4-384 kHz, too many channels, or a duration over the limit is
    refused from the header alone; decoding never runs past max_seconds."""
    import struct

    def wav(rate: int, channels: int = 1, samples: int = 100) -> bytes:
        data = b"\x00\x00" * samples * channels
        fmt = struct.pack("<IHHIIHH", 16, 1, channels, rate, rate * 2 * channels, 2 * channels, 16)
        return b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + fmt + b"data" + struct.pack("<I", len(data)) + data

    with pytest.raises(InputError, match="sample rate of 1 Hz"):
        load_audio(wav(1))
    with pytest.raises(InputError, match="channels"):
        load_audio(wav(16000, channels=12))
    with pytest.raises(InputError, match="limit is 0.005 s"):
        load_audio(wav(16000, samples=100), max_seconds=0.005)
    assert load_audio(wav(16000, samples=100), max_seconds=0.01).shape == (100,)
