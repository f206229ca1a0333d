"""A model family as the registry knows it: its names, its facade, and what it can do."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str  # "qwen3_omni" | "fish_s2" (the `family` of a model card)
    label: str  # "Qwen3-Omni"
    model_types: tuple[str, ...]  # config.json `model_type` values it loads
    demo: str  # the --model spelling of its built-in demo
    demo_served_name: str  # the demo's served model id
    facade: str  # "module:Class" of its Python API (imported when a model loads)
    chat: bool  # POST /v1/chat/completions (it understands as well as speaks)
    cloning: bool  # reference voices (POST /v1/audio/voices, `references`)
    sample_rate: int  # of the audio it writes
    stages: tuple[str, ...] = ()  # the stage names a placement may give a device (engine/placement.py)
    kv_stages: tuple[str, ...] = ()  # the stages with a KV cache (`--kv-cache-mb stage=MB,...`)

    def load(self, folder: Path | None, **kwargs) -> Any:
        module, cls = self.facade.split(":")
        return getattr(importlib.import_module(module), cls)(model=folder, **kwargs)
