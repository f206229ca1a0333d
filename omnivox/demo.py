"""What the built-in demo models share (each family's `demo.py` builds its own: Qwen3-Omni's
`models/qwen3_omni/demo.py` `demo_model_path`, S2's `models/fish_s2/demo.py`): the cache folder,
the lock that builds a demo once for processes started together, and the note that its output is
noise."""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

NOISE_NOTE = "note: the built-in demo model has random weights; its text and audio are noise."


def cache_root() -> Path:
    return Path(os.environ.get("OMNIVOX_CACHE") or Path.home() / ".cache" / "omnivox")


@contextlib.contextmanager
def build_lock(folder: Path):
    """Held while a demo folder is built: servers started together on one cache build it once, the
    others wait here and then find it built. A file system without locks is simply not locked
    (building stays safe under races: each build renames a finished folder into place)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".lock-{folder.name}", "ab") as f:  # not ".demo*": the build's temporary folders
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
