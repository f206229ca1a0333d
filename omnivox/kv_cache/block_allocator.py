"""Page (block) allocator with reference counts and a digest-keyed prefix cache. Pure Python.

Invariants:
- a block is either in use (ref > 0) or free (ref == 0, in `_free`, least recently freed first);
- a free block may still hold a cached prefix (it keeps its key until it is reallocated), so a
  later request with the same prefix reuses it without recomputing;
- `allocate` never hands out a block that someone still references.

A watcher (`watch`) hears of every prefix the cache takes (`cached`: a block holds it, possibly
one cached before) and every one it drops (`evicted`: its block was reallocated or re-keyed), so
state kept beside the cache follows it without reading `by_hash`.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class PrefixWatcher(Protocol):
    def cached(self, key: bytes) -> None: ...

    def evicted(self, key: bytes) -> None: ...


class OutOfBlocks(Exception):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("need at least one block of at least one slot")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        # prefix keys: chained digests (kv_cache/prefix.py), bytes
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._watcher: PrefixWatcher | None = None

    def watch(self, watcher: PrefixWatcher) -> None:
        """Report the prefixes the cache takes and drops to `watcher` (one at a time)."""
        self._watcher = watcher

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A fresh block (its cached prefix, if any, is forgotten)."""
        if not self._free:
            raise OutOfBlocks
        block, _ = self._free.popitem(last=False)
        self._forget(block)
        self.ref[block] = 1
        return block

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] <= 0:
                raise RuntimeError(f"double free of block {b}")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self._free[b] = None

    def register(self, block: int, key: bytes) -> None:
        """Mark a full, computed block as holding the prefix identified by `key`."""
        if self.hash_of[block] == key:
            return  # registered already (a running sequence offers its blocks at every step)
        if key not in self.by_hash:  # else the same prefix is already cached elsewhere: keep the first
            self._forget(block)
            self.hash_of[block] = key
            self.by_hash[key] = block
        if self._watcher is not None:
            self._watcher.cached(key)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The longest run of cached blocks for a chain of prefix keys; takes a reference on each."""
        hit = []
        for k in keys:
            b = self.by_hash.get(k)
            if b is None:
                break
            hit.append(b)
        for b in hit:
            if self.ref[b] == 0:
                del self._free[b]
            self.ref[b] += 1
        return hit

    def _forget(self, block: int) -> None:
        key = self.hash_of[block]
        if key is not None:
            self.hash_of[block] = None
            if self.by_hash.get(key) == block:
                del self.by_hash[key]
                if self._watcher is not None:
                    self._watcher.evicted(key)
