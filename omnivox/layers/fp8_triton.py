"""Triton kernels for block-FP8 weights: one GEMM for a linear and a grouped GEMM for the experts
of a MoE layer (every expert of a step in one launch).

Weights are float8_e4m3fn [N, K] (experts [E, N, K]) in blocks of BN x BK (`block`, as the
checkpoint's weight_block_size; square in every checkpoint seen) with float32 scales
[ceil(N/BN), ceil(K/BK)] (experts [E, ...]): the value of w[n, k] is
w_q[n, k] * scale[n // BN, k // BK], the last block of a dimension cut short (the DeepSeek-V3 /
Qwen3-FP8 convention that part 1 loads).

Two ways through the K loop, picked per call:
- W8A8 (`fp8_dot`, when BK is a power of two >= 16): the activations are quantized per token and
  group of BK columns on the fly (scale = amax / 448 per group, an all-zero group scale 1), each
  K tile lies in one weight block and one activation group, and the tile's product is one
  fp8 x fp8 `tl.dot` (FP8 tensor cores on sm89+) scaled by the row's and the column block's scales,
  accumulated in fp32. What the peers run (SGLang/vLLM w8a8 block FP8, groups of 128).
- W8A16 (any BK, e.g. 24): the weight tile is dequantized in registers and multiplied with the
  activations as they are (fp32 dot, IEEE), so only the rounding of the sums differs from
  dequantize-then-matmul.

Imported only where triton runs (a CUDA device, or TRITON_INTERPRET=1 set before triton is first
imported, when the kernels run on CPU tensors). The kernels keep to what sm90 compiles with triton
3.6 and 3.8: power-of-two tiles, every `tl.dot` dimension >= 16, a mask on every load and store.
Nothing reads the device from the host, so both sit inside a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_dot_block(block: tuple[int, int]) -> bool:
    """Whether weights in BN x BK blocks take the W8A8 path (else W8A16)."""
    bk = block[1]
    return bk >= 16 and bk & (bk - 1) == 0


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, ceil(K/group)]): each row's groups of
    `group` columns (the last cut short) scaled by amax / 448; an all-zero group gets scale 1."""
    m, k = x.shape
    pad = -k % group
    xf = F_pad(x.float(), pad).view(m, -1, group)
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, -1)[:, :k], scale


def F_pad(x: torch.Tensor, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols)) if cols else x


@triton.jit
def _block_fp8_mm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr,
                         tile_expert_ptr, tile_row_ptr, group_end_ptr,
                         M, N, K,
                         stride_am, stride_ak, stride_asm, stride_ask,
                         stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk,
                         stride_om, stride_on,
                         BN_W: tl.constexpr, BK_W: tl.constexpr, GROUPED: tl.constexpr, FP8_DOT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    if GROUPED:  # tile t covers rows tile_row[t] .. of expert tile_expert[t] (-1: an unused tile)
        e = tl.load(tile_expert_ptr + t)
        if e < 0:
            return
        row0 = tl.load(tile_row_ptr + t)
        row_end = tl.load(group_end_ptr + e)
        w_base = w_ptr + e.to(tl.int64) * stride_we
        ws_base = w_scale_ptr + e.to(tl.int64) * stride_wse
    else:
        row0 = t * BLOCK_M
        row_end = M
        w_base = w_ptr
        ws_base = w_scale_ptr
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + rows64[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        if FP8_DOT:  # the tile lies in one activation group and one weight block along K
            a_s = tl.load(a_scale_ptr + rows64 * stride_asm + (k0 // BK_W) * stride_ask, mask=row_ok, other=0.0)
            w_s = tl.load(ws_base + (cols // BN_W) * stride_wsn + (k0 // BK_W) * stride_wsk, mask=col_ok, other=0.0)
            acc += tl.dot(a, w, out_dtype=tl.float32) * a_s[:, None] * w_s[None, :]
        else:
            w_s = tl.load(ws_base + (cols[None, :] // BN_W) * stride_wsn + (ks[:, None] // BK_W) * stride_wsk,
                          mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32) * w_s, input_precision="ieee")
    tl.store(out_ptr + rows64[:, None] * stride_om + cols[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _tiles(m: int, block: tuple[int, int], fp8_dot: bool) -> tuple[int, int, int]:
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64
    block_k = min(block[1], 128) if fp8_dot else 32
    return block_m, block_n, block_k


def _launch(a, a_scale, w, w_scale, out, block, grouped, fp8_dot, grid_m, tile_expert, tile_row, group_end, tiles):
    block_m, block_n, block_k = tiles
    n, k = w.shape[-2], w.shape[-1]
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    ws3 = w_scale if w_scale.dim() == 3 else w_scale.unsqueeze(0)
    a_scale = a_scale if a_scale is not None else a.new_zeros(1, 1, dtype=torch.float32)
    grid = (grid_m, triton.cdiv(n, block_n))
    _block_fp8_mm_kernel[grid](
        a, a_scale, w3, ws3, out, tile_expert, tile_row, group_end,
        a.shape[0], n, k,
        a.stride(0), a.stride(1), a_scale.stride(0), a_scale.stride(1),
        w3.stride(0), w3.stride(1), w3.stride(2), ws3.stride(0), ws3.stride(1), ws3.stride(2),
        out.stride(0), out.stride(1),
        BN_W=block[0], BK_W=block[1], GROUPED=grouped, FP8_DOT=fp8_dot, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def _check(w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int]) -> None:
    n, k = w.shape[-2:]
    want = (*w.shape[:-2], -(-n // block[0]), -(-k // block[1]))
    if w.dtype != torch.float8_e4m3fn or tuple(w_scale.shape) != want or w_scale.dtype != torch.float32:
        raise ValueError(f"block-FP8 kernel: weight {tuple(w.shape)} {w.dtype} with scale {tuple(w_scale.shape)} "
                         f"{w_scale.dtype}; expected float8_e4m3fn with float32 scale {want} for {block[0]}x{block[1]} blocks")


def block_fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [..., K] @ (w [N, K] in BN x BK blocks)^T -> [..., N] in x's dtype."""
    _check(w, w_scale, block)
    shape = x.shape
    a = x.reshape(-1, shape[-1])
    m, n = a.shape[0], w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*shape[:-1], n)
    fp8_dot = fp8_dot_block(block)
    a_scale = None
    if fp8_dot:
        a, a_scale = quantize_groups(a, block[1])
    else:
        a = a.contiguous()
    tiles = _tiles(m, block, fp8_dot)
    dummy = torch.zeros(1, dtype=torch.int32, device=x.device)
    _launch(a, a_scale, w, w_scale, out, block, False, fp8_dot, triton.cdiv(m, tiles[0]), dummy, dummy, dummy, tiles)
    return out.view(*shape[:-1], n)


def expert_tiles(group_end: torch.Tensor, rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows sorted by expert (group_end [E] int32: each expert's end row), the (expert, first
    row) of every BLOCK_M tile: [cdiv(rows, block_m) + E] each, -1 for the tiles left over. Device
    ops of fixed shapes only: no host read."""
    e = group_end.shape[0]
    ends = group_end.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    per = (ends - starts + block_m - 1) // block_m  # [E] tiles of each expert
    tile_end = torch.cumsum(per, 0)  # [E]
    t = torch.arange(-(-rows // block_m) + e, device=group_end.device)
    expert = torch.searchsorted(tile_end, t, right=True)  # [T] in 0..E (E: unused)
    used = expert < e
    safe = expert.clamp(max=e - 1)
    first = starts[safe] + (t - (tile_end - per)[safe]) * block_m
    return (torch.where(used, safe, -1).to(torch.int32), torch.where(used, first, 0).to(torch.int32))


def block_fp8_grouped(xs: torch.Tensor, group_end: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      block: tuple[int, int]) -> torch.Tensor:
    """Rows xs [P, K] sorted by expert (group_end [E] int32, each expert's end row, as
    torch._grouped_mm's offs) through their expert's w [E, N, K] (BN x BK blocks, scales
    [E, ceil(N/BN), ceil(K/BK)]) -> [P, N] in xs's dtype. An expert with no rows costs nothing."""
    _check(w, w_scale, block)
    p, n = xs.shape[0], w.shape[1]
    out = torch.empty(p, n, dtype=xs.dtype, device=xs.device)
    if p == 0:
        return out
    fp8_dot = fp8_dot_block(block)
    a, a_scale = quantize_groups(xs, block[1]) if fp8_dot else (xs.contiguous(), None)
    tiles = _tiles(p, block, fp8_dot)
    tile_expert, tile_row = expert_tiles(group_end, p, tiles[0])
    _launch(a, a_scale, w, w_scale, out, block, True, fp8_dot, tile_expert.shape[0], tile_expert, tile_row,
            group_end.to(torch.int32), tiles)
    return out
