"""The KV pool's dummy page and choosing a backend by name."""
import pytest
import torch

from omnivox.attention.backends import make_backend
from omnivox.kv_cache.pool import KVPool


def test_dummy_page_lies_after_the_allocator_pages():
    pool = KVPool(2, 5, 4, 1, 8, torch.float32, "cpu")
    assert pool.k.shape == (2, 6 * 4, 1, 8) and pool.dummy_slot == 5 * 4
    assert pool.slots([4, 0], 2, 6).tolist() == [18, 19, 0, 1]
    pool.poison(list(range(pool.num_blocks)))
    assert pool.k[:, :pool.dummy_slot].isnan().all() and not pool.k[:, pool.dummy_slot:].isnan().any()
    assert KVPool.bytes_per_block(2, 4, 1, 8, torch.float32) == 2 * 2 * 4 * 8 * 4  # per allocator page


def test_make_backend():
    assert make_backend(None, "cpu").name == "torch_ref"
    assert make_backend("per_sequence", torch.device("cpu")).name == "per_sequence"
    with pytest.raises(ValueError, match="torch_ref"):
        make_backend("flash", "cpu")
