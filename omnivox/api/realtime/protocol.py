"""The OpenAI Realtime protocol as omnivox speaks it: the two dialects' server event names, the
session configuration (parsed from either dialect's `session.update`, rendered in the client's),
and error events.

GA (the default) is what `openai` 3.x's `client.realtime.connect` speaks; a client that connects
with the header `OpenAI-Beta: realtime=v1` gets the beta names instead (never both). Client events
of both dialects are accepted from everyone. omnivox's own settings travel in an `omnivox` object
inside the session (and `response.create`'s response): the Talker instruction, the AuT attention
window, sampling, a limit on audio frames.
"""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from omnivox.api.output_limits import OutputLimits
from omnivox.api.realtime.audio_input import PCM_RATE, VadSettings
from omnivox.errors import InputError
from omnivox.serving import ChatParams, SpeechParams


def new_id(prefix: str) -> str:
    """A server-made id of the protocol's kind (`sess_...`, `item_...`, `resp_...`)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ProtocolError(InputError):
    """A client event that cannot be applied: answered with an `error` event; the session goes on."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value",
                 event_id: str | None = None):
        super().__init__(message, param=param, code=code)
        self.event_id = event_id


@dataclass(frozen=True)
class Dialect:
    beta: bool
    output_text: str  # content type of an assistant text part
    output_audio: str
    names: dict[str, str]  # GA server event name -> this dialect's (None: not sent)

    def name(self, ga_name: str) -> str | None:
        return self.names.get(ga_name, ga_name)


GA = Dialect(False, "output_text", "output_audio", {})
BETA = Dialect(True, "text", "audio", {
    "conversation.item.added": "conversation.item.created", "conversation.item.done": None,
    "response.output_text.delta": "response.text.delta", "response.output_text.done": "response.text.done",
    "response.output_audio.delta": "response.audio.delta", "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
})


def error_event(message: str, *, code: str | None = None, param: str | None = None, event_id: str | None = None,
                kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "code": code, "message": message, "param": param,
                                       "event_id": event_id}}


# ---- configuration -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Generation:
    """What one response is generated with (a session's defaults, or a response.create's overrides)."""
    instructions: str = ""
    voice: str | None = None  # None: the model's default
    modalities: tuple[str, ...] = ("audio",)  # ("audio",) = audio + its transcript; ("text",)
    max_output_tokens: float | None = None  # text tokens; math.inf: "inf", None: unset (`within` makes it an int)
    talker_instruction: str | None = None
    max_audio_frames: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    greedy: bool = False
    # a full-duplex session's text token sampling (temperature and top_k above are its audio's)
    text_temperature: float | None = None
    text_top_k: int | None = None

    @property
    def audio(self) -> bool:
        return "audio" in self.modalities

    def within(self, limits: OutputLimits) -> "Generation":
        """These settings within the server's output limits, as the session keeps and shows them:
        "inf" and a value above a limit are the limit (clamped: OpenAI's realtime clients send
        "inf" or 4096 routinely); unset is the model's default, as the HTTP routes' omitted fields."""
        frames, _ = limits.frames(self.max_audio_frames, "max_audio_frames", at_most=True)
        return replace(self, max_output_tokens=limits.tokens_at_most(self.max_output_tokens),
                       max_audio_frames=frames)

    def chat_params(self) -> ChatParams:
        """What a listening session's response is generated with (`ChatModel.open_prompt`)."""
        return ChatParams(speaker=self.voice, return_audio=self.audio, max_tokens=self.max_output_tokens,
                          max_frames=self.max_audio_frames, greedy=self.greedy, temperature=self.temperature,
                          top_p=self.top_p, top_k=self.top_k, repetition_penalty=self.repetition_penalty,
                          seed=self.seed, talker_instruction=self.talker_instruction,
                          playing=self.audio)  # a response's audio streams to the session's player

    def speech_params(self) -> SpeechParams:
        """What a speaking session's response is voiced with (`ServedModel.speech`)."""
        return SpeechParams(seed=self.seed, max_frames=self.max_audio_frames, temperature=self.temperature,
                            top_p=self.top_p, top_k=self.top_k, repetition_penalty=self.repetition_penalty,
                            playing=True)


@dataclass(frozen=True)
class SessionConfig:
    gen: Generation = field(default_factory=Generation)
    turn_detection: VadSettings | None = field(default_factory=VadSettings)
    audio_window_s: float = 1.0


SAMPLING = {"temperature": (0.0, 100.0), "top_p": (0.0, 1.0), "repetition_penalty": (0.01, 100.0)}
OMNIVOX_KEYS = ("talker_instruction", "max_audio_frames", "temperature", "top_p", "top_k", "repetition_penalty",
                "seed", "greedy", "audio_window_s", "text_temperature", "text_top_k")
DUPLEX_KEYS = ("temperature", "top_k", "text_temperature", "text_top_k", "seed", "greedy")  # a duplex session's


def _obj(v: Any, param: str) -> dict:
    if not isinstance(v, dict):
        raise ProtocolError(f"{param} must be an object", param=param)
    return v


def _number(v: Any, param: str, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise ProtocolError(f"{param} must be a number in [{lo:g}, {hi:g}], got {v!r:.40}", param=param)
    return float(v)


def _integer(v: Any, param: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ProtocolError(f"{param} must be an integer in [{lo}, {hi}], got {v!r:.40}", param=param)
    return v


def _max_tokens(v: Any, param: str) -> float:
    return math.inf if v == "inf" else _integer(v, param, 1, 4096)


def tokens_json(v: float | None) -> int | str:
    """max_output_tokens as the protocol writes it: a number, or "inf"."""
    return "inf" if v is None or v == math.inf else int(v)


def _modalities(v: Any, param: str, beta: bool) -> tuple[str, ...]:
    if not isinstance(v, list) or not v or any(m not in ("text", "audio") for m in v):
        raise ProtocolError(f'{param} must be ["audio"] or ["text"]' + (' (or ["text", "audio"])' if beta else ""),
                            param=param)
    if "audio" in v:
        return ("audio",)  # audio always comes with its transcript
    return ("text",)


def _audio_format(v: Any, param: str) -> None:
    ok = v == "pcm16" or (isinstance(v, dict) and v.get("type", "audio/pcm") == "audio/pcm"
                          and v.get("rate", PCM_RATE) == PCM_RATE)
    if not ok:
        raise ProtocolError(f"{param}: only pcm16 (audio/pcm at {PCM_RATE} Hz, mono little-endian int16) is supported",
                            param=param, code="unsupported_audio_format")


def _vad(v: Any, param: str, old: VadSettings | None) -> VadSettings | None:
    if v is None:
        return None
    v = _obj(v, param)
    if v.get("type", "server_vad") != "server_vad":
        raise ProtocolError(f"{param}.type {v.get('type')!r} is not supported: use server_vad or null",
                            param=f"{param}.type", code="unsupported_turn_detection")
    base = old or VadSettings()
    kw = {}
    if "threshold" in v:
        kw["threshold"] = _number(v["threshold"], f"{param}.threshold", 0.01, 0.99)
    for k in ("prefix_padding_ms", "silence_duration_ms"):
        if k in v:
            kw[k] = _integer(v[k], f"{param}.{k}", 0, 10_000)
    for k in ("create_response", "interrupt_response"):
        if k in v:
            if not isinstance(v[k], bool):
                raise ProtocolError(f"{param}.{k} must be true or false", param=f"{param}.{k}")
            kw[k] = v[k]
    if v.get("idle_timeout_ms") is not None:
        raise ProtocolError(f"{param}.idle_timeout_ms is not supported", param=f"{param}.idle_timeout_ms",
                            code="unsupported_feature")
    return replace(base, **kw)


def _unsupported_if_set(s: dict, key: str, param: str, what: str) -> None:
    if s.get(key) not in (None, [], {}):
        raise ProtocolError(f"{param}: {what} is not supported by omnivox", param=param, code="unsupported_feature")


def parse_generation(s: dict, gen: Generation, param: str, voices: list[str]) -> Generation:
    """Fields shared by session.update's session and response.create's response, both dialects."""
    kw: dict[str, Any] = {}
    if "instructions" in s:
        if not isinstance(s["instructions"], str):
            raise ProtocolError(f"{param}.instructions must be a string", param=f"{param}.instructions")
        kw["instructions"] = s["instructions"]
    for key, beta in (("output_modalities", False), ("modalities", True)):
        if key in s:
            kw["modalities"] = _modalities(s[key], f"{param}.{key}", beta)
    for key in ("max_output_tokens", "max_response_output_tokens"):
        if key in s:
            kw["max_output_tokens"] = _max_tokens(s[key], f"{param}.{key}")
    voice = s.get("voice")
    audio = s.get("audio")
    if audio is not None:
        out = _obj(_obj(audio, f"{param}.audio").get("output") or {}, f"{param}.audio.output")
        voice = out.get("voice", voice)
        if "format" in out:
            _audio_format(out["format"], f"{param}.audio.output.format")
        if out.get("speed", 1.0) != 1.0:
            raise ProtocolError(f"{param}.audio.output.speed: only 1.0 is supported", param=f"{param}.audio.output.speed",
                                code="unsupported_feature")
    if "output_audio_format" in s:
        _audio_format(s["output_audio_format"], f"{param}.output_audio_format")
    if voice is not None:
        if isinstance(voice, dict):
            voice = voice.get("id")
        if not isinstance(voice, str) or (voice.lower() not in voices and voice != "default"):
            raise ProtocolError(f"unknown voice {voice!r:.60}; this model's voices are: {', '.join(voices)}",
                                param=f"{param}.voice", code="invalid_voice")
        kw["voice"] = None if voice == "default" else voice.lower()
    if "temperature" in s:  # beta's session/response temperature
        kw["temperature"] = _number(s["temperature"], f"{param}.temperature", *SAMPLING["temperature"])
    ext = _obj(s.get("omnivox") or {}, f"{param}.omnivox")
    unknown = set(ext) - set(OMNIVOX_KEYS)
    if unknown:
        raise ProtocolError(f"{param}.omnivox: unknown field {sorted(unknown)[0]!r}; known: {', '.join(OMNIVOX_KEYS)}",
                            param=f"{param}.omnivox")
    for k, (lo, hi) in SAMPLING.items():
        if k in ext:
            kw[k] = None if ext[k] is None else _number(ext[k], f"{param}.omnivox.{k}", lo, hi)
    if "text_temperature" in ext:
        kw["text_temperature"] = None if ext["text_temperature"] is None else _number(
            ext["text_temperature"], f"{param}.omnivox.text_temperature", *SAMPLING["temperature"])
    for k in ("top_k", "text_top_k"):
        if k in ext:
            kw[k] = None if ext[k] is None else _integer(ext[k], f"{param}.omnivox.{k}", 0, 1_000_000)
    if "seed" in ext:
        kw["seed"] = None if ext["seed"] is None else _integer(ext["seed"], f"{param}.omnivox.seed", 0, 2**63 - 1)
    if "max_audio_frames" in ext:
        kw["max_audio_frames"] = None if ext["max_audio_frames"] is None else _integer(
            ext["max_audio_frames"], f"{param}.omnivox.max_audio_frames", 0, 1_000_000)
    if "greedy" in ext:
        if not isinstance(ext["greedy"], bool):
            raise ProtocolError(f"{param}.omnivox.greedy must be true or false", param=f"{param}.omnivox.greedy")
        kw["greedy"] = ext["greedy"]
    if "talker_instruction" in ext:
        t = ext["talker_instruction"]
        if t is not None and not isinstance(t, str):
            raise ProtocolError(f"{param}.omnivox.talker_instruction must be a string",
                                param=f"{param}.omnivox.talker_instruction")
        kw["talker_instruction"] = t or None
    _unsupported_if_set(s, "tools", f"{param}.tools", "tool calling")
    return replace(gen, **kw)


def parse_session_update(s: Any, cfg: SessionConfig, voices: list[str], max_window_s: float) -> SessionConfig:
    s = _obj(s, "session")
    if s.get("type", "realtime") != "realtime":
        raise ProtocolError(f"session.type {s.get('type')!r} is not supported: omnivox serves realtime "
                            "conversations (no transcription sessions)", param="session.type",
                            code="unsupported_feature")
    gen = parse_generation(s, cfg.gen, "session", voices)
    vad = cfg.turn_detection
    if "turn_detection" in s:  # beta
        vad = _vad(s["turn_detection"], "session.turn_detection", vad)
    if "input_audio_format" in s:
        _audio_format(s["input_audio_format"], "session.input_audio_format")
    _unsupported_if_set(s, "input_audio_transcription", "session.input_audio_transcription",
                        "input audio transcription")
    audio = s.get("audio")
    if audio is not None:
        inp = _obj(_obj(audio, "session.audio").get("input") or {}, "session.audio.input")
        if "format" in inp:
            _audio_format(inp["format"], "session.audio.input.format")
        if "turn_detection" in inp:
            vad = _vad(inp["turn_detection"], "session.audio.input.turn_detection", vad)
        _unsupported_if_set(inp, "transcription", "session.audio.input.transcription", "input audio transcription")
        _unsupported_if_set(inp, "noise_reduction", "session.audio.input.noise_reduction", "noise reduction")
    window = cfg.audio_window_s
    ext = s.get("omnivox") or {}
    if "audio_window_s" in ext:
        window = _number(ext["audio_window_s"], "session.omnivox.audio_window_s", 0.08, max_window_s)
    return SessionConfig(gen=gen, turn_detection=vad, audio_window_s=window)


def parse_response_params(r: Any, gen: Generation, voices: list[str]) -> Generation:
    r = _obj(r if r is not None else {}, "response")
    if r.get("conversation", "auto") != "auto":
        raise ProtocolError("response.conversation: only \"auto\" (the session's conversation) is supported",
                            param="response.conversation", code="unsupported_feature")
    if r.get("input") is not None:
        raise ProtocolError("response.input (out-of-band context) is not supported", param="response.input",
                            code="unsupported_feature")
    if isinstance(r.get("omnivox"), dict) and "audio_window_s" in r["omnivox"]:
        raise ProtocolError("response.omnivox.audio_window_s: the window is a session setting",
                            param="response.omnivox.audio_window_s")
    return parse_generation(r, gen, "response", voices)


# ---- rendering -----------------------------------------------------------------------------------
def generation_json(cfg: SessionConfig) -> dict[str, Any]:
    """A turn-based session's own settings, as its session.omnivox shows them."""
    g = cfg.gen
    return {"audio_window_s": cfg.audio_window_s, "talker_instruction": g.talker_instruction,
            "max_audio_frames": g.max_audio_frames, "temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k,
            "repetition_penalty": g.repetition_penalty, "seed": g.seed, "greedy": g.greedy}


def session_json(sid: str, model: str, cfg: SessionConfig, dialect: Dialect, ext: dict,
                 voice: str | None) -> dict[str, Any]:
    """The session object of session.created / session.updated, in the client's dialect. `ext`:
    session.omnivox (the kind's); `voice`: the session's (the model's default unless set)."""
    g, vad = cfg.gen, cfg.turn_detection
    td = None if vad is None else {"type": "server_vad", "threshold": vad.threshold,
                                   "prefix_padding_ms": vad.prefix_padding_ms,
                                   "silence_duration_ms": vad.silence_duration_ms,
                                   "create_response": vad.create_response,
                                   "interrupt_response": vad.interrupt_response, "idle_timeout_ms": None}
    tokens = tokens_json(g.max_output_tokens)
    if dialect.beta:
        return {"id": sid, "object": "realtime.session", "model": model,
                "modalities": ["text", "audio"] if g.audio else ["text"], "instructions": g.instructions,
                "voice": voice, "input_audio_format": "pcm16", "output_audio_format": "pcm16",
                "input_audio_transcription": None, "turn_detection": td, "tools": [], "tool_choice": "auto",
                "temperature": g.temperature, "max_response_output_tokens": tokens, "omnivox": ext}
    fmt = {"type": "audio/pcm", "rate": PCM_RATE}
    return {"type": "realtime", "object": "realtime.session", "id": sid, "model": model,
            "output_modalities": list(g.modalities), "instructions": g.instructions,
            "audio": {"input": {"format": fmt, "transcription": None, "noise_reduction": None, "turn_detection": td},
                      "output": {"format": fmt, "voice": voice, "speed": 1.0}},
            "tools": [], "tool_choice": "auto", "max_output_tokens": tokens, "tracing": None, "truncation": "disabled",
            "prompt": None, "include": None, "omnivox": ext}
