"""The KV budget from the device's memory (engine/memory.py), on CPU with a fake device memory:
the arithmetic, stages sharing a device or each on its own, CPU stages keeping the default, and a
device with no room left refused in one line."""
import pytest
import torch

from omnivox.engine.memory import kv_budget_from_memory
from omnivox.errors import OmnivoxError

GIB = 2**30
CUDA0, CUDA1, CPU = torch.device("cuda:0"), torch.device("cuda:1"), torch.device("cpu")


def fake(**held_gib):
    """80 GiB devices; this process holds `held_gib[cuda_N]` GiB on each (weights after loading)."""
    return lambda d: (80 * GIB, int(held_gib[f"cuda_{d.index}"] * GIB))


def test_stages_on_one_device_share_what_utilization_leaves():
    got = kv_budget_from_memory({"thinker": CUDA0, "talker": CUDA0}, 0.9, 256, fake(cuda_0=35))
    assert got == {"thinker": (0.9 * 80 - 35) * 1024 / 2, "talker": (0.9 * 80 - 35) * 1024 / 2}


def test_each_device_under_placement_budgets_its_own_stages():
    got = kv_budget_from_memory({"thinker": CUDA0, "talker": CUDA1}, 0.5, 256, fake(cuda_0=30, cuda_1=4))
    assert got == {"thinker": 10 * 1024, "talker": 36 * 1024}


def test_two_servers_on_one_gpu_each_count_only_their_own_memory():
    """Each process budgets utilization x total minus what it holds itself: 0.45 each never oversubscribes."""
    a = kv_budget_from_memory({"slow_ar": CUDA0}, 0.45, 4096, fake(cuda_0=10))
    b = kv_budget_from_memory({"slow_ar": CUDA0}, 0.45, 4096, fake(cuda_0=10))
    assert (a["slow_ar"] + b["slow_ar"]) * 2**20 + 2 * 10 * GIB <= 0.9 * 80 * GIB


def test_cpu_stages_keep_the_default_share_and_all_cpu_means_no_change():
    got = kv_budget_from_memory({"thinker": CUDA0, "talker": CPU}, 0.9, 256, fake(cuda_0=0))
    assert got["talker"] == 128 and got["thinker"] == 0.9 * 80 * 1024
    assert kv_budget_from_memory({"thinker": CPU, "talker": CPU}, 0.9, 256, fake()) is None


def test_no_room_and_bad_fractions_are_one_line_errors():
    with pytest.raises(OmnivoxError, match=r"^--gpu-memory-utilization 0.8 of cuda:0 \(80.0 GiB\) leaves no KV room: "
                                           r"this process already holds 65.7 GiB there"):
        kv_budget_from_memory({"thinker": CUDA0, "talker": CUDA0}, 0.8, 256, fake(cuda_0=65.7))
    with pytest.raises(OmnivoxError, match=r"must be in \(0, 1\]"):
        kv_budget_from_memory({"thinker": CUDA0}, 1.5, 256, fake(cuda_0=1))
