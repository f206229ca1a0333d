"""Sliding-window paged attention (`AttentionMetadata.window`): each backend equals a dense reference
that softmaxes over exactly the keys p - window + 1 .. p of the token at p, and never reads a key
before its row's earliest window (those positions hold NaN here). The Triton backend runs on a GPU
or under Triton's interpreter (tests/triton_interpreter.py)."""
import math

import pytest
import torch

from triton_interpreter import DEVICE, here, in_a_fresh_process

from attn_cases import MIXED, make_step  # noqa: E402
from omnivox.attention.metadata import build_metadata  # noqa: E402
from omnivox.attention.per_sequence import PerSequenceAttention  # noqa: E402
from omnivox.attention.torch_ref import TorchPagedAttention  # noqa: E402
from omnivox.attention.triton_paged import TritonPagedAttention  # noqa: E402

test_in_a_fresh_process = in_a_fresh_process(__file__)

BACKENDS = {"torch_ref": TorchPagedAttention, "per_sequence": PerSequenceAttention,
            "triton_paged": TritonPagedAttention}
ALL = ["torch_ref", "per_sequence", pytest.param("triton_paged", marks=here)]


def _run(name, step, window):
    """One layer's forward of `step` with `window` on a copy of the pool -> (out [N, H, D] on CPU, k, v
    as written)."""
    dev = DEVICE if name == "triton_paged" else "cpu"
    meta = build_metadata(step.tables, step.past, step.new, block_size=step.pool.block_size,
                          dummy_slot=step.pool.dummy_slot, device=dev,
                          pad_rows=step.meta.num_rows - len(step.past), window=window)
    k, v = step.pool.k[0].clone().to(dev), step.pool.v[0].clone().to(dev)
    with torch.no_grad():
        out = BACKENDS[name]().forward(step.q.to(dev), step.k.to(dev), step.v.to(dev), k, v, meta)
    return out.cpu(), k.cpu(), v.cpu()


def _reference(step, k_cache, v_cache, window):
    """Per real token at position p: fp64 softmax over exactly keys max(0, p - window + 1) .. p."""
    group = step.q.shape[1] // k_cache.shape[1]
    outs = []
    for b, (table, past, new) in enumerate(zip(step.tables, step.past, step.new)):
        for i in range(new):
            p, tok = past + i, step.meta.cu_q_host[b] + i
            s = step.pool.slots(table, 0 if window is None else max(0, p - window + 1), p + 1)
            kb = k_cache[s].double().repeat_interleave(group, 1)  # [L, H, D]
            vb = v_cache[s].double().repeat_interleave(group, 1)
            w = torch.einsum("hd,lhd->hl", step.q[tok].double(), kb) / math.sqrt(step.q.shape[-1])
            outs.append(torch.einsum("hl,lhd->hd", w.softmax(-1), vb))
    return torch.stack(outs)  # [real N, H, D]


def _poison_before_windows(step, window) -> int:
    """NaN at every position before each row's earliest window (its first new token's); how many whole
    pages that covers."""
    whole = 0
    for table, past in zip(step.tables, step.past):
        lo = max(0, past - window + 1)
        if lo:
            s = step.pool.slots(table, 0, lo)
            step.pool.k[:, s], step.pool.v[:, s] = float("nan"), float("nan")
            whole += lo // step.pool.block_size
    return whole


def _check(name, past, new, *, window, block_size, heads=4, kv_heads=2, pad_rows=0, seed=0):
    step = make_step(past, new, block_size=block_size, heads=heads, kv_heads=kv_heads, seed=seed,
                     pad_rows=pad_rows)
    whole = _poison_before_windows(step, window)
    out, k, v = _run(name, step, window)
    assert torch.isfinite(out).all(), "a key before the window (NaN here) or a padding row leaked into the output"
    real = step.meta.cu_q_host[len(past)]
    torch.testing.assert_close(out[:real].double(), _reference(step, k, v, window), rtol=0, atol=1e-5)
    return whole


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_prefill_chunks_cross_the_window_edge(name, block_size):
    # a chunk over a past whose windows start mid-page and move across pages, and a fresh prefill
    # longer than the window (its later tokens drop its first keys)
    assert _check(name, [13, 0], [9, 11], window=6, block_size=block_size, pad_rows=1) > 0


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("block_size", [3, 4])
def test_decode_steps_past_the_window(name, block_size):
    past = [4, 0, 17, 33, 8, 1, 70]
    assert _check(name, past, [1] * len(past), window=5, block_size=block_size, pad_rows=2) > 0


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("window", [1, 7])
def test_mixed_rows_of_different_lengths(name, window):
    _check(name, *MIXED, window=window, block_size=4, pad_rows=2, seed=window)


@pytest.mark.parametrize("name", ALL)
def test_windows_start_past_the_first_key_tiles(name):
    # MHA, 50 new tokens in one 64-row query block: the last tokens' windows start beyond the block's
    # first key tiles (fully masked there), and the block starts reading at its first token's window
    _check(name, [20, 3], [50, 2], window=8, block_size=4, heads=2, kv_heads=2)


@pytest.mark.parametrize("name", ALL)
def test_window_covering_every_row_equals_unwindowed(name):
    step = make_step(*MIXED, block_size=4, heads=4, kv_heads=2, seed=5, pad_rows=1)
    plain = _run(name, step, None)[0]
    assert step.meta.max_seq == 31
    for window in (31, 1000):  # 31: the longest row's length
        out = _run(name, step, window)[0]
        if name == "per_sequence":  # a masked SDPA vs its causal one: same values, another reduction
            torch.testing.assert_close(out, plain, rtol=0, atol=1e-6)
        else:
            assert torch.equal(out, plain)


@pytest.mark.parametrize("name", ALL)
def test_nan_before_the_window_changes_nothing(name):
    """Pages wholly before the window (and the edge page's head) hold NaN in one pool and finite keys in
    the other: equal outputs prove nothing there is read (a masked read of NaN still gives NaN)."""
    rows = [40, 25, 2], [1, 6, 1]
    clean = make_step(*rows, block_size=4, heads=4, kv_heads=2, seed=3)
    poisoned = make_step(*rows, block_size=4, heads=4, kv_heads=2, seed=3)
    assert _poison_before_windows(poisoned, 8) == 8 + 4  # pages 0..7 of row 0 and 0..3 of row 1
    out = _run(name, poisoned, 8)[0]
    assert torch.isfinite(out).all() and torch.equal(out, _run(name, clean, 8)[0])


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_bad_window_is_refused(window):
    with pytest.raises(ValueError, match="attention window must be a positive int"):
        build_metadata([[0]], [0], [1], block_size=4, dummy_slot=8, device="cpu", window=window)


def test_windowed_layout_reads_nothing_back():
    """The torch backend's windowed layout, like its plain one, is derived on the device (CUDA graphs)."""
    from host_guard import no_host_reads

    step = make_step(*MIXED, block_size=4, heads=4, kv_heads=2, pad_rows=2, window=5)
    k, v = step.caches()
    with torch.no_grad(), no_host_reads():
        TorchPagedAttention().forward(step.q, step.k, step.v, k[0], v[0], step.meta)
    assert step.meta.derived["torch_ref"].t_max == 5 + 9 - 1  # window + longest q_len - 1 keys, not 31
