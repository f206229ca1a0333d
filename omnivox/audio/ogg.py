"""Ogg pages (RFC 3533) for a single logical stream, written by hand so that a page can be
closed and sent after every chunk of audio.

NOTE: ffmpeg's ogg muxer keeps the last page of a stream buffered until the next one starts
(or until it has held `page_duration`, 1 s by default) and PyAV has no call to flush it; that
would hold the first audio of a stream back by a page.

A page: "OggS", version 0, flags (1 continued, 2 first, 4 last), granule position (int64), stream
serial, page sequence number, CRC-32 (polynomial 0x04C11DB7, no reflection, init 0), the lacing
table (each packet as 255-byte runs plus one value below 255), then the packet bytes.
"""
from __future__ import annotations

import struct

MAX_LACING = 255  # lacing values (segments) per page


def _crc_table() -> list[int]:
    table = []
    for byte in range(256):
        r = byte << 24
        for _ in range(8):
            r = ((r << 1) ^ 0x04C11DB7) if r & 0x80000000 else r << 1
        table.append(r & 0xFFFFFFFF)
    return table


_CRC = _crc_table()


def ogg_crc(data: bytes) -> int:
    crc = 0
    for b in data:
        crc = ((crc << 8) & 0xFFFFFFFF) ^ _CRC[(crc >> 24) ^ b]
    return crc


def _lacing(size: int) -> bytes:
    return b"\xff" * (size // 255) + bytes([size % 255])


class OggWriter:
    """Pages of one logical stream. Packets never span pages (every packet here is far below
    the 65,025 bytes a page can hold), so each page's granule position is that of its last packet."""

    def __init__(self, serial: int):
        self.serial, self.sequence, self.started, self.ended = serial & 0xFFFFFFFF, 0, False, False
        self.granule = 0  # of the last page written

    def page(self, packets: list[bytes], granule: int, last: bool = False) -> bytes:
        """One page holding `packets` whole; the first page written is marked first-of-stream."""
        lacing = b"".join(_lacing(len(p)) for p in packets)
        if len(lacing) > MAX_LACING:
            raise ValueError(f"{len(packets)} packets need {len(lacing)} lacing values; a page holds {MAX_LACING}")
        if self.ended:
            raise ValueError("the stream's last page was already written")
        flags = (0 if self.started else 2) | (4 if last else 0)
        header = struct.pack("<4sBBqIIIB", b"OggS", 0, flags, granule, self.serial, self.sequence, 0, len(lacing))
        body = header + lacing + b"".join(packets)
        crc = ogg_crc(body)
        self.started, self.ended, self.sequence, self.granule = True, last, self.sequence + 1, granule
        return body[:22] + struct.pack("<I", crc) + body[26:]

    def pages(self, packets: list[tuple[bytes, int]], last: bool = False) -> bytes:
        """(packet, granule after it) pairs as few pages as the lacing limit allows; `last` marks
        the final page (with no packets, an empty one that repeats the last granule position)."""
        out, group, used = [], [], 0
        for data, granule in packets:
            need = len(data) // 255 + 1
            if group and used + need > MAX_LACING:
                out.append(self.page([d for d, _ in group], group[-1][1]))
                group, used = [], 0
            group.append((data, granule))
            used += need
        if group or last:
            granule = group[-1][1] if group else self.granule
            out.append(self.page([d for d, _ in group], granule, last=last))
        return b"".join(out)
