"""The built-in demo model's learned drafts (`--speculative-config '{"method": "dflash" | "eagle3",
"model": "demo"}'`): small weights shipped in `dflash/demo_draft/` and `eagle3/demo_draft/`,
trained by `scripts/train_demo_draft.py` for the demo Thinker of `DEMO_VERSION`, whose weights'
hash they record; any other Thinker is refused."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from omnivox.speculative.fit import DraftMismatch

FOLDERS = {method: Path(__file__).parent / method / "demo_draft" for method in ("dflash", "eagle3")}
NAMES = {"dflash": "DFlash draft", "eagle3": "EAGLE-3 head"}


def demo_draft_folder(method: str) -> Path:
    folder = FOLDERS[method]
    if not (folder / "config.json").is_file():
        raise DraftMismatch(f"the demo {NAMES[method]} is missing from {folder} (scripts/train_demo_draft.py "
                            f"--method {method} writes it)")
    return folder


def thinker_hash(model) -> str:
    """sha256 over the Thinker's text decoder, embedding and head (name, shape, values rounded to
    bfloat16: the same for the demo loaded in float32 or bfloat16)."""
    h = hashlib.sha256()
    state = model.thinker.state_dict()
    for name in sorted(k for k in state if k.startswith(("model.", "lm_head."))):
        t = state[name].detach().to("cpu", torch.bfloat16).to(torch.float32).contiguous()
        h.update(name.encode() + repr(tuple(t.shape)).encode() + t.numpy().tobytes())
    return h.hexdigest()


def check_demo_draft(folder: Path, model, method: str, demo_version: int) -> None:
    """Refuse the demo draft for any Thinker but the demo one it was trained for (the demo model
    of `demo_version`, which the model's family says)."""
    name = NAMES[method]
    meta = json.loads((Path(folder) / "omnivox_demo.json").read_text())
    if meta["demo_version"] != demo_version:
        raise DraftMismatch(f"the demo {name} was trained for demo version {meta['demo_version']} but the demo "
                            f"model is version {demo_version}")
    got = thinker_hash(model)
    if meta["thinker_sha256"] != got:
        raise DraftMismatch(f"the demo {name} was trained for the demo Thinker {meta['thinker_sha256'][:12]} but "
                            f"this Thinker is {got[:12]} (model 'demo' serves the built-in demo model only)")
