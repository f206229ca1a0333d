import pytest
import torch


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    from omnivox.models.fish_s2.tiny import write_tiny_checkpoint
    return write_tiny_checkpoint(tmp_path_factory.mktemp("fish-tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_llm(tiny_folder):
    from omnivox.models.fish_s2.weights import load_llm
    return load_llm(tiny_folder, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_codec(tiny_folder):
    from omnivox.models.fish_s2.weights import load_codec
    return load_codec(tiny_folder / "codec.pth")
