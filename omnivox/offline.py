"""The offline Python API over any served model: `generate` a chat's reply, `speak` text, `stream`
either one's events, `submit` either one for a handle; every collected result is one
`omnivox.serving.Output`. It uses the serving protocols only (`omnivox.serving`: a chat needs a
`ChatModel`), so it is the same over every family; `Omni` and `FishTTS` load a family and are
this API over it.

Everything else (the engine, the tokenizer, `build_prompt`, `encode_voice`, the model card's
facts) is the served model's, reached as `api.served` or directly (`omni.engine`).
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any, Iterator

from omnivox.engine.events import Event
from omnivox.engine.handle import RequestHandle
from omnivox.errors import InputError
from omnivox.models.fish_s2.family import FAMILY as FISH_S2
from omnivox.models.qwen3_omni.family import FAMILY as QWEN3_OMNI
from omnivox.serving import ChatModel, ChatParams, Output, ServedModel, SpeechParams

SPEECH_FIELDS = frozenset(f.name for f in fields(SpeechParams))
PROMPT_KEYS = ("prompt_ids", "audio", "images", "videos", "system")  # a chat model's other prompt forms


class OfflineModel:
    """A served model's offline verbs. A request is a chat (`messages=`, or a family's other
    prompt keywords such as Qwen3-Omni's `prompt_ids=`) or text to speech (a `str`, or `text=`).

    Chat keywords: `ChatParams`' fields (max_tokens, max_frames, greedy, temperature, top_p, top_k,
    repetition_penalty, seed, speaker, return_audio, talker_*, playing, ...), `text_hook`.
    Speech keywords: `voice`, `references`, `SpeechParams`' fields (seed, max_frames, temperature,
    top_p, top_k, repetition_penalty, instructions, playing) and the family's own (Qwen3-Omni:
    `ChatParams`' fields such as speaker=, greedy=; S2: mode, greedy_residual,
    mask_residual_overflow, ignore_eos). `playing`: serving.PLAYING."""

    def __init__(self, served: ServedModel):
        self.served = served

    def __getattr__(self, name: str) -> Any:  # the served model's members: engine, tokenizer, close, ...
        if name == "served":
            raise AttributeError(name)
        return getattr(self.served, name)

    def __setattr__(self, name: str, value: Any) -> None:  # one object's state: `omni.engine_config = ...` is the model's
        if name == "served":
            object.__setattr__(self, name, value)
        else:
            setattr(self.served, name, value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.served.family.label}, {self.served.folder})"

    def submit(self, messages: list[dict] | str | None = None, *, text: str | None = None,
               request_id: str | None = None, loop=None, text_hook=None, **kwargs) -> RequestHandle:
        """Queue one request in the engine; iterate the handle for its events (TextDelta,
        AudioChunk, then Finished or Failed)."""
        if isinstance(messages, str):
            messages, text = None, messages
        if text is not None:
            if messages is not None or text_hook is not None:
                raise InputError("text to speech takes text= only (no messages=, no text_hook=)")
            return self._speech(text, request_id, loop, kwargs)
        served = self.served
        if not isinstance(served, ChatModel):
            raise InputError(f"{served.family.label} speaks text only: pass the text (speak/stream/submit(text))")
        prompt = {k: kwargs.pop(k) for k in PROMPT_KEYS if k in kwargs}
        prepared = served.prepare_chat(messages, ChatParams(**kwargs), **prompt)
        return served.submit_chat(prepared, text_hook=text_hook, loop=loop, request_id=request_id)

    def _speech(self, text: str, request_id: str | None, loop, kwargs: dict) -> RequestHandle:
        voice, references = kwargs.pop("voice", None), kwargs.pop("references", None) or ()
        params = SpeechParams(**{k: kwargs.pop(k) for k in SPEECH_FIELDS & set(kwargs)})
        return self.served.speech(text, params, voice=voice, references=references, loop=loop,
                                  request_id=request_id, **kwargs)

    def stream(self, messages: list[dict] | str | None = None, **kwargs) -> Iterator[Event]:
        """Events of one request (a chat, or text to speech) as they happen; closing the iterator
        early cancels the request."""
        handle = self.submit(messages, **kwargs)
        try:
            yield from handle
        finally:  # the caller stopped listening: free the request's resources
            handle.cancel()

    def generate(self, messages: list[dict] | list[list[dict]] | None = None, *,
                 requests: list[dict] | None = None, **kwargs) -> Output | list[Output]:
        """A chat's reply, collected; or many at once, run concurrently: `generate([{...}, {...}])`
        (or `requests=`) where each dict holds the keywords a single call takes."""
        if requests is None and isinstance(messages, list) and messages and all(
                isinstance(m, dict) and "role" not in m for m in messages):
            requests, messages = messages, None
        if requests is None:
            return self.collect(self.submit(messages, **kwargs))
        handles = [self.submit(**r) for r in requests]
        return [self.collect(h) for h in handles]

    def speak(self, text: str, **kwargs) -> Output:
        """`text` voiced, collected: `.audio` at `.sample_rate` and `.codes`."""
        if not isinstance(text, str):
            raise InputError(f"speak takes the text to voice as a string, got {type(text).__name__}")
        return self.collect(self.submit(text=text, **kwargs))

    def collect(self, handle: RequestHandle) -> Output:
        """Wait for a submitted request's end (a Failed one raises InputError or OmnivoxError)."""
        ev, audio = handle.collect()
        return Output(ev.text, ev.text_ids, ev.codes, audio, self.served.sample_rate, ev.finish_reason)


class Omni(OfflineModel):
    """Qwen3-Omni offline: load a checkpoint folder (None: the built-in demo) and `generate`,
    `stream`, `speak`. Keywords: `models.qwen3_omni.served.Qwen3OmniCheckpoint`'s (dtype,
    device, engine_config, speculative_config, placement, tensor_parallel_size, quantization, ...)."""

    def __init__(self, model: str | Path | None = None, **kwargs):
        super().__init__(QWEN3_OMNI.load(model, **kwargs))


class FishTTS(OfflineModel):
    """Fish Audio S2 Pro offline: load a checkpoint folder (None: the built-in tiny demo) and
    `speak` / `stream` text, optionally in reference voices (`references=`, `encode_voice`).
    Keywords: `models.fish_s2.served.FishS2Checkpoint`'s (dtype, device, engine_config, placement,
    quantization, ...)."""

    def __init__(self, model: str | Path | None = None, **kwargs):
        super().__init__(FISH_S2.load(model, **kwargs))
