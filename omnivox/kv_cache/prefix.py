"""Prefix-cache digests: one chained, collision-resistant key per full block of a sequence.

A block's key is blake2b-128 over (the parent block's digest, the canonical bytes of the block's
key items), so equal keys mean equal whole prefixes, in every process and on every machine (a
router can compute them). Python's `hash()` is neither: an int hashes to n mod 2**61 - 1, tuples
have no secret seed (a crafted prompt could land on another user's cached block), and strings
hash differently per process.

A key item is what identifies one input position: a token id (int), or a tuple of ints, strings
and bytes (a media placeholder with its content digest, a realtime audio row, an S2 code column).
Each value is written with a type tag and a fixed width or a length, so no two different item
sequences share bytes.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Iterable, Sequence

DIGEST_SIZE = 16  # bytes: blake2b-128
ROOT = b"\0" * DIGEST_SIZE  # the parent of a sequence's first block

_INT = struct.Struct("<cq")  # tag, int64 little-endian
_LEN = struct.Struct("<cI")  # tag, uint32 length or count


def item_bytes(item) -> bytes:
    """Canonical bytes of one key item: ints fixed-width little-endian, strings UTF-8, bytes as
    they are, tuples as their items; every value tagged with its type."""
    if isinstance(item, tuple):
        return _LEN.pack(b"t", len(item)) + b"".join(item_bytes(x) for x in item)
    if isinstance(item, str):
        data = item.encode("utf-8")
        return _LEN.pack(b"s", len(data)) + data
    if isinstance(item, (bytes, bytearray)):
        return _LEN.pack(b"b", len(item)) + bytes(item)
    if hasattr(item, "__index__") and not isinstance(item, bool):  # int, numpy integers
        return _INT.pack(b"i", item.__index__())  # NOTE: struct.error outside int64, never a wrap
    raise TypeError(f"a prefix key item is an int, str, bytes or a tuple of them, not {type(item).__name__}")


def block_digest(parent: bytes, items: Iterable) -> bytes:
    """The key of one block: its parent's key and its items."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    for item in items:
        h.update(item_bytes(item))
    return h.digest()


def prefix_digests(ids: Sequence, block_size: int, parent: bytes = ROOT) -> list[bytes]:
    """Chained keys of every full block of `ids` (key items; token ids for a text prompt); a
    partial last block has none. Equal to what the engine's prefix cache uses."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    out = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = block_digest(parent, ids[start:start + block_size])
        out.append(parent)
    return out


def content_digest(data: bytes) -> bytes:
    """A media item's identity in a key: the digest of its content bytes."""
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()
