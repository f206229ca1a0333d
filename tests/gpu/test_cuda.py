"""CUDA checks (skipped without a GPU): the engine on CUDA gives transformers' greedy answer,
and bf16 serving produces finite, full-length audio. Run on a lent GPU with
`python3 -m pytest -q tests/gpu tests/attention/test_triton_paged.py` (the full-size models are
checked by `scripts/gpu_verify.py`; scripts/README.md)."""
import numpy as np
import pytest
import torch

from omnivox import Omni
from qwen_tiny import chat, reference_generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def ckpt(tiny_reference):
    return tiny_reference


def test_engine_on_cuda_equals_transformers_on_cpu(ckpt):
    ref, folder = ckpt
    omni = Omni(model=folder, device="cuda", progress=False)
    try:
        prompts = [chat([1000 + 17 * i + k for k in range(3 + i)]) for i in range(4)]
        outs = omni.generate([dict(prompt_ids=p, greedy=True, max_tokens=8, max_frames=12) for p in prompts])
    finally:
        omni.close()
    for p, out in zip(prompts, outs):
        ids, codes, wav = reference_generate(ref, p, 8, 12)
        assert out.text_ids == ids
        np.testing.assert_array_equal(out.codes, codes)
        np.testing.assert_allclose(out.audio, wav, rtol=0, atol=1e-4)  # TF32/cuDNN round-off


def test_bf16_on_cuda_runs_to_length(ckpt):
    _, folder = ckpt
    omni = Omni(model=folder, device="cuda", dtype="bfloat16", progress=False)
    try:
        out = omni.generate(prompt_ids=chat([1000, 2000]), greedy=True, ignore_eos=True, max_tokens=6, max_frames=10)
    finally:
        omni.close()
    assert len(out.text_ids) == 6 and out.codes.shape == (10, 16)
    assert out.audio.shape == (10 * 1920 - 555,) and np.isfinite(out.audio).all()
