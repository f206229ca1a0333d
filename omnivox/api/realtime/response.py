"""One response: the engine's events for it, as the protocol's events, and the reply item they fill.

Order of what the client gets (GA names; `protocol.BETA` renames them):
  response.created, response.output_item.added, conversation.item.added, response.content_part.added,
  then response.output_audio.delta + response.output_audio_transcript.delta (audio; pcm16 at 24 kHz,
  one delta per engine chunk) or response.output_text.delta (text), then the .done events,
  response.output_item.done, conversation.item.done and response.done (status completed,
  incomplete at max_output_tokens (`status_details.omnivox.limit`: "tokens" or "audio", the limit
  that cut it), cancelled with the reason, or failed with the error).
"""
from __future__ import annotations

import asyncio
import base64
import time
import traceback
from typing import Any, Protocol

import numpy as np

from omnivox.api.realtime.audio_input import PCM_RATE
from omnivox.api.realtime.conversation import Chunk, Conversation, ConversationOwner, ReplyItem
from omnivox.api.realtime.host import SessionHost
from omnivox.api.realtime.metrics import RealtimeMetrics
from omnivox.api.realtime.protocol import (Generation, ProtocolError, SessionConfig, new_id, parse_response_params,
                                           tokens_json)
from omnivox.audio.io import encode_pcm16
from omnivox.audio.input_stream import StreamResampler
from omnivox.engine.events import AudioChunk, Failed, Finished, TextDelta
from omnivox.engine.handle import RequestHandle
from omnivox.engine.playback import PlaybackClock
from omnivox.errors import Draining
from omnivox.serving import ServedModel


class ResponseOwner(ConversationOwner, Protocol):
    """What responses read of their session (`session.RealtimeSession` is one): its conversation and
    settings, and how it turns a generation into an engine request."""

    conversation: Conversation
    conversation_id: str
    cfg: SessionConfig
    host: SessionHost
    model: ServedModel
    metrics: RealtimeMetrics
    voices: list[str]
    default_voice: str

    async def check_generation(self, gen: Generation, param: str) -> None: ...
    async def engine_request(self, gen: Generation) -> tuple[RequestHandle, int, float | None]: ...

CANCEL_WAIT_S = 10.0  # a cancelled request ends within one engine step; this only bounds a stuck engine


class ResponseRun:
    """One response of `session`: it reads the session's dialect, conversation and metrics, and
    sends through its outbox."""

    def __init__(self, session: ResponseOwner, handle: RequestHandle, gen: Generation, item: ReplyItem,
                 speech_end: float | None, audio_tokens: int = 0):
        self.session, self.handle, self.gen, self.item = session, handle, gen, item
        self.id = new_id("resp")
        self.speech_end = speech_end  # monotonic time the user's speech ended (None: no spoken turn)
        self.audio_tokens = audio_tokens  # audio rows in the prompt (usage)
        self.cancel_reason: str | None = None
        self.finished = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.first_audio: float | None = None
        self.clock: PlaybackClock | None = PlaybackClock()  # underruns (None: the kind counts lateness itself)
        self._resampler: StreamResampler | None = None
        self._n_ids = 0

    # ---- lifecycle ----------------------------------------------------------------------------
    async def cancel(self, reason: str) -> None:
        """Cancel and wait for the end (the engine frees the request's pages within one step)."""
        if self.finished.is_set():
            return
        self.cancel_reason = self.cancel_reason or reason
        self.handle.cancel()
        try:
            async with asyncio.timeout(CANCEL_WAIT_S):
                await self.finished.wait()
        except asyncio.TimeoutError:
            pass

    async def start(self) -> None:
        s, item = self.session, self.item
        await s.out.send({"type": "response.created", "response": self.json("in_progress")})
        await s.out.send({"type": "response.output_item.added", "response_id": self.id, "output_index": 0,
                      "item": item.to_json(s.dialect)})
        prev = s.conversation.previous_id(item)
        await s.out.send({"type": "conversation.item.added", "previous_item_id": prev, "item": item.to_json(s.dialect)})
        await s.out.send(self._part_event("response.content_part.added", "", ""))

    async def run(self) -> None:
        """Forward the request's events until its end; always ends with response.done."""
        final = None
        try:
            async for ev in self.handle:
                if isinstance(ev, TextDelta):
                    await self._text(ev)
                elif isinstance(ev, AudioChunk):
                    await self._audio(ev)
                else:
                    final = ev
            await self._done(final)
        finally:
            if final is None:  # the session went away mid-response
                self.handle.cancel()
            self.finished.set()

    # ---- events -------------------------------------------------------------------------------
    def _ids(self, event_type: str, **fields) -> dict[str, Any]:
        return {"type": event_type, "response_id": self.id, "item_id": self.item.id, "output_index": 0,
                "content_index": 0, **fields}

    def _part_event(self, event_type: str, text: str, transcript: str) -> dict[str, Any]:
        part = {"type": "audio", "transcript": transcript} if self.gen.audio else {"type": "text", "text": text}
        return self._ids(event_type, part=part)

    async def _text(self, ev: TextDelta) -> None:
        item = self.item
        self._n_ids += len(ev.token_ids)
        item.ids.extend(ev.token_ids)
        item.text += ev.text
        item.deltas.append((len(item.text), self._n_ids))
        if ev.text and not self.gen.audio:
            await self.session.out.send(self._ids("response.output_text.delta", delta=ev.text))

    async def _audio(self, ev: AudioChunk) -> None:
        samples = ev.samples
        if ev.sample_rate != PCM_RATE:  # e.g. S2's 44.1 kHz: the protocol's pcm16 is 24 kHz
            if self._resampler is None:
                self._resampler = StreamResampler(ev.sample_rate, PCM_RATE)
            samples = self._resampler.push(samples)
        await self._send_audio(samples, ev.frames, ev.transcript)

    async def _send_audio(self, samples: np.ndarray, frames: int, transcript: str) -> None:
        s, item = self.session, self.item
        item.transcript += transcript
        prev = item.chunks[-1] if item.chunks else Chunk(0, 0, 0)
        item.chunks.append(Chunk(prev.frames + frames, prev.samples + len(samples), len(item.transcript)))
        if len(samples):
            await s.out.send(self._ids("response.output_audio.delta",
                                   delta=base64.b64encode(encode_pcm16(samples)).decode()))
            now = time.monotonic()
            if self.first_audio is None:
                self.first_audio = now
                if self.speech_end is not None:
                    s.metrics.ttfa.observe(max(0.0, now - self.speech_end))
            if self.clock is not None and self.clock.on_chunk(len(samples) / PCM_RATE, now):
                s.metrics.underruns.inc()
        if transcript:
            await s.out.send(self._ids("response.output_audio_transcript.delta", delta=transcript))

    async def _done(self, final: Finished | Failed | None) -> None:
        s, item = self.session, self.item
        if self._resampler is not None:
            rest = self._resampler.flush()
            if len(rest):
                await self._send_audio(rest, 0, "")
        details = None
        if isinstance(final, Finished):
            item.ids = list(final.text_ids)  # the generated ids, as the prefix cache keyed them
            item.codes = final.codes
            if self.cancel_reason is not None or final.finish_reason == "abort":
                status = "cancelled"
                details = {"type": "cancelled", "reason": self.cancel_reason or "client_cancelled"}
            elif final.finish_reason == "length":  # OpenAI's one reason for a length stop; ours says which limit
                status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens",
                                                 "omnivox": {"limit": final.limit or "tokens"}}
            else:
                status = "completed"
        else:
            status = "failed"
            message = final.message if isinstance(final, Failed) else "the response ended without a result"
            details = {"type": "failed", "error": {"type": "server_error" if not isinstance(final, Failed)
                                                   or final.status >= 500 else "invalid_request_error",
                                                   "code": "response_failed", "message": message}}
        item.status = "completed" if status == "completed" else "incomplete"
        if self.gen.audio:
            await s.out.send(self._ids("response.output_audio.done"))
            await s.out.send(self._ids("response.output_audio_transcript.done", transcript=item.transcript))
        else:
            await s.out.send(self._ids("response.output_text.done", text=item.text))
        await s.out.send(self._part_event("response.content_part.done", item.text, item.transcript))
        await s.out.send({"type": "response.output_item.done", "response_id": self.id, "output_index": 0,
                      "item": item.to_json(s.dialect)})
        await s.out.send({"type": "conversation.item.done", "previous_item_id": s.conversation.previous_id(item),
                      "item": item.to_json(s.dialect)})
        usage = self._usage(final) if isinstance(final, Finished) else None
        s.metrics.responses.inc(status=status)
        await s.out.send({"type": "response.done", "response": self.json(status, details, usage)})

    # ---- the response object ------------------------------------------------------------------
    def json(self, status: str, details: dict | None = None, usage: dict | None = None) -> dict[str, Any]:
        s, g = self.session, self.gen
        body: dict[str, Any] = {
            "id": self.id, "object": "realtime.response", "status": status, "status_details": details,
            "output": [] if status == "in_progress" else [self.item.to_json(s.dialect)],
            "conversation_id": s.conversation_id, "usage": usage, "metadata": None,
            "max_output_tokens": tokens_json(g.max_output_tokens),
            "omnivox": {"ttfa_ms": None if self.first_audio is None or self.speech_end is None
                        else round((self.first_audio - self.speech_end) * 1000, 1),
                        "audio_ms": self.item.audio_ms}}
        voice = {"format": {"type": "audio/pcm", "rate": PCM_RATE}, "voice": g.voice or s.default_voice}
        if s.dialect.beta:
            body["modalities"] = ["text", "audio"] if g.audio else ["text"]
            body["voice"], body["output_audio_format"] = voice["voice"], "pcm16"
        else:
            body["output_modalities"] = list(g.modalities)
            body["audio"] = {"output": voice}
        return body

    def _usage(self, ev: Finished) -> dict[str, Any]:
        frames = int(ev.codes.shape[0]) if ev.codes is not None and ev.codes.ndim == 2 else 0
        text_out = len(ev.text_ids)
        inp = ev.prompt_tokens
        return {"total_tokens": inp + text_out + frames, "input_tokens": inp, "output_tokens": text_out + frames,
                "input_token_details": {"text_tokens": inp - self.audio_tokens, "audio_tokens": self.audio_tokens},
                "output_token_details": {"text_tokens": text_out, "audio_tokens": frames}}


class Responses:
    """A session's responses, one at a time (`run`: the one in progress): response.create and
    response.cancel, and a turn's end under server VAD (`respond`)."""

    def __init__(self, session: ResponseOwner):
        self.session = session
        self.run: ResponseRun | None = None

    async def on_create(self, event: dict) -> None:
        s = self.session
        if self.run is not None:
            raise ProtocolError(f"response {self.run.id} is still in progress: cancel it or wait for response.done",
                                code="conversation_already_has_active_response")
        gen = parse_response_params(event.get("response"), s.cfg.gen, s.voices).within(s.host.output)
        await s.check_generation(gen, "response")
        await self.respond(gen)

    async def on_cancel(self, event: dict) -> None:
        run = self.run
        if run is None or (event.get("response_id") not in (None, run.id)):
            raise ProtocolError("there is no response in progress to cancel", code="response_cancel_not_active")
        await run.cancel("client_cancelled")

    async def respond(self, gen: Generation) -> None:
        s = self.session
        if s.model.engine.draining:  # response.create, or a turn's end under server VAD
            raise Draining("server draining: it is shutting down and starts no new response; open a new session "
                           "(a load balancer sends it to another server)")
        handle, audio_tokens, speech_end = await s.engine_request(gen)
        item = ReplyItem(new_id("item"), status="in_progress", audio=gen.audio)
        s.conversation.items.append(item)
        run = ResponseRun(s, handle, gen, item, speech_end, audio_tokens)
        self.run = run
        await run.start()
        run.task = asyncio.ensure_future(self._drive(run))

    async def _drive(self, run: ResponseRun) -> None:
        try:
            await run.run()
        except ConnectionError:  # the socket went away mid-send: the request is cancelled by run()
            pass
        except Exception as e:  # a bug ends this response only; its traceback goes to the log
            traceback.print_exception(e)
        finally:
            if self.run is run:
                self.run = None
            self.session.sync()  # a turn spoken during the response waits for it to end

    def cancel(self) -> None:
        """The session ended: the response in progress is cancelled (its pages freed)."""
        if self.run is not None:
            self.run.handle.cancel()
            if self.run.task is not None:
                self.run.task.cancel()
