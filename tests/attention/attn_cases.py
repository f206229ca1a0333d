"""Paged attention steps for backend tests: a KV pool whose every page not holding a row's past is
NaN, rows on random non-contiguous pages, random q/k/v, and the step's metadata."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from omnivox.attention.metadata import AttentionMetadata, build_metadata
from omnivox.kv_cache.pool import KVPool

LAYERS = 2


@dataclass
class Step:
    pool: KVPool
    q: torch.Tensor  # [N, H, D]
    k: torch.Tensor  # [N, Hkv, D]
    v: torch.Tensor
    meta: AttentionMetadata
    tables: list[list[int]]
    past: list[int]
    new: list[int]

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh copies of the pool's k/v [layers, S, Hkv, D] for one backend run."""
        return self.pool.k.clone(), self.pool.v.clone()


def make_step(past: list[int], new: list[int], *, block_size: int, heads: int, kv_heads: int,
              head_dim: int = 8, dtype: torch.dtype = torch.float32, seed: int = 0, pad_rows: int = 0,
              spare_blocks: int = 3, window: int | None = None) -> Step:
    """Rows with past[b] cached and new[b] new tokens. Pages are handed out in random order; every
    slot of an allocator page that is not a row's past position holds NaN. `window`: the metadata's."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(p + n) // block_size) for p, n in zip(past, new)]
    num_blocks = sum(need) + spare_blocks
    pool = KVPool(LAYERS, num_blocks, block_size, kv_heads, head_dim, dtype, "cpu")
    pool.poison(list(range(num_blocks)))  # the dummy page stays as allocated
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for b, p in enumerate(past):
        tables.append(order[at:at + need[b]])
        at += need[b]
        if p:
            slots = pool.slots(tables[b], 0, p)
            pool.k[:, slots] = torch.randn(LAYERS, p, kv_heads, head_dim, generator=g, dtype=dtype)
            pool.v[:, slots] = torch.randn(LAYERS, p, kv_heads, head_dim, generator=g, dtype=dtype)
    n = sum(new) + pad_rows
    q = torch.randn(n, heads, head_dim, generator=g, dtype=dtype)
    k = torch.randn(n, kv_heads, head_dim, generator=g, dtype=dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=g, dtype=dtype)
    meta = build_metadata(tables, past, new, block_size=block_size, dummy_slot=pool.dummy_slot,
                          device="cpu", pad_rows=pad_rows, window=window)
    return Step(pool, q, k, v, meta, tables, list(past), list(new))


def fresh_meta(step: Step) -> AttentionMetadata:
    """The same step's metadata with nothing derived yet."""
    m = step.meta
    return replace(m, derived={})


def layer_inputs(step: Step, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each layer its own q/k/v: the step's, scaled by the layer number."""
    s = layer + 1.0
    return step.q * s, step.k * s, step.v / s


def run_layers(backend, step: Step, k_pool: torch.Tensor, v_pool: torch.Tensor) -> list[torch.Tensor]:
    """One forward per layer over one metadata object, as a model's step does."""
    meta = fresh_meta(step)
    with torch.no_grad():
        return [backend.forward(*layer_inputs(step, i), k_pool[i], v_pool[i], meta) for i in range(LAYERS)]


# (past, new) rows of a mixed step: fresh prefill, decode rows, a chunk over a past crossing pages,
# a fresh single token, a long decode
MIXED = ([0, 5, 13, 3, 0, 30, 16], [7, 1, 6, 1, 1, 1, 9])
DECODE = ([4, 0, 17, 33, 8, 1], [1, 1, 1, 1, 1, 1])
PREFILL = ([0, 0, 0], [5, 12, 1])


def random_rows(rows: int, seed: int, decode_only: bool) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    past = torch.randint(0, 40, (rows,), generator=g).tolist()
    new = [1] * rows if decode_only else torch.randint(1, 10, (rows,), generator=g).tolist()
    return past, new
