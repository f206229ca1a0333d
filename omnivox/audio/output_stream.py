"""Streaming audio formats (`FormatStream`): one per response, fed the samples as the vocoder
decodes them.

    enc = format_stream("opus", 24000)
    for chunk in chunks:            # float32 mono in [-1, 1]
        send(enc.push(chunk))       # the bytes that are complete now (may be b"")
    send(enc.close())               # the rest: encoder tail, final page

Every format goes through the same two calls, so a server has one streaming path:
- pcm: little-endian int16, as pushed.
- wav: a 44-byte header whose RIFF and data sizes are 0xFFFFFFFF (unknown), then pcm.
- mp3: libmp3lame through PyAV, CBR 64 kbps; every push returns the MP3 frames LAME has
  finished. A raw frame sequence (no LAME tag) decodes with the codec's delay in front (1105
  samples) and up to two frames of padding behind. NOTE: LAME looks ahead by more than a
  frame: the first 80 ms push yields one frame that is all priming; after two 80 ms pushes
  26 ms (24 kHz) / 53 ms (44.1 kHz) of the audio are decodable, and it stays ~75-120 ms behind.
- opus: libopus through PyAV (32 kbps target, 20 ms frames), in Ogg pages written here
  (`audio.ogg`): the two header pages with the first push, then one page per push holding
  every packet that push completed, so audio is playable after the first chunk (a first 80 ms
  push decodes to 73.5 ms at 24 kHz: 4 packets less the 6.5 ms pre-skip; 53.5 ms at 44.1 kHz,
  where the resampler and the 20 ms framing keep the rest for the next push); `close` ends
  the stream with a page whose granule position trims the encoder's padding. Rates Opus lacks
  (44.1 kHz) are resampled to 48 kHz by PyAV's swresample, statefully across pushes.

NOTE: an mp3 or Opus stream closed before any audio was pushed holds nothing decodable (mp3:
no bytes; Opus: the headers and an empty last page); wav gives a valid 0-sample file.
"""
from __future__ import annotations

import struct
from fractions import Fraction

import numpy as np

from omnivox.audio.encode import MEDIA_TYPES, MP3_KBPS, OPUS_BPS, float_mono, opus_rate
from omnivox.audio.io import encode_pcm16
from omnivox.audio.ogg import OggWriter
from omnivox.errors import InputError

UNKNOWN_SIZE = 0xFFFFFFFF
OGG_SERIAL = 0x6F6D6E69  # any value identifies the one logical stream; fixed, so output is deterministic
OPUS_VENDOR = b"omnivox"


def wav_header(sample_rate: int, data_bytes: int | None = None) -> bytes:
    """The 44-byte header of a mono 16-bit PCM wav; sizes 0xFFFFFFFF when the length is unknown."""
    riff = UNKNOWN_SIZE if data_bytes is None else 36 + data_bytes
    data = UNKNOWN_SIZE if data_bytes is None else data_bytes
    fmt = struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + fmt + b"data" + struct.pack("<I", data)


class FormatStream:
    """push(samples) -> bytes complete so far; close() -> the remaining bytes. Not thread-safe."""

    fmt = ""

    def __init__(self, sample_rate: int):
        self.sample_rate = int(sample_rate)
        self.closed = False

    @property
    def media_type(self) -> str:
        return MEDIA_TYPES[self.fmt]

    def push(self, samples: np.ndarray) -> bytes:
        if self.closed:
            raise RuntimeError(f"{self.fmt} stream is closed")
        return self._push(float_mono(samples))

    def close(self) -> bytes:
        if self.closed:
            return b""
        self.closed = True
        return self._close()

    def _push(self, x: np.ndarray) -> bytes:
        raise NotImplementedError

    def _close(self) -> bytes:
        return b""


class PcmStream(FormatStream):
    fmt = "pcm"

    def _push(self, x: np.ndarray) -> bytes:
        return encode_pcm16(x)


class WavStream(FormatStream):
    fmt = "wav"

    def __init__(self, sample_rate: int):
        super().__init__(sample_rate)
        self._header = wav_header(self.sample_rate)

    def _take_header(self) -> bytes:
        header, self._header = self._header, b""
        return header

    def _push(self, x: np.ndarray) -> bytes:
        return self._take_header() + encode_pcm16(x)

    def _close(self) -> bytes:
        return self._take_header()  # a stream closed before any audio is still a (0-sample) wav


class _CodecStream(FormatStream):
    """A PyAV audio encoder fed float frames; packets come back as soon as the codec finishes them."""

    codec, sample_format, bit_rate = "", "", 0

    def __init__(self, sample_rate: int, codec_rate: int):
        super().__init__(sample_rate)
        import av

        self._av = av
        ctx = av.CodecContext.create(self.codec, "w")
        if codec_rate not in ctx.codec.audio_rates:
            raise InputError(f"{self.fmt} cannot encode {codec_rate} Hz audio")
        ctx.sample_rate, ctx.layout, ctx.format, ctx.bit_rate = codec_rate, "mono", self.sample_format, self.bit_rate
        ctx.time_base = Fraction(1, codec_rate)
        ctx.open()
        self.ctx, self.pushed = ctx, 0

    def _packets(self, x: np.ndarray | None) -> list:
        if x is None:
            return self.ctx.encode(None)
        if x.size == 0:
            return []
        frame = self._av.AudioFrame.from_ndarray(x[None, :], format=self.sample_format, layout="mono")
        frame.sample_rate, frame.time_base, frame.pts = self.sample_rate, Fraction(1, self.sample_rate), self.pushed
        self.pushed += x.size
        return self.ctx.encode(frame)


class Mp3Stream(_CodecStream):
    fmt, codec, sample_format, bit_rate = "mp3", "libmp3lame", "fltp", MP3_KBPS * 1000

    def __init__(self, sample_rate: int):
        super().__init__(sample_rate, int(sample_rate))

    def _push(self, x: np.ndarray) -> bytes:
        return b"".join(bytes(p) for p in self._packets(x))

    def _close(self) -> bytes:
        return b"".join(bytes(p) for p in self._packets(None))


class OpusStream(_CodecStream):
    fmt, codec, sample_format, bit_rate = "opus", "libopus", "flt", OPUS_BPS

    def __init__(self, sample_rate: int):
        super().__init__(sample_rate, opus_rate(sample_rate))
        head = bytes(self.ctx.extradata)  # OpusHead as ffmpeg writes it: version, channels, pre-skip, rate
        if head[:8] != b"OpusHead":
            raise RuntimeError("libopus did not produce an OpusHead")
        tags = b"OpusTags" + struct.pack("<I", len(OPUS_VENDOR)) + OPUS_VENDOR + struct.pack("<I", 0)
        self.ogg = OggWriter(OGG_SERIAL)
        self._headers = self.ogg.page([head], 0) + self.ogg.page([tags], 0)
        self._scale = 48000 // self.ctx.sample_rate  # granule positions count 48 kHz samples
        self.granule = 0  # 48 kHz samples of every packet so far, pre-skip included

    def _pages(self, packets: list, last: bool) -> bytes:
        out = []
        for p in packets:
            self.granule += int(p.duration) * self._scale
            out.append((bytes(p), self.granule))
        headers, self._headers = self._headers, b""
        return headers + self.ogg.pages(out, last=last)

    def _push(self, x: np.ndarray) -> bytes:
        return self._pages(self._packets(x), last=False)

    def _close(self) -> bytes:
        # NOTE: the final packet's duration is cut to the samples left, so the last granule is
        # pre-skip + input samples (at 48 kHz) and decoders drop the encoder's padding.
        return self._pages(self._packets(None), last=True)


STREAMS = {"pcm": PcmStream, "wav": WavStream, "mp3": Mp3Stream, "opus": OpusStream}


def format_stream(fmt: str, sample_rate: int) -> FormatStream:
    """A fresh streaming encoder of mono `sample_rate` audio into `fmt` (pcm, wav, mp3, opus)."""
    if fmt not in STREAMS:
        raise InputError(f"audio format {fmt!r} cannot be streamed; choose one of {', '.join(STREAMS)}",
                         param="response_format")
    return STREAMS[fmt](sample_rate)
