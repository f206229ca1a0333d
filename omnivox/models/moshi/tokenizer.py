"""Moshi's text tokenizer: the sentencepiece model named by config.json's `tokenizer_name`.

The LM emits one text token per frame; the padding ids (`existing_text_padding_id`, 3, and
`existing_text_end_padding_id`, 0) carry no text. A word piece's "▁" is a space (moshi's server
renders text this way).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import sentencepiece

from omnivox.errors import CheckpointError
from omnivox.models.moshi.config import MoshiConfig


class MoshiTokenizer:
    def __init__(self, path: str | Path, padding_ids: Iterable[int] = (0, 3)):
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path} not found (config.json's tokenizer_name)")
        self.sp = sentencepiece.SentencePieceProcessor()
        try:
            self.sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise CheckpointError(f"{path}: not a sentencepiece model ({e})") from None
        self.padding_ids = frozenset(padding_ids)

    @classmethod
    def from_folder(cls, folder: str | Path, cfg: MoshiConfig) -> "MoshiTokenizer":
        return cls(Path(folder) / cfg.files.tokenizer_name,
                   (cfg.existing_text_end_padding_id, cfg.existing_text_padding_id))

    def piece(self, token: int) -> str:
        """The text one frame's token adds ('' for padding and out-of-vocabulary ids)."""
        if token in self.padding_ids or not 0 <= token < self.sp.GetPieceSize():
            return ""
        return self.sp.IdToPiece(token).replace("\u2581", " ")

    def text(self, tokens: Iterable[int]) -> str:
        return "".join(self.piece(int(t)) for t in tokens)

    def encode(self, text: str) -> list[int]:
        return list(self.sp.EncodeAsIds(text))
