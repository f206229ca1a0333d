"""The Thinker's accept-layer rows of the media blocks in its prefix cache.

The Talker's prefill reads the Thinker's accept-layer hidden states at the prompt's media
positions. A request whose prompt hits a cached block takes that block's K/V without computing
it, so the rows of a block with media are kept beside the cache, keyed like it, and copied back
for the hit. A block with media whose rows are not kept is not usable from the cache for a request
that speaks (`usable`): it is computed again.

Who holds a block's rows: the request that computed them (`keep`), until the allocator reports the
block cached (`cached`); then the cache, until the allocator reports it evicted (`evicted`). Rows
whose block never entered the cache go when their request ends (`release`). So the store holds
rows only for blocks the cache holds, or that a running request is about to offer it.
"""
from __future__ import annotations

import torch


class MediaRows:
    """Prefix key -> accept-layer rows [block_size, H] of a block with media (a `PrefixWatcher`
    of the Thinker's allocator: `cached` and `evicted`)."""

    def __init__(self, block_size: int, media_ids: set[int]):
        self.block_size, self.media_ids = block_size, media_ids
        self.rows: dict[bytes, torch.Tensor] = {}
        self._held: dict[bytes, str] = {}  # key -> rid of the request whose block is not cached yet

    def __len__(self) -> int:
        return len(self.rows)

    def has_media(self, ids: list[int], b: int) -> bool:
        """Does block `b` of a prompt hold a media position?"""
        bs = self.block_size
        return any(t in self.media_ids for t in ids[b * bs:(b + 1) * bs])

    def usable(self, ids: list[int], keys: list[bytes], blocks: int) -> int:
        """How many of the first `blocks` cached blocks a speaking request may take: up to the
        first block with media whose rows are not kept."""
        for b in range(blocks):
            if self.has_media(ids, b) and keys[b] not in self.rows:
                return b
        return blocks

    def restore(self, ids: list[int], keys: list[bytes], hit: int, hidden: torch.Tensor) -> None:
        """Copy the kept rows of every media block within the first `hit` positions into `hidden`
        ([P, H]: the request's accept-layer rows of its prompt)."""
        bs = self.block_size
        for b in range(hit // bs):
            if self.has_media(ids, b):
                dest = hidden[b * bs:(b + 1) * bs]
                dest.copy_(self.rows[keys[b]][:dest.shape[0]])

    def keep(self, rid: str, ids: list[int], keys: list[bytes], hidden: torch.Tensor, blocks: int) -> None:
        """Keep the rows of the media blocks among the first `blocks` (computed, keyed) that are
        not kept yet; held by request `rid` until their block is cached. A block past the prompt's
        end (`hidden` holds prompt rows only) is padded with zero rows: the Talker reads these rows
        only at media positions, all inside the prompt."""
        bs = self.block_size
        for b in range(blocks):
            key = keys[b]
            if key in self.rows or not self.has_media(ids, b):
                continue
            rows = hidden[b * bs:(b + 1) * bs]
            if rows.shape[0] < bs:
                rows = torch.cat([rows, rows.new_zeros(bs - rows.shape[0], rows.shape[1])])
            self.rows[key] = rows.clone()
            self._held[key] = rid

    def release(self, rid: str) -> None:
        """Request `rid` ended: drop the rows it kept whose blocks never entered the cache."""
        for key in [k for k, owner in self._held.items() if owner == rid]:
            del self._held[key], self.rows[key]

    # ---- the allocator's reports (kv_cache.block_allocator.PrefixWatcher) ----------------------
    def cached(self, key: bytes) -> None:
        self._held.pop(key, None)

    def evicted(self, key: bytes) -> None:
        self._held.pop(key, None)
        self.rows.pop(key, None)
