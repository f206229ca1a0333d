"""The KV budget from the device's memory after a profiling run (engine/memory.py), on CPU with a
fake device memory: the arithmetic (activations and CUDA graph pools off the room), stages sharing
a device or each on its own, CPU stages keeping the default, tensor-parallel ranks' minimum, a
device with no room left refused in one line; and the profiling run itself on the tiny models: it
steps each stage's worst-case shapes (seen by forward hooks) and leaves nothing behind (the same
outputs as a model loaded without it, every page free)."""
import threading

import numpy as np
import pytest
import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from omnivox.engine.config import EngineConfig
from omnivox.engine.memory import Profile, kv_budget_from_memory
from omnivox.errors import OmnivoxError
from omnivox.models.registry import load
from omnivox.offline import OfflineModel
from omnivox.parallel.group import host_store, init_group
from omnivox.parallel.launch import gather_memory, measured_row
from memory_fake import Fake
from qwen_tiny import chat

GIB, MIB = 2**30, 2**20
CUDA0, CUDA1, CPU = torch.device("cuda:0"), torch.device("cuda:1"), torch.device("cpu")


def test_activations_and_graph_pools_come_off_the_room_of_stages_sharing_a_device():
    measured = Profile(activations={CUDA0: 3 * GIB}, graphs={CUDA0: 2 * GIB})
    got = kv_budget_from_memory({"thinker": CUDA0, "talker": CUDA0}, 0.9, 256, Fake(held={"cuda:0": 35 * GIB}),
                                measured)
    assert got.stage_mb == {"thinker": (0.9 * 80 - 35 - 3 - 2) * 1024 / 2, "talker": (0.9 * 80 - 35 - 3 - 2) * 1024 / 2}
    assert got.describe() == ("KV budget cuda:0: 0.9 x 80.0 GiB - held 35.00 - activations 3.00 - cuda graphs 2.00 = "
                              "32.00 GiB KV -> thinker 16384 MB, talker 16384 MB")


def test_a_device_named_without_its_index_is_the_one_its_tensors_are_on():
    """`--device cuda` places stages on "cuda"; their tensors (and so the profile's peaks) are on "cuda:0"."""
    got = kv_budget_from_memory({"thinker": torch.device("cuda"), "talker": CUDA0}, 0.5, 256, Fake(),
                                Profile(activations={CUDA0: 8 * GIB}))
    assert got.stage_mb == {"thinker": 16 * 1024, "talker": 16 * 1024} and [r.where for r in got.rooms] == ["cuda:0"]


def test_each_device_under_placement_budgets_its_own_stages_and_peak():
    measured = Profile(activations={CUDA0: 2 * GIB, CUDA1: 1 * GIB})
    got = kv_budget_from_memory({"thinker": CUDA0, "talker": CUDA1}, 0.5, 256,
                                Fake(held={"cuda:0": 30 * GIB, "cuda:1": 4 * GIB}), measured)
    assert got.stage_mb == {"thinker": 8 * 1024, "talker": 35 * 1024}


def test_two_servers_on_one_gpu_each_count_only_their_own_memory():
    """Each process budgets utilization x total minus what it holds and peaks at: 0.45 each never oversubscribes."""
    measured = Profile(activations={CUDA0: GIB})
    a, b = (kv_budget_from_memory({"slow_ar": CUDA0}, 0.45, 4096, Fake(held={"cuda:0": 10 * GIB}), measured)
            for _ in range(2))
    assert (a.stage_mb["slow_ar"] + b.stage_mb["slow_ar"]) * MIB + 2 * (10 + 1) * GIB <= 0.9 * 80 * GIB


def test_cpu_stages_keep_the_default_share_and_all_cpu_means_no_change():
    got = kv_budget_from_memory({"thinker": CUDA0, "talker": CPU}, 0.9, 256, Fake())
    assert got.stage_mb["talker"] == 128 and got.stage_mb["thinker"] == 0.9 * 80 * 1024
    assert kv_budget_from_memory({"thinker": CPU, "talker": CPU}, 0.9, 256, Fake()) is None


def test_tensor_parallel_ranks_take_the_least_room_of_any_rank():
    """Rank 0 shares cuda:0 with the Talker (half of 32 GiB each); rank 1 holds the Thinker alone but
    peaks higher: 0.9 x 80 - 40 - 20 = 12 GiB is the Thinker's budget on every rank."""
    measured = Profile(activations={CUDA0: 0}, ranks={"thinker": [(80 * GIB, 40 * GIB, 20 * GIB)]})
    got = kv_budget_from_memory({"thinker": CUDA0, "talker": CUDA0}, 0.9, 256, Fake(held={"cuda:0": 40 * GIB}),
                                measured)
    assert got.stage_mb == {"thinker": 12 * 1024, "talker": 16 * 1024}
    assert "thinker's tensor-parallel rank 1: 0.9 x 80.0 GiB - held 40.00 - activations 20.00" in got.describe()
    unmeasured = Profile(ranks={"thinker": [(0, 0, 0)]})  # a CPU rank: no limit
    assert kv_budget_from_memory({"thinker": CUDA0}, 0.9, 256, Fake(), unmeasured).stage_mb == {"thinker": 0.9 * 80 * 1024}


def test_the_ranks_gather_each_ones_own_figures_over_gloo():
    """`rank_memory`'s collective: rank 1 answers what its own device memory reads (two ranks in threads)."""
    store = host_store(2, timeout_s=20)
    got, errors = {}, []

    def rank(r):
        try:
            group = init_group(r, 2, store.port, store=store if r == 0 else None, timeout_s=20)
            fake = Fake(total=(70 + r) * GIB, held={"cpu": r * GIB}, peak=3 * r * GIB, cpu=True)
            fake.begin(CPU)
            got[r] = gather_memory(group, (0, 0, 0) if r == 0 else measured_row(fake, CPU))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and got[0] == got[1] == [(0, 0, 0), (71 * GIB, GIB, 3 * GIB)]
    assert measured_row(Fake(), CPU) == (0, 0, 0)  # a CPU rank is not measured


def test_no_room_and_bad_fractions_are_one_line_errors():
    with pytest.raises(OmnivoxError, match=r"^--gpu-memory-utilization 0.8 of cuda:0 \(80.0 GiB\) leaves no KV room: "
                                           r"this process holds 60.0 GiB there and its warm-up peaked at 4.0 GiB more"):
        kv_budget_from_memory({"thinker": CUDA0, "talker": CUDA0}, 0.8, 256, Fake(held={"cuda:0": 60 * GIB}),
                              Profile(activations={CUDA0: 4 * GIB}))
    with pytest.raises(OmnivoxError, match=r"of tensor-parallel rank 1 \(80.0 GiB\) leaves no KV room"):
        kv_budget_from_memory({"thinker": CUDA0}, 0.9, 256, Fake(), Profile(ranks={"thinker": [(80 * GIB, 70 * GIB, 2 * GIB)]}))
    with pytest.raises(OmnivoxError, match=r"must be in \(0, 1\]"):
        kv_budget_from_memory({"thinker": CUDA0}, 1.5, 256, Fake())


def test_a_worst_case_step_out_of_memory_is_one_line():
    from omnivox.engine.memory import profile

    class Stage:
        name, device, mirror = "talker", CPU, None  # (a CUDA device's context needs CUDA)

        def profile_steps(self):
            def oom():
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return {"decode": oom}

    with pytest.raises(OmnivoxError, match=r"^the talker stage's worst-case step \(the KV budget's profiling run\) ran "
                                           r"out of memory on cpu: lower --max-running"):
        profile(type("Graph", (), {"stages": {"talker": Stage()}})(), Fake(cpu=True), graphs=True)


def test_profiling_steps_each_stage_at_its_worst_and_leaves_nothing_behind(tiny_reference):
    cfg = EngineConfig(max_running=3, token_budget=40, scheduling="fifo")
    fake = Fake(total=64 * MIB, held={"cpu": 16 * MIB}, peak=8 * MIB, cpu=True)
    seen = []  # (module, leading dim of its first input) of every forward while a step is measured
    hook = register_module_forward_pre_hook(
        lambda mod, args: seen.append((mod, args[0].shape[0])) if fake.measuring is not None and args else None)
    try:
        profiled = load(str(tiny_reference[1]), progress=False, engine_config=cfg, device_memory=fake)
    finally:
        hook.remove()
    plain = load(str(tiny_reference[1]), progress=False, engine_config=cfg,
                 kv_cache_mb=dict(profiled.engine_config.kv_stage_mb))
    try:
        assert profiled.kv_budget.stage_mb == {"thinker": (0.9 * 64 - 16 - 8) / 2, "talker": (0.9 * 64 - 16 - 8) / 2}
        m = profiled.model
        shapes = {name: {n for mod, n in seen if mod is part}
                  for name, part in (("thinker", m.thinker.model), ("talker", m.talker.model),
                                     ("code2wav", m.code2wav.code_embedding))}
        # a prefill chunk of token_budget tokens and a decode step of max_running rows; the vocoder's
        # max_running streams
        assert shapes == {"thinker": {40, 3}, "talker": {40, 3}, "code2wav": {3}}
        reqs = [dict(prompt_ids=chat([1000 + 37 * i + k for k in range(3 + 9 * i)]), max_tokens=5, max_frames=6,
                     greedy=i != 1, seed=7) for i in range(3)]  # one sampled; the last prefills in two chunks
        want, got = OfflineModel(plain).generate(reqs), OfflineModel(profiled).generate(reqs)
        for w, g in zip(want, got, strict=True):
            assert g.text_ids == w.text_ids
            np.testing.assert_array_equal(g.codes, w.codes)
            np.testing.assert_array_equal(g.audio, w.audio)
        stats = profiled.engine.stats()
        assert stats.kv_pages_free == stats.kv_pages_total
    finally:
        plain.close()
        profiled.close()
