"""TorchPagedAttention (one masked SDPA per layer) equals the per-sequence loop on mixed paged steps."""
import pytest
import torch

from attn_cases import DECODE, LAYERS, MIXED, PREFILL, make_step, random_rows, run_layers
from omnivox.attention.per_sequence import PerSequenceAttention
from omnivox.attention.torch_ref import TorchPagedAttention

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
HEADS = [(4, 1), (4, 2), (4, 4)]  # GQA 4:1, 2:1, MHA


def compare(step, dtype):
    """Both backends on copies of the pool: outputs within TOL, pools bit-equal (NaN where NaN)."""
    kr, vr = step.caches()
    ko, vo = step.caches()
    ref = run_layers(PerSequenceAttention(), step, ko, vo)
    ours = run_layers(TorchPagedAttention(), step, kr, vr)
    worst = 0.0
    for a, b in zip(ours, ref):
        assert a.shape == b.shape and a.dtype == dtype
        assert torch.isfinite(a).all(), "a NaN page leaked into the output"
        worst = max(worst, (a - b).abs().max().item())
    assert worst <= TOL[dtype]
    torch.testing.assert_close(kr, ko, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(vr, vo, rtol=0, atol=0, equal_nan=True)
    return worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("rows", [MIXED, DECODE, PREFILL], ids=["mixed", "decode", "prefill"])
def test_matches_per_sequence(rows, block_size, heads, kv_heads, dtype):
    step = make_step(*rows, block_size=block_size, heads=heads, kv_heads=kv_heads, dtype=dtype, seed=block_size)
    compare(step, dtype)


@pytest.mark.parametrize("seed", range(4))
def test_matches_per_sequence_random_rows(seed):
    past, new = random_rows(12, seed, decode_only=seed % 2 == 1)
    step = make_step(past, new, block_size=4, heads=4, kv_heads=2, dtype=torch.float64, seed=seed)
    compare(step, torch.float64)


def test_gqa_without_repeat_equals_repeat():
    """enable_gqa=True in SDPA equals repeating the kv heads (what the oracle does)."""
    step = make_step(*MIXED, block_size=4, heads=4, kv_heads=1, dtype=torch.float32, seed=3)
    mha = make_step(*MIXED, block_size=4, heads=4, kv_heads=1, dtype=torch.float32, seed=3)
    k, v = step.caches()
    out = run_layers(TorchPagedAttention(), step, k, v)
    rep = lambda t: t.repeat_interleave(4, dim=-2)  # noqa: E731
    mha.pool.k, mha.pool.v, mha.k, mha.v = rep(mha.pool.k), rep(mha.pool.v), rep(mha.k), rep(mha.v)
    k4, v4 = mha.caches()
    expected = run_layers(TorchPagedAttention(), mha, k4, v4)
    for a, b in zip(out, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("rows", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("backend", [TorchPagedAttention, PerSequenceAttention])
def test_padding_rows_change_nothing_real(rows, backend):
    """Padding rows (seq_len 0, writing to the dummy page): real outputs bit-equal, real pages untouched."""
    pad = 3
    plain = make_step(*rows, block_size=4, heads=4, kv_heads=2, seed=7)
    padded = make_step(*rows, block_size=4, heads=4, kv_heads=2, seed=7, pad_rows=pad)
    n = plain.meta.num_tokens
    padded.q[:n], padded.k[:n], padded.v[:n] = plain.q, plain.k, plain.v
    assert padded.meta.num_rows == plain.meta.num_rows + pad
    k0, v0 = plain.caches()
    k1, v1 = padded.caches()
    out0 = run_layers(backend(), plain, k0, v0)
    out1 = run_layers(backend(), padded, k1, v1)
    for a, b in zip(out0, out1):
        assert torch.equal(a, b[:n])
        assert torch.isfinite(b).all()  # padding rows produce no NaN either
    real = slice(0, plain.pool.dummy_slot)
    torch.testing.assert_close(k1[:, real], k0[:, real], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v1[:, real], v0[:, real], rtol=0, atol=0, equal_nan=True)
    assert not torch.equal(k1[:, padded.pool.dummy_slot], padded.pool.k[:, padded.pool.dummy_slot])


def test_layout_is_derived_once_per_step():
    step = make_step(*MIXED, block_size=4, heads=4, kv_heads=2, seed=1)
    k, v = step.caches()
    backend, meta = TorchPagedAttention(), step.meta
    with torch.no_grad():
        backend.forward(step.q, step.k, step.v, k[0], v[0], meta)
        layout = meta.derived["torch_ref"]
        backend.forward(step.q, step.k, step.v, k[1], v[1], meta)
    assert meta.derived["torch_ref"] is layout and LAYERS == 2
