"""Response bodies of `/v1/chat/completions` in OpenAI's shapes (plain dicts, JSON-ready).

Audio: `message.audio` / `delta.audio` = {id, data (base64), transcript, expires_at}. omnivox
keeps no audio after the reply, so `expires_at` is nominal (one hour after `created`) and an
`audio.id` sent back in a later request is ignored.
Usage: `completion_tokens` = text tokens + speech frames; the details split them
(`completion_tokens_details.text_tokens`, `.audio_tokens` = 80 ms frames). `prompt_tokens` counts
the Talker-only `talker_instruction` turn too (`prompt_tokens_details.talker_instruction_tokens`).
Streamed chunks carry vLLM-Omni's top-level `modality`: "audio" on the chunks with
`delta.audio`, "text" on every other one (role, content, finish and usage chunks).
"""
from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from omnivox.engine.events import Finished

AUDIO_TTL_S = 3600


@dataclass
class ReplyIds:
    """Identifiers shared by every chunk of one reply."""

    id: str
    audio_id: str
    created: int
    model: str
    system_fingerprint: str = field(default="omnivox")

    @property
    def expires_at(self) -> int:
        return self.created + AUDIO_TTL_S


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def audio_object(ids: ReplyIds, data: bytes, transcript: str) -> dict[str, Any]:
    return {"id": ids.audio_id, "data": b64(data), "transcript": transcript, "expires_at": ids.expires_at}


def usage(fin: Finished, instruction_tokens: int = 0) -> dict[str, Any]:
    text, frames = len(fin.text_ids), int(fin.codes.shape[0])
    prompt = fin.prompt_tokens + instruction_tokens
    return {"prompt_tokens": prompt, "completion_tokens": text + frames,
            "total_tokens": prompt + text + frames,
            "completion_tokens_details": {"text_tokens": text, "audio_tokens": frames},
            "prompt_tokens_details": {"cached_tokens": 0, "talker_instruction_tokens": instruction_tokens}}


def completion(ids: ReplyIds, fin: Finished, audio: dict[str, Any] | None,
               instruction_tokens: int = 0) -> dict[str, Any]:
    message = {"role": "assistant", "content": fin.text, "refusal": None, "audio": audio}
    return {"id": ids.id, "object": "chat.completion", "created": ids.created, "model": ids.model,
            "system_fingerprint": ids.system_fingerprint,
            "choices": [{"index": 0, "message": message, "finish_reason": fin.finish_reason, "logprobs": None}],
            "usage": usage(fin, instruction_tokens)}


def chunk(ids: ReplyIds, delta: dict[str, Any], finish_reason: str | None = None,
          modality: str = "text") -> dict[str, Any]:
    return {"id": ids.id, "object": "chat.completion.chunk", "created": ids.created, "model": ids.model,
            "system_fingerprint": ids.system_fingerprint, "modality": modality,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}


def usage_chunk(ids: ReplyIds, fin: Finished, instruction_tokens: int = 0) -> dict[str, Any]:
    return {"id": ids.id, "object": "chat.completion.chunk", "created": ids.created, "model": ids.model,
            "system_fingerprint": ids.system_fingerprint, "modality": "text", "choices": [],
            "usage": usage(fin, instruction_tokens)}
