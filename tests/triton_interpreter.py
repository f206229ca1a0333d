"""Triton kernels' tests on CPU run under Triton's interpreter, which must be switched on
(TRITON_INTERPRET=1) before triton is first imported: triton defines its own helpers (tl.zeros, ...)
at import. A test module imports this first: on CPU it sets the switch if triton is not imported
yet; if something imported triton earlier (torch._dynamo does), the module's tests are marked
`here` (skipped) and its `test_in_a_fresh_process = in_a_fresh_process(__file__)` runs the module
again in a fresh process with the switch set. On a CUDA machine the kernels compile and run on the
GPU. The interpreter checks no GPU limits: only a GPU run proves the kernels compile; the
interpreter proves the indexing and the numerics."""
import os
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # NOTE: for the whole process; on CPU nothing else runs triton
triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernels and their tests need it")

RUN_HERE = DEVICE == "cuda" or type(triton.language.zeros).__name__ == "InterpretedFunction"
here = pytest.mark.skipif(not RUN_HERE, reason="triton was imported before without its interpreter: "
                                               "these run in test_in_a_fresh_process")


def in_a_fresh_process(path: str):
    """The test that runs the module at `path` in a fresh process, where this one cannot."""
    @pytest.mark.skipif(RUN_HERE, reason="the tests run in this process")
    def test_in_a_fresh_process():
        assert os.environ.get("OMNIVOX_TRITON_FRESH") != "1", \
            "triton was imported before this module even in a fresh process"
        env = {**os.environ, "TRITON_INTERPRET": "1", "OMNIVOX_TRITON_FRESH": "1"}
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                           env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-2000:]
    return test_in_a_fresh_process
