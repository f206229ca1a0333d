"""From a validated `ChatRequest` to what the model takes: chat messages and `ChatParams`.

Sampling: `temperature: 0` (or any temperature below 1e-5: `ChatParams.is_greedy`) means greedy
(argmax) decoding in every stage - Thinker, Talker and code predictor - exactly
`Omni.generate(greedy=True)` / `omnivox generate --greedy`; Talker
sampling fields given alongside it re-enable sampling for the Talker only. Any other
temperature (or top_p/top_k alone) samples the Thinker; omitted fields take the checkpoint's
generation_config.json defaults.

The peers' spellings (`talker_max_new_tokens`, OpenAI's voice names, a missing `audio.voice` or
`model`, `audio` without `modalities`, `video_url` parts, local media paths) are mapped here with
`api/dialects.py` and `api/media.py`.
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from omnivox.api.dialects import PEER_CHAT, VoiceAliases, alias_of, check_peer_fields
from omnivox.api.errors import ApiError
from omnivox.api.media import MediaReader
from omnivox.api.output_limits import OutputLimits
from omnivox.api.protocol import ChatRequest, Message
from omnivox.errors import InputError
from omnivox.serving import ChatModel, ChatParams, PreparedChat

OUTPUT_FORMATS = ("wav", "pcm16", "flac", "mp3", "opus")  # non-streaming message.audio.data
STREAM_FORMATS = ("pcm16", "wav")  # streamed deltas: raw pcm16, or each one a complete wav
MEDIA_PARTS = ("image_url", "audio_url", "video_url")
INPUT_AUDIO_FORMATS = ("wav", "flac", "ogg", "mp3")


@dataclass
class Plan:
    """One request, ready for `ChatModel.prepare_chat` and `submit_chat`."""

    messages: list[dict]
    params: ChatParams  # checked by the model already (`check_chat`)
    audio_format: str | None  # None: text only
    max_tokens: int | None = None  # as requested (None: omitted)
    tokens_param: str = "max_tokens"  # the field it came in (max_tokens or max_completion_tokens)
    reply_tokens: int | None = None  # the reply's budget, once the prompt is built (`fit`)
    clamped: str | None = None  # an "at most" field clamped to the server's limit (omnivox_requests_clamped_total)
    warning: str | None = None  # X-Omnivox-Warning: what was clamped
    instruction_tokens: int = 0  # prompt tokens outside the messages, counted in usage (`fit`)

    def fit(self, limits: OutputLimits, request: PreparedChat) -> None:
        """The reply's token budget once the prompt is built (a 400 when it does not fit the context)."""
        self.reply_tokens = limits.reply_tokens(self.max_tokens, self.tokens_param, request.prompt_tokens)
        self.instruction_tokens = request.instruction_tokens if self.audio_format is not None else 0


def plan_request(req: ChatRequest, model: ChatModel, served_name: str, aliases: VoiceAliases | None = None,
                 media: MediaReader | None = None, limits: OutputLimits | None = None) -> Plan:
    """NOTE: reads local media files (api/media.py): run it in a worker thread. `limits`: the
    server's output limits (default: what the model's context allows)."""
    if req.model is not None and req.model != served_name:
        raise ApiError(404, f"model {req.model!r} is not served here; this server serves {served_name!r} "
                            "(see GET /v1/models)", param="model", code="model_not_found")
    bad = req.unsupported()
    if bad:
        raise ApiError(400, bad[1], param=bad[0], code="unsupported_parameter")
    check_peer_fields(req, PEER_CHAT)
    limits = limits or OutputLimits.for_model(model)
    tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    limits.check_tokens(req.completion_limit, tokens_param)
    audio_format = _audio_format(req, model)
    speaker = _voice(req, model, aliases or VoiceAliases(model.builtin_voices)) if audio_format else None
    media = media or MediaReader()
    frames, warning = _frames(req, limits)
    return Plan(messages=[_message(m, i, media) for i, m in enumerate(req.messages)],
                params=_params(req, model, audio_format is not None, speaker, frames, limits), audio_format=audio_format,
                max_tokens=req.completion_limit, tokens_param=tokens_param,
                clamped="talker_max_new_tokens" if warning else None, warning=warning)


def _audio_format(req: ChatRequest, model: ChatModel) -> str | None:
    """The reply's audio format, None for text only. `modalities` decides; without it an `audio`
    object asks for speech (clients of Qwen-Omni servers send `audio` alone), on a model that speaks."""
    if req.modalities is not None and "text" not in req.modalities:
        raise ApiError(400, 'modalities must be ["text"] or ["text", "audio"]', param="modalities")
    if req.modalities is None:
        if req.audio is None or "audio" not in model.modalities:
            return None
    elif "audio" not in req.modalities:  # ["text"] given: text only, whatever `audio` says
        return None
    elif "audio" not in model.modalities:
        raise ApiError(400, 'this model cannot speak; use modalities ["text"]', param="modalities")
    fmt = (req.audio.format if req.audio else "wav").lower()
    allowed = STREAM_FORMATS if req.stream else OUTPUT_FORMATS
    if fmt not in allowed:
        how = "streamed audio is raw pcm16 deltas or one wav per delta" if req.stream else "non-streaming audio"
        raise ApiError(400, f"audio.format {fmt!r} is not supported ({how}); use one of: {', '.join(allowed)}",
                       param="audio.format", code="unsupported_audio_format")
    return fmt


def _voice(req: ChatRequest, model: ChatModel, aliases: VoiceAliases) -> str | None:
    """The speaker to use (None: the model's default), from `audio.voice` or what it is an alias of."""
    voice = req.audio.voice if req.audio else None
    if voice is None:
        return None
    name = aliases.resolve(voice).lower()
    if name == "default":
        return None
    if name not in model.builtin_voices:
        raise ApiError(400, f"unknown voice {voice!r}; this model's voices are: {', '.join(model.builtin_voices)} "
                            "(or default, or one of OpenAI's voice names)",
                       param="audio.voice", code="invalid_voice")
    return name


def _message(m: Message, i: int, media: MediaReader) -> dict:
    role = "system" if m.role == "developer" else m.role
    if not isinstance(m.content, list):
        return {"role": role, "content": m.content or ""}
    parts = []
    for j, part in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if part.type == "input_audio":
            if part.input_audio.format.lower() not in INPUT_AUDIO_FORMATS:
                raise ApiError(400, f"input_audio.format {part.input_audio.format!r} is not supported; use one of: "
                                    f"{', '.join(INPUT_AUDIO_FORMATS)}", param=f"{where}.input_audio.format",
                               code="unsupported_audio_format")
        elif part.type in MEDIA_PARTS:
            url = getattr(part, part.type).url
            if url.startswith(("http://", "https://")):
                raise ApiError(400, f"{part.type}.url must be a data: URL (data:<mime>;base64,...): this server "
                                    "fetches nothing from the network", param=f"{where}.{part.type}.url")
            local = media.url(url, f"{where}.{part.type}.url")  # a file under --allowed-local-media-path
            if local is not None:
                parts.append({"type": part.type, part.type: local})  # the processor decodes bytes
                continue
        parts.append(part.model_dump(exclude_none=True))
    return {"role": role, "content": parts}


def has_media(messages: list[dict]) -> bool:
    """Whether any message holds a media part (audio, image, video) to decode."""
    return any(part.get("type") != "text" for m in messages if isinstance(m["content"], list) for part in m["content"])


def decode_media_base64(messages: list[dict]) -> None:
    """Decode every media payload's base64, once, in place: the processor takes the bytes (an
    input_audio's `data` becomes bytes beside its format, a data URL part becomes the file's bytes).
    A bad payload is a 400 naming its field. Run off the event loop."""
    for i, m in enumerate(messages):
        for j, part in enumerate(m["content"] if isinstance(m["content"], list) else ()):
            kind = part["type"]
            if kind == "input_audio":
                field, data = "input_audio.data", part["input_audio"]["data"]
            elif kind in MEDIA_PARTS:
                if isinstance(part[kind], bytes):  # a local file's bytes, read already
                    continue
                field, data = f"{kind}.url", part[kind]["url"].partition(",")[2]
            else:
                continue
            try:
                raw = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                raw = None
            if not raw:
                raise ApiError(400, f"messages[{i}].content[{j}].{field} is not valid base64 (standard alphabet, "
                                    "padded, no whitespace)", param=f"messages[{i}].content[{j}].{field}",
                               code="invalid_base64")
            if kind == "input_audio":
                part["input_audio"] = {**part["input_audio"], "data": raw}
            else:
                part[kind] = raw


def _frames(req: ChatRequest, limits: OutputLimits) -> tuple[int, str | None]:
    """The reply's audio frames, and a note when clamped: omnivox's `max_audio_frames` above the
    limit is a 400; SGLang-Omni's `talker_max_new_tokens` alone means "at most" and is clamped."""
    at_most = req.max_audio_frames is None
    return limits.frames(alias_of(req, "max_audio_frames", "talker_max_new_tokens"),
                         "talker_max_new_tokens" if at_most else "max_audio_frames", at_most)


def _params(req: ChatRequest, model: ChatModel, audio: bool, speaker: str | None, frames: int,
            limits: OutputLimits) -> ChatParams:
    """The request's generation fields, checked by the model before any media is read."""
    try:
        params = ChatParams(
            max_tokens=req.completion_limit or limits.default_tokens, max_frames=frames,
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            repetition_penalty=req.repetition_penalty, seed=req.seed, speaker=speaker, return_audio=audio,
            talker_temperature=req.talker_temperature, talker_top_k=req.talker_top_k, talker_top_p=req.talker_top_p,
            talker_repetition_penalty=req.talker_repetition_penalty,
            talker_instruction=req.talker_instruction if audio else None, ignore_eos=req.ignore_eos,
            speculative=req.omnivox is None or req.omnivox.speculative,
            playing=bool(req.stream) and audio)  # a streamed spoken reply: its client plays it (serving.PLAYING)
        model.check_chat(params)
    except InputError as e:
        raise ApiError(400, str(e), param=e.param, code=e.code or "invalid_value") from None
    return params
