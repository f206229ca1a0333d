"""The built-in demo model: a tiny random Qwen3-Omni with a real trained tokenizer, written
deterministically to a cache folder on first use (no network). Its output is noise."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

DEMO_VERSION = 1
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


def demo_model_path() -> Path:
    """The demo checkpoint folder, created on first use (atomically, safe under races; built once
    by processes started together: `build_lock`)."""
    folder = cache_root() / f"demo-qwen3-omni-v{DEMO_VERSION}"
    if (folder / "OMNIVOX_DEMO").exists():
        return folder
    with build_lock(folder):
        return _build_demo(folder)


def _build_demo(folder: Path) -> Path:
    from omnivox.models.qwen3_omni.demo import write_demo_files
    from omnivox.models.qwen3_omni.random_init import save_random_checkpoint

    if (folder / "OMNIVOX_DEMO").exists():  # built while this process waited for the lock
        return folder
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
