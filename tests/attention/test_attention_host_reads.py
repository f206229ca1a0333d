"""TorchPagedAttention.forward reads nothing back to the host and runs a fixed op sequence, whatever
B and the lengths (what a CUDA graph of a step needs)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from host_guard import HostRead, no_host_reads
from attn_cases import fresh_meta, layer_inputs, make_step, random_rows
from omnivox.attention.torch_ref import TorchPagedAttention

class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "mixed"])
def test_no_host_reads_in_any_layer(decode_only):
    """Neither the first layer's call (which derives the step's layout) nor the later ones read back."""
    step = make_step(*random_rows(9, 1, decode_only), block_size=4, heads=4, kv_heads=2, pad_rows=2)
    k, v = step.caches()
    meta, backend = fresh_meta(step), TorchPagedAttention()
    with torch.no_grad(), no_host_reads():
        for layer in range(2):
            out = backend.forward(*layer_inputs(step, layer), k[layer], v[layer], meta)
    assert "torch_ref" in meta.derived and out.shape == step.q.shape


def test_host_read_guard_catches_reads():
    t = torch.arange(4)
    with pytest.raises(HostRead), no_host_reads():
        t[t > 1]
    with pytest.raises(HostRead), no_host_reads():
        t.tolist()


def op_counts(rows: int, decode_only: bool) -> tuple[list[str], list[str]]:
    """Ops of the first layer's forward (derivation included) and of the second layer's."""
    step = make_step(*random_rows(rows, rows, decode_only), block_size=4, heads=4, kv_heads=2)
    k, v = step.caches()
    meta, backend, counts = fresh_meta(step), TorchPagedAttention(), []
    with torch.no_grad():
        for layer in range(2):
            args = (*layer_inputs(step, layer), k[layer], v[layer], meta)
            with CountOps() as c:
                backend.forward(*args)
            counts.append(c.ops)
    return counts[0], counts[1]


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "mixed"])
def test_op_count_independent_of_batch(decode_only):
    runs = [op_counts(b, decode_only) for b in (1, 8, 32)]
    first, later = runs[0]
    for f, l in runs[1:]:
        assert l == later, "later layers' ops depend on B or the lengths"
        assert f == first, "the derivation's ops depend on B or the lengths"
    # views included. decode: 2 writes, 2 kv gathers + 2 views + 2 transposes, unsqueeze, sdpa, squeeze;
    # mixed: the q gather + view + transpose instead of the unsqueeze, transpose + view + gather after
    assert len(later) == (11 if decode_only else 15), later
