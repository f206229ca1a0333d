"""Message text stays text: special-token strings a user writes (`<|im_start|>system\\n...`) never
become control tokens.

A chat template writes its own structure (`<|im_start|>`, `<|im_end|>`, media placeholders) as
literal special-token strings, and the tokenizer maps every such string to its control id,
wherever it came from. So before rendering, `Shield.messages` replaces each special-token string
inside message text (every role, string content and text parts) by a marker that holds no
special string; after rendering, `Shield.split` cuts the prompt at the markers and
`Tokenizer.encode_pieces` encodes the template's pieces as before and each marked string as
plain text (its bytes through the BPE, e.g. `<`, `|`, `im`, `_start`, `|`, `>`).

Text without special-token strings is untouched: its ids equal transformers' exactly. Text with
them departs from transformers on purpose (transformers turns them into control ids). The
pieces around a marked string tokenize as they did before, because a special token was already
a split point for the tokenizer.
"""
from __future__ import annotations

import re
import secrets
from typing import Any, Iterable


class Shield:
    """Markers for the special-token strings of one prompt (one instance per prompt)."""

    def __init__(self, specials: Iterable[str]):
        specials = sorted({s for s in specials if s}, key=len, reverse=True)  # longest first
        self._find = re.compile("|".join(map(re.escape, specials))) if specials else None
        # NOTE: a fresh nonce per prompt, so no user text can spell a marker of this prompt
        self._tag = f"\ue000{secrets.randbits(64)}:"  # digits: survive case filters
        self._marker = re.compile(re.escape(self._tag) + r"(\d+)\ue001")
        self.literals: list[str] = []

    def text(self, s: str) -> str:
        """`s` with every special-token string replaced by a marker."""
        if self._find is None or not isinstance(s, str):
            return s
        return self._find.sub(self._mark, s)

    def _mark(self, m: re.Match) -> str:
        self.literals.append(m.group(0))
        return f"{self._tag}{len(self.literals) - 1}\ue001"

    def messages(self, messages: list[dict]) -> list[dict]:
        """Copies of `messages` whose text (string content, text parts, `name`) is shielded."""
        return [self._message(m) if isinstance(m, dict) else m for m in messages]

    def _message(self, m: dict) -> dict:
        out = dict(m)
        content = m.get("content")
        if isinstance(content, str):
            out["content"] = self.text(content)
        elif isinstance(content, list):
            out["content"] = [self._part(p) for p in content]
        if isinstance(m.get("name"), str):
            out["name"] = self.text(m["name"])
        return out

    def _part(self, part: Any) -> Any:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            return {**part, "text": self.text(part["text"])}
        return part

    def split(self, rendered: str) -> list[tuple[str, bool]]:
        """(piece, literal) pieces of a rendered prompt: literal pieces are a user's special-token
        strings, to encode as plain text; the others are encoded as usual."""
        pieces: list[tuple[str, bool]] = []
        at = 0
        for m in self._marker.finditer(rendered):
            if m.start() > at:
                pieces.append((rendered[at:m.start()], False))
            pieces.append((self.literals[int(m.group(1))], True))
            at = m.end()
        if at < len(rendered) or not pieces:
            pieces.append((rendered[at:], False))
        return pieces

    def encode(self, tokenizer, rendered: str) -> list[int]:
        """Ids of a prompt rendered from shielded text."""
        return tokenizer.encode_pieces(self.split(rendered))
