import os
import tempfile
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# Ray's single-machine mode (its node on 127.0.0.1), as `omnivox serve --replicas` runs its own
# instance (omnivox/replicas/ray_cluster.py). NOTE: Ray reads it once, when it is first imported,
# and some test modules import it at collection
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# the built-in demo model is written here, never into the user's ~/.cache
os.environ.setdefault("OMNIVOX_CACHE", tempfile.mkdtemp(prefix="omnivox-test-cache-"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_reference():
    """(transformers model, checkpoint folder) for the base tiny config."""
    from qwen_tiny import build_reference, save_reference

    folder = Path(tempfile.mkdtemp(prefix="omnivox-tiny-"))
    model = build_reference()
    save_reference(model, folder)
    return model, folder


@pytest.fixture(scope="session")
def demo_omni():
    """The built-in demo model (a real tokenizer), in float32 on CPU, its engine shared."""
    from omnivox import Omni

    omni = Omni(progress=False)
    yield omni
    omni.close()
