"""The peers' request dialects (SGLang-Omni, vLLM-Omni) and OpenAI's voice names, mapped onto
omnivox's own fields; the README's "Coming from SGLang-Omni / vLLM-Omni" lists the same.

Rule: a field one of the peers defines is honoured (mapped below) or, unless it holds its
neutral value, a 400 that says so (`PEER_SPEECH` / `PEER_CHAT`); never silently dropped.
Fields nobody defines stay ignored, as before.

Voices: OpenAI's built-in names map to a voice of the served model by `OPENAI_VOICES` (each
name's preferences, taken in order among the model's `builtin_voices`, else the model's default
voice), overridden per name with `--voice-alias NAME=VOICE`. A name the model has a voice of
always means that voice; any other unknown name stays a 400.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from omnivox.api.errors import ApiError
from omnivox.api.media import MediaReader, strict_b64
from omnivox.errors import InputError, OmnivoxError

DEFAULT_VOICE = "default"
# OpenAI's built-in voices -> the voices they become, in order of preference (Qwen3-Omni's
# speakers: chelsie, female; ethan and aiden, male). A model with none of them (S2: only
# "default") answers every name with its default voice.
OPENAI_VOICES: dict[str, tuple[str, ...]] = {
    "alloy": (), "ash": ("aiden",), "ballad": ("ethan",), "coral": ("chelsie",), "echo": ("ethan",),
    "fable": ("aiden",), "onyx": ("ethan",), "nova": ("chelsie",), "sage": ("chelsie",),
    "shimmer": ("chelsie",), "verse": ("aiden",), "marin": ("chelsie",), "cedar": ("ethan",),
}


def parse_voice_alias(text: str) -> tuple[str, str]:
    """argparse type of `--voice-alias NAME=VOICE`."""
    name, sep, voice = text.partition("=")
    if not sep or not name.strip() or not voice.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VOICE (e.g. alloy=chelsie), got {text!r}")
    return name.strip().lower(), voice.strip()


class VoiceAliases:
    """Voice names a client may send that are not the model's own -> the model's voice they mean."""

    def __init__(self, builtin_voices: list[str], overrides: dict[str, str] | None = None, *,
                 saved_voices: bool = False):
        self.own = {v.lower() for v in builtin_voices} | {DEFAULT_VOICE}
        self.table = {name: next((v for v in prefs if v in self.own), DEFAULT_VOICE)
                      for name, prefs in OPENAI_VOICES.items()}
        for name, voice in (overrides or {}).items():
            if name in self.own:
                raise OmnivoxError(f"--voice-alias {name}={voice}: {name!r} is already one of this model's voices")
            if voice.lower() not in self.own and not saved_voices:
                raise OmnivoxError(f"--voice-alias {name}={voice}: {voice!r} is not one of this model's voices "
                                   f"({', '.join(sorted(self.own))})")
            self.table[name] = voice.lower() if voice.lower() in self.own else voice  # else a saved voice's name
        self.overridden = sorted(overrides or ())

    def resolve(self, name: str) -> str:
        """The voice `name` means: itself when the model has it (or when nothing maps it), else its alias."""
        key = name.lower()
        return name if key in self.own else self.table.get(key, name)


# ---- fields the peers define that omnivox cannot honour ------------------------------------
@dataclass(frozen=True)
class PeerField:
    name: str
    neutral: Callable[[Any], bool]  # the values that ask for nothing omnivox does not do
    why: str  # completes "<name> ... is not supported: <why>"


def _none(v) -> bool:
    return v is None


def _falsy(v) -> bool:
    return not v


PEER_SPEECH = (
    PeerField("task_type", lambda v: v is None or v.lower() in ("base", "customvoice"),
              "voice design from a description (VoiceDesign) does not exist here; a reference clones "
              "(Base), a voice name picks a voice (CustomVoice)"),
    PeerField("language", lambda v: v is None or v.lower() == "auto",
              "these models have no language switch: they speak the language of `input`; send 'Auto' or drop it"),
    PeerField("x_vector_only_mode", _falsy, "cloning always uses the reference's codes and transcript"),
    PeerField("non_streaming_mode", _none, "it selects a Qwen3-TTS prompt layout, which these models do not have"),
    PeerField("initial_codec_chunk_frames", _none, "omnivox streams every frame as soon as it is decoded"),
    PeerField("token_count", _none, "a duration target (MOSS-TTS) does not exist here; use max_frames"),
    PeerField("duration_tokens", _none, "a duration target (MOSS-TTS) does not exist here; use max_frames"),
    PeerField("stage_params", _falsy, "per-stage parameters are omnivox's own fields (temperature, top_p, ...)"),
)

PEER_CHAT = (
    PeerField("min_p", _falsy, "use top_p / top_k"),
    PeerField("audios", _falsy, "put audio in the messages' content parts (input_audio, audio_url)"),
    PeerField("images", _falsy, "put images in the messages' content parts (image_url)"),
    PeerField("videos", _falsy, "put videos in the messages' content parts (video_url)"),
    PeerField("video_fps", _none, "video is sampled at 2 frames per second (the README's rule)"),
    PeerField("video_max_frames", _none, "video keeps at most 768 frames (the README's rule)"),
    PeerField("video_min_pixels", _none, "frame sizes follow the checkpoint's preprocessor_config.json"),
    PeerField("video_max_pixels", _none, "frame sizes follow the checkpoint's preprocessor_config.json"),
    PeerField("video_total_pixels", _none, "frame sizes follow the checkpoint's preprocessor_config.json"),
    PeerField("stage_sampling", _falsy, "use temperature / top_p / top_k and the talker_* fields"),
    PeerField("stage_params", _falsy, "use the talker_* fields"),
    PeerField("image_generation", _falsy, "this model does not generate images"),
)


def check_peer_fields(req, fields: tuple[PeerField, ...]) -> None:
    for f in fields:
        value = getattr(req, f.name)
        if not f.neutral(value):
            raise ApiError(400, f"{f.name} {value!r:.60} is not supported: {f.why}", param=f.name,
                           code="unsupported_parameter")


def alias_of(req, field: str, alias: str, param_of_field: str | None = None):
    """The value of `field`, or of the peers' `alias` for it; both given and different is a 400."""
    mine, theirs = getattr(req, field), getattr(req, alias)
    if theirs is None:
        return mine
    if mine is not None and mine != theirs:
        raise ApiError(400, f"{alias} ({theirs!r:.40}) and {param_of_field or field} ({mine!r:.40}) disagree; "
                            "send one of them", param=alias, code="invalid_value")
    return theirs


# ---- speech: references from every spelling -------------------------------------------------
@dataclass(frozen=True)
class RefSource:
    """One reference clip as a request names it; `load` reads it (a worker thread)."""

    kind: str  # "base64" (omnivox's references[].audio) | "audio" (ref_audio: base64, data: URL or path) | "path"
    value: str
    text: str
    param: str  # the field to name in errors

    def load(self, media: MediaReader) -> tuple[bytes, str]:
        if self.kind == "base64":
            raw = media.data_url(self.value, self.param) if self.value.startswith("data:") else _strict_b64(self)
            return raw, self.text
        if self.kind == "audio":
            return media.audio(self.value, self.param), self.text
        return media.local(self.value, self.param), self.text


def _strict_b64(src: RefSource) -> bytes:
    raw = strict_b64(src.value)
    if raw is None:
        raise ApiError(400, f"{src.param} is not valid base64 of an audio file (standard alphabet, padded, "
                            "no whitespace)", param=src.param, code="invalid_base64")
    return raw


def reference_sources(req, saved_voice: bool = False) -> list[RefSource]:
    """The request's reference clips, from `references` (audio | audio_path | SGLang-Omni's ref_audio /
    data) or from `ref_audio` + `ref_text` (not both). `ref_text` alone goes with a saved voice
    (`saved_voice`: vLLM-Omni's clients send both; the saved voice keeps its own transcript). Shape
    checks only: nothing is read here."""
    if req.ref_text is not None and req.ref_audio is None and not saved_voice:
        raise ApiError(400, "ref_text is the transcript of ref_audio: send ref_audio with it (or name a saved "
                            "voice in voice)", param="ref_text", code="invalid_value")
    if req.ref_audio is not None:
        if req.references:
            raise ApiError(400, "send either ref_audio + ref_text or references, not both", param="ref_audio",
                           code="invalid_value")
        if not (req.ref_text or "").strip():
            raise ApiError(400, "ref_audio needs ref_text, the transcript of the clip (cloning reads both)",
                           param="ref_text", code="invalid_value")
        return [RefSource("audio", req.ref_audio, req.ref_text, "ref_audio")]
    out = []
    for i, ref in enumerate(req.references or ()):
        given = [(k, v) for k, v in (("audio", ref.audio), ("audio_path", ref.audio_path), ("ref_audio", ref.ref_audio),
                                     ("data", ref.data)) if v is not None]
        if len(given) != 1:
            raise ApiError(400, f"references[{i}] needs exactly one of audio (base64), audio_path (a local file) "
                                f"or ref_audio / data; got {len(given) or 'none'}", param=f"references[{i}].audio",
                           code="invalid_value")
        if ref.vq_codes is not None:
            raise ApiError(400, "references[].vq_codes is not supported: send the clip itself",
                           param=f"references[{i}].vq_codes", code="unsupported_parameter")
        key, value = given[0]
        kind = {"audio": "base64", "audio_path": "path"}.get(key, "audio")
        out.append(RefSource(kind, value, ref.text, f"references[{i}].{key}"))
    return out


def with_source_param(e: InputError, sources: list[RefSource]) -> InputError:
    """A model error about `references[i].audio` renamed to the field the client actually sent."""
    param = e.param or ""
    for i, src in enumerate(sources):
        mine = f"references[{i}].audio"
        if param == mine and src.param != mine:
            return InputError(str(e).replace(mine, src.param, 1), param=src.param, code=e.code)
    return e
