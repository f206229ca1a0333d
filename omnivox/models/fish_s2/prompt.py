"""The exact S2 prompt (spec 11): segments tokenized one by one, never across boundaries.

A prompt is a matrix [1 + num_codebooks, T]: row 0 holds token ids, rows 1.. hold codes c0..c9
at VQ positions (row 0 there = semantic_begin + c0) and zeros elsewhere.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence, Union

import torch

from omnivox.errors import CheckpointError, InputError
from omnivox.models.fish_s2.config import FishConfig

SPEAKER_TAG = re.compile(r"<\|speaker:\d+\|>")
SYSTEM_NO_REF = "convert the provided text to speech"
SYSTEM_REF = "convert the provided text to speech reference to the following:\n\nText:\n"
ASSISTANT_VOICE = "<|im_start|>assistant\n<|voice|>"


class SegmentTokenizer(Protocol):
    def encode(self, text: str) -> list[int]:
        """Ids of one segment: no special tokens added, inline special tokens parsed as single ids."""


class TextTokenizer:
    """`tokenizer.json` through the `tokenizers` library, encoding without added special tokens."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path} not found: the S2 folder must hold tokenizer.json")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


@dataclass(frozen=True)
class Reference:
    text: str
    codes: torch.Tensor  # [num_codebooks, F] codec codes of the reference clip


@dataclass(frozen=True)
class Turn:
    """A past turn: a user text, or an assistant voice turn given by its codes [num_codebooks, F]."""

    role: str
    text: str = ""
    codes: torch.Tensor | None = None


Segment = Union[str, torch.Tensor]  # text, or codes [num_codebooks, F]


def _ref_texts(refs: Sequence[Reference], mode: str) -> list[str]:
    if mode == "sglang":
        return ["<|speaker:0|>" + r.text for r in refs]
    joined = "\n".join(r.text if SPEAKER_TAG.search(r.text) else f"<|speaker:{i}|>{r.text}"
                       for i, r in enumerate(refs))
    return [joined]


def prompt_segments(text: str, references: Sequence[Reference] = (), history: Sequence[Turn] = (),
                    mode: str = "fish") -> list[Segment]:
    """The segment list, in order (text segments are tokenized separately)."""
    if mode not in ("fish", "sglang"):
        raise InputError(f"prompt mode must be 'fish' or 'sglang', got {mode!r}")
    segs: list[Segment] = []
    if references:
        codes = torch.cat([r.codes for r in references], dim=1)  # clips concatenated in time
        segs += ["<|im_start|>system\n", SYSTEM_REF, *_ref_texts(references, mode), "\n\nSpeech:\n", codes,
                 "<|im_end|>\n"]
    elif mode == "fish":
        segs += ["<|im_start|>system\n", SYSTEM_NO_REF, "<|im_end|>\n"]
    for turn in history:
        if turn.role == "user":
            segs += ["<|im_start|>user\n", turn.text, "<|im_end|>\n"]
        elif turn.role == "assistant" and turn.codes is not None:
            segs += [ASSISTANT_VOICE, turn.codes, "<|im_end|>\n"]
        else:
            raise InputError(f"history turn must be a user text or an assistant voice turn, got role {turn.role!r}")
    user = "<|speaker:0|>" + text if mode == "sglang" else text
    segs += ["<|im_start|>user\n", user, "<|im_end|>\n", ASSISTANT_VOICE]
    return segs


def encode_segments(segments: Sequence[Segment], tokenizer: SegmentTokenizer, cfg: FishConfig) -> torch.Tensor:
    """Segments -> prompt matrix [1 + num_codebooks, T] (long)."""
    n = cfg.num_codebooks
    cols: list[torch.Tensor] = []
    for seg in segments:
        if isinstance(seg, str):
            ids = torch.tensor(tokenizer.encode(seg), dtype=torch.long)
            cols.append(torch.cat((ids[None], torch.zeros(n, ids.numel(), dtype=torch.long))))
            continue
        codes = seg.to(torch.long).cpu()
        if codes.dim() != 2 or codes.shape[0] != n:
            raise InputError(f"reference codes must be [{n}, frames], got {tuple(codes.shape)}")
        if codes.numel() and (int(codes[0].min()) < 0 or int(codes[0].max()) >= cfg.codebook_size):
            raise InputError(f"semantic codes must lie in [0, {cfg.codebook_size})")
        cols.append(torch.cat((cfg.semantic_begin + codes[:1], codes)))
    return torch.cat(cols, dim=1)


def build_prompt(tokenizer: SegmentTokenizer, cfg: FishConfig, text: str, references: Sequence[Reference] = (),
                 history: Sequence[Turn] = (), mode: str = "fish") -> torch.Tensor:
    """The exact prompt matrix [1 + num_codebooks, T]; generation starts after <|voice|>."""
    return encode_segments(prompt_segments(text, references, history, mode), tokenizer, cfg)
