"""The block-FP8 Triton kernels (omnivox/layers/fp8_triton.py) against references written here.

On CPU they run under Triton's interpreter (tests/triton_interpreter.py); the interpreter proves
the indexing and the numerics; only a GPU run (scripts/gpu_verify.py phase fp8) proves they compile
and how fast.

Error bounds: W8A8 (B a power of two >= 16) quantizes the activations per token and group of B to
e4m3 (3 mantissa bits), so against activations kept in full precision the relative error (norm of
the difference / norm of the reference) is about 2e-2 here and bounded at 5e-2; against the same
quantized activations it is fp32 rounding (bound 1e-5). W8A16 (any B) only rounds sums differently
from dequantize-then-matmul (bound 1e-5).
"""
import numpy as np
import pytest
import torch

from triton_interpreter import DEVICE, here, in_a_fresh_process

from omnivox.layers import fp8_triton as ft  # noqa: E402

test_in_a_fresh_process = in_a_fresh_process(__file__)


def quantize_blocks(w: torch.Tensor, b: int, bk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference block quantization, written here: w [..., N, K] -> (e4m3 [..., N, K], fp32 scales
    [..., ceil(N/b), ceil(K/bk)]), scale = amax(|block|) / 448, an all-zero block scale 1."""
    n, k = w.shape[-2:]
    bk = bk or b
    padded = torch.nn.functional.pad(w.float(), (0, -k % bk, 0, -n % b))
    blocks = padded.unflatten(-2, (-1, b)).unflatten(-1, (-1, bk))  # [..., N/b, b, K/b, b]
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.flatten(-4, -3).flatten(-2, -1)[..., :n, :k].contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """q * scale with a scale per `rows` x `cols` block (the last ones cut short)."""
    n, k = q.shape[-2:]
    return q.float() * scale.repeat_interleave(rows, -2).repeat_interleave(cols, -1)[..., :n, :k]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the dequantized weight applied to x as it is, and to x quantized as the W8A8 kernel does)."""
    w = dequantize(q, scale, b, b)
    xq, xs = ft.quantize_groups(x.float(), b)
    return x.float() @ w.T, dequantize(xq, xs, 1, b) @ w.T


@here
@pytest.mark.parametrize("b,m,n,k", [
    (128, 1, 1536, 2048),   # the released Thinker's expert gate||up at decode (one token)
    (128, 16, 2048, 768),   # its down projection, 16 tokens
    (32, 37, 200, 300),     # cut-short last blocks along both dims, W8A8
    (24, 37, 200, 300),     # a block size no tile can hold: W8A16
    (16, 1, 16, 16),        # the smallest tiles
])
def test_linear_against_the_dequantized_reference(b, m, n, k):
    g = torch.Generator().manual_seed(b + m)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g)
    q, scale = quantize_blocks(w, b)
    y = ft.block_fp8_linear(x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), (b, b)).cpu()
    full, quantized = reference(x, q, scale, b)
    assert y.shape == (m, n) and y.dtype == x.dtype
    if ft.fp8_dot_block((b, b)):
        assert rel(y, quantized) < 1e-5 and rel(y, full) < 5e-2, (rel(y, quantized), rel(y, full))
    else:
        assert rel(y, full) < 1e-5, rel(y, full)


@here
def test_linear_keeps_leading_dims_and_dtype_and_takes_no_rows():
    g = torch.Generator().manual_seed(1)
    q, scale = quantize_blocks(torch.randn(64, 96, generator=g), 32)
    x = torch.randn(2, 3, 96, generator=g).to(torch.bfloat16)
    y = ft.block_fp8_linear(x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), (32, 32)).cpu()
    assert y.shape == (2, 3, 64) and y.dtype == torch.bfloat16
    _, quantized = reference(x.reshape(6, 96).float(), q, scale, 32)
    assert rel(y.reshape(6, 64), quantized) < 1e-2  # bf16 output rounding
    empty = ft.block_fp8_linear(x[:0].to(DEVICE), q.to(DEVICE), scale.to(DEVICE), (32, 32))
    assert empty.shape == (0, 3, 64)


@here
def test_blocks_of_two_sizes():
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(100, 120, generator=g), torch.randn(5, 120, generator=g)
    q, scale = quantize_blocks(w, 24, 32)  # 24 rows x 32 columns a block
    y = ft.block_fp8_linear(x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), (24, 32)).cpu()
    w_deq = dequantize(q, scale, 24, 32)
    xq, xs = ft.quantize_groups(x, 32)
    assert rel(y, dequantize(xq, xs, 1, 32) @ w_deq.T) < 1e-5


def test_a_scale_of_the_wrong_shape_is_refused_in_one_line():
    q, scale = quantize_blocks(torch.randn(64, 96), 32)
    with pytest.raises(ValueError, match=r"expected float8_e4m3fn with float32 scale \(2, 3\) for 32x32") as e:
        ft.block_fp8_linear(torch.randn(1, 96), q, scale[:, :2], (32, 32))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("counts", [[0, 1, 70, 0, 3, 16, 0, 2], [5], [0, 0, 9], [33, 0]])
def test_expert_tiles_cover_every_row_once(counts):
    block_m = 16
    ends = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    rows = int(ends[-1])
    expert, first = ft.expert_tiles(ends, rows, block_m)
    assert expert.shape[0] == -(-rows // block_m) + len(counts)  # a fixed grid, whatever the routing
    covered = []
    starts = [0] + ends[:-1].tolist()
    for e, r in zip(expert.tolist(), first.tolist()):
        if e < 0:
            continue
        assert starts[e] <= r < ends[e]  # a tile starts inside its expert's group
        covered += [(i, e) for i in range(r, min(r + block_m, int(ends[e])))]
    assert sorted(covered) == [(i, e) for e, c in enumerate(counts) for i in range(starts[e], starts[e] + c)]


@here
@pytest.mark.parametrize("b,n,k,counts", [
    (128, 768, 2048, [0, 1, 20, 0, 3, 0, 0, 1]),  # released-like expert shapes: an empty expert, one-token groups
    (32, 72, 100, [0, 1, 70, 0, 3, 0, 2, 0]),     # cut-short blocks, a group over several row tiles
    (24, 72, 100, [4, 0, 0, 1, 18]),               # W8A16
])
def test_grouped_experts_against_each_experts_reference(b, n, k, counts):
    g = torch.Generator().manual_seed(b + n)
    e = len(counts)
    w = torch.randn(e, n, k, generator=g) * 0.05
    q, scale = quantize_blocks(w, b)
    ends = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    rows = int(ends[-1])
    xs = torch.randn(rows, k, generator=g)
    y = ft.block_fp8_grouped(xs.to(DEVICE), ends.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), (b, b)).cpu()
    assert y.shape == (rows, n)
    start = 0
    for ex, c in enumerate(counts):  # each expert's rows against that expert alone
        if c:
            full, quantized = reference(xs[start:start + c], q[ex], scale[ex], b)
            got = y[start:start + c]
            if ft.fp8_dot_block((b, b)):
                assert rel(got, quantized) < 1e-5 and rel(got, full) < 5e-2, (ex, rel(got, quantized), rel(got, full))
            else:
                assert rel(got, full) < 1e-5, (ex, rel(got, full))
        start += c


# ---- the kernels as the FP8 layers' compute path (layers/fp8.py, --fp8-compute) ------------------

def test_auto_never_takes_the_kernels_on_cpu_and_triton_is_refused_where_they_cannot_run(monkeypatch):
    from omnivox.errors import CheckpointError
    from omnivox.layers import fp8

    assert fp8.compute_path("auto", "cpu") == "dequant" and fp8.compute_path("dequant", "cpu") == "dequant"
    assert fp8.describe_compute("auto", "cpu").startswith("compute auto: dequantize per layer")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    fp8.kernel_unavailable.cache_clear()
    fp8.compute_path.cache_clear()
    try:
        with pytest.raises(CheckpointError, match=r"^--fp8-compute triton cannot run here: no CUDA device \(cpu\); "
                                                  r"use auto or dequant$"):
            fp8.FP8Config.resolve(None, "fp8", "triton", devices=("cpu",))
    finally:
        monkeypatch.undo()
        fp8.kernel_unavailable.cache_clear()
        fp8.compute_path.cache_clear()


@here
def test_a_tiny_qwen_on_the_kernels_answers_as_on_dequant(tmp_path, monkeypatch):
    """8 x 8 blocks take the W8A16 kernels (every linear and both expert projections of every AR
    layer), which only round sums differently from dequantizing: greedy ids and codes equal; the
    same under the CUDA-graph runner (a fake graph on CPU, as tests/engine/test_graphs.py)."""
    from fp8_checkpoints import qwen_rule, write_fp8
    from omnivox import Omni
    from omnivox.engine.config import EngineConfig
    from omnivox.models.qwen3_omni.random_init import save_random_checkpoint
    from qwen_tiny import BASE, chat

    calls = {"linear": 0, "grouped": 0}
    for name, key in (("block_fp8_linear", "linear"), ("block_fp8_grouped", "grouped")):
        real = getattr(ft, name)
        monkeypatch.setattr(ft, name, lambda *a, _real=real, _key=key: calls.__setitem__(_key, calls[_key] + 1)
                            or _real(*a))
    save_random_checkpoint(BASE, tmp_path / "src", seed=5)
    folder = write_fp8(tmp_path / "src", tmp_path / "fp8", (8, 8), qwen_rule)
    fifo = EngineConfig(scheduling="fifo")  # fixed step shapes (slack sizes chunks by measured time)
    graphs = EngineConfig(scheduling="fifo", cuda_graphs="fake", graph_buckets=(1,))  # the graph runner's plumbing
    outs, seen = {}, {}
    for run, compute, cfg in (("triton", "triton", fifo), ("graphs", "triton", graphs), ("dequant", "dequant", fifo)):
        omni = Omni(model=folder, progress=False, engine_config=cfg, fp8_compute=compute)
        try:
            outs[run] = omni.generate(prompt_ids=chat([1000, 2000, 3000]), greedy=True, max_tokens=3, max_frames=3,
                                      speaker="ethan")
            if run == "graphs":
                stages = omni.engine.stages.stages
                assert stages["thinker"].graphs.replays > 0 and stages["talker"].graphs.replays > 0
        finally:
            omni.close()
        seen[run] = dict(calls)
    assert seen["triton"]["linear"] > 0 and seen["triton"]["grouped"] > 0, seen
    assert seen["graphs"]["linear"] > seen["triton"]["linear"] and seen["dequant"] == seen["graphs"]  # dequant: none
    g = outs["graphs"]
    assert g.text_ids == outs["triton"].text_ids
    np.testing.assert_array_equal(g.codes, outs["triton"].codes)
    a, b = outs["triton"], outs["dequant"]
    assert a.text_ids == b.text_ids and len(a.text_ids) > 1
    np.testing.assert_array_equal(a.codes, b.codes)
    np.testing.assert_allclose(a.audio, b.audio, rtol=0, atol=1e-4)


@here
def test_layers_whose_blocks_straddle_merged_parts_keep_dequant():
    from omnivox.layers.fp8 import FP8Linear, dequantize_rows, quantize
    from omnivox.layers.merged import Part

    g = torch.Generator().manual_seed(4)
    parts = (Part("q", slice(0, 40), (40, 32)), Part("k", slice(40, 56), (16, 32)))  # 40 rows: no multiple of 16
    lin = FP8Linear(32, 56, (16, 16), parts, compute="triton")
    w = torch.randn(56, 32, generator=g)
    qa, sa = quantize(w[:40], (16, 16))
    qb, sb = quantize(w[40:], (16, 16))
    with torch.no_grad():
        lin.weight.copy_(torch.cat([qa, qb]))
        lin.weight_scale_inv.copy_(torch.cat([sa, sb]))
    assert not lin.aligned()
    x = torch.randn(3, 32, generator=g)
    want = x @ dequantize_rows(lin.weight, lin.weight_scale_inv, (40, 16), (16, 16), torch.float32).T
    torch.testing.assert_close(lin(x), want, rtol=0, atol=0)  # exactly the dequant path
