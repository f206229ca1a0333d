"""The GPU attention backend: Triton kernels reading K/V pages through the block table.

`TritonPagedAttention.forward` is two custom ops, each one kernel launch per layer:
    omnivox::paged_kv_store   writes this step's k/v at meta.write_slots (declares both caches mutated)
    omnivox::paged_attention  one launch for the whole mixed batch: decode rows, chunks over a
                              past and fresh prefills; padding rows (seq_len 0) read nothing and give 0;
                              with meta.window, no key before a row's earliest window is read
Being custom ops with their mutations in the schema and fake implementations, they trace
under torch.compile and CUDA graphs without the compiler ever copying the pool; `forward` reads
nothing from the device (the grid comes from the metadata's host ints).

Supported: fp32 / fp16 / bf16, any head_dim (padded to a power of two >= 16), any GQA group
(H % Hkv == 0, MHA included), any page size >= 1 (powers of two turn // and % into shifts).
Kernel design: `triton_kernels`.

Choosing a backend (wired by the engine, not here): "triton_paged" by default when the stage runs
on CUDA and `triton_available()`, else the torch implementation; an engine option forces either
one. NOTE: test the device too, not `triton_available()` alone: it is also true on CPU under the
interpreter, which the kernel tests switch on for their whole process. Kernels compile on first
launch: run one step eagerly before capturing CUDA graphs.
"""
from __future__ import annotations

import os

import torch

from omnivox.attention.metadata import AttentionMetadata


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available() -> bool:
    """Triton imports and can run here: a CUDA device, or the CPU interpreter (TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return _interpreting() or torch.cuda.is_available()


def _kernels():
    # imported on first use, so `triton_available()` works without triton and the interpreter
    # switch (read when the kernels are defined) can be set by then
    from omnivox.attention import triton_kernels
    return triton_kernels


@torch.library.custom_op("omnivox::paged_kv_store", mutates_args=("k_cache", "v_cache"))
def paged_kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """k/v [N, Hkv, D] into k_cache/v_cache [S, Hkv, D] at slots [N] (long)."""
    _kernels().kv_store(k, v, k_cache, v_cache, slots)


@paged_kv_store.register_fake
def _(k, v, k_cache, v_cache, slots) -> None:
    return None


@torch.library.custom_op("omnivox::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_q: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int, max_q: int,
                    window: int | None = None) -> torch.Tensor:
    """q [N, H, D] attends causally over each row's pages -> [N, H, D] in q's dtype. `max_q` (the
    longest q_len, a host int) sizes the grid; `window`: a sliding window (`AttentionMetadata.window`)."""
    return _kernels().paged_attention(q, k_cache, v_cache, cu_q, seq_lens, block_table, block_size, max_q, window)


@paged_attention.register_fake
def _(q, k_cache, v_cache, cu_q, seq_lens, block_table, block_size, max_q, window=None):
    return q.new_empty(q.shape)


class TritonPagedAttention:
    """The backend contract of `omnivox.attention`, on Triton kernels."""

    name = "triton_paged"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # q [N, H, D], k/v [N, Hkv, D], caches [S, Hkv, D] -> [N, H, D]
        assert q.shape[1] % k.shape[1] == 0 and k.shape[1] == k_cache.shape[1], "GQA: H % Hkv == 0"
        paged_kv_store(k, v, k_cache, v_cache, meta.write_slots)
        return paged_attention(q, k_cache, v_cache, meta.cu_q, meta.seq_lens, meta.block_table,
                               meta.block_size, meta.max_q, meta.window)
