"""Streaming Ogg Opus input: bytes in any pieces -> mono float32 PCM, as moshi's server reads it
(`sphn.OpusStreamReader`). The output side is `audio.output_stream.OpusStream` (one page per
pushed chunk), which sphn's reader decodes.

    dec = OpusStreamDecoder(24000)
    for piece in pieces:          # Ogg bytes as they arrive (page and message boundaries do not matter)
        pcm = dec.push(piece)     # the samples of every packet completed so far (may be empty)

Decoding: libopus through PyAV, which always decodes at 48 kHz; the output keeps every second
(or n-th) sample, phase 0. That is what libopus itself does to decode at 24 kHz (its CELT
decoder synthesises at 48 kHz and keeps sample 0 of each pair; it codes no band above the
output's Nyquist), and measured against sphn's 24 kHz decode of the same stream it is within one
16-bit step (PyAV's libopus decoder gives int16 samples). It is stateless, so a frame is whole as
soon as its packets arrive: no resampler look-ahead holds its end back for the next message.

NOTE (pre-skip): the OpusHead's pre-skip is NOT trimmed: the first sample out is the first
packet's first sample, as moshi's server (sphn) decodes a stream. sphn's writer declares a
pre-skip of 3840 (80 ms at 48 kHz, a whole frame) while its encoder's delay is 6.5 ms, so a
decoder that trimmed it would drop the user's first frame and every frame after would shift.
"""
from __future__ import annotations

import struct

import numpy as np

from omnivox.audio.ogg import ogg_crc
from omnivox.errors import InputError

CAPTURE = b"OggS"
HEADER = 27  # bytes of a page header before its lacing table
MAX_PAGE = HEADER + 255 + 255 * 255  # the largest page RFC 3533 allows
MAX_PACKET = 1275 * 3 * 2  # bytes of one Opus packet at most (RFC 6716: 120 ms of 1275-byte frames), with slack
DECODE_RATE = 48000  # PyAV's libopus decoder output


class OggPackets:
    """Ogg pages of one logical stream, fed as bytes in any pieces, as their packets (a packet
    may continue over pages). InputError for bytes that are not such a stream: a bad capture
    pattern, version or CRC, a second logical stream, an oversized packet."""

    def __init__(self):
        self._buf = bytearray()
        self._partial = bytearray()  # the start of a packet that continues on the next page
        self.serial: int | None = None

    def push(self, data: bytes) -> list[bytes]:
        self._buf += data
        packets: list[bytes] = []
        while len(self._buf) >= HEADER:
            size = self._page_size()
            if size is None or len(self._buf) < size:
                break
            packets += self._page(bytes(self._buf[:size]))
            del self._buf[:size]
        return packets

    def _page_size(self) -> int | None:
        if self._buf[:4] != CAPTURE or self._buf[4] != 0:
            raise InputError("audio is not an Ogg stream (expected an Ogg page: 'OggS', version 0)")
        segments = self._buf[26]
        if len(self._buf) < HEADER + segments:
            return None
        return HEADER + segments + sum(self._buf[HEADER:HEADER + segments])

    def _page(self, page: bytes) -> list[bytes]:
        flags, serial = page[5], struct.unpack_from("<I", page, 14)[0]
        crc = struct.unpack_from("<I", page, 22)[0]
        if ogg_crc(page[:22] + b"\0\0\0\0" + page[26:]) != crc:
            raise InputError("an Ogg page of the audio is corrupt (CRC mismatch)")
        if self.serial is None:
            self.serial = serial
        elif serial != self.serial:
            raise InputError("the Ogg audio holds more than one logical stream; send one Opus stream")
        if not flags & 1:
            self._partial.clear()  # a page that does not continue a packet drops an unfinished one
        lacing, at = page[HEADER:HEADER + page[26]], HEADER + page[26]
        packets = []
        for n in lacing:
            self._partial += page[at:at + n]
            at += n
            if len(self._partial) > MAX_PACKET:
                raise InputError(f"an Opus packet of the audio is over {MAX_PACKET} bytes")
            if n < 255:
                packets.append(bytes(self._partial))
                self._partial.clear()
        return packets


class OpusStreamDecoder:
    """Ogg Opus bytes (any pieces) -> mono float32 samples at `sample_rate` (a divisor of 48 kHz
    that Opus decodes: 8, 12, 16, 24 or 48 kHz). Not thread-safe. InputError (one line) for bytes
    that are not a mono Ogg Opus stream or a packet libopus rejects."""

    def __init__(self, sample_rate: int = 24000):
        if sample_rate not in (8000, 12000, 16000, 24000, 48000):
            raise ValueError(f"Opus decodes at 8, 12, 16, 24 or 48 kHz, not {sample_rate}")
        self.sample_rate, self.step = sample_rate, DECODE_RATE // sample_rate
        self.ogg = OggPackets()
        self.packets = 0  # packets seen, headers included
        self._ctx = None
        self._phase = 0  # the index in the next 48 kHz block of the next sample kept

    def push(self, data: bytes) -> np.ndarray:
        out = [self._decode(p) for p in self.ogg.push(data)]
        out = [x for x in out if x is not None]
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def _decode(self, packet: bytes) -> np.ndarray | None:
        self.packets += 1
        if self.packets == 1:
            self._open(packet)
            return None
        if self.packets == 2:
            if packet[:8] != b"OpusTags":
                raise InputError("the Ogg Opus stream's second packet is not OpusTags")
            return None
        import av

        try:
            frames = self._ctx.decode(av.Packet(packet))
        except av.error.FFmpegError as e:
            raise InputError(f"the audio holds a packet libopus cannot decode ({type(e).__name__})") from None
        if not frames:
            return None
        x = np.concatenate([f.to_ndarray().reshape(-1) for f in frames])  # [n] int16, mono
        kept = x[self._phase::self.step]
        self._phase = (self._phase - x.size) % self.step
        return kept.astype(np.float32) / 32768.0

    def _open(self, head: bytes) -> None:
        """A libopus decoder for the stream's OpusHead, its pre-skip zeroed (see the module's NOTE)."""
        if len(head) < 19 or head[:8] != b"OpusHead":
            raise InputError("the Ogg audio is not Opus (its first packet is not an OpusHead)")
        if head[9] != 1:
            raise InputError(f"the Opus audio has {head[9]} channels; send mono")
        import av

        ctx = av.CodecContext.create("libopus", "r")
        ctx.extradata = head[:10] + b"\0\0" + head[12:]
        self._ctx = ctx
