"""Fixtures of the API tests: the demo checkpoint, written once per session into a temporary
OMNIVOX_CACHE that every server process and the in-process oracle share (the same weights)."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_cache():
    """(cache dir, demo folder): the demo model, written once for every server and the oracle."""
    cache = Path(tempfile.mkdtemp(prefix="omnivox-api-cache-"))
    old = os.environ.get("OMNIVOX_CACHE")
    os.environ["OMNIVOX_CACHE"] = str(cache)
    try:
        from omnivox.models.qwen3_omni.demo import demo_model_path
        folder = demo_model_path()
    finally:
        if old is None:
            os.environ.pop("OMNIVOX_CACHE", None)
        else:
            os.environ["OMNIVOX_CACHE"] = old
    yield cache, folder
    shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(scope="session")
def oracle(demo_cache):
    """The same demo model loaded in this process: `generate_reference` is the offline truth."""
    import torch

    from omnivox import Omni
    torch.set_num_threads(1)
    omni = Omni(model=demo_cache[1], progress=False)
    yield omni
    omni.close()




@pytest.fixture(scope="module")
def omni(demo_cache):
    """The demo model loaded in this process for one test module (its own engine: statistics and
    prefix cache start empty per module); a module that needs other engine limits defines its own."""
    import torch

    from omnivox import Omni
    torch.set_num_threads(1)
    o = Omni(model=demo_cache[1], progress=False)
    yield o
    o.close()


@pytest.fixture(scope="session")
def qwen_server(demo_cache):
    """(url, pid): one `omnivox serve` on the Qwen3-Omni demo with the default flags, shared by the
    modules that need nothing else of it (each server costs a start-up). Tests that read its
    counters compare before and after, never absolute values."""
    from api_helpers import running_server
    with running_server(demo_cache[0]) as (url, proc, _):
        yield url, proc.pid


@pytest.fixture(scope="session")
def fish_server(demo_cache, tmp_path_factory):
    """(url, pid, voices folder): one `omnivox serve --model fish-demo` with the default flags and
    its own voices folder, shared by the modules that need nothing else of it. Voices saved by one
    module stay for the next: a test names its own, and checks the folder against what was there."""
    from api_helpers import running_server
    folder = tmp_path_factory.mktemp("fish-voices")
    with running_server(demo_cache[0], "--model", "fish-demo", "--voices-dir", str(folder)) as (url, proc, _):
        yield url, proc.pid, folder
