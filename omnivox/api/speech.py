"""`POST /v1/audio/speech`: text to speech on any family, as the OpenAI client calls it.

The loaded model's `speech()` (`omnivox.serving.ServedModel`) decides what a voice is (Qwen3-Omni:
a speaker, the Talker voicing `input` directly with no Thinker; Fish S2, a `VoiceCloner`:
`default`, a saved voice, or per-request `references`, an extension that clones a voice) and
refuses what it cannot do; this module validates the request's shape, resolves saved voices and
streams the reply.

Replies: without `stream_format` one whole file (`response_format` mp3, OpenAI's default; wav
with exact sizes, flac, Ogg Opus or raw pcm; `audio.encode`); `stream_format: "audio"` (or the
extension `stream: true`) streams the bytes as they are decoded (`audio.output_stream`: wav a
header with unknown sizes 0xFFFFFFFF, then pcm16 frames; pcm raw little-endian int16; mp3 frames;
Ogg Opus with a page per chunk); a request that fails mid-stream has its response cut (no final
chunk: the client's read raises); `stream_format: "sse"` sends `speech.audio.delta` events
(base64 pcm16; mp3/opus: the stream's bytes) then `speech.audio.done`. The audio is mono at the
model's own rate (Qwen3-Omni 24 kHz, S2 44.1 kHz; Opus at 48 kHz where it lacks the rate;
header X-Sample-Rate). The peers' fields (`ref_audio`, `max_new_tokens`, ...) are mapped by
`api/dialects.py`. A client that disconnects cancels its request.
"""
from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from omnivox.api.admission import Pools
from omnivox.api.dialects import (PEER_SPEECH, RefSource, VoiceAliases, alias_of, check_peer_fields,
                                  reference_sources, with_source_param)
from omnivox.api.flow import (ClientGone, capacity_error, chain, failed_error, guard, observe_audio_done,
                              observe_chunk, overloaded_error)
from omnivox.api.errors import ApiError, error_body, from_validation
from omnivox.api.media import MediaReader
from omnivox.api.metrics import ServerMetrics
from omnivox.api.output_limits import OutputLimits
from omnivox.api.protocol import SpeechRequest
from omnivox.api.streaming import SSEResponse, StreamFailed
from omnivox.api.voices import NAME_RE, VoiceStore
from omnivox.audio.encode import MEDIA_TYPES, encode, opus_rate
from omnivox.audio.io import encode_pcm16
from omnivox.audio.output_stream import FormatStream, format_stream
from omnivox.engine.events import AudioChunk, Event, Failed, Finished
from omnivox.engine.playback import PlaybackClock
from omnivox.errors import InputError, Overloaded
from omnivox.serving import ServedModel, SpeechParams, VoiceCloner

MAX_INPUT_CHARS = 4096  # OpenAI's documented limit
FORMATS = ("mp3", "wav", "pcm", "flac", "opus")
STREAM_FORMATS = ("audio", "sse")


@dataclass
class SpeechPlan:
    """One validated request: what to pass to `model.speech` and how to answer."""

    text: str
    fmt: str  # mp3 | wav | pcm | flac | opus
    stream: str | None  # None | "audio" | "sse"
    params: SpeechParams = SpeechParams()
    voice: Any = None  # a built-in voice's name, or a saved voice (the model's object)
    refs: list[RefSource] = field(default_factory=list)  # read in the worker thread that submits
    warning: str | None = None  # sent as the X-Omnivox-Warning header
    clamped: str | None = None  # an "at most" field clamped to the server's limit (omnivox_requests_clamped_total)


class SpeechService:
    def __init__(self, model: ServedModel, served_name: str, metrics: ServerMetrics, pools: Pools,
                 voices: VoiceStore | None, aliases: VoiceAliases | None = None, media: MediaReader | None = None,
                 limits: OutputLimits | None = None):
        self.model, self.served_name = model, served_name
        self.limits = limits or OutputLimits.for_model(model)
        self.metrics, self.pools, self.voices = metrics, pools, voices
        self.sample_rate = int(model.sample_rate)
        self.aliases = aliases or VoiceAliases(model.builtin_voices)
        self.media = media or MediaReader()

    async def create(self, request: Request):
        arrival = time.monotonic()
        raw = await request.body()
        try:
            req = SpeechRequest.model_validate_json(raw)
        except ValidationError as e:
            raise from_validation(e) from None
        plan = self.plan(req)
        if plan.clamped:
            self.metrics.clamped.inc(field=plan.clamped)
        self._check_capacity()
        loop = asyncio.get_running_loop()
        # references are encoded with the codec while submitting: the voice pool's work
        pool = self.pools.voice if plan.refs else self.pools.requests
        handle = await pool.run(self._submit, plan, loop)
        if await request.is_disconnected():
            handle.cancel()
            raise ClientGone()
        events = handle.__aiter__()
        first = await guard(events.__anext__(), request, handle, self.metrics)
        if isinstance(first, Failed):
            raise failed_error(first)
        rate = opus_rate(self.sample_rate) if plan.fmt == "opus" else self.sample_rate
        headers = {"X-Sample-Rate": str(rate), **({"X-Omnivox-Warning": plan.warning} if plan.warning else {})}
        if plan.stream == "sse":
            return SSEResponse(self._sse(plan, first, events, arrival), on_close=handle.cancel, headers=headers)
        if plan.stream == "audio":
            return SSEResponse(self._audio_stream(plan, first, events, arrival), on_close=handle.cancel,
                               media_type=MEDIA_TYPES[plan.fmt], headers=headers)
        samples, fin = await guard(self._collect(first, events, arrival), request, handle, self.metrics)
        data = await self.pools.requests.run(encode, plan.fmt, samples, self.sample_rate)
        return Response(data, media_type=MEDIA_TYPES[plan.fmt],
                        headers={**headers, "X-Omnivox-Finish-Reason": fin.finish_reason})

    # ---- validation --------------------------------------------------------------------------
    def plan(self, req: SpeechRequest) -> SpeechPlan:
        if req.model is not None and req.model != self.served_name:
            raise ApiError(404, f"model {req.model!r} is not served here; this server serves {self.served_name!r} "
                                "(see GET /v1/models)", param="model", code="model_not_found")
        if not req.input.strip():
            raise ApiError(400, "input is empty: send the text to speak", param="input", code="invalid_value")
        if len(req.input) > MAX_INPUT_CHARS:
            raise ApiError(400, f"input is {len(req.input)} characters; the limit is {MAX_INPUT_CHARS}",
                           param="input", code="input_too_long")
        fmt = req.response_format.lower()
        if fmt not in FORMATS:
            raise ApiError(400, f"response_format {req.response_format!r} is not supported; use one of: "
                                f"{', '.join(FORMATS)}", param="response_format", code="unsupported_audio_format")
        if req.speed is not None and req.speed != 1.0:
            raise ApiError(400, "speed other than 1.0 is not supported; remove `speed`", param="speed",
                           code="unsupported_parameter")
        stream = req.stream_format
        if stream is not None and stream not in STREAM_FORMATS:
            raise ApiError(400, f"stream_format {stream!r} is not supported; use 'audio' or 'sse'",
                           param="stream_format", code="invalid_value")
        if stream is None and req.stream:
            stream = "audio"
        if stream is not None and fmt == "flac":
            raise ApiError(400, "flac cannot be streamed; stream wav, pcm, mp3 or opus, or drop stream_format for "
                                "a whole flac file", param="response_format", code="unsupported_audio_format")
        check_peer_fields(req, PEER_SPEECH)
        if req.sample_rate is not None and req.sample_rate not in (self.sample_rate, opus_rate(self.sample_rate)):
            raise ApiError(400, f"sample_rate {req.sample_rate} is not supported: this model speaks at "
                                f"{self.sample_rate} Hz (drop sample_rate)", param="sample_rate",
                           code="unsupported_parameter")
        name = self._voice_name(self._voice_field(req))
        refs = self._references(req, saved_voice=self.voices is not None and name != "default")
        voice = self._voice(name)
        frames, clamped = self._frames(req)
        try:
            params = SpeechParams(seed=req.seed, max_frames=frames, temperature=req.temperature, top_p=req.top_p,
                                  top_k=req.top_k, repetition_penalty=req.repetition_penalty,
                                  instructions=req.instructions or None,
                                  playing=stream is not None)  # streamed audio: its client plays it (serving.PLAYING)
        except InputError as e:
            raise ApiError(400, str(e), param=e.param, code=e.code or "invalid_value") from None
        warnings = [w for w in (clamped, _ref_text_warning(req, name, voice)) if w]
        return SpeechPlan(req.input, fmt, stream, params, voice, refs, "; ".join(warnings) or None,
                          "max_new_tokens" if clamped else None)

    def _frames(self, req: SpeechRequest) -> tuple[int, str | None]:
        """The frames to generate, and a note when clamped: omnivox's `max_frames` above the limit is
        a 400; the peers' `max_new_tokens` alone means "at most" and is clamped to it."""
        at_most = req.max_frames is None
        return self.limits.frames(alias_of(req, "max_frames", "max_new_tokens"),
                                  "max_new_tokens" if at_most else "max_frames", at_most)

    @staticmethod
    def _voice_field(req: SpeechRequest) -> str:
        """`voice`, or SGLang-Omni's `speaker` when voice is left at default."""
        name = req.voice_name
        if req.speaker is None or req.speaker == name:
            return name
        if name != "default":
            raise ApiError(400, f"speaker ({req.speaker!r:.40}) and voice ({name!r:.40}) disagree; send one of them",
                           param="speaker", code="invalid_value")
        return req.speaker

    def _references(self, req: SpeechRequest, saved_voice: bool) -> list[RefSource]:
        refs = reference_sources(req, saved_voice)
        peer = next((r for r in refs if r.kind != "base64"), None)
        if peer is not None and not isinstance(self.model, VoiceCloner):  # refused before any file is read
            raise ApiError(400, f"{peer.param} asks for voice cloning, which {self.model.family.label} does not do; "
                                f"use one of its voices: {', '.join(self.model.builtin_voices)}", param=peer.param,
                           code="voices_unsupported")
        return refs

    def _voice_name(self, name: str) -> str:
        """The voice `name` means: a saved voice's own name, else what OpenAI's voice names (and
        --voice-alias names) stand for."""
        if self.voices is None or name not in self.voices.names():
            name = self.aliases.resolve(name)
        return name

    def _voice(self, name: str):
        """A saved voice (models with cloning) by name, else the name for the model to check."""
        if self.voices is not None and name != "default":
            if not NAME_RE.fullmatch(name) or name not in self.voices.names():
                raise ApiError(400, f"unknown voice {name!r:.80}; use 'default' or a saved voice "
                                    "(GET /v1/audio/voices)", param="voice", code="invalid_voice")
            try:
                return self.model.voice_from_bytes(self.voices.load(name))
            except InputError as e:
                raise ApiError(500, f"saved voice {name!r} is unreadable: {e}") from None
        return name

    def _check_capacity(self) -> None:  # cheap early refusal, before reading references
        error = capacity_error(self.model.engine)
        if error is not None:
            raise error

    # ---- running -----------------------------------------------------------------------------
    def _submit(self, plan: SpeechPlan, loop):  # worker thread: reads and encodes references, builds the prompt
        references = [src.load(self.media) for src in plan.refs]
        try:
            return self.model.speech(plan.text, plan.params, voice=plan.voice, references=references, loop=loop)
        except Overloaded as e:
            raise overloaded_error(str(e)) from None
        except InputError as e:
            e = with_source_param(e, plan.refs)
            raise ApiError(400, str(e), param=e.param, code=e.code or "invalid_value") from None

    async def _collect(self, first: Event, events, arrival: float) -> tuple[np.ndarray, Finished]:
        chunks: list[np.ndarray] = []
        async for ev in chain(first, events):
            if isinstance(ev, AudioChunk):
                chunks.append(ev.samples)
            elif isinstance(ev, Failed):
                raise failed_error(ev)
            elif isinstance(ev, Finished):
                if ev.first_audio_time is not None:
                    self.metrics.ttfa.observe(max(0.0, ev.first_audio_time - arrival))
                self._finished(ev, arrival)
                return np.concatenate(chunks) if chunks else np.zeros(0, np.float32), ev
        raise ApiError(500, "the request ended without a result")

    async def _audio_stream(self, plan: SpeechPlan, first: Event, events, arrival: float) -> AsyncIterator[bytes]:
        clock, done = PlaybackClock(), False
        fmt_stream = format_stream(plan.fmt, self.sample_rate)
        try:
            head = fmt_stream.push(np.zeros(0, np.float32))  # wav / Ogg headers before the first audio
            if head:
                yield head
            async for ev in chain(first, events):
                if isinstance(ev, AudioChunk):
                    data = self._chunk(ev, clock, arrival, fmt_stream)
                    if data:
                        yield data
                elif isinstance(ev, Finished):
                    done = True
                    self._finished(ev, arrival, clock)
                    tail = fmt_stream.close()  # mp3 / Opus: the codec's last frames
                    if tail:
                        yield tail
                elif isinstance(ev, Failed):  # raw bytes cannot carry an error: the response is cut
                    done = True
                    self.metrics.speech.inc(finish_reason="error")
                    raise StreamFailed(ev.status, ev.message)
        finally:
            if not done:
                self.metrics.disconnects.inc()

    async def _sse(self, plan: SpeechPlan, first: Event, events, arrival: float) -> AsyncIterator[bytes]:
        clock, done = PlaybackClock(), False
        # pcm and wav deltas are raw pcm16; mp3 and opus deltas are the pieces of one encoded stream
        fmt_stream = format_stream(plan.fmt, self.sample_rate) if plan.fmt in ("mp3", "opus") else None
        try:
            async for ev in chain(first, events):
                if isinstance(ev, AudioChunk):
                    data = self._chunk(ev, clock, arrival, fmt_stream)
                    if data:
                        yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
                elif isinstance(ev, Finished):
                    done = True
                    self._finished(ev, arrival, clock)
                    tail = fmt_stream.close() if fmt_stream is not None else b""
                    if tail:
                        yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(tail).decode("ascii")})
                    frames = int(ev.codes.shape[0])
                    yield _event({"type": "speech.audio.done", "finish_reason": ev.finish_reason, "usage": {
                        "input_tokens": ev.prompt_tokens, "output_tokens": frames,
                        "total_tokens": ev.prompt_tokens + frames}})
                elif isinstance(ev, Failed):
                    done = True
                    self.metrics.speech.inc(finish_reason="error")
                    yield _event({"type": "error", **error_body(ev.status, ev.message, code=ev.code or "request_failed")})
        finally:
            if not done:
                self.metrics.disconnects.inc()

    def _chunk(self, ev: AudioChunk, clock: PlaybackClock, arrival: float,
               fmt_stream: FormatStream | None = None) -> bytes:
        observe_chunk(self.metrics, ev, clock, arrival)
        return fmt_stream.push(ev.samples) if fmt_stream is not None else encode_pcm16(ev.samples)

    def _finished(self, ev: Finished, arrival: float, clock: PlaybackClock | None = None) -> None:
        m = self.metrics
        m.speech.inc(finish_reason=ev.finish_reason)
        observe_audio_done(m, ev, arrival, clock)


def _ref_text_warning(req: SpeechRequest, name: str, voice) -> str | None:
    """vLLM-Omni's clients send a saved voice's name with `ref_text` (and no `ref_audio`): the saved
    voice is used with its own transcript, which belongs to its audio; a different `ref_text` is said
    to be ignored."""
    if req.ref_text is None or req.ref_audio is not None or isinstance(voice, str):
        return None
    if req.ref_text.strip() == voice.text.strip():
        return None
    return f"ref_text ignored: the saved voice {name!r} speaks with its own transcript"


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
