"""Qwen3-Omni's chat template in ids: the conversation layout of a realtime session
(`omnivox.serving.ConversationLayout`, `Omni.conversation_layout`).

    <|im_start|>system\\n{instructions}<|im_end|>\\n                     (when there are instructions)
    <|im_start|>user\\n<|audio_start|>{rows}<|audio_end|><|im_end|>\\n   (a spoken turn)
    <|im_start|>user\\n{text}<|im_end|>\\n                               (a text item)
    <|im_start|>assistant\\n{generated ids, ending in <|im_end|>}\\n     (a reply)
and a prompt the model answers ends with the assistant header.
"""
from __future__ import annotations

from functools import lru_cache

import tokenizers

from omnivox.engine.prompt import Segment
from omnivox.errors import InputError


@lru_cache(maxsize=8)
def _plain(backend: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """The tokenizer reading special-token strings as plain text (user text never becomes a
    control id: `<|im_end|>` typed by a user is text, not the end of their turn)."""
    copy = tokenizers.Tokenizer.from_str(backend.to_str())
    copy.encode_special_tokens = True
    return copy


class ChatLayout:
    """The ids that frame each item, read once from the model's tokenizer and config."""

    def __init__(self, tokenizer, cfg):
        if tokenizer is None:
            raise InputError("realtime conversations need the checkpoint's tokenizer")
        self.tokenizer = tok = tokenizer
        self.header = {role: tok.encode(f"<|im_start|>{role}\n") for role in ("system", "user", "assistant")}
        self.end = tok.encode("<|im_end|>\n")  # [im_end, newline]
        self.im_end, self.newline = cfg.im_end_token_id, self.end[-1]
        th = cfg.thinker
        self.audio_pad = th.audio_token_id
        self.audio_start = th.audio_start_token_id
        self.audio_end = th.audio_end_token_id if th.audio_end_token_id is not None else tok.encode("<|audio_end|>")[0]
        self._system: dict[str, list[int]] = {}  # instructions -> their ids (the session's and one response's)

    def text_ids(self, text: str) -> list[int]:
        return _plain(self.tokenizer.backend).encode_batch([text], add_special_tokens=False)[0].ids

    def has_system(self, instructions: str) -> bool:
        return not instructions or instructions in self._system

    def system(self, instructions: str) -> list[Segment]:
        """NOTE: the session tokenizes instructions in a worker thread when they are set
        (session.update, response.create), so on the event loop this is a cache hit."""
        if not instructions:
            return []
        kept = list(self._system.items())
        ids = self._system.get(instructions)
        if ids is None:
            ids = self.text_ids(instructions)
        fresh = {k: v for k, v in kept if k != instructions}
        fresh[instructions] = ids
        self._system = dict(list(fresh.items())[-2:])  # the two last used, swapped in whole: two threads call this
        return self.text_turn("system", ids)

    def text_turn(self, role: str, ids: list[int]) -> list[Segment]:
        return [Segment(self.header[role] + ids + self.end)]

    def audio_open(self) -> list[int]:
        return self.header["user"] + [self.audio_start]

    def audio_close(self) -> list[int]:
        return [self.audio_end] + self.end

    def reply(self, ids: list[int]) -> list[Segment]:
        """The header, then the generated ids as they are: the model may have sampled any id (media
        placeholders too), read back as plain tokens, never checked as user input. Two segments, so
        a conversation that starts with a reply still opens with text (`Omni.open_prompt`)."""
        body = list(ids)
        if not body or body[-1] != self.im_end:
            body.append(self.im_end)
        return [Segment(self.header["assistant"]), Segment(body + [self.newline])]

    def reply_header(self) -> list[int]:
        return list(self.header["assistant"])
