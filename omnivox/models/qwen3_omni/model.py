"""The whole Qwen3-Omni module tree, named as the checkpoint: thinker, talker, code2wav; and which
modules each stage owns (`stage_modules`: what a placement puts on the stage's device)."""
from __future__ import annotations

import torch
from torch import nn

from omnivox.models.qwen3_omni.code2wav import Code2Wav
from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
from omnivox.models.qwen3_omni.talker import Talker
from omnivox.models.qwen3_omni.thinker import Thinker


class Qwen3OmniModel(nn.Module):
    def __init__(self, cfg: Qwen3OmniConfig):
        super().__init__()
        self.cfg = cfg
        self.thinker = Thinker(cfg.thinker)
        if cfg.has_audio_output:
            self.talker = Talker(cfg.talker)
            self.code2wav = Code2Wav(cfg.code2wav)

    def stage_modules(self) -> dict[str, list[nn.Module]]:
        """The modules each stage owns (keys: `FAMILY.stages`; the encoders, AuT and ViT, are a stage
        of their own for a placement, though they run inside the Thinker's admission). The Talker
        stage also reads the Thinker's `embed_tokens` (through `hand_over`: talker_prompt.py), never
        its own copy."""
        out = {"thinker": [self.thinker.model, self.thinker.lm_head],
               "encoder": [self.thinker.audio_tower, self.thinker.visual]}
        if self.cfg.has_audio_output:
            out["talker"], out["vocoder"] = [self.talker], [self.code2wav]
        return out

    def stage_prefixes(self) -> dict[str, tuple[str, ...]]:
        """Each stage's checkpoint name prefixes ("thinker.audio_tower.", ...)."""
        path = {id(m): name for name, m in self.named_modules()}
        return {stage: tuple(path[id(m)] + "." for m in modules) for stage, modules in self.stage_modules().items()}

    def device_of(self, stage: str) -> torch.device:
        """The device a stage's weights are on (its device from then on)."""
        return next(self.stage_modules()[stage][0].parameters()).device
