"""A protocol-level client of moshi's `/api/chat`, written from moshi 0.2.13's `client.py` and
`server.py` (moshi's own client needs a microphone and a speaker). One binary WebSocket message
per event, its first byte the kind:
  0x00  handshake (server -> client), once, when the session starts;
  0x01  Ogg Opus bytes, both ways (the client: `sphn.OpusStreamWriter`, one message per 80 ms
        frame of its audio; the server: one message per output frame);
  0x02  UTF-8 text (server -> client): one text token's piece, "▁" rendered as a space.

moshi's protocol has no end of input and the server never closes: output is driven by input,
one frame out per frame in but the first. So `chat` sends the speech and one frame of silence
after it, and reads until the silence's output frame arrives: every frame of the speech's
output is then whole (its text follows its audio). The caller compares the first `frames - 1`.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import sphn

F = 1920
RATE = 24000


@dataclass
class ChatResult:
    first: bytes  # the first message received (moshi's handshake: b"\x00")
    sent: list[bytes] = field(default_factory=list)  # the Ogg Opus payloads sent, one per frame
    kinds: list[int] = field(default_factory=list)  # the kind byte of every message after the first
    audio: list[np.ndarray] = field(default_factory=list)  # each 0x01 message, decoded by sphn's reader
    text: list[str] = field(default_factory=list)  # each 0x02 message
    text_after: list[int] = field(default_factory=list)  # for each text message, the audio messages before it

    @property
    def pcm(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)


def opus_frames(pcm: np.ndarray) -> list[bytes]:
    """pcm (24 kHz mono, whole frames) as moshi's client sends it: one sphn Opus message per frame."""
    writer = sphn.OpusStreamWriter(RATE)
    return [writer.append_pcm(np.ascontiguousarray(pcm[i:i + F], dtype=np.float32)) for i in range(0, len(pcm), F)]


def sphn_decode(messages: list[bytes]) -> np.ndarray:
    """What moshi's server decodes from the client's messages (sphn's reader)."""
    reader = sphn.OpusStreamReader(RATE)
    return np.concatenate([reader.append_bytes(m) for m in messages])


async def chat(url: str, pcm: np.ndarray, *, timeout_s: float = 120.0, headers: dict | None = None,
               pace_s: float = 0.0) -> ChatResult:
    """One session: the handshake, then pcm (whole frames) and one silent frame, one message per
    frame (`pace_s` apart), reading until as many audio messages as pcm has frames arrived."""
    frames = len(pcm) // F
    payloads = opus_frames(np.concatenate([pcm[:frames * F], np.zeros(F, np.float32)]))
    async with aiohttp.ClientSession() as session, \
            session.ws_connect(url, headers=headers, max_msg_size=0) as ws:
        async with asyncio.timeout(timeout_s):
            first = await ws.receive()
        if first.type != aiohttp.WSMsgType.BINARY:
            return ChatResult(first=b"", kinds=[-1])
        result = ChatResult(first=first.data)
        reader = sphn.OpusStreamReader(RATE)

        async def send() -> None:
            for p in payloads:
                if p:
                    await ws.send_bytes(b"\x01" + p)
                    result.sent.append(p)
                await asyncio.sleep(pace_s)

        sender = asyncio.ensure_future(send())
        try:
            async with asyncio.timeout(timeout_s):
                while len(result.audio) < frames:
                    message = await ws.receive()
                    if message.type != aiohttp.WSMsgType.BINARY:
                        break  # closed by the server
                    kind, payload = message.data[0], message.data[1:]
                    result.kinds.append(kind)
                    if kind == 1:
                        result.audio.append(reader.append_bytes(payload))
                    elif kind == 2:
                        result.text.append(payload.decode())
                        result.text_after.append(len(result.audio))
            await sender
        finally:
            sender.cancel()
    return result
