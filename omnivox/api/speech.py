"""`POST /v1/audio/speech`: text to speech on any family, as the OpenAI client calls it.

The loaded model's `speech()` decides what a voice is (Qwen3-Omni: a speaker, the Talker voicing
`input` directly with no Thinker; Fish S2: `default`, a saved voice, or per-request
`references`, an extension that clones a voice) and refuses what it cannot do; this module
validates the request's shape, resolves saved voices and streams the reply.

Replies: without `stream_format` one whole file (wav with exact sizes, flac, or raw pcm);
`stream_format: "audio"` (or the extension `stream: true`) streams the bytes as they are decoded
(wav: a header with unknown sizes 0xFFFFFFFF, then pcm16 frames; pcm: raw little-endian int16);
a request that fails mid-stream has its response cut (no final chunk: the client's read raises);
`stream_format: "sse"` sends `speech.audio.delta` events (base64 pcm16) then `speech.audio.done`.
The audio is mono at the model's own rate (Qwen3-Omni 24 kHz, S2 44.1 kHz; header X-Sample-Rate).
A client that disconnects cancels its request.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import struct
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from omnivox.api.admission import Pools
from omnivox.api.flow import (ClientGone, chain, failed_error, guard, observe_audio_done, observe_chunk,
                              overloaded_error)
from omnivox.api.errors import ApiError, error_body, from_validation
from omnivox.api.metrics import ServerMetrics
from omnivox.api.protocol import SpeechRequest
from omnivox.api.streaming import PlaybackClock, SSEResponse, StreamFailed
from omnivox.api.voices import NAME_RE, VoiceStore
from omnivox.audio.io import encode_flac, encode_pcm16
from omnivox.engine.events import AudioChunk, Event, Failed, Finished
from omnivox.errors import InputError, Overloaded

MAX_INPUT_CHARS = 4096  # OpenAI's documented limit
FORMATS = ("wav", "pcm", "flac")
STREAM_FORMATS = ("audio", "sse")
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}
UNKNOWN_SIZE = 0xFFFFFFFF


def wav_header(sample_rate: int, data_bytes: int | None = None) -> bytes:
    """The 44-byte header of a mono 16-bit PCM wav; sizes 0xFFFFFFFF when the length is unknown (streaming)."""
    riff = UNKNOWN_SIZE if data_bytes is None else 36 + data_bytes
    data = UNKNOWN_SIZE if data_bytes is None else data_bytes
    fmt = struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + fmt + b"data" + struct.pack("<I", data)


@dataclass
class SpeechPlan:
    """One validated request: what to pass to `model.speech` and how to answer."""

    text: str
    fmt: str  # wav | pcm | flac
    stream: str | None  # None | "audio" | "sse"
    kwargs: dict[str, Any] = field(default_factory=dict)  # model.speech keywords


class SpeechService:
    def __init__(self, model, served_name: str, metrics: ServerMetrics, pools: Pools, voices: VoiceStore | None):
        self.model, self.served_name = model, served_name
        self.metrics, self.pools, self.voices = metrics, pools, voices
        self.sample_rate = int(model.sample_rate)

    async def create(self, request: Request):
        arrival = time.monotonic()
        raw = await request.body()
        try:
            req = SpeechRequest.model_validate_json(raw)
        except ValidationError as e:
            raise from_validation(e) from None
        plan = self.plan(req)
        self._check_capacity()
        loop = asyncio.get_running_loop()
        # references are encoded with the codec while submitting: the voice pool's work
        pool = self.pools.voice if plan.kwargs["references"] else self.pools.requests
        handle = await pool.run(self._submit, plan, loop)
        if await request.is_disconnected():
            handle.cancel()
            raise ClientGone()
        events = handle.__aiter__()
        first = await guard(events.__anext__(), request, handle, self.metrics)
        if isinstance(first, Failed):
            raise failed_error(first)
        headers = {"X-Sample-Rate": str(self.sample_rate)}
        if plan.stream == "sse":
            return SSEResponse(self._sse(first, events, arrival), on_close=handle.cancel, headers=headers)
        if plan.stream == "audio":
            return SSEResponse(self._audio_stream(plan, first, events, arrival), on_close=handle.cancel,
                               media_type=MEDIA_TYPES[plan.fmt], headers=headers)
        samples = await guard(self._collect(first, events, arrival), request, handle, self.metrics)
        data = await self.pools.requests.run(self._encode, plan.fmt, samples)
        return Response(data, media_type=MEDIA_TYPES[plan.fmt], headers=headers)

    # ---- validation --------------------------------------------------------------------------
    def plan(self, req: SpeechRequest) -> SpeechPlan:
        if req.model != self.served_name:
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
            raise ApiError(400, "flac cannot be streamed; stream wav or pcm, or drop stream_format for a whole "
                                "flac file", param="response_format", code="unsupported_audio_format")
        kwargs = {"voice": self._voice(req.voice_name), "instructions": req.instructions or None,
                  "references": [self._reference(i, ref) for i, ref in enumerate(req.references or ())],
                  "seed": req.seed, "max_frames": req.max_frames, "temperature": req.temperature,
                  "top_p": req.top_p, "top_k": req.top_k, "repetition_penalty": req.repetition_penalty}
        return SpeechPlan(req.input, fmt, stream, kwargs)

    def _voice(self, name: str):
        """A saved voice (models with cloning) by name, else the name for the model to check."""
        if self.voices is not None and name != "default":
            if not NAME_RE.fullmatch(name) or name not in self.voices.names():
                raise ApiError(400, f"unknown voice {name!r:.80}; use 'default' or a saved voice "
                                    "(GET /v1/audio/voices)", param="voice", code="invalid_voice")
            return self.voices.load(name)
        return name

    @staticmethod
    def _reference(i: int, ref) -> tuple[bytes, str]:
        try:
            audio = base64.b64decode(ref.audio, validate=True)
        except (binascii.Error, ValueError):
            audio = b""
        if not audio:
            raise ApiError(400, f"references[{i}].audio is not valid base64 of an audio file (standard "
                                "alphabet, padded, no whitespace)", param=f"references[{i}].audio",
                           code="invalid_base64")
        return audio, ref.text

    def _check_capacity(self) -> None:
        cfg, engine = self.model.engine_config, self.model.engine
        if engine.in_flight >= cfg.max_running + cfg.max_queue:
            raise overloaded_error(f"server busy: {engine.in_flight} requests in flight "
                              f"(max_running {cfg.max_running} + max_queue {cfg.max_queue})")

    # ---- running -----------------------------------------------------------------------------
    def _submit(self, plan: SpeechPlan, loop):  # worker thread: encodes references, builds the prompt
        try:
            return self.model.speech(plan.text, loop=loop, **plan.kwargs)
        except Overloaded as e:
            raise overloaded_error(str(e)) from None
        except InputError as e:
            raise ApiError(400, str(e), param=e.param, code=e.code or "invalid_value") from None

    def _encode(self, fmt: str, samples: np.ndarray) -> bytes:
        if fmt == "flac":
            return encode_flac(samples, self.sample_rate)
        pcm = encode_pcm16(samples)
        return wav_header(self.sample_rate, len(pcm)) + pcm if fmt == "wav" else pcm

    async def _collect(self, first: Event, events, arrival: float) -> np.ndarray:
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
                return np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        raise ApiError(500, "the request ended without a result")

    async def _audio_stream(self, plan: SpeechPlan, first: Event, events, arrival: float) -> AsyncIterator[bytes]:
        clock, done = PlaybackClock(), False
        try:
            if plan.fmt == "wav":
                yield wav_header(self.sample_rate)
            async for ev in chain(first, events):
                if isinstance(ev, AudioChunk):
                    yield self._chunk(ev, clock, arrival)
                elif isinstance(ev, Finished):
                    done = True
                    self._finished(ev, arrival, clock)
                elif isinstance(ev, Failed):  # raw bytes cannot carry an error: the response is cut
                    done = True
                    self.metrics.speech.inc(finish_reason="error")
                    raise StreamFailed(ev.status, ev.message)
        finally:
            if not done:
                self.metrics.disconnects.inc()

    async def _sse(self, first: Event, events, arrival: float) -> AsyncIterator[bytes]:
        clock, done = PlaybackClock(), False
        try:
            async for ev in chain(first, events):
                if isinstance(ev, AudioChunk):
                    data = base64.b64encode(self._chunk(ev, clock, arrival)).decode("ascii")
                    yield _event({"type": "speech.audio.delta", "audio": data})
                elif isinstance(ev, Finished):
                    done = True
                    self._finished(ev, arrival, clock)
                    frames = int(ev.codes.shape[0])
                    yield _event({"type": "speech.audio.done", "usage": {
                        "input_tokens": ev.prompt_tokens, "output_tokens": frames,
                        "total_tokens": ev.prompt_tokens + frames}})
                elif isinstance(ev, Failed):
                    done = True
                    self.metrics.speech.inc(finish_reason="error")
                    yield _event({"type": "error", **error_body(ev.status, ev.message, code="request_failed")})
        finally:
            if not done:
                self.metrics.disconnects.inc()

    def _chunk(self, ev: AudioChunk, clock: PlaybackClock, arrival: float) -> bytes:
        observe_chunk(self.metrics, ev, clock, arrival)
        return encode_pcm16(ev.samples)

    def _finished(self, ev: Finished, arrival: float, clock: PlaybackClock | None = None) -> None:
        m = self.metrics
        m.speech.inc(finish_reason=ev.finish_reason)
        observe_audio_done(m, ev, arrival, clock)


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
