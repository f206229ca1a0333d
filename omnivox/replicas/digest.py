"""The routing digest of a request: requests with equal digests go to one engine replica
(`routing.choose`), where they share its cached state.

- a session key, when the request names one: the `x-omnivox-session` header (chat and speech),
  else a chat's `user` field: sha256 of the key, so every request of that session or user goes to
  one replica, whatever it says.
- chat completions: sha256 of the canonical JSON (sorted keys, no spaces) of `model` and the
  conversation's head, its messages up to and including the first user message (the system
  prompt and the first question), cut to its first `PREFIX_BYTES` bytes. Every later turn of a
  conversation repeats that head, so turn 2 goes where turn 1 ran and meets its cached prefix;
  conversations that differ only after their first 4 KiB (a long system prompt, a shared
  document) meet on one replica too.
- speech: sha256 of the voice and the references (`voice`, `references`, `ref_audio`,
  `ref_text`): a cloned voice is encoded once, on its home replica.
- anything else (or a body that is not a JSON object): no digest; the least loaded replica.
"""
from __future__ import annotations

import hashlib
import json

PREFIX_BYTES = 4096
SPEECH_KEYS = ("voice", "references", "ref_audio", "ref_text")
SESSION_HEADER = "x-omnivox-session"
CHAT, SPEECH = "/v1/chat/completions", "/v1/audio/speech"


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def request_digest(path: str, body: bytes, session: str | None = None) -> str | None:
    """The digest for a POST to `path` with `body` (`session`: the x-omnivox-session header), or None."""
    if path not in (CHAT, SPEECH):
        return None
    if session:
        return _session_digest(session)
    try:
        obj = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    if path == SPEECH:
        return hashlib.sha256(_canonical({k: obj.get(k) for k in SPEECH_KEYS})).hexdigest()
    if isinstance(obj.get("user"), str) and obj["user"]:
        return _session_digest(obj["user"])
    key = (_canonical(obj.get("model")) + b"\n" + _canonical(conversation_head(obj.get("messages"))))[:PREFIX_BYTES]
    return hashlib.sha256(key).hexdigest()


def conversation_head(messages):
    """The messages up to and including the first user message (all of them if none is)."""
    if not isinstance(messages, list):
        return messages
    first_user = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), None)
    return messages if first_user is None else messages[:first_user + 1]


def _session_digest(key: str) -> str:
    return hashlib.sha256(b"session\n" + key.encode("utf-8", "replace")).hexdigest()
