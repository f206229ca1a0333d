import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_reference():
    """(transformers model, checkpoint folder) for the base tiny config."""
    from qwen_tiny import build_reference, save_reference

    import tempfile
    folder = Path(tempfile.mkdtemp(prefix="omnivox-tiny-"))
    model = build_reference()
    save_reference(model, folder)
    return model, folder
