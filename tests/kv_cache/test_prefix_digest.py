"""Prefix-cache keys: chained, collision-resistant digests, equal in every process."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from omnivox.engine.scheduler import Seq
from omnivox.kv_cache.prefix import ROOT, block_digest, item_bytes, prefix_digests

REALTIME_ROWS = [("realtime", "sess_abc", "item_1", r) for r in range(8)]


def test_python_hash_collisions_are_different_keys():
    # hash() of an int is n mod 2**61 - 1, and tuples hash without a secret: the old keys collided
    a, b = [5, 7, 9, 11], [5 + (2 ** 61 - 1), 7, 9, 11]
    assert hash((0, tuple(a))) == hash((0, tuple(b)))
    assert prefix_digests(a, 4) != prefix_digests(b, 4)
    sa, sb = Seq("a", 0, 4, 8, key_items=a, block_size=4), Seq("b", 1, 4, 8, key_items=b, block_size=4)
    assert sa.prefix_keys != sb.prefix_keys


def test_encoding_is_unambiguous():
    cases = [[1, 2], [(1, 2)], [(1,), 2], ["12"], [b"12"], ["a", "b"], ["ab"], [("a", "b")], [-1], [2 ** 32]]
    encoded = [b"".join(item_bytes(x) for x in c) for c in cases]
    assert len(set(encoded)) == len(cases)
    assert item_bytes(np.int64(7)) == item_bytes(7)
    with pytest.raises(TypeError):
        item_bytes(1.5)
    with pytest.raises(Exception):
        item_bytes(2 ** 64)  # never wrapped into another id


def test_chained_keys_cover_whole_prefixes():
    ids = list(range(40))
    keys = prefix_digests(ids, 16)
    assert len(keys) == 2 and all(len(k) == 16 for k in keys)  # a partial block has no key
    assert keys[1] == block_digest(keys[0], ids[16:32])
    other = prefix_digests([99] + ids[1:], 16)
    assert other[0] != keys[0] and other[1] != keys[1]  # a change anywhere before changes every later key


def test_a_sequence_fed_piece_by_piece_gets_the_public_keys():
    items = list(range(30)) + REALTIME_ROWS + [(151646, b"\x01" * 16)] * 20
    seq = Seq("r", 0, 1, 100, key_items=items[:5], block_size=16)
    for i in range(5, len(items), 3):
        seq.extend_keys(items[i:i + 3])
    assert seq.prefix_keys == prefix_digests(items, 16)
    assert prefix_digests(items, 16, ROOT) == prefix_digests(items, 16)


def test_keys_are_the_same_in_every_process():
    """String items (realtime rows) hashed differently per process under hash(); digests do not."""
    items = list(range(20)) + REALTIME_ROWS + [("x", 1)] * 4
    code = ("import json, sys; from omnivox.kv_cache.prefix import prefix_digests; "
            "items = [tuple(x) if isinstance(x, list) else x for x in json.loads(sys.argv[1])]; "
            "print(json.dumps([k.hex() for k in prefix_digests(items, 8)]))")
    here = [k.hex() for k in prefix_digests(items, 8)]
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code, json.dumps(items)], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PYTHONHASHSEED": seed}, check=True)
        assert json.loads(out.stdout) == here
