"""The request body of `POST /v1/chat/completions`, as pydantic models.

Types are strict (a string is never coerced to a number, nor a float to an integer) and ranges
are OpenAI's documented ones; omnivox's extensions are marked below. Fields that OpenAI defines
but omnivox does not implement are accepted only at their neutral value (see `unsupported`).
Unknown fields are ignored, as OpenAI-compatible servers commonly do.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class _Model(BaseModel):
    model_config = STRICT


class OmnivoxOptions(_Model):  # omnivox extension: per-request engine switches
    model_config = ConfigDict(extra="forbid", strict=True)  # a misspelt switch is a 400, never ignored

    speculative: bool = True  # False: this request's Thinker never drafts (speculative decoding off for it)


# ---- content parts ---------------------------------------------------------------------------
class TextPart(_Model):
    type: Literal["text"]
    text: str


class InputAudio(_Model):
    data: str  # base64 of a whole audio file
    format: str  # wav, flac, ogg or mp3 (libsndfile decodes it; the header decides)


class InputAudioPart(_Model):
    type: Literal["input_audio"]
    input_audio: InputAudio


class MediaURL(_Model):
    url: str  # a data: URL (no network fetches)
    detail: str | None = None


class ImageURLPart(_Model):
    type: Literal["image_url"]
    image_url: MediaURL


class AudioURLPart(_Model):  # a common serving alias: audio as a data: URL
    type: Literal["audio_url"]
    audio_url: MediaURL


class VideoURLPart(_Model):  # the peers' spelling: an mp4/webm data: URL (or a local file, api/media.py)
    type: Literal["video_url"]
    video_url: MediaURL


Part = Annotated[Union[TextPart, InputAudioPart, ImageURLPart, AudioURLPart, VideoURLPart],
                 Field(discriminator="type")]


class AudioRef(_Model):
    id: str  # a previous reply's audio id: accepted and ignored (omnivox stores no audio)


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part] | None = None
    name: str | None = None
    audio: AudioRef | None = None


# ---- request ---------------------------------------------------------------------------------
class AudioParams(_Model):
    voice: str | None = None  # None: the model's default voice; OpenAI's names map (api/dialects.py)
    format: str = "wav"


class StreamOptions(_Model):
    include_usage: bool = True  # omnivox default: the usage chunk is always sent unless disabled


Prob = Annotated[float, Field(gt=0.0, le=1.0)]
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
Penalty = Annotated[float, Field(ge=0.01, le=100.0)]  # sampling.params.MIN_PENALTY..MAX_PENALTY


class ChatRequest(_Model):
    model: str | None = None  # None: the one model served
    messages: list[Message] = Field(min_length=1)
    modalities: list[Literal["text", "audio"]] | None = None  # None: ["text", "audio"] if `audio` is given
    audio: AudioParams | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None  # 0 = greedy (argmax) in every stage
    top_p: Prob | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    # OpenAI fields omnivox accepts only at their neutral value
    stop: str | list[str] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logprobs: bool | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    # ---- omnivox extensions ----
    top_k: Annotated[int, Field(ge=0)] | None = None
    repetition_penalty: Penalty | None = None
    max_audio_frames: Annotated[int, Field(ge=0)] | None = None  # 80 ms speech frames
    talker_instruction: str | None = None  # voice/style instruction seen only by the Talker
    talker_temperature: Temperature | None = None
    talker_top_p: Prob | None = None
    talker_top_k: Annotated[int, Field(ge=0)] | None = None
    talker_repetition_penalty: Penalty | None = None
    ignore_eos: bool = False  # the Thinker runs to the token limit (vLLM's benchmark field)
    omnivox: OmnivoxOptions | None = None  # {"speculative": false}: no drafts for this request
    # ---- the peers' fields (api/dialects.py: honoured, or a 400 unless neutral) ----
    talker_max_new_tokens: Annotated[int, Field(ge=0)] | None = None  # SGLang-Omni: max_audio_frames
    min_p: float | None = None
    audios: list[Any] | None = None
    images: list[Any] | None = None
    videos: list[Any] | None = None
    video_fps: float | None = None
    video_max_frames: int | None = None
    video_min_pixels: int | None = None
    video_max_pixels: int | None = None
    video_total_pixels: int | None = None
    stage_sampling: dict[str, Any] | None = None
    stage_params: dict[str, Any] | None = None
    image_generation: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first OpenAI feature set to a value omnivox does not implement."""
        checks = (
            ("n", self.n not in (None, 1), "n must be 1 (one choice per request); send several requests instead"),
            ("stop", bool(self.stop), "stop sequences are not supported; remove `stop`"),
            ("frequency_penalty", bool(self.frequency_penalty),
             "frequency_penalty is not supported; use repetition_penalty (an omnivox extension)"),
            ("presence_penalty", bool(self.presence_penalty),
             "presence_penalty is not supported; use repetition_penalty (an omnivox extension)"),
            ("logprobs", bool(self.logprobs), "logprobs are not supported; remove `logprobs`"),
            ("tools", bool(self.tools), "tools are not supported; remove `tools`"),
            ("response_format", self.response_format not in (None, {}, {"type": "text"}),
             "only response_format {\"type\": \"text\"} is supported"),
        )
        return next(((p, m) for p, bad, m in checks if bad), None)

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options.include_usage if self.stream_options is not None else True


# ---- POST /v1/audio/speech -------------------------------------------------------------------
class SpeechReference(_Model):  # omnivox extension: per-request voice cloning (S2)
    audio: str | None = None  # base64 of a whole wav/flac/ogg/mp3 file (or a data: URL)
    text: str  # its transcript
    # the peers' spellings of the clip (exactly one of audio / audio_path / ref_audio / data)
    audio_path: str | None = None  # a local file under --allowed-local-media-path
    ref_audio: str | None = None  # SGLang-Omni: base64, a data: URL or a local path
    data: str | None = None  # SGLang-Omni: the same
    media_type: str | None = None  # SGLang-Omni: a hint only (the file's header decides)
    vq_codes: list[Any] | None = None  # SGLang-Omni: precomputed codes, refused


class VoiceId(_Model):  # the OpenAI client's custom-voice form: {"id": "..."}
    id: str


MAX_REFERENCES = 8


class SpeechRequest(_Model):
    model: str | None = None  # None: the one model served
    input: str
    voice: str | VoiceId = "default"
    instructions: str | None = None  # Qwen3-Omni: a style instruction seen only by the Talker
    response_format: str = "mp3"  # OpenAI's default
    speed: Annotated[float, Field(ge=0.25, le=4.0)] | None = None  # only 1.0 is implemented
    stream_format: str | None = None  # "audio" (raw bytes as decoded) | "sse"; absent: one whole file
    # ---- omnivox extensions ----
    stream: bool | None = None  # true: the same as stream_format "audio"
    references: list[SpeechReference] | None = Field(default=None, max_length=MAX_REFERENCES)
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    max_frames: Annotated[int, Field(ge=1)] | None = None  # S2: 21.5 Hz frames; Qwen3-Omni: 80 ms frames
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None  # Qwen3-Omni: 0 = greedy Talker
    top_p: Prob | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    repetition_penalty: Penalty | None = None
    # ---- the peers' fields (api/dialects.py: honoured, or a 400 unless neutral) ----
    speaker: str | None = None  # SGLang-Omni: the voice
    ref_audio: str | None = None  # one reference clip: base64, a data: URL or a local path ...
    ref_text: str | None = None  # ... and its transcript
    max_new_tokens: Annotated[int, Field(ge=1)] | None = None  # max_frames
    sample_rate: Annotated[int, Field(ge=1)] | None = None  # only the model's own rate
    task_type: str | None = None
    language: str | None = None
    x_vector_only_mode: bool | None = None
    non_streaming_mode: bool | None = None
    initial_codec_chunk_frames: int | None = None
    token_count: int | None = None
    duration_tokens: int | None = None
    stage_params: dict[str, Any] | None = None

    @property
    def voice_name(self) -> str:
        return self.voice.id if isinstance(self.voice, VoiceId) else self.voice
