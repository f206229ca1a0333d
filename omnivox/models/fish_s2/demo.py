"""The built-in Fish S2 demo: the tiny official-layout checkpoint (`tiny.write_tiny_checkpoint`,
seed 0), written deterministically to the cache folder on first use (no network). Its audio is noise."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from omnivox.demo import NOISE_NOTE, cache_root

FISH_DEMO_VERSION = 1
MARKER = "OMNIVOX_DEMO"


def fish_demo_path() -> Path:
    """The demo S2 folder, created on first use (atomically, safe under races)."""
    from omnivox.models.fish_s2.tiny import write_tiny_checkpoint

    folder = cache_root() / f"demo-fish-s2-v{FISH_DEMO_VERSION}"
    if (folder / MARKER).exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-fish-", dir=folder.parent))
    try:
        write_tiny_checkpoint(tmp, seed=0)
        (tmp / MARKER).write_text(NOISE_NOTE + "\n")
        try:
            os.replace(tmp, folder)
        except OSError:  # another process won the race (or a stale folder without the marker)
            if not (folder / MARKER).exists():
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
