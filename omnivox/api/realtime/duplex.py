"""A duplex session (a `DuplexModel`, Moshi): the model listens and speaks at once, so the session
is one open-ended response that speaks for as long as the session lasts (docs/realtime.md,
"Full-duplex models", states the whole mapping):

  - the engine request is opened before the connection is accepted (`open`: Overloaded closes it
    with 1013, as any busy refusal); session.created says `omnivox.duplex: true`, then the one
    response starts: response.created, output_item.added, conversation.item.added,
    content_part.added (an assistant message with one audio part);
  - `input_audio_buffer.append` (pcm16 at 24 kHz, any length) is pushed to the session's input as
    it arrives; per output frame (one per input frame but the first) a response.output_audio.delta
    of 1920 samples, then the frame's text piece, if any, as response.output_audio_transcript.delta;
  - `session.update` changes the sampling (session.omnivox: `temperature`/`top_k` the audio's,
    `text_temperature`/`text_top_k` the text's, `seed`, `greedy`) from the next frame on; what a
    duplex session cannot honour (turn detection, instructions, a text-only output, the turn
    kinds' omnivox fields) is refused whole with an `error` event naming the field (`duplex_session`);
  - every turn-based client event gets one `error` event (`duplex_session`); the session goes on;
  - the end: at its maximum length (RealtimeLimits.duplex_max_session_s, else the model's) the
    .done events and response.done (status incomplete, `omnivox.limit` "session"), then an `error`
    event `session_expired` and close 1001, as OpenAI's Realtime API ends a session at its duration;
    the drain's timeout (`RealtimeHub.cut`), or a failed engine request, an `error` event with its
    code (`draining`), then close 1012 for a drain (a restart) or 1011; a drain waits for a duplex
    session (`working`) as for an /api/chat one; a client that goes away cancels the engine request.

Appends are decoded on the event loop: a live client sends one 80 ms append (~5 KB of base64)
every 80 ms, whose decoding costs microseconds, less than a worker's hand-off; a batch holding
more than LOOP_DECODE_CHARS (a client catching up, one huge append) is decoded in a worker job.
"""
from __future__ import annotations

import asyncio
import math
import traceback
from dataclasses import replace
from typing import Any, Awaitable, Callable

import numpy as np

from omnivox.api.duplex_frames import DuplexFrames
from omnivox.api.realtime.audio_input import PCM_RATE, decode_appends
from omnivox.api.realtime.conversation import Conversation, ReplyItem
from omnivox.api.realtime.host import SessionHost
from omnivox.api.realtime.protocol import (DUPLEX_KEYS, OMNIVOX_KEYS, Generation, ProtocolError, SessionConfig,
                                           new_id, parse_session_update, session_json)
from omnivox.api.realtime.response import ResponseRun
from omnivox.api.realtime.session import Handler, HangUp, RealtimeSession
from omnivox.engine.events import AudioChunk, Failed, Finished, TextDelta
from omnivox.errors import InputError
from omnivox.serving_duplex import DuplexParams

CODE = "duplex_session"  # what a duplex session cannot do: one code for every refusal
TURN_EVENTS = ("input_audio_buffer.commit", "input_audio_buffer.clear", "conversation.item.create",
               "conversation.item.truncate", "conversation.item.delete", "conversation.item.retrieve",
               "response.create", "response.cancel", "output_audio_buffer.clear")
LOOP_DECODE_CHARS = 256 * 1024  # base64 of a batch of appends decoded on the loop (~2.7 s of audio)
# DuplexParams' fields by their names in session.omnivox
PARAM_NAMES = {"temp": "temperature", "top_k": "top_k", "temp_text": "text_temperature",
               "top_k_text": "text_top_k", "seed": "seed", "greedy": "greedy"}


class DuplexRun(ResponseRun):
    """The session's one response: per output frame its audio delta, then the frame's text piece
    (its TextDelta comes before the frame's audio) as a transcript delta; each frame observed by
    the hub's frame deadlines (`DuplexFrames`), which count its lateness (no playback clock)."""

    def __init__(self, session: DuplexSession, handle, gen: Generation, item: ReplyItem, frames: DuplexFrames):
        super().__init__(session, handle, gen, item, None)
        self.clock = None
        self.frames = frames
        self.frames_out = 0
        self.final: Finished | Failed | None = None
        self._piece = ""

    async def _text(self, ev: TextDelta) -> None:
        self._piece += ev.text

    async def _audio(self, ev: AudioChunk) -> None:
        piece, self._piece = self._piece, ""
        await self._send_audio(ev.samples, ev.frames, piece)
        self.frames.observe(self.session.id, ev)
        self.frames_out += 1

    async def _done(self, final: Finished | Failed | None) -> None:
        self.final = final
        if isinstance(final, Failed):  # told as an error; the session then closes (`DuplexSession._drive`)
            self.item.status = "incomplete"
            self.session.metrics.responses.inc(status="failed")
            await self.session.out.error(final.message, code=final.code or "response_failed")
            return
        if isinstance(final, Finished) and final.finish_reason == "length":
            final = replace(final, limit=final.limit or "session")  # the session's maximum length
        await super()._done(final)


class DuplexSession(RealtimeSession):
    """One duplex session (see the module docstring). `frames`: the hub's frame deadlines."""

    def __init__(self, host: SessionHost, send: Callable[[str], Awaitable[None]], beta: bool, hang_up: HangUp, *,
                 frames: DuplexFrames):
        super().__init__(host, send, beta, hang_up)
        self.frames = frames
        self.frame_size = self.model.frame_size
        # no turns, audio out, no output limit but the session's length
        self.cfg = SessionConfig(gen=Generation(max_output_tokens=math.inf), turn_detection=None,
                                 audio_window_s=host.limits.audio_window_s)
        self.conversation = Conversation(self)  # the response's reply item (`ResponseRun` reads it)
        self.default_voice = self.model.default_voice  # the response object's voice (the model has one)
        limit = host.limits.duplex_max_session_s
        self.max_seconds = self.model.max_session_seconds if limit is None else min(limit,
                                                                                    self.model.max_session_seconds)
        self.handle = self.user = self.run = None
        self.samples_in = 0  # pushed to the session's input
        self._task: asyncio.Task | None = None

    # ---- the session's life -------------------------------------------------------------------
    def open(self) -> None:
        if self.model.sample_rate != PCM_RATE:
            raise InputError(f"a duplex model at {self.model.sample_rate} Hz cannot take the protocol's "
                             f"{PCM_RATE} Hz pcm16")
        self.handle, self.user = self.model.open_duplex(DuplexParams(max_seconds=self.max_seconds), loop=self.loop,
                                                        request_id=self.id)
        self.frames.start(self.id)  # `close` ends it

    async def start(self) -> None:
        await super().start()
        item = ReplyItem(new_id("item"), status="in_progress", audio=True)
        self.conversation.items.append(item)
        self.run = DuplexRun(self, self.handle, self.cfg.gen, item, self.frames)
        await self.run.start()
        self._task = asyncio.ensure_future(self._drive(self.run))

    async def _drive(self, run: DuplexRun) -> None:
        """The response until its end, then the socket closed with what ended it."""
        try:
            await run.run()
        except ConnectionError:
            return  # the client went away: the session ends
        except Exception as e:  # a bug ends the session; its traceback goes to the log
            traceback.print_exception(e)
            return await self.hang_up(1011, "server error")
        final = run.final
        if isinstance(final, Failed):
            await self.hang_up(1012 if final.code == "draining" else 1011, final.message)
        elif isinstance(final, Finished) and final.finish_reason == "length":
            # as OpenAI's Realtime API ends a session at its maximum duration: an error event, then 1001
            reason = f"the session reached its maximum length ({self.max_seconds:g} s of audio)"
            await self.out.tell(reason, code="session_expired")
            await self.hang_up(1001, reason)
        else:
            await self.hang_up(1000, "the session ended")

    async def close(self) -> None:
        await super().close()
        if self.handle is not None:
            self.handle.cancel()
            self.user.close()
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.frames.end(self.id)

    @property
    def busy(self) -> bool:
        """Frames sent wait for their answer (the first frame has none): the client is not idle."""
        run = self.run
        return run is not None and not run.finished.is_set() and \
            run.frames_out < self.samples_in // self.frame_size - 1

    @property
    def working(self) -> bool:
        """A live conversation: a drain waits for it (until --drain-timeout, then `cut`), as for /api/chat's."""
        return self.run is not None and not self.run.finished.is_set()

    def cut(self, reason: str) -> None:
        """The drain's timeout: an `error` event (`draining`), then close 1012 ("service restart").
        NOTE: the engine's cut leaves a live session's request running (its input is still open)."""
        async def end() -> None:
            await self.out.tell(reason, code="draining")
            await self.hang_up(1012, reason)
        if self.working:
            asyncio.ensure_future(end())

    # ---- client events ------------------------------------------------------------------------
    def handlers(self) -> dict[str, Handler]:
        return {"session.update": self.on_session_update, **{t: self.turn_based for t in TURN_EVENTS}}

    async def turn_based(self, event: dict) -> None:
        raise ProtocolError(f"{event['type']} is turn-based; this is a full-duplex session: it listens to "
                            "input_audio_buffer.append and speaks all along in its one response (session.update "
                            "changes its sampling)", code=CODE)

    async def on_appends(self, batch: list[tuple[dict, float]]) -> None:
        datas = [self._append_data(event) for event, _ in batch]
        if sum(len(d) for d in datas if isinstance(d, str)) <= LOOP_DECODE_CHARS:
            pcms = decode_appends(datas)
        else:
            pcms = await self.work(decode_appends, datas)
        for (event, _), pcm in zip(batch, pcms):
            if isinstance(pcm, Exception):
                await self.out.report(pcm, event)
                continue
            self.metrics.input_seconds.inc(len(pcm) / PCM_RATE)
            try:
                self.user.push(pcm.astype(np.float32) / 32768.0)
            except InputError:
                continue  # the session reached its maximum length: its response ends it
            self.samples_in += len(pcm)

    async def on_session_update(self, event: dict) -> None:
        """All or nothing: what a duplex session cannot honour, or a bad value, refuses the whole
        update with an `error` event naming the field."""
        s = event.get("session")
        ext = s.get("omnivox") if isinstance(s, dict) else None
        if isinstance(ext, dict):
            for k in OMNIVOX_KEYS:
                if k not in DUPLEX_KEYS and ext.get(k) is not None:
                    raise self._cannot(f"session.omnivox.{k}", f"{k} is a turn-based session's setting")
        cfg = parse_session_update(s, self.cfg, [], self.host.limits.max_window_s)
        if cfg.turn_detection is not None:
            where = "session.turn_detection" if "turn_detection" in s else "session.audio.input.turn_detection"
            raise self._cannot(where, "it has no turns to detect (turn_detection must be null)")
        if cfg.gen.instructions:
            raise self._cannot("session.instructions", "it takes no instructions")
        if not cfg.gen.audio:
            param = "session.modalities" if "modalities" in s else "session.output_modalities"
            raise self._cannot(param, "it speaks: its output is audio (with its transcript)")
        g = cfg.gen
        params = self._params(g)
        try:
            self.model.check_duplex(params)
            self.user.update(params)
        except InputError as e:
            raise _refused(e) from None
        self.cfg = replace(cfg, gen=replace(g, max_output_tokens=math.inf))
        await self.out.send({"type": "session.updated", "session": self.session_json()})

    @staticmethod
    def _params(g: Generation) -> DuplexParams:
        try:
            return DuplexParams(greedy=g.greedy, seed=g.seed, temp=g.temperature, temp_text=g.text_temperature,
                                top_k=g.top_k, top_k_text=g.text_top_k)
        except InputError as e:
            raise _refused(e) from None

    def _cannot(self, param: str, why: str) -> ProtocolError:
        return ProtocolError(f"{param}: a full-duplex session cannot take it: {why}; nothing was applied",
                             param=param, code=CODE)

    def session_json(self) -> dict[str, Any]:
        g = self.cfg.gen
        d = self.model.default_params  # what a value left unset means: the checkpoint's
        unset = {"temperature": d.temp, "top_k": d.top_k, "text_temperature": d.temp_text, "text_top_k": d.top_k_text}
        ext = {"duplex": True, "listens": True, "frame_samples": self.frame_size, "max_session_s": self.max_seconds,
               **{k: unset.get(k) if getattr(g, k) is None else getattr(g, k) for k in DUPLEX_KEYS}}
        return session_json(self.id, self.host.served_name, self.cfg, self.dialect, ext, None)


def _refused(e: InputError) -> ProtocolError:
    """A sampling value the session refuses, named as the client set it (`session.omnivox.*`)."""
    name = PARAM_NAMES.get(e.param or "")
    return ProtocolError(str(e), param=f"session.omnivox.{name}" if name else None, code=e.code or "invalid_value")
