"""The grouped MoE experts against the per-expert loop they replace: same numbers, no host reads,
and an op count that depends on neither the batch nor the routing."""
from __future__ import annotations

import itertools

import pytest
import torch

from host_guard import Guard, counting, no_host_reads
from omnivox.layers.moe import DENSE_BMM, GROUPED_MM, FusedExperts, SparseMoE, experts_impl

H, I = 32, 16


def experts(E: int, dtype: torch.dtype, seed: int = 0, hidden: int = H, inter: int = I) -> FusedExperts:
    g = torch.Generator().manual_seed(seed)
    m = FusedExperts(E, hidden, inter)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m.to(dtype)


def routing(N: int, E: int, k: int, kind: str, dtype: torch.dtype, seed: int = 1):
    """top_idx [N, k] (k distinct experts per token, as top-k gives) and positive weights [N, k].
    kind: "random" (at N*k < E most experts get no token), or "same" (every token picks the same
    k experts, so with k=1 all tokens land on one expert)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        top_idx = torch.rand(N, E, generator=g).argsort(-1)[:, :k]
    else:
        top_idx = torch.randperm(E, generator=g)[:k].expand(N, k).clone()
    return top_idx, torch.rand(N, k, generator=g).to(dtype)


def inputs(N: int, dtype: torch.dtype, hidden: int = H, seed: int = 2) -> torch.Tensor:
    return torch.randn(N, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


CASES = [(N, E, k, kind) for N, E, k, kind in itertools.product((1, 7, 64), (8, 128), (1, 2, 8), ("random", "same"))
         if k <= E]


@pytest.mark.parametrize("N,E,k,kind", CASES)
def test_grouped_equals_loop_exactly_fp32(N, E, k, kind):
    m = experts(E, torch.float32)
    x, (top_idx, top_w) = inputs(N, torch.float32), routing(N, E, k, kind, torch.float32)
    assert experts_impl(x, I) == GROUPED_MM
    with torch.no_grad():
        assert torch.equal(m(x, top_idx, top_w), m.forward_loop(x, top_idx, top_w))


def fp32_accumulated_loop(m: FusedExperts, x, top_idx, top_w) -> torch.Tensor:
    """The loop's per-expert products (each in x.dtype), added in fp32 in ascending expert order and
    rounded once: what one CPU `index_add_` over all pairs computes for bf16/fp16."""
    acc = torch.zeros(x.shape, dtype=torch.float32)
    for tok, y in m.loop_products(x, top_idx, top_w):
        acc.index_add_(0, tok, y.float())
    return acc.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,E,k,kind", CASES)
def test_grouped_half_precision(N, E, k, kind, dtype):
    """The grouped GEMMs are bit-identical to the loop's per-expert mm in bf16/fp16 too; only the
    sum over a token's k experts rounds differently: the loop rounds to bf16 after every expert's
    `index_add_`, one CPU `index_add_` over all pairs accumulates in fp32 and rounds once. So the
    grouped result equals the fp32-accumulated loop exactly, and the loop within a few output ulps
    (at most one rounding per added expert)."""
    m = experts(E, dtype)
    x, (top_idx, top_w) = inputs(N, dtype), routing(N, E, k, kind, dtype)
    assert experts_impl(x, I) == GROUPED_MM
    with torch.no_grad():
        got, loop = m(x, top_idx, top_w), m.forward_loop(x, top_idx, top_w)
        assert torch.equal(got, fp32_accumulated_loop(m, x, top_idx, top_w))
    if k <= 2:  # 0 + a and a + b round once either way
        assert torch.equal(got, loop)
    ulp = torch.finfo(dtype).eps * loop.float().abs().amax(-1, keepdim=True)
    assert ((got.float() - loop.float()).abs() <= (k - 1) * ulp).all()


@pytest.mark.parametrize("N,E,k,kind", CASES)
def test_dense_fallback_fp64(N, E, k, kind):
    """fp64: `_grouped_mm` rejects it, so every expert runs on every token as one bmm. CPU gemm
    blocks its sums by the row count, which differs from the loop's per-expert counts: equal to the
    last few ulps, not bitwise."""
    m = experts(E, torch.float64)
    x, (top_idx, top_w) = inputs(N, torch.float64), routing(N, E, k, kind, torch.float64)
    assert experts_impl(x, I) == DENSE_BMM
    with torch.no_grad():
        torch.testing.assert_close(m(x, top_idx, top_w), m.forward_loop(x, top_idx, top_w), rtol=0, atol=1e-13)


def test_rows_not_16_byte_aligned_take_the_dense_path():
    m = experts(8, torch.float32, hidden=6, inter=5)
    x, (top_idx, top_w) = inputs(7, torch.float32, hidden=6), routing(7, 8, 2, "random", torch.float32)
    assert experts_impl(x, 5) == DENSE_BMM
    with torch.no_grad():
        torch.testing.assert_close(m(x, top_idx, top_w), m.forward_loop(x, top_idx, top_w), rtol=0, atol=1e-6)


def test_path_choice():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert experts_impl(torch.empty(3, 64, dtype=dtype), 32) == GROUPED_MM
    assert experts_impl(torch.empty(3, 64, dtype=torch.float64), 32) == DENSE_BMM
    assert experts_impl(torch.empty(3, 12, dtype=torch.bfloat16), 32) == DENSE_BMM  # 24-byte rows


# ---- no host reads --------------------------------------------------------------------------

def moe(E: int, k: int, dtype=torch.float32, hidden: int = 128, shared: int = 0) -> SparseMoE:
    m = SparseMoE(hidden, E, I, k, renormalize=True, shared_intermediate=shared)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return m.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_no_host_reads(dtype):
    m = moe(128, 8, dtype, shared=32)
    x = inputs(9, dtype, hidden=128).reshape(3, 3, 128)
    with torch.no_grad():
        want = m.experts.forward_loop(x.reshape(9, 128), *m.gate(x.reshape(9, 128)))
        with no_host_reads() as mode:
            got = m(x)
    assert ("aten._grouped_mm.default" in mode.ops) == (dtype != torch.float64)
    assert ("aten.bmm.default" in mode.ops) == (dtype == torch.float64)
    shared = torch.sigmoid(m.shared_expert_gate(x.reshape(9, 128))) * m.shared_expert(x.reshape(9, 128))
    torch.testing.assert_close(got.reshape(9, 128), want + shared, rtol=0, atol=0 if dtype == torch.float32 else 0.05)


def test_the_guard_catches_the_loop():
    m = experts(8, torch.float32)
    x, (top_idx, top_w) = inputs(4, torch.float32), routing(4, 8, 2, "random", torch.float32)
    with torch.no_grad(), pytest.raises(AssertionError, match="host read"), no_host_reads():
        m.forward_loop(x, top_idx, top_w)


@pytest.mark.parametrize("read", [lambda t: t[t > 0], lambda t: t.nonzero(), lambda t: t.sum().item(),
                                  lambda t: bool(t.any()), lambda t: t.tolist(), lambda t: int(t[0])],
                         ids=["mask", "nonzero", "item", "bool", "tolist", "int"])
def test_the_guard_catches_each_kind_of_host_read(read):
    with pytest.raises(AssertionError, match="host read|bool-mask"), no_host_reads():
        read(torch.randn(4))


# ---- op count -------------------------------------------------------------------------------

def count_ops(m: SparseMoE, x: torch.Tensor) -> Guard:
    with torch.no_grad(), counting() as mode:
        m(x)
    return mode


def hit_experts(m: SparseMoE, x: torch.Tensor) -> int:
    with torch.no_grad():
        return m.gate(x)[0].unique().numel()


def test_op_count_depends_on_neither_batch_nor_routing():
    E, hidden = 128, 128
    one_hot = torch.eye(E, hidden)  # token i routes first to expert i under an identity router
    counts = {}
    for k in (1, 8):
        m = moe(E, k, hidden=hidden)
        with torch.no_grad():
            m.gate.weight.copy_(10 * torch.eye(E, hidden))
        for name, x in [("N=1", inputs(1, torch.float32, hidden)), ("N=32", inputs(32, torch.float32, hidden)),
                        ("N=64", inputs(64, torch.float32, hidden)),
                        ("one expert hit", one_hot[:1].expand(64, hidden).contiguous()),
                        ("all experts hit", one_hot)]:
            if name == "one expert hit" and k == 1:
                assert hit_experts(m, x) == 1
            if name == "all experts hit":
                assert hit_experts(m, x) == E
            counts[f"k={k} {name}"] = count_ops(m, x).total
    print("aten ops per SparseMoE.forward (E=128):", counts)
    assert len(set(counts.values())) == 1, counts
    assert counts["k=8 N=1"] <= 30  # router + routed experts, views included (27 with torch 2.13)

