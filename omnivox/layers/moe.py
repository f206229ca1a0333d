"""Mixture-of-experts feed-forward: softmax router, top-k, optional renormalisation,
experts stored fused ([E, 2I, H] gate||up and [E, H, I] down, filled at load time).

The experts run grouped on the device: the N*k (token, expert) pairs are sorted by expert so each
expert's rows are one contiguous group, and one grouped GEMM per projection covers every expert.
Nothing reads the device from the host and the op count depends on neither the batch nor the
routing, so a layer can sit inside a CUDA graph. `FusedExperts.forward_loop` is the per-expert loop
kept as the reference.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.layers.collectives import Collectives
from omnivox.layers.mlp import SwiGLU


GROUPED_MM = "grouped_mm"  # torch._grouped_mm over contiguous per-expert groups
DENSE_BMM = "dense_bmm"    # every expert on every token, then the routed rows (fallback)


@functools.lru_cache(maxsize=None)
def _cutlass_grouped_mm(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] in (9, 10)


def experts_impl(x: torch.Tensor, intermediate: int) -> str:
    """Which path `FusedExperts.forward` takes for activations x and expert width `intermediate`.

    `torch._grouped_mm` (torch 2.13) on CPU takes fp32/bf16/fp16 (a loop of mm over the groups,
    bit-identical to the per-expert loop) and rejects fp64; every row stride must be a multiple of
    16 bytes. On CUDA only bf16 on sm90/sm100 gets the CUTLASS kernel.
    NOTE: every other CUDA case falls back inside torch to a loop that copies `offs` to the host
    (a sync per layer), so those take the dense path instead.
    """
    if not hasattr(torch, "_grouped_mm"):
        return DENSE_BMM
    per_16_bytes = 16 // x.element_size()
    if x.shape[-1] % per_16_bytes or intermediate % per_16_bytes:
        return DENSE_BMM
    if x.device.type == "cpu":
        ok = x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    elif x.device.type == "cuda":
        ok = x.dtype == torch.bfloat16 and _cutlass_grouped_mm(x.device.index or 0)
    else:
        ok = False
    return GROUPED_MM if ok else DENSE_BMM


class FusedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) to compute with (`layers.fp8.FP8Experts` dequantizes)."""
        return self.gate_up_proj, self.down_proj

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """x [N, H]; top_idx/top_w [N, k] -> [N, H]: each token's k weighted expert outputs, added
        in ascending expert order as the loop adds them (bit-identical to it in fp32 on CPU).
        NOTE: one CPU `index_add_` accumulates bf16/fp16 in fp32 and rounds once, where the loop
        rounds after every expert, so those dtypes differ from the loop by a few ulps; on CUDA
        `index_add_` adds with atomics, in no fixed order."""
        expert, order = torch.sort(top_idx.flatten(), stable=True)  # [P], P = N*k, grouped by expert
        tok = order // top_idx.shape[1]  # [P] token of each pair
        y = self.products(x, expert, tok)
        y = y * top_w.flatten().index_select(0, order).unsqueeze(-1)  # [P, H]
        return torch.zeros_like(x).index_add_(0, tok, y)

    def products(self, x: torch.Tensor, expert: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        """x [N, H], the (expert, token) pairs sorted by expert -> [P, H]: each pair's expert output."""
        gate_up, down = self.weights(x.dtype)
        if experts_impl(x, down.shape[-1]) == GROUPED_MM:
            return self._grouped(x.index_select(0, tok), expert, gate_up, down)
        return self._dense(x, expert, tok, gate_up, down)

    @staticmethod
    def _grouped(xs: torch.Tensor, expert: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """xs [P, H] rows sorted by their expert [P] -> [P, H]."""
        ids = torch.arange(gate_up.shape[0], device=expert.device)
        offs = torch.searchsorted(expert, ids, right=True, out_int32=True)  # [E] end row of each group
        gate, up = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offs)

    @staticmethod
    def _dense(x: torch.Tensor, expert: torch.Tensor, tok: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> [P, H] rows (expert[p], tok[p]). E/k times the grouped path's work and an
        [E, N, 2I] intermediate: meant for fp64 test runs and dtypes the grouped kernel lacks."""
        xe = x.expand(gate_up.shape[0], *x.shape)  # [E, N, H], no copy
        gate, up = torch.bmm(xe, gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [E, N, I]
        y = torch.bmm(F.silu(gate) * up, down.transpose(1, 2))  # [E, N, H]
        return y[expert, tok]

    def forward_loop(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """Reference: loops over the experts that were hit (reads the routing on the host)."""
        out = torch.zeros_like(x)
        for tok, y in self.loop_products(x, top_idx, top_w):
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def loop_products(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor):
        """Yields (tokens [n], weighted outputs [n, H]) for each expert hit, in expert order."""
        flat = top_idx.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        k = top_idx.shape[1]
        gate_up, down = self.weights(x.dtype)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start:start + n]
            start += n
            tok, slot = sel // k, sel % k
            gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
            yield tok, F.linear(F.silu(gate) * up, down[e]) * top_w[tok, slot, None]


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int, top_k: int, renormalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_idx, top_w.to(x.dtype)


class SparseMoE(nn.Module):
    """Routed experts, plus (talker) a sigmoid-gated shared SwiGLU expert.

    Tensor parallel (`parallel/shard.py`): the router is replicated (every rank routes alike)
    and every expert, the shared one too, is split inside (I/N gate and up rows, I/N down
    columns), so each rank does the same share of work whatever the routing; `tp` sums the
    ranks' partial outputs, routed and shared together, in one all_reduce.
    """

    def __init__(self, hidden: int, num_experts: int, intermediate: int, top_k: int,
                 renormalize: bool, shared_intermediate: int = 0):
        super().__init__()
        self.gate = Router(num_experts, hidden, top_k, renormalize)
        self.experts = FusedExperts(num_experts, hidden, intermediate)
        if shared_intermediate:
            self.shared_expert = SwiGLU(hidden, shared_intermediate)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.tp: Collectives | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, H]
        top_idx, top_w = self.gate(flat)
        out = self.experts(flat, top_idx, top_w)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        return out.reshape(shape)
