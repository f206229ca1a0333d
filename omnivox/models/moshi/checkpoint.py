"""One Kyutai Moshi folder -> the LM, the Mimi and the tokenizer.

The folder is what moshi's `loaders.CheckpointInfo` reads: `config.json` (the LM's keyword
arguments plus `moshi_name`, `mimi_name`, `tokenizer_name`, optional `mimi_config_name` and
`lm_gen_config`); every file name comes from it (`MoshiConfig.files`, `mimi_checkpoint`).
`moshi-demo` names the built-in tiny demo (`models/moshi/demo.py`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from omnivox.errors import CheckpointError
from omnivox.models.moshi.config import MoshiConfig
from omnivox.models.moshi.lm import MoshiLM
from omnivox.models.moshi.lm_weights import load_lm
from omnivox.models.moshi.mimi import Mimi
from omnivox.models.moshi.mimi_config import mimi_checkpoint
from omnivox.models.moshi.mimi_weights import load_mimi
from omnivox.models.moshi.tokenizer import MoshiTokenizer

DEMO = "moshi-demo"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class MoshiCheckpoint:
    folder: Path
    cfg: MoshiConfig
    lm: MoshiLM
    mimi: Mimi
    tokenizer: MoshiTokenizer
    is_demo: bool = False


def is_moshi_config(raw: object) -> bool:
    """A config.json of Kyutai's layout: model_type "moshi", or the Moshi file-name keys."""
    return isinstance(raw, dict) and (raw.get("model_type") == "moshi" or "moshi_name" in raw or "mimi_name" in raw)


def load_moshi(model: str | Path, dtype: str | torch.dtype = "float32",
               device: torch.device | str = "cpu") -> MoshiCheckpoint:
    """A folder (or `moshi-demo`) loaded: the LM in `dtype`, Mimi in fp32 (the codec stays exact)."""
    is_demo = str(model) == DEMO
    if is_demo:
        from omnivox.models.moshi.demo import moshi_demo_path
        model = moshi_demo_path()
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise CheckpointError(f"dtype {dtype!r} unsupported; use one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    folder = Path(model)
    if not folder.is_dir():
        raise CheckpointError(f"model folder {folder} does not exist (or pass --model {DEMO})")
    _require_moshi(folder)
    cfg = MoshiConfig.from_folder(folder)
    lm = load_lm(folder, dtype=dtype, device=device, cfg=cfg)
    weights, mimi_cfg = mimi_checkpoint(folder)
    if mimi_cfg.quantizer.bins != cfg.card or mimi_cfg.num_codebooks < cfg.dep_q:
        raise CheckpointError(f"{folder}: Mimi ({mimi_cfg.num_codebooks} codebooks of {mimi_cfg.quantizer.bins}) "
                              f"does not match the LM (dep_q {cfg.dep_q}, card {cfg.card})")
    mimi = load_mimi(weights, mimi_cfg, device=device)
    return MoshiCheckpoint(folder, cfg, lm, mimi, MoshiTokenizer.from_folder(folder, cfg), is_demo)


def _require_moshi(folder: Path) -> None:
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # MoshiConfig.from_folder says what is wrong with it
    if not is_moshi_config(raw):
        kind = raw.get("model_type") if isinstance(raw, dict) else None
        raise CheckpointError(f"{folder} is not a Moshi checkpoint (config.json has model_type {kind!r} and no "
                              "moshi_name / mimi_name)")
