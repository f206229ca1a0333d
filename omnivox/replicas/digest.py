"""The routing digest of a request body: requests with equal digests go to one engine replica
(`routing.choose`), where they share its cached state.

- chat completions: sha256 of the canonical JSON (sorted keys, no spaces) of `model` and
  `messages`, cut to its first `PREFIX_BYTES` bytes: two requests whose conversations agree on
  their first 4 KiB (a long system prompt, a shared document, an earlier turn) hash alike and
  meet that replica's prefix cache; shorter conversations hash by their whole text.
- speech: sha256 of the voice and the references (`voice`, `references`, `ref_audio`,
  `ref_text`): a cloned voice is encoded once, on its home replica.
- anything else (or a body that is not a JSON object): no digest; the least loaded replica.
"""
from __future__ import annotations

import hashlib
import json

PREFIX_BYTES = 4096
SPEECH_KEYS = ("voice", "references", "ref_audio", "ref_text")


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def request_digest(path: str, body: bytes) -> str | None:
    """The digest for a POST to `path` with `body`, or None."""
    if path not in ("/v1/chat/completions", "/v1/audio/speech") or not body:
        return None
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    if path == "/v1/chat/completions":
        key = (_canonical(obj.get("model")) + b"\n" + _canonical(obj.get("messages")))[:PREFIX_BYTES]
    else:
        key = _canonical({k: obj.get(k) for k in SPEECH_KEYS})
    return hashlib.sha256(key).hexdigest()
