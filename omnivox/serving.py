"""The serving surface: what the server, the CLI and the benchmark may use of a loaded model, and
the typed parameters they pass it. A family implements these protocols in its
`models/<family>/served.py`; the offline API (`omnivox/offline.py`: `Omni`, `FishTTS`) is written
against them too, and one request's collected result is an `Output`. Callers depend on this
module only, never on a family's package (`omnivox/api` imports no `omnivox.models.<family>` module: a test holds it).

Why a module of its own, beside `models/registry.py`: the registry finds and loads a family (it
imports their packages); this module is the contract between the layers above and any family, and
imports none. Capabilities are `isinstance` checks on the protocols:
  - `ServedModel`: every model (text to speech, the model card, the engine);
  - `ChatModel(ServedModel)`: it understands as well as speaks (chat completions, listening
    realtime sessions);
  - `VoiceCloner`: it speaks in voices cloned from a reference clip (saved voices, `references`);
  - `DuplexModel(ServedModel)`: full duplex, listening and speaking at once (`serving_duplex.py`).
`Family` (below) names a family: labels, `--model` detection before a model loads, its served class.

NOTE: the protocols come from typing_extensions: its `isinstance` looks members up statically
(as Python 3.12's does), so a check never runs a property (`engine` would start the engine).
"""
from __future__ import annotations

import importlib
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from typing_extensions import Protocol, runtime_checkable

from omnivox.engine.prompt import PromptStream, Segment
from omnivox.errors import InputError
from omnivox.sampling.params import GREEDY_TEMPERATURE

if TYPE_CHECKING:
    from omnivox.engine.config import EngineConfig
    from omnivox.engine.engine import Engine
    from omnivox.engine.graph import StageGraph
    from omnivox.engine.handle import RequestHandle
    from omnivox.media_budget import MediaLimits

MAX_SEED = 2**63 - 1
# NOTE: text longer than this many characters per context token cannot fit and is refused before
# tokenizing (tokenizing megabytes takes seconds of a worker's time)
MAX_CHARS_PER_TOKEN = 16


# ---- parameters ------------------------------------------------------------------------------
def _number(name: str, v: Any) -> None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
        raise InputError(f"{name} must be a finite number, got {v!r}", param=name)


def _integer(name: str, v: Any, low: int, high: int | None = None, what: str | None = None) -> None:
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low or (high is not None and v > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InputError(what or f"{name} must be an integer {bound}, got {v!r}", param=name)


def greedy_temperature(temperature: float | None) -> bool:
    """Whether a requested temperature means greedy decoding in every stage: 0, or any value below
    GREEDY_TEMPERATURE (the limit of sampling; dividing logits by less would overflow)."""
    return temperature is not None and temperature < GREEDY_TEMPERATURE


PLAYING = """`playing`: the caller streams the reply's audio to a listener who plays it as it arrives
(a streamed spoken reply, a realtime response): `--scheduling slack` paces it so it never stalls.
False (the default): batch work (offline calls, non-streamed replies; a text-only reply is batch
whatever it says), run for throughput in the time playing streams leave (engine/slack.py)."""


@dataclass(frozen=True)
class SpeechParams:
    """How to voice one text (`ServedModel.speech`). None: the model's default. Checked here
    (types and ranges, InputError naming the field); the model checks what only it knows."""

    seed: int | None = None
    max_frames: int | None = None  # the most audio frames (`ServedModel.frame_rate` a second)
    temperature: float | None = None  # below GREEDY_TEMPERATURE (0 included): greedy (`greedy_temperature`)
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    instructions: str | None = None  # a style note (a model that takes none refuses it)
    playing: bool = False  # a listener plays the audio as it streams (`PLAYING`)

    def __post_init__(self) -> None:
        _integer("seed", self.seed, 0, MAX_SEED)
        _integer("max_frames", self.max_frames, 1)
        for name in ("temperature", "top_p", "repetition_penalty"):
            _number(name, getattr(self, name))
        _integer("top_k", self.top_k, 0)
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise InputError(f"repetition_penalty must be positive, got {self.repetition_penalty}",
                             param="repetition_penalty")
        if self.instructions is not None and not isinstance(self.instructions, str):
            raise InputError("instructions must be a string", param="instructions")


@dataclass(frozen=True)
class ChatParams:
    """How to answer one chat (`ChatModel.prepare_chat`, `open_prompt`). None: the model's
    default (its generation_config.json). Checked here (types and ranges, InputError naming the
    field); the model checks what only it knows (a speaker's name, an instruction's tokens).

    greedy: argmax in every stage, and so is a `temperature` below GREEDY_TEMPERATURE (0 included;
    `is_greedy`); a `talker_*` sampling field given with it samples the speech stage (a
    Thinker-Talker's Talker) only. temperature/top_p/top_k alone sample the text."""

    max_tokens: int | None = None
    max_frames: int | None = None
    greedy: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    speaker: str | None = None  # a built-in voice (None: the model's default)
    return_audio: bool = True  # False: text only
    talker_temperature: float | None = None  # the speech stage's sampling
    talker_top_k: int | None = None
    talker_top_p: float | None = None
    talker_repetition_penalty: float | None = None
    talker_instruction: str | None = None  # a speech-only user turn (voice, style)
    ignore_eos: bool = False  # benchmarks: run to the length limits
    speculative: bool = True  # False: this request's Thinker never drafts (the server's speculation stays on)
    playing: bool = False  # a listener plays the audio as it streams (`PLAYING`)

    def __post_init__(self) -> None:
        _integer("max_tokens", self.max_tokens, 1, what="max_tokens must be a positive integer")
        _integer("max_frames", self.max_frames, 0, what="max_frames must be a non-negative integer")
        for name in ("temperature", "top_p", "repetition_penalty", "talker_temperature", "talker_top_p",
                     "talker_repetition_penalty"):
            _number(name, getattr(self, name))
        _integer("top_k", self.top_k, 0)
        _integer("talker_top_k", self.talker_top_k, 0)

    @property
    def is_greedy(self) -> bool:
        return self.greedy or greedy_temperature(self.temperature)

    @property
    def talker_sampling(self) -> bool:
        """Whether any `talker_*` sampling field is given."""
        return any(v is not None for v in (self.talker_temperature, self.talker_top_k, self.talker_top_p,
                                           self.talker_repetition_penalty))


@dataclass
class Output:
    """One request's result, collected (the offline API's `generate` and `speak`): text and text ids
    (empty for a model that only speaks; the ids exclude the prompt, an end token included), the
    audio codes [frames, codebooks], mono float32 audio at `sample_rate`, and why it stopped
    ("stop", "length", "abort")."""

    text: str
    text_ids: list[int]
    codes: np.ndarray
    audio: np.ndarray
    sample_rate: int
    finish_reason: str

    @property
    def audio_seconds(self) -> float:
        return self.audio.shape[0] / self.sample_rate

    def __iter__(self):
        """Deprecated: `audio, rate = FishTTS(...).speak(text)` (its return before this release)."""
        import warnings
        warnings.warn("speak returns an Output now; unpacking it as (audio, sample_rate) goes in the next release: "
                      "use out.audio and out.sample_rate", DeprecationWarning, stacklevel=2)
        return iter((self.audio, self.sample_rate))


@dataclass(eq=False)
class PreparedChat:
    """A chat request a `ChatModel` built (`prepare_chat`), ready to submit: its prompt and
    options are the model's own (opaque here); the sizes are what the server reads."""

    prompt: Any
    options: Any
    prompt_tokens: int  # the messages' tokens
    instruction_tokens: int = 0  # prompt tokens outside the messages (the Talker instruction turn)


def stage_weight_bytes(stages: dict[str, list[Any]]) -> dict[str, dict[str, int]]:
    """stage -> dtype name ("bfloat16", "float8_e4m3fn", ...) -> bytes of its modules' parameters and
    buffers (tensors still on the meta device, never loaded here, count nothing)."""
    out: dict[str, dict[str, int]] = {}
    for stage, modules in stages.items():
        seen, by = set(), out.setdefault(stage, {})
        for m in modules:
            for t in (*m.parameters(), *m.buffers()):
                if t.is_meta or id(t) in seen:
                    continue
                seen.add(id(t))
                key = str(t.dtype).removeprefix("torch.")
                by[key] = by.get(key, 0) + t.numel() * t.element_size()
    return out


def describe_weight_bytes(stages: dict[str, dict[str, int]]) -> str:
    """"weights: thinker 1.2 GiB (bfloat16 300 MiB, float8_e4m3fn 924 MiB); ..."."""
    def size(n: int) -> str:
        unit = next((u for u, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)) if n >= 2**k), "B")
        return f"{n / 2**{'GiB': 30, 'MiB': 20, 'KiB': 10, 'B': 0}[unit]:.3g} {unit}"
    parts = [f"{stage} {size(sum(by.values()))} ({', '.join(f'{k} {size(v)}' for k, v in sorted(by.items()))})"
             for stage, by in stages.items() if by]
    return "weights: " + "; ".join(parts)


# ---- a family ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """A model family as the registry knows it: its names, its served class, and what it can do."""

    name: str  # "qwen3_omni" | "fish_s2" | "moshi" (the `family` of a model card)
    label: str  # "Qwen3-Omni"
    model_types: tuple[str, ...]  # config.json `model_type` values it loads
    demo: str  # the --model spelling of its built-in demo
    demo_served_name: str  # the demo's served model id
    served: str  # "module:Class" of its served model (`models/<family>/served.py`, imported when a model loads)
    # what it can do, known before a load (the CLI checks its flags against them); a loaded model
    # says the same by its protocols (ChatModel, VoiceCloner)
    chat: bool  # POST /v1/chat/completions (it understands as well as speaks)
    cloning: bool  # reference voices (POST /v1/audio/voices, `references`)
    stages: tuple[str, ...] = ()  # the stage names a placement may give a device (engine/placement.py)
    kv_stages: tuple[str, ...] = ()  # the stages with a KV cache (`--kv-cache-mb stage=MB,...`)
    graph: str = ""  # "module:function": (loaded model, EngineConfig) -> its StageGraph (the profiling run's)
    config_keys: tuple[str, ...] = ()  # config.json keys that name the family when model_type does not
    # why generate / speak / bench refuse the family (their one-line error); `serve` takes every family
    unserved: str = ""

    def load(self, folder: Path | None, **kwargs) -> Any:
        return _named(self.served)(model=folder, **kwargs)

    def stage_graph(self, loaded: Any, cfg: "EngineConfig") -> "StageGraph":
        """A loaded model's stages under `cfg`, apart from its engine (engine/memory.py's profiling run)."""
        return _named(self.graph)(loaded, cfg)


def _named(spec: str) -> Any:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


# ---- what a served model offers ------------------------------------------------------------------
@runtime_checkable
class ServedModel(Protocol):
    """What the server, the CLI and the benchmark use of any loaded model: text to speech, the
    facts of the model card, the engine. Model work runs on the engine thread only."""

    family: "Family"
    folder: Path
    is_demo: bool
    engine_config: "EngineConfig"
    media_limits: "MediaLimits"  # what one request's media may cost to decode (omnivox/media_budget.py)

    @property
    def engine(self) -> "Engine": ...  # started on first use
    @property
    def sample_rate(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def frame_rate(self) -> float: ...  # audio frames per second (Qwen3-Omni 12.5, S2 ~21.5)
    @property
    def audio_context_frames(self) -> int: ...  # the most audio frames one reply can hold
    @property
    def default_max_frames(self) -> int: ...  # frames of a reply that names none
    @property
    def modalities(self) -> list[str]: ...
    @property
    def builtin_voices(self) -> list[str]: ...
    @property
    def default_voice(self) -> str | None: ...  # what a request that names no voice speaks with (None: none)

    def close(self) -> None: ...
    def parameter_count(self) -> int: ...
    def weight_bytes(self) -> dict[str, dict[str, int]]: ...  # stage -> dtype -> bytes (`stage_weight_bytes`)
    def default_kv_mb(self) -> float: ...
    def kv_summary(self) -> str: ...
    def describe(self) -> list[str]: ...
    def bench_workload(self, args) -> Any: ...

    def check_speech(self, params: SpeechParams) -> None:
        """Refuse what the model cannot do with `params` (InputError naming the field)."""

    def speech(self, text: str, params: SpeechParams = SpeechParams(), *, voice: Any = None,
               references: list[tuple[bytes, str]] = (), loop=None, request_id: str | None = None,
               **options) -> "RequestHandle":
        """Queue text to speech in `voice` (None or "default": the default voice; a built-in name; a
        voice of `VoiceCloner.voice_from_bytes`) with per-request `references` ((encoded audio, its
        transcript) pairs: a model that does not clone refuses them). Bad values raise InputError
        naming the field (`param`). Worker thread: references are encoded here. `options`: the
        family's own keywords, from offline callers only (the server passes none)."""


@runtime_checkable
class ChatModel(ServedModel, Protocol):
    """A model that understands as well as speaks: chat completions and listening realtime sessions.
    Prompts are chat messages (OpenAI content parts) or, for realtime, token ids streamed in
    segments laid out by the model's `conversation_layout`."""

    @property
    def default_max_tokens(self) -> int: ...  # tokens of a reply that names none
    @property
    def prompt_kv_pages(self) -> int: ...  # KV pages of the stage that holds prompts

    def check_chat(self, params: ChatParams) -> None:
        """Refuse what the model cannot do with `params` (InputError naming the field), before any
        media is read. May tokenize: a worker thread."""

    def prepare_chat(self, messages: list[dict] | None, params: ChatParams, **prompt) -> PreparedChat:
        """The request for `messages` (media decoded: a worker thread). ContextTooLong when the
        prompt cannot fit; InputError for bad messages or params. `prompt`: the family's other
        prompt forms, from offline callers only (Qwen3-Omni: `prompt_ids=` with `audio=`, ...)."""

    def submit_chat(self, request: PreparedChat, *, max_tokens: int | None = None, text_hook=None, loop=None,
                    request_id: str | None = None) -> "RequestHandle":
        """Queue `request` in the engine; `max_tokens` (once the prompt's length is known) replaces
        the params'. Cheap: the event loop may call it. Overloaded when the engine is full."""

    def open_prompt(self, prompt_ids: list[int], params: ChatParams, *, segments: list[Segment] = (),
                    loop=None, request_id: str | None = None) -> tuple["RequestHandle", PromptStream]:
        """A request whose prompt keeps growing (realtime input): `prompt_ids` now (text), then what
        the caller appends to the stream; the model answers once the stream is closed with the
        layout's `reply_header`. `segments` are in the stream before the engine sees the request
        (the prefix cache matches them at admission)."""

    def conversation_layout(self) -> "ConversationLayout":
        """A fresh layout for one conversation (it caches tokenized instructions)."""

    def audio_window(self, window_seconds: float) -> "AudioWindow":
        """Host arithmetic of the audio-input encoder with an attention window of about
        `window_seconds`: which rows a clip's log-mel frames make final. The encoding itself is
        the listening request's encoder stage (host audio in the prompt stream)."""


@runtime_checkable
class VoiceCloner(Protocol):
    """A model that speaks in voices cloned from a reference clip. A voice is the model's own
    object (`ClonedVoice`); stores keep it as the bytes the model writes."""

    def encode_voice(self, audio: bytes, transcript: str) -> "ClonedVoice":
        """A voice from a clip (encoded bytes) and its transcript (InputError for bad audio).
        Worker thread: the model encodes it on the engine thread."""

    def voice_to_bytes(self, voice: "ClonedVoice") -> bytes: ...

    def voice_from_bytes(self, data: bytes) -> "ClonedVoice":
        """The voice `voice_to_bytes` wrote (InputError when `data` is not one)."""


class ClonedVoice(Protocol):
    text: str  # the transcript of its reference clip


class ConversationLayout(Protocol):
    """How a conversation becomes a chat model's prompt: each item as segments of token ids (audio
    turns with one placeholder id per encoded row, whose embeddings the caller supplies)."""

    audio_pad: int  # the placeholder id of one audio row

    def text_ids(self, text: str) -> list[int]:
        """`text` as plain tokens (special-token strings stay text)."""

    def has_system(self, instructions: str) -> bool:
        """Whether `system(instructions)` is tokenized already (or has nothing to tokenize)."""

    def system(self, instructions: str) -> list[Segment]:
        """The system turn of `instructions` ([] when empty)."""

    def text_turn(self, role: str, ids: list[int]) -> list[Segment]:
        """A user/system/assistant turn holding text ids."""

    def audio_open(self) -> list[int]:
        """The ids before a user's audio rows."""

    def audio_close(self) -> list[int]:
        """The ids after a user's audio rows (the end of the turn)."""

    def reply(self, ids: list[int]) -> list[Segment]:
        """An assistant reply of generated `ids` (ended as the model ends a turn)."""

    def reply_header(self) -> list[int]:
        """The ids that end a prompt the model answers."""


class AudioWindow(Protocol):
    """What a realtime session knows of the audio-input encoder (host only, no model)."""

    window_chunks: int  # the attention window, in encoder chunks

    def rows(self, frames: int, final: bool) -> int:
        """Rows final after a clip's first `frames` log-mel frames (`final`: the clip ended)."""
