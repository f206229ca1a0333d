"""A Qwen3-Omni request in the engine, and the voiced-text stream from the Thinker to the Talker."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnivox.engine.request import Request
from omnivox.models.qwen3_omni.types import GenerationOptions, PreparedPrompt
from omnivox.stages.text_stream import TextHook, VoicedIds


@dataclass(eq=False)
class VoicedText(VoicedIds):
    """What the Talker reads from the Thinker: the ids to voice (the Thinker's, or the hook's
    re-tokenized text plus an end marker; written by its `TextStream`), and the accept-layer
    hidden states of the prompt."""

    hidden: torch.Tensor | None = None  # [P, H_thinker]; None when the prompt has no media rows to project
    hidden_done: int = 0  # prompt positions whose hidden state is known

    def for_frame(self, s: int) -> tuple[bool, int | None, bool]:
        """(available, token, is_final) of frame s's text input: ids[s+1], `tts_eos` in place of
        the final token, `tts_pad` (token None) once the text is used up."""
        i = s + 1
        if i < len(self.ids) and (i + 1 < len(self.ids) or self.final):
            return True, self.ids[i], self.final and i == len(self.ids) - 1
        if self.final:
            return True, None, False
        return False, None, False

    def too_short(self) -> bool:
        """The Talker needs a first token plus at least one more (the reference crashes otherwise)."""
        return self.final and len(self.ids) < 2


@dataclass(eq=False)
class QwenRequest(Request):
    prompt: PreparedPrompt = None
    opts: GenerationOptions = None
    hook: TextHook | None = None
    voiced: VoicedText = field(default_factory=VoicedText)
    seed: int = 0  # every draw's noise is keyed on it (drawn at submission when the caller gave none)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.ids)
