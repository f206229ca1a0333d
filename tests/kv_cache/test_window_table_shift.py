"""A windowed AR stage frees the pages behind each row's window and passes the row counted from its
first kept page (stages/ar.py): its table without the freed pages and its past less their positions.
Every backend gives the same output and writes the same K/V for that shifted row as for the whole
row, because causal and window masks depend only on query-key distances; the freed pages hold NaN."""
import sys
from pathlib import Path

import pytest
import torch

from triton_interpreter import DEVICE, RUN_HERE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "attention"))  # attn_cases
from attn_cases import make_step  # noqa: E402
from omnivox.attention.metadata import build_metadata  # noqa: E402
from omnivox.attention.per_sequence import PerSequenceAttention  # noqa: E402
from omnivox.attention.torch_ref import TorchPagedAttention  # noqa: E402
from omnivox.attention.triton_paged import TritonPagedAttention  # noqa: E402

# the Triton kernel on a GPU, or under its interpreter when this module is the first to import triton
# (run alone); no fresh process for it in the suite, where tests/attention/test_window.py covers its windows
triton_here = pytest.mark.skipif(not RUN_HERE, reason="triton was imported before without its interpreter")
CASES = [(4, 7), (3, 1), (4, 8)]  # (block_size, window)

BACKENDS = {"torch_ref": TorchPagedAttention, "per_sequence": PerSequenceAttention,
            "triton_paged": TritonPagedAttention}


def _forward(name, step, tables, past, window):
    dev = DEVICE if name == "triton_paged" else "cpu"
    meta = build_metadata(tables, past, step.new, block_size=step.pool.block_size, dummy_slot=step.pool.dummy_slot,
                          device=dev, pad_rows=1, window=window)
    k, v = step.pool.k[0].clone().to(dev), step.pool.v[0].clone().to(dev)
    with torch.no_grad():
        out = BACKENDS[name]().forward(step.q.to(dev), step.k.to(dev), step.v.to(dev), k, v, meta)
    return out.cpu(), k.cpu(), v.cpu()


@pytest.mark.parametrize("name, block_size, window", [(n, *c) for n in ("torch_ref", "per_sequence") for c in CASES]
                         + [pytest.param("triton_paged", *CASES[0], marks=triton_here)])
def test_a_row_counted_from_its_first_kept_page_attends_the_same(name, block_size, window):
    past, new = [40, 25, 2, 13], [1, 6, 1, 9]  # decode and chunks, windows starting mid-page
    step = make_step(past, new, block_size=block_size, heads=4, kv_heads=2, seed=window, pad_rows=1)
    first = [max(0, p - window + 1) // block_size for p in past]  # pages wholly behind the window
    step.pool.poison([b for t, f in zip(step.tables, first) for b in t[:f]])  # freed
    assert sum(first) > 0
    whole = _forward(name, step, step.tables, past, window)
    shifted = _forward(name, step, [t[f:] for t, f in zip(step.tables, first)],
                       [p - f * block_size for p, f in zip(past, first)], window)
    real = sum(new)
    assert torch.isfinite(shifted[0][:real]).all()
    assert torch.equal(shifted[0][:real], whole[0][:real])
    for got, want in zip(shifted[1:], whole[1:]):  # the same slots written (freed ones stay NaN)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
