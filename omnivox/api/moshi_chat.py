"""`/api/chat`: moshi's full-duplex WebSocket protocol (the protocol of `moshi/server.py` and its
clients, which vLLM-Omni also serves), for a `DuplexModel` (`omnivox.serving_duplex`). Mounted
only when the served model is one.

Binary messages, the first byte the kind (moshi 0.2.13):
  0x00  handshake, sent once when the session starts, before anything else;
  0x01  Ogg Opus (24 kHz mono) both ways. In: the user's audio as a stream of Ogg pages (message
        and page boundaries do not matter: `audio.opus.OpusStreamDecoder`); out: one message per
        output frame (`audio.output_stream.OpusStream`: headers with the first, then a page of
        four 20 ms packets per 80 ms frame, which sphn's reader decodes to one 1920-sample frame);
  0x02  UTF-8 text, the piece of one text token (padding tokens send nothing; "▁" is a space),
        after the audio of its frame.
Any other kind, an empty message or a text frame is ignored, as moshi's server does.

The session steps as input arrives: decoded samples go to the engine as they come, and each whole
1920-sample frame makes one engine step and one output frame. Nothing is sent before input.
Sampling: moshi's web client's query parameters `audio_temperature`, `audio_topk`,
`text_temperature`, `text_topk` (a temperature of 0 is greedy) and ours `seed`; the checkpoint's
(`lm_gen_config`) otherwise; other parameters the web client sends are ignored.

First frame (decided here): moshi's server feeds the user's first frame to Mimi and the LM, which
outputs nothing for it (the LM's delay), then resets Mimi's streaming state, so its second frame
is encoded as if it were the stream's first. That reset is a quirk of its loop (moshi's other
loops and `LMGen`'s own do not reset); omnivox runs the plain loop (`Duplex.converse`), so from
the second frame on its codes can differ from moshi's server's. What a client sees is the same:
the handshake, no output for the first frame, then one audio frame (and maybe a text piece) per
input frame. The Opus pre-skip of the input is not trimmed, as sphn does not (`audio/opus.py`).

Limits: a connection is checked as `/v1/realtime`'s (`RealtimeHub.connection_refusal`: Host,
API key, Origin; refused with the same close codes); sessions at once are bounded by
--max-realtime-sessions (default --max-running) and the engine's capacity (close 1013); a client
that sends nothing for `idle_timeout_s` (10 s; a live client sends every 80 ms) while every frame
it sent has its answer is closed with 1000; a client that stops reading (over
--realtime-send-buffer-kb unsent for --realtime-send-timeout-s) is closed with 1008 and counted in
`omnivox_slow_readers_dropped_total{api="moshi_chat"}`, as a realtime one is (`realtime/sender.py`);
a session that reaches --duplex-max-session-s of input (default: the model's maximum, 3600 s for
Moshi) is closed with 1000 once its last frame's output is sent; bad Opus closes with 4400. A
disconnect cancels the session's engine request.

Drain (`lifecycle.py`): a new connection is closed with 1013; a session that runs is a live
conversation and goes on (the drain waits for it, `Lifecycle.working`) until --drain-timeout, when
it is closed with 1012, "service restart" (`MoshiChat.cut`; an engine request a drain fails maps
to 1012 too).

NOTE: Opus decoding and encoding run on the event loop, as moshi's server runs sphn's: encoding costs
what sphn's does, decoding about twice (benchmarks/opus_frames.py: 0.45 + 2.6 ms per 80 ms frame
on a 2-core CPU at load average 7, 1.7 + 6.4 ms at 15), so one loop holds tens of sessions' Opus
on a quiet core; past that the Opus belongs in a worker pool.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, replace

from fastapi import FastAPI, WebSocket

from omnivox.api.errors import ApiError
from omnivox.api.flow import capacity_error, overloaded_error
from omnivox.api.metrics import MetricFamily
from omnivox.api.realtime.hub import RealtimeHub
from omnivox.api.realtime.inbox import Inbox
from omnivox.api.realtime.sender import Sender, close_reason
from omnivox.audio.opus import OpusStreamDecoder
from omnivox.audio.output_stream import OpusStream
from omnivox.engine.events import AudioChunk, Failed, Finished, TextDelta
from omnivox.errors import InputError, Overloaded
from omnivox.serving_duplex import DuplexModel, DuplexParams

log = logging.getLogger("omnivox.api")
HANDSHAKE, AUDIO, TEXT = b"\x00", 1, 2
QUERY = {"audio_temperature": ("temp", float), "audio_topk": ("top_k", int),
         "text_temperature": ("temp_text", float), "text_topk": ("top_k_text", int), "seed": ("seed", int)}


@dataclass(frozen=True)
class MoshiChatLimits:
    idle_timeout_s: float = 10.0  # a client that sends nothing this long is closed (serve --duplex-idle-timeout-s)


def duplex_params(query) -> DuplexParams:
    """A session's sampling from the URL's query (see the module docstring); InputError naming a bad one."""
    given = {}
    for name, (field, kind) in QUERY.items():
        raw = query.get(name)
        if raw is None:
            continue
        try:
            given[field] = kind(raw)
        except ValueError:
            raise InputError(f"query parameter {name} must be {'an integer' if kind is int else 'a number'}, "
                             f"got {raw[:20]!r}", param=name) from None
    return DuplexParams(**given)


class MoshiChat:
    """The `/api/chat` sessions of one server. `hub`: the realtime hub, whose connection checks
    and session limit apply; `dropped`: the server's count of clients dropped for not reading."""

    def __init__(self, model: DuplexModel, hub: RealtimeHub, limits: MoshiChatLimits, dropped: MetricFamily):
        self.model, self.hub, self.limits, self.dropped = model, hub, limits, dropped
        # a session's most seconds of input (serve --duplex-max-session-s; the model's own by default)
        self.max_seconds = hub.limits.duplex_max_session_s
        self.sessions: set[_Session] = set()  # connected now (a drain's timeout closes them: `cut`)
        self.active = MetricFamily("omnivox_moshi_chat_sessions_active", "/api/chat sessions connected now.", "gauge")
        self.total = MetricFamily("omnivox_moshi_chat_sessions_total", "/api/chat sessions accepted.")
        self.refused = MetricFamily("omnivox_moshi_chat_sessions_refused_total",
                                    "/api/chat connections refused, by reason.", labelled=True)
        self.idle = MetricFamily("omnivox_moshi_chat_idle_closes_total",
                                 "/api/chat sessions closed after the client sent nothing for the idle bound.")

    def render(self) -> str:
        return "\n".join(line for m in (self.active, self.total, self.refused, self.idle) for line in m.render()) + "\n"

    def refusal(self, ws: WebSocket) -> ApiError | None:
        refused = self.hub.connection_refusal(ws)
        if refused is not None:
            return refused
        if self.hub.live_sessions >= self.hub.max_sessions:
            return overloaded_error(f"server busy: {self.hub.live_sessions} sessions (at most {self.hub.max_sessions}: "
                                    "--max-realtime-sessions)")
        return capacity_error(self.model.engine)

    async def refuse(self, ws: WebSocket, refused: ApiError) -> None:
        """Accept, then close with the reason (as `/v1/realtime` refuses: 4000 + status, 1013 when busy)."""
        self.refused.inc(reason=refused.code or str(refused.status))
        await ws.accept()
        await ws.close(code=1013 if refused.status == 503 else 4000 + refused.status,
                       reason=close_reason(refused.message))

    async def serve(self, ws: WebSocket) -> None:
        refused = self.refusal(ws)
        if refused is None:
            try:
                params = replace(duplex_params(ws.query_params), max_seconds=self.max_seconds)
                self.model.check_duplex(params)
                handle, user = self.model.open_duplex(params, loop=asyncio.get_running_loop())
            except InputError as e:
                refused = ApiError(400, str(e), code="invalid_request")
            except Overloaded as e:
                refused = overloaded_error(str(e))
        if refused is not None:
            return await self.refuse(ws, refused)
        await ws.accept()
        self.hub.chat_sessions += 1
        self.total.inc()
        self.active.inc()
        session = _Session(self, ws, handle, user)
        self.sessions.add(session)
        try:
            await session.run()
        finally:
            self.sessions.discard(session)
            self.hub.chat_sessions -= 1
            self.active.inc(-1)

    def cut(self, reason: str) -> None:
        """The drain's timeout (`lifecycle.Lifecycle.cut`, on the event loop): every session still
        connected is closed with 1012, "service restart" (the engine's cut leaves a live session's
        request running: its input is still open); each ends as a client that went away does."""
        for session in list(self.sessions):
            asyncio.ensure_future(_close(session.ws, 1012, reason))


class _Session:
    """One connection: a reader task (messages into the inbox), a player task (the handle's events
    out) and the listener (the inbox's Opus decoded and pushed), until the client goes, idles, is
    dropped or the session ends."""

    def __init__(self, chat: MoshiChat, ws: WebSocket, handle, user):
        self.chat, self.ws, self.handle, self.user = chat, ws, handle, user
        self.frame_size = chat.model.frame_size
        limits = chat.hub.limits
        self.inbox = Inbox(limits.inbox_bytes)
        self.send = Sender(ws, self.inbox, limits.send_timeout_s, limits.send_buffer_bytes, chat.dropped, api="moshi_chat")
        self.samples_in = 0  # pushed to the session
        self.frames_out = 0  # audio frames sent
        self.id = uuid.uuid4().hex[:16]  # its name in /metrics' per-session families

    async def run(self) -> None:
        tasks = []
        self.chat.hub.frames.start(self.id)
        try:
            await self.send(HANDSHAKE)
            tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._play())]
            await self._listen()
        except ConnectionError:
            pass  # the client went away mid-send
        finally:
            self.handle.cancel()
            self.user.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.send.ended()
            self.chat.hub.frames.end(self.id)

    @property
    def answering(self) -> bool:
        """Whether input frames still wait for their output (the first frame has none)."""
        return self.frames_out < self.samples_in // self.frame_size - 1

    async def _read(self) -> None:
        """Binary messages into the inbox until the client goes away or, with every frame answered,
        sends nothing for the idle bound."""
        idle = self.chat.limits.idle_timeout_s
        try:
            while True:
                try:
                    async with asyncio.timeout(idle):
                        message = await self.ws.receive()
                except asyncio.TimeoutError:
                    if self.answering:  # waiting for the server is not idling
                        continue
                    self.chat.idle.inc()
                    await _close(self.ws, 1000, f"no message for {idle:g} s: the session is closed (a client sends "
                                                "its audio every 80 ms)")
                    return
                if message["type"] == "websocket.disconnect":
                    return
                data = message.get("bytes")
                if data:  # text frames and empty messages are ignored, as moshi's server does
                    await self.inbox.put(data)
        finally:
            self.inbox.close()

    async def _listen(self) -> None:
        """The user's Ogg Opus, decoded as it arrives, pushed to the session."""
        decoder = OpusStreamDecoder(self.chat.model.sample_rate)
        while (message := await self.inbox.get()) is not None:
            data = message[0]
            if data[0] != AUDIO:
                continue  # moshi's server logs unknown kinds and goes on
            try:
                pcm = decoder.push(data[1:])
            except InputError as e:
                await _close(self.ws, 4400, str(e))
                return
            if pcm.size:
                try:
                    self.user.push(pcm)
                except InputError:
                    continue  # the session reached its maximum length: the player closes the socket
                self.samples_in += pcm.size

    async def _play(self) -> None:
        """The session's events as messages: per frame its audio, then its text piece."""
        encoder, text = OpusStream(self.chat.model.sample_rate), []
        async for ev in self.handle:
            if isinstance(ev, TextDelta):
                if ev.text:
                    text.append(ev.text)
            elif isinstance(ev, AudioChunk):
                data = encoder.push(ev.samples)
                if data:
                    await self.send(bytes([AUDIO]) + data)
                self.chat.hub.frames.observe(self.id, ev)
                self.frames_out += 1
                for piece in text:
                    await self.send(bytes([TEXT]) + piece.encode())
                text.clear()
            elif isinstance(ev, Finished):
                if ev.finish_reason == "length":
                    seconds = self.chat.max_seconds or self.chat.model.max_session_seconds
                    await _close(self.ws, 1000, f"the session reached its maximum length ({seconds:g} s of "
                                                "audio, --duplex-max-session-s)")
                return
            elif isinstance(ev, Failed):
                log.warning("/api/chat session failed: %s", ev.message)
                await _close(self.ws, failed_code(ev), ev.message)
                return


def failed_code(ev: Failed) -> int:
    """The close code of a session whose engine request failed: 1012 ("service restart") when a
    drain cut it, 1011 for a server error, 4000 + status for the client's."""
    if ev.code == "draining":
        return 1012
    return 1011 if ev.status >= 500 else 4000 + ev.status


async def _close(ws: WebSocket, code: int, reason: str) -> None:
    try:
        await ws.close(code=code, reason=close_reason(reason))
    except RuntimeError:
        pass  # closed already


def mount_moshi_chat(app: FastAPI, model: DuplexModel, hub: RealtimeHub, limits: MoshiChatLimits,
                     dropped: MetricFamily) -> MoshiChat:
    chat = MoshiChat(model, hub, limits, dropped)

    @app.websocket("/api/chat")
    async def moshi_chat(ws: WebSocket):
        await chat.serve(ws)

    return chat
