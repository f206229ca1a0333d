"""Triton kernels of the paged backend: the KV store and one attention kernel for a mixed batch.

Imported only where triton imports (see `triton_paged.triton_available`). Under
TRITON_INTERPRET=1 (set before this module is first imported) the same kernels run on CPU
tensors; the interpreter checks no GPU limits, so the kernels keep to what sm90 compiles:
power-of-two blocks, every `tl.dot` dimension >= 16, a mask on every load and store.

Attention layout. One program per (row b, query block, kv head). A query block packs BLOCK_M
(token, q head) pairs of one row that share a kv head: flat index f -> token f // GROUP, q head
kv_head * GROUP + f % GROUP. A decode row of the Thinker (GROUP = 32 / 4 = 8) thus fills 8 of
16 MMA rows instead of 1, and any GROUP works (it need not divide BLOCK_M). The program walks
its row's keys 0 .. (last position of its block) in tiles of BLOCK_N, gathering each key's slot
through the block table (slot = page * PAGE + offset), so BLOCK_N is independent of the page
size and pages of any size >= 1 work. Online softmax in fp32 (exp2 with the scale folded in).

Sliding window (WINDOWED, `window` keys up to and including the query's own): the loop starts at
the first key the block's first token sees instead of 0, so no key before it is loaded (pages wholly
before the window may be freed and hold NaN), and each query masks the keys at or before
pos - window of the tiles it shares with later queries.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _kv_store_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
                     stride_kn, stride_kh, stride_vn, stride_vh, stride_cs, stride_ch,
                     HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)  # one program per new token
    slot = tl.load(slots_ptr + i).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HKV) & (d < D)
    dst = slot * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + i.to(tl.int64) * stride_kn + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + i.to(tl.int64) * stride_vn + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, cu_q_ptr, seq_lens_ptr, block_table_ptr,
                            stride_qn, stride_qh, stride_on, stride_oh, stride_cs, stride_ch, stride_bt,
                            scale_log2, window,
                            WINDOWED: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                            PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    m_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if m_block * BLOCK_M >= q_len * GROUP:  # the grid is sized for the step's longest row
        return
    ctx = tl.load(seq_lens_ptr + b) - q_len  # cached before this step; -1 for a padding row

    f = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    token = f // GROUP  # [BLOCK_M] token of the row
    head = kv_head * GROUP + f % GROUP  # [BLOCK_M] its q head
    pos = ctx + token  # [BLOCK_M] its position in the sequence
    row_ok = token < q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_off = (q_start + token).to(tl.int64)[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    # keys 0 .. last position of this block (<= seq_len; 0 for a padding row, so it reads nothing)
    kv_end = ctx + tl.minimum((m_block * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1) + 1
    kv_start = 0
    if WINDOWED:  # from the first key of the block's first token's window; nothing before it is read
        kv_start = tl.maximum(ctx + (m_block * BLOCK_M) // GROUP - window + 1, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(kv_start, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        n_ok = n < kv_end
        page = tl.load(block_table_ptr + b.to(tl.int64) * stride_bt + n // PAGE, mask=n_ok, other=0)
        slot = page.to(tl.int64) * PAGE + n % PAGE
        kv_off = slot[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
        # NOTE: keys past kv_end load as 0, never from the page: a page not owned by the row may
        # hold anything (NaN), and 0 * NaN in p @ v would poison the whole row.
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        s = tl.where((n[None, :] <= pos[:, None]) & n_ok[None, :], s, float("-inf"))
        if WINDOWED:
            s = tl.where(n[None, :] > pos[:, None] - window, s, float("-inf"))
        # NOTE: unwindowed, m_new is finite from the first tile on (no -inf - -inf NaN): the loop runs
        # only for real rows (kv_end is 0 for padding), whose queries all have pos >= 0 and see key 0.
        # Windowed, a later query's window may start past the first tiles: its m_new stays -inf
        # there, and the exponents are taken against 0 instead (p = alpha = 0, l_i and acc stay 0).
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = m_new
        if WINDOWED:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a padding row: 0, not NaN
    o_off = (q_start + token).to(tl.int64)[:, None] * stride_on + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k/v [N, Hkv, D] -> k_cache/v_cache [S, Hkv, D] at slots [N], in place."""
    n, hkv, d = k.shape
    if n == 0:
        return
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, "caches: one layout, rows contiguous"
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    _kv_store_kernel[(n,)](
        k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        HKV=hkv, D=d, BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d))


def attention_blocks(max_q: int, group: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for a step: 16 (token, head) rows when every row fits in one MMA tile
    (decode steps), else 64. fp32 halves BLOCK_N to keep K/V stages within sm90 shared memory."""
    block_m = 16 if max_q * group <= 16 else 64
    block_n = 32 if dtype == torch.float32 else 64
    return block_m, block_n


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_q: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int, max_q: int,
                    window: int | None = None) -> torch.Tensor:
    """q [N, H, D] over the paged caches [S, Hkv, D] -> [N, H, D] in q's dtype; `window`: each query
    sees its last `window` positions only (None: all)."""
    n, h, d = q.shape
    hkv = k_cache.shape[1]
    group = h // hkv
    out = torch.empty((n, h, d), dtype=q.dtype, device=q.device)
    rows = block_table.shape[0]
    if n == 0 or rows == 0:
        return out
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, "caches: one layout, rows contiguous"
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_m, block_n = attention_blocks(max_q, group, q.dtype)
    grid = (rows, triton.cdiv(max_q * group, block_m), hkv)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, cu_q, seq_lens, block_table,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_table.stride(0), LOG2E / d ** 0.5, window or 0,
        WINDOWED=window is not None, GROUP=group, D=d, BLOCK_D=_block_d(d), PAGE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2)
    return out
