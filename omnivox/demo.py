"""The built-in demo model: a tiny random Qwen3-Omni with a real trained tokenizer, written
deterministically to a cache folder on first use (no network). Its output is noise."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

DEMO_VERSION = 1
NOISE_NOTE = "note: the built-in demo model has random weights; its text and audio are noise."


def cache_root() -> Path:
    return Path(os.environ.get("OMNIVOX_CACHE") or Path.home() / ".cache" / "omnivox")


def demo_model_path() -> Path:
    """The demo checkpoint folder, created on first use (atomically, safe under races)."""
    from omnivox.models.qwen3_omni.demo import write_demo_files
    from omnivox.models.qwen3_omni.random_init import save_random_checkpoint

    folder = cache_root() / f"demo-qwen3-omni-v{DEMO_VERSION}"
    if (folder / "OMNIVOX_DEMO").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=folder.parent))
    try:
        write_demo_files(tmp)
        save_random_checkpoint(json.loads((tmp / "config.json").read_text()), tmp, seed=0)
        (tmp / "OMNIVOX_DEMO").write_text(NOISE_NOTE + "\n")
        try:
            os.replace(tmp, folder)
        except OSError:  # another process won the race (or a stale folder without the marker)
            if not (folder / "OMNIVOX_DEMO").exists():
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
