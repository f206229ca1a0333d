"""The built-in demo model's DFlash draft (`--speculative-config '{"method": "dflash", "model":
"demo"}'`): small weights shipped in this folder's `demo_draft/`, trained by
`scripts/train_demo_dflash.py` for the demo Thinker of `DEMO_VERSION`, whose weights' hash they
record; any other Thinker is refused."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from omnivox.speculative.dflash.config import DraftMismatch

FOLDER = Path(__file__).parent / "demo_draft"


def demo_draft_folder() -> Path:
    if not (FOLDER / "config.json").is_file():
        raise DraftMismatch(f"the demo DFlash draft is missing from {FOLDER} (scripts/train_demo_dflash.py writes it)")
    return FOLDER


def thinker_hash(model) -> str:
    """sha256 over the Thinker's text decoder, embedding and head (name, shape, values rounded to
    bfloat16: the same for the demo loaded in float32 or bfloat16)."""
    h = hashlib.sha256()
    state = model.thinker.state_dict()
    for name in sorted(k for k in state if k.startswith(("model.", "lm_head."))):
        t = state[name].detach().to("cpu", torch.bfloat16).to(torch.float32).contiguous()
        h.update(name.encode() + repr(tuple(t.shape)).encode() + t.numpy().tobytes())
    return h.hexdigest()


def check_demo_draft(folder: Path, model) -> None:
    """Refuse the demo draft for any Thinker but the demo one it was trained for."""
    from omnivox.models.qwen3_omni.demo import DEMO_VERSION

    meta = json.loads((Path(folder) / "omnivox_demo.json").read_text())
    if meta["demo_version"] != DEMO_VERSION:
        raise DraftMismatch(f"the demo DFlash draft was trained for demo version {meta['demo_version']} but the demo "
                            f"model is version {DEMO_VERSION}")
    got = thinker_hash(model)
    if meta["thinker_sha256"] != got:
        raise DraftMismatch(f"the demo DFlash draft was trained for the demo Thinker {meta['thinker_sha256'][:12]} but "
                            f"this Thinker is {got[:12]} (model 'demo' serves the built-in demo model only)")
