"""Streaming encoders: the concatenated pushes decode (soundfile and ffmpeg) to the input at the
right rate and length, chunking does not change the audio, and Ogg Opus is playable after the
first 80 ms push."""
import io
import random
import struct

import av
import numpy as np
import pytest
import soundfile as sf

from omnivox.audio.encode import encode_pcm16, opus_rate
from omnivox.audio.io import resample
from omnivox.audio.ogg import ogg_crc
from omnivox.audio.output_stream import FormatStream, format_stream, wav_header
from omnivox.errors import InputError

from codec_helpers import av_decode, sf_decode, snr_db, speech

RATES = [24000, 44100]
LAME_DELAY = 1105  # encoder + decoder delay of a raw LAME stream (no tag to trim it)


def chunks(n: int, size: int | None, seed: int = 0) -> list[slice]:
    """Slices covering [0, n): a fixed size, or random sizes (0 included) when size is None."""
    rng, out, start = random.Random(seed), [], 0
    while start < n:
        step = size if size is not None else rng.choice([0, 1, 7, 480, 1000, 1920, 5000])
        out.append(slice(start, min(n, start + step)))
        start += step
    return out


def stream(enc: FormatStream, x: np.ndarray, size: int | None) -> list[bytes]:
    return [enc.push(x[s]) for s in chunks(len(x), size)] + [enc.close()]


@pytest.mark.parametrize("fmt", ["pcm", "wav"])
@pytest.mark.parametrize("rate", RATES)
def test_pcm_and_wav_streams_are_exact(fmt, rate):
    x = speech(rate)
    parts = stream(format_stream(fmt, rate), x, None)
    data = b"".join(parts)
    pcm = encode_pcm16(x)
    if fmt == "pcm":
        assert data == pcm
        return
    assert parts[0][:44] == wav_header(rate) and data[44:] == pcm  # header once, then pcm16
    assert struct.unpack("<I", data[4:8])[0] == struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    y, r = sf_decode(data)  # readers take "unknown size" as "to the end of the file"
    assert r == rate and np.array_equal(np.round(y * 32768).astype(np.int16), np.frombuffer(pcm, "<i2"))
    z, r2, channels = av_decode(data)
    assert (r2, channels, len(z)) == (rate, 1, len(x))


def test_wav_closed_before_any_audio_is_an_empty_file():
    data = format_stream("wav", 24000).close()
    assert data == wav_header(24000) and sf_decode(data)[0].size == 0


@pytest.mark.parametrize("rate", RATES)
def test_mp3_stream_decodes_and_ignores_chunking(rate):
    x = speech(rate)
    enc = format_stream("mp3", rate)
    assert enc.media_type == "audio/mpeg"
    fixed = b"".join(stream(enc, x, int(0.08 * rate)))
    assert b"".join(stream(format_stream("mp3", rate), x, None)) == fixed  # same frames, byte for byte
    frame = 1152 if rate >= 32000 else 576
    for y, r in (sf_decode(fixed), av_decode(fixed)[:2]):
        assert r == rate
        assert len(x) + LAME_DELAY <= len(y) <= len(x) + LAME_DELAY + 2 * frame and len(y) % frame == 0
        assert snr_db(x, y[LAME_DELAY:]) > 15


def mp3_frame_sizes(data: bytes) -> list[int]:
    """Byte lengths of the MPEG audio frames that tile `data` exactly (Layer III headers)."""
    kbps = {1: [0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320],
            2: [0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160]}
    rates = {1: [44100, 48000, 32000], 2: [22050, 24000, 16000]}
    sizes, pos = [], 0
    while pos < len(data):
        h = int.from_bytes(data[pos:pos + 4], "big")
        assert h >> 21 == 0x7FF and (h >> 17) & 3 == 1, f"no Layer III frame header at byte {pos}"
        version = 1 if (h >> 19) & 3 == 3 else 2
        bitrate, rate, pad = kbps[version][(h >> 12) & 15], rates[version][(h >> 10) & 3], (h >> 9) & 1
        size = (144 if version == 1 else 72) * bitrate * 1000 // rate + pad
        sizes.append(size)
        pos += size
    assert pos == len(data)
    return sizes


@pytest.mark.parametrize("rate", RATES)
def test_mp3_pushes_return_whole_frames(rate):
    """Each push returns whole MP3 frames as LAME finishes them: the first 80 ms push returns
    one frame (all of it the encoder's priming); from the second push on, frames hold audio."""
    x = speech(rate)
    enc, ch = format_stream("mp3", rate), int(0.08 * rate)
    cbr = (144 if rate >= 32000 else 72) * 64000 // rate  # bytes of a 64 kbps frame (+1 when padded)
    got = [enc.push(x[k * ch:(k + 1) * ch]) for k in range(4)]
    assert all(set(mp3_frame_sizes(part)) <= {cbr, cbr + 1} for part in got)
    assert len(mp3_frame_sizes(got[0])) == 1 and all(got)
    ctx = av.CodecContext.create("mp3", "r")  # a bare decoder: no container probing
    decoded = sum(f.samples for p in ctx.parse(b"".join(got[:2])) for f in ctx.decode(p))
    assert decoded > LAME_DELAY  # 160 ms pushed: some real audio is out


@pytest.mark.parametrize("rate", RATES + [16000])
def test_opus_stream_decodes_exactly(rate):
    x = speech(rate)
    enc = format_stream("opus", rate)
    assert enc.media_type == "audio/ogg"
    data = b"".join(stream(enc, x, None))
    out = opus_rate(rate)
    y, r = sf_decode(data)
    ref = x if out == rate else resample(x, rate, out)
    assert r == out and len(y) == len(ref)  # pre-skip and the last granule trim exactly
    assert snr_db(ref, y) > 6
    z, r2, channels = av_decode(data)
    assert (r2, channels, len(z)) == (48000, 1, len(ref) * 48000 // out)
    assert snr_db(resample(x, rate, 48000), z) > 10


def ogg_pages(data: bytes) -> list[dict]:
    pages, pos = [], 0
    while pos < len(data):
        assert data[pos:pos + 4] == b"OggS"
        flags, granule, serial, seq, crc, n = struct.unpack("<BqIIIB", data[pos + 5:pos + 27])
        lacing = data[pos + 27:pos + 27 + n]
        end = pos + 27 + n + sum(lacing)
        body = data[pos:pos + 22] + b"\0\0\0\0" + data[pos + 26:end]
        pages.append(dict(flags=flags, granule=granule, serial=serial, seq=seq, crc=crc, crc_ok=ogg_crc(body) == crc,
                          packets=sum(1 for v in lacing if v < 255), payload=data[pos + 27 + n:end]))
        pos = end
    return pages


@pytest.mark.parametrize("rate", RATES)
def test_opus_pages_flush_per_push_and_first_chunk_plays(rate):
    x = speech(rate)
    enc, ch = format_stream("opus", rate), int(0.08 * rate)
    first = enc.push(x[:ch])
    heads = ogg_pages(first)
    assert [p["payload"][:8] for p in heads[:2]] == [b"OpusHead", b"OpusTags"] and heads[0]["flags"] == 2
    assert len(heads) == 3 and heads[2]["packets"] >= 3  # the audio of this push, in its own page
    for decode in (sf_decode, lambda d: av_decode(d)[:2]):  # 80 ms pushed -> >= 50 ms playable now
        y, r = decode(first)
        assert len(y) / r >= 0.05 and snr_db(resample(x[:ch], rate, r) if r != rate else x[:ch], y) > 3
    rest = [enc.push(x[ch * k:ch * (k + 1)]) for k in range(1, 5)]
    assert all(len(ogg_pages(p)) == 1 for p in rest)  # one page per push
    pages = ogg_pages(first + b"".join(rest) + enc.close())
    assert all(p["crc_ok"] and p["serial"] == heads[0]["serial"] for p in pages)
    assert [p["seq"] for p in pages] == list(range(len(pages)))
    assert pages[-1]["flags"] == 4 and pages[-1]["granule"] == 312 + 5 * ch * 48000 // rate  # pre-skip + input


def test_ogg_crc_matches_libogg():
    """Our CRC agrees with the pages libsndfile (libogg) writes."""
    buf = io.BytesIO()
    sf.write(buf, speech(24000)[:4800], 24000, format="OGG", subtype="OPUS")
    pages = ogg_pages(buf.getvalue())
    assert len(pages) >= 3 and all(p["crc_ok"] for p in pages)


def test_opus_chunking_changes_pages_not_audio():
    x = speech(44100)
    a = b"".join(stream(format_stream("opus", 44100), x, 3528))
    b = b"".join(stream(format_stream("opus", 44100), x, None))
    assert a != b and np.array_equal(sf_decode(a)[0], sf_decode(b)[0])


def test_stream_errors():
    with pytest.raises(InputError, match="cannot be streamed") as e:
        format_stream("flac", 24000)
    assert e.value.param == "response_format"
    with pytest.raises(InputError, match="96000 Hz"):
        format_stream("mp3", 96000)
    enc = format_stream("pcm", 24000)
    enc.close()
    assert enc.close() == b""
    with pytest.raises(RuntimeError, match="closed"):
        enc.push(np.zeros(4))
