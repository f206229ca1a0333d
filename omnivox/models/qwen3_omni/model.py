"""The whole Qwen3-Omni module tree, named as the checkpoint: thinker, talker, code2wav."""
from __future__ import annotations

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
