"""`POST /v1/chat/completions`: one request from HTTP body to engine and back.

1. Parse and validate the body (ApiError 400/404 with the field to fix).
2. Featurise media and build the prompt in a worker thread (`ChatModel.prepare_chat`): the event loop
   never runs model or feature work; the engine thread runs all model work. The prompt's length
   then fixes max_tokens: within the context it leaves (`api/output_limits.py`).
3. Submit to the engine (503 when over max_running + max_queue) and wait for the first event,
   so a request the engine rejects at admission still gets a proper 4xx before any byte is sent.
4. Non-streaming: collect the events into one completion. Streaming: forward each event as an
   SSE chunk the moment it arrives (the first audio chunk is one decoded frame); every chunk
   carries the peers' top-level `modality` ("text" or "audio": one modality per chunk), and with
   `audio.format` "wav" each `delta.audio.data` is a complete wav file (pcm16: raw pcm).
A client that goes away at any point cancels its request, which frees its KV pages.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import AsyncIterator

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from omnivox.api import responses as R
from omnivox.api.admission import Pools
from omnivox.api.convert import Plan, decode_media_base64, has_media, plan_request
from omnivox.api.dialects import VoiceAliases
from omnivox.api.flow import (ClientGone, capacity_error, chain, failed_error, guard, observe_audio_done,
                              observe_chunk, overloaded_error)
from omnivox.api.errors import ApiError, error_body, from_validation
from omnivox.api.hooks import GuardedHook, HookFactory
from omnivox.api.media import MediaReader
from omnivox.api.metrics import ServerMetrics
from omnivox.api.output_limits import OutputLimits
from omnivox.api.protocol import ChatRequest
from omnivox.api.streaming import DONE, SSEResponse, sse
from omnivox.audio.encode import encode
from omnivox.audio.io import encode_pcm16, encode_wav
from omnivox.errors import Overloaded
from omnivox.engine.events import AudioChunk, Event, Failed, Finished, TextDelta
from omnivox.engine.playback import PlaybackClock
from omnivox.errors import ContextTooLong, InputError
from omnivox.serving import ChatModel, PreparedChat

log = logging.getLogger("omnivox.api")
ENCODED = {"pcm16": "pcm"}  # chat's format names -> audio.encode's


class ChatService:
    def __init__(self, model: ChatModel, served_name: str, metrics: ServerMetrics,
                 hook_factory: HookFactory | None = None, pools: Pools | None = None,
                 aliases: VoiceAliases | None = None, media: MediaReader | None = None,
                 limits: OutputLimits | None = None):
        self.model, self.served_name, self.metrics = model, served_name, metrics
        self.limits = limits or OutputLimits.for_model(model)
        self.hook_factory = hook_factory
        self.pools = pools or Pools.create()
        self.aliases, self.media = aliases or VoiceAliases(model.builtin_voices), media or MediaReader()

    async def create(self, request: Request):
        arrival = time.monotonic()
        raw = await request.body()
        self._check_capacity()
        loop = asyncio.get_running_loop()
        # parsing, planning (which tokenizes talker_instruction) and featurising run in a worker:
        # the event loop never does work that grows with the body
        req, plan = await self.pools.requests.run(self._plan, raw)
        if plan.clamped:
            self.metrics.clamped.inc(field=plan.clamped)
        # media decoding has its own bounded pool: a burst of it never delays text-only requests
        pool = self.pools.media if has_media(plan.messages) else self.pools.requests
        prepared = await pool.run(self._prepare, plan)
        if await request.is_disconnected():
            raise ClientGone()
        handle = self._submit(prepared, plan, self._hook(raw, plan), loop)
        events = handle.__aiter__()
        first = await guard(events.__anext__(), request, handle, self.metrics)
        if isinstance(first, Failed):
            raise failed_error(first)
        now = int(time.time())
        ids = R.ReplyIds(f"chatcmpl-{uuid.uuid4().hex}", f"audio_{uuid.uuid4().hex}", now, self.served_name)
        headers = {"X-Omnivox-Warning": plan.warning} if plan.warning else None
        if req.stream:
            return SSEResponse(self._stream(ids, req, plan, first, events, arrival), on_close=handle.cancel,
                               headers=headers)
        body = await guard(self._collect(ids, plan, first, events, arrival), request, handle, self.metrics)
        return JSONResponse(body, headers=headers)

    # ---- steps -------------------------------------------------------------------------------
    def _check_capacity(self) -> None:  # cheap early refusal, before featurising
        error = capacity_error(self.model.engine)
        if error is not None:
            raise error

    def _plan(self, raw: bytes) -> tuple[ChatRequest, Plan]:  # worker thread
        try:
            req = ChatRequest.model_validate_json(raw)
        except ValidationError as e:
            raise from_validation(e) from None
        return req, plan_request(req, self.model, self.served_name, self.aliases, self.media, self.limits)

    def _prepare(self, plan: Plan) -> PreparedChat:  # worker thread
        decode_media_base64(plan.messages)
        try:
            prepared = self.model.prepare_chat(plan.messages, plan.params)
        except ContextTooLong as e:
            raise ApiError(400, f"{e}; shorten the messages", param="messages",
                           code="context_length_exceeded") from None
        except InputError as e:
            raise ApiError(400, str(e), param="messages", code="invalid_value") from None
        plan.fit(self.limits, prepared)  # max_tokens within the context the prompt leaves
        return prepared

    def _hook(self, raw: bytes, plan: Plan):
        if self.hook_factory is None or plan.audio_format is None:
            return None
        try:
            hook = self.hook_factory(json.loads(raw))
        except Exception as e:  # its text stays in the server log
            log.exception("the text hook plug-in's factory raised")
            raise ApiError(500, f"the server's text hook plug-in failed ({type(e).__name__}); see the server "
                                "log") from None
        return GuardedHook(hook) if hook is not None else None

    def _submit(self, prepared: PreparedChat, plan: Plan, hook, loop):
        try:
            return self.model.submit_chat(prepared, max_tokens=plan.reply_tokens, text_hook=hook, loop=loop)
        except Overloaded as e:
            raise overloaded_error(str(e)) from None
        except InputError as e:
            raise ApiError(400, str(e)) from None


    # ---- replies -----------------------------------------------------------------------------
    async def _collect(self, ids: R.ReplyIds, plan: Plan, first: Event, events, arrival: float) -> dict:
        chunks: list[np.ndarray] = []
        seen = False
        async for ev in chain(first, events):
            if isinstance(ev, TextDelta):
                seen = self._first_token(ev, arrival, seen)
            elif isinstance(ev, AudioChunk):
                chunks.append(ev.samples)
            elif isinstance(ev, Failed):
                raise failed_error(ev)
            elif isinstance(ev, Finished):
                if ev.first_audio_time is not None:
                    self.metrics.ttfa.observe(max(0.0, ev.first_audio_time - arrival))
                self._finished(ev, arrival)
                audio = None
                if plan.audio_format is not None:  # encoding a long reply takes a while: off the loop
                    samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
                    fmt = ENCODED.get(plan.audio_format, plan.audio_format)
                    data = await self.pools.requests.run(encode, fmt, samples, self.model.sample_rate)
                    audio = R.audio_object(ids, data, ev.transcript)
                return R.completion(ids, ev, audio, plan.instruction_tokens)
        raise ApiError(500, "the request ended without a result")

    async def _stream(self, ids: R.ReplyIds, req: ChatRequest, plan: Plan, first: Event, events,
                      arrival: float) -> AsyncIterator[bytes]:
        clock, done, seen = PlaybackClock(), False, False
        try:
            yield sse(R.chunk(ids, {"role": "assistant", "content": ""}))
            async for ev in chain(first, events):
                if isinstance(ev, TextDelta):
                    seen = self._first_token(ev, arrival, seen)
                    if ev.text:
                        yield sse(R.chunk(ids, {"content": ev.text}))
                elif isinstance(ev, AudioChunk):
                    yield self._audio_delta(ids, plan, ev, clock, arrival)
                elif isinstance(ev, Finished):
                    done = True
                    self._finished(ev, arrival, clock)
                    yield sse(R.chunk(ids, {}, ev.finish_reason))
                    if req.include_usage:
                        yield sse(R.usage_chunk(ids, ev, plan.instruction_tokens))
                elif isinstance(ev, Failed):
                    done = True
                    self.metrics.completions.inc(finish_reason="error")
                    yield sse(error_body(ev.status, ev.message, code=ev.code or "request_failed"))
            yield DONE
        finally:
            if not done:  # the client went away (or the stream was cut): free the request now
                self.metrics.disconnects.inc()

    def _audio_delta(self, ids: R.ReplyIds, plan: Plan, ev: AudioChunk, clock: PlaybackClock, arrival: float) -> bytes:
        observe_chunk(self.metrics, ev, clock, arrival)
        wav = plan.audio_format == "wav"
        data = encode_wav(ev.samples, self.model.sample_rate) if wav else encode_pcm16(ev.samples)
        return sse(R.chunk(ids, {"audio": R.audio_object(ids, data, ev.transcript)}, modality="audio"))

    # ---- metrics -----------------------------------------------------------------------------
    def _first_token(self, ev: TextDelta, arrival: float, seen: bool) -> bool:
        """Observe TTFT at the first delta carrying a token; returns whether one was seen."""
        if not seen and ev.token_ids:
            self.metrics.ttft.observe(max(0.0, ev.time - arrival))
            return True
        return seen

    def _finished(self, ev: Finished, arrival: float, clock: PlaybackClock | None = None) -> None:
        m = self.metrics
        m.completions.inc(finish_reason=ev.finish_reason)
        m.prompt_tokens.inc(ev.prompt_tokens)
        m.completion_tokens.inc(len(ev.text_ids))
        observe_audio_done(m, ev, arrival, clock)
