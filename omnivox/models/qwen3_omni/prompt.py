"""Chat messages -> prompt text -> prompt ids with every media placeholder expanded.

Three steps, in request order:
1. `render_messages`: OpenAI-style messages to prompt text, through the checkpoint's jinja chat
   template (rendered as transformers renders it) or, without one, the Qwen3-Omni layout of spec
   section 3.5. Each media part becomes ONE pad token between its start/end markers.
2. The tokenizer encodes the text (special tokens written literally map to their ids).
3. `expand_media_tokens`: each single pad id is repeated by its medium's token count, in order.
`media_in_order` returns the media payloads in the same order as the pads, for the encoders.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from omnivox.errors import CheckpointError, InputError

# Content-part "type" values per kind. OpenAI spells input_audio / image_url; transformers'
# processors spell audio / image / video; audio_url and video_url are common serving aliases.
PART_KINDS = {
    "text": "text",
    "audio": "audio", "input_audio": "audio", "audio_url": "audio",
    "image": "image", "image_url": "image",
    "video": "video", "video_url": "video",
}
# Spec section 3.5: one placeholder per media part, expanded after tokenization.
PLACEHOLDERS = {
    "audio": "<|audio_start|><|audio_pad|><|audio_end|>",
    "image": "<|vision_start|><|image_pad|><|vision_end|>",
    "video": "<|vision_start|><|video_pad|><|vision_end|>",
}


def part_kind(part: Any) -> str:
    """'text', 'audio', 'image' or 'video' for one content part; InputError otherwise."""
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise InputError(f"content part {part!r} must be an object with a string 'type'")
    kind = PART_KINDS.get(part["type"])
    if kind is None:
        raise InputError(f"content part type {part['type']!r} is not supported; use one of {sorted(PART_KINDS)}")
    if kind == "text" and not isinstance(part.get("text"), str):
        raise InputError("a text content part needs a string 'text' field")
    return kind


def _check_messages(messages: list[dict]) -> None:
    if not isinstance(messages, list) or not messages:
        raise InputError("messages must be a non-empty list of {role, content} objects")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InputError(f"message {m!r} must be an object with a string 'role'")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InputError(f"message content must be a string or a list of parts, got {type(content).__name__}")
        for part in content if isinstance(content, list) else ():
            part_kind(part)


def _with_system(messages: list[dict], system: str | None) -> list[dict]:
    """Prepend `system` as a system turn unless the conversation already opens with one."""
    if system is None or messages[0].get("role") == "system":
        return messages
    return [{"role": "system", "content": system}, *messages]


def _render_content(content: str | list | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    pieces = []
    for part in content:
        kind = part_kind(part)
        pieces.append(part["text"] if kind == "text" else PLACEHOLDERS[kind])
    return "".join(pieces)


def render_default(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The Qwen3-Omni prompt layout of spec section 3.5, for checkpoints without a template."""
    turns = [f"<|im_start|>{m['role']}\n{_render_content(m.get('content'))}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        turns.append("<|im_start|>assistant\n")
    return "".join(turns)


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers in some templates): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Not jinja's own tojson, which HTML-escapes; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """A chat template compiled in a sandbox with the helpers transformers provides."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"chat template does not compile (line {e.lineno}: {e.message}); "
                              "fix chat_template in the checkpoint folder") from e


def render_messages(messages: list[dict], template: str | None, add_generation_prompt: bool = True,
                    system: str | None = None, template_vars: dict[str, Any] | None = None) -> str:
    """Prompt text for OpenAI-style chat messages.

    `system` is a default system prompt, used only when the messages do not open with a system
    turn. `template_vars` are extra template variables (transformers passes the tokenizer's
    special_tokens_map: bos_token, eos_token, ...). A template's `raise_exception` becomes InputError.
    """
    _check_messages(messages)
    messages = _with_system(messages, system)
    if template is None:
        return render_default(messages, add_generation_prompt)
    compiled = compile_template(template)
    try:
        return compiled.render({**(template_vars or {}), "messages": messages, "tools": None,
                                "documents": None, "add_generation_prompt": add_generation_prompt})
    except jinja2.TemplateError as e:
        raise InputError(f"the chat template rejected the messages: {e}") from e


def _payload(part: dict) -> Any:
    """The media value of a part: part[type] when present, else the part's other fields (url, path, ...)."""
    if part["type"] in part:
        return part[part["type"]]
    return {k: v for k, v in part.items() if k != "type"}


def media_in_order(messages: list[dict]) -> tuple[list[Any], list[Any], list[Any]]:
    """(audios, images, videos): raw payloads of the media parts, in prompt order, untouched."""
    found: dict[str, list[Any]] = {"audio": [], "image": [], "video": []}
    for m in messages:
        content = m.get("content")
        for part in content if isinstance(content, list) else ():
            kind = part_kind(part)
            if kind != "text":
                found[kind].append(_payload(part))
    return found["audio"], found["image"], found["video"]


def expand_media_tokens(ids: list[int], *, audio_token_id: int, image_token_id: int, video_token_id: int,
                        audio_counts: list[int], image_counts: list[int], video_counts: list[int]) -> list[int]:
    """Repeat the i-th pad of each medium `counts[i]` times (pads are single ids after rendering)."""
    media = {audio_token_id: ("audio", list(audio_counts)), image_token_id: ("image", list(image_counts)),
             video_token_id: ("video", list(video_counts))}
    for pad, (name, counts) in media.items():
        found = sum(1 for t in ids if t == pad)
        if found != len(counts):
            raise InputError(f"the prompt has {found} {name} placeholder(s) (id {pad}) but {len(counts)} {name} "
                             f"input(s) were given; give exactly one {name} part per placeholder")
        if any(int(c) < 1 for c in counts):
            raise InputError(f"every {name} input must yield at least one token, got counts {counts}")
    out: list[int] = []
    cursor = {pad: 0 for pad in media}
    for t in ids:
        if t in media:
            out.extend([t] * int(media[t][1][cursor[t]]))
            cursor[t] += 1
        else:
            out.append(t)
    return out
