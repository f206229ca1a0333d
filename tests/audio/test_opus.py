"""Streaming Ogg Opus against sphn (what moshi's client and server use): sphn-written streams decode
with ours (`audio.opus.OpusStreamDecoder`), ours (`audio.output_stream.OpusStream`, 1920-sample
pushes) decode with sphn.

Tolerances: two decoders of one stream agree within one 16-bit step (2^-15; PyAV's libopus decoder
gives int16 samples, sphn floats). Against the input, Opus is lossy: after the encoder's delay
(6.5 ms, 156 samples at 24 kHz, which neither side trims: see opus.py's NOTE) the error's energy is
under 15% of the speech's (sphn's writer; ours at 32 kbps: under 5%)."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from omnivox.audio.io import load_audio
from omnivox.audio.ogg import OggWriter
from omnivox.audio.opus import OpusStreamDecoder
from omnivox.audio.output_stream import OpusStream
from omnivox.errors import InputError

sphn = pytest.importorskip("sphn")

F = 1920
STEP = 2.0**-15
SPEECH = load_audio(Path(__file__).resolve().parents[1] / "media" / "question_24k.wav", target_sr=24000)[:25 * F]


def sphn_messages(x: np.ndarray) -> list[bytes]:
    writer = sphn.OpusStreamWriter(24000)
    return [writer.append_pcm(x[i:i + F].astype(np.float32)) for i in range(0, len(x), F)]


def delay_and_error(decoded: np.ndarray, x: np.ndarray) -> tuple[int, float]:
    """The lag (samples) that best aligns decoded with x, and the error's energy over x's there."""
    errs = []
    for lag in range(400):
        n = min(len(decoded) - lag, len(x))
        errs.append(np.sum((decoded[lag:lag + n] - x[:n]) ** 2) / np.sum(x[:n] ** 2))
    lag = int(np.argmin(errs))
    return lag, float(errs[lag])


@pytest.mark.parametrize("piece", [1, 7, 500, None])  # bytes per push; None: sphn's own messages
def test_sphn_stream_decodes_with_ours_in_any_pieces(piece):
    messages = sphn_messages(SPEECH)
    reader = sphn.OpusStreamReader(24000)
    want = np.concatenate([reader.append_bytes(m) for m in messages])
    data = b"".join(messages)
    pieces = messages if piece is None else [data[i:i + piece] for i in range(0, len(data), piece)]
    dec = OpusStreamDecoder(24000)
    got = np.concatenate([dec.push(p) for p in pieces])
    assert got.dtype == np.float32 and len(got) == len(want) == len(SPEECH)
    assert np.abs(got - want).max() <= STEP
    lag, err = delay_and_error(got, SPEECH)
    assert 140 <= lag <= 170 and err < 0.15, (lag, err)


def test_each_sphn_message_yields_its_frame():
    """A whole frame is decodable from its own message (nothing waits for the next one)."""
    dec = OpusStreamDecoder(24000)
    assert [len(dec.push(m)) for m in sphn_messages(SPEECH[:5 * F])] == [F] * 5


def test_ours_decodes_with_sphn():
    enc = OpusStream(24000)
    messages = [enc.push(SPEECH[i:i + F]) for i in range(0, len(SPEECH), F)]
    reader = sphn.OpusStreamReader(24000)
    got = [reader.append_bytes(m) for m in messages]
    assert [len(g) for g in got] == [F] * len(messages)  # one frame per 80 ms message, as moshi's server sends
    got = np.concatenate(got)
    lag, err = delay_and_error(got, SPEECH)
    assert 140 <= lag <= 170 and err < 0.05, (lag, err)
    ours = np.concatenate([OpusStreamDecoder(24000).push(m) for m in [b"".join(messages)]])
    assert np.abs(ours - got).max() <= STEP


def test_other_rates_keep_every_nth_sample():
    data = b"".join(sphn_messages(SPEECH[:10 * F]))
    full = OpusStreamDecoder(48000).push(data)
    assert np.array_equal(OpusStreamDecoder(16000).push(data), full[::3])
    pieces = OpusStreamDecoder(16000)
    assert np.array_equal(np.concatenate([pieces.push(data[i:i + 333]) for i in range(0, len(data), 333)]), full[::3])


def _head(channels: int = 1) -> bytes:
    return b"OpusHead" + struct.pack("<BBHIhB", 1, channels, 312, 24000, 0, 0)


@pytest.mark.parametrize("data, message", [
    (b"RIFF" + bytes(40), "not an Ogg stream"),
    (OggWriter(1).page([b"\x01vorbis" + bytes(22)], 0), "not Opus"),
    (OggWriter(1).page([_head(2)], 0), "2 channels; send mono"),
    (OggWriter(1).page([_head()], 0) + OggWriter(2).page([b"OpusTags" + bytes(8)], 0), "more than one logical"),
])
def test_bad_streams_are_one_line_errors(data, message):
    with pytest.raises(InputError) as e:
        OpusStreamDecoder(24000).push(data)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_corrupt_page_is_refused():
    data = bytearray(sphn_messages(SPEECH[:2 * F])[0])
    data[40] ^= 0xFF
    with pytest.raises(InputError, match="CRC mismatch"):
        OpusStreamDecoder(24000).push(bytes(data))
