"""Tensor parallelism end to end on CPU: the Thinker sharded over 2 processes (gloo) serves the same
requests as one process, and a rank that dies fails the engine cleanly (503 `engine_failed`, no
hang, no orphan process).

One 2-rank group for the equality matrix (module scope), another for the kill tests; every worker
is stopped by its test (the fixtures close their models; the kill tests check the processes are
gone). Every wait is bounded."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from omnivox import Omni
from omnivox.engine.config import EngineConfig
from omnivox.engine.events import Failed, Finished, TextDelta
from omnivox.errors import EngineFailed
from qwen_tiny import chat, mixed_requests

STREAM_ATOL = 3e-5  # streamed vs one-shot decode (tests/engine/test_engine.py)
FAIL_WITHIN_S = 10.0


def _wait_for(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie (exited, not reaped by a parent that is itself gone) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


# chunked prefill (16 tokens a step) and a KV cache that preempts (12 pages of 4 tokens a stage)
CONFIGS = {"batched": EngineConfig(scheduling="fifo", token_budget=16),
           "preempting": EngineConfig(scheduling="fifo", kv_cache_mb=0.047, block_size=4, prefix_cache=False,
                                      poison_freed_pages=True)}


@pytest.fixture(scope="module")
def pair(tiny_reference):
    """(one process, 2 ranks) over the same tiny checkpoint."""
    one = Omni(model=tiny_reference[1], progress=False)
    two = Omni(model=tiny_reference[1], progress=False, tensor_parallel_size=2)
    yield one, two
    one.close()
    two.close()
    for p in two.tp.workers.procs:
        assert p.poll() is not None


def _generate(omni: Omni, cfg: EngineConfig, reqs: list[dict]):
    """The requests on a fresh engine under `cfg` (the workers stay: only the engine restarts)."""
    if omni._engine is not None:
        omni._engine.shutdown()
        omni._engine = None
    omni.engine_config = cfg
    return omni.generate(reqs), omni.engine.stats()


def test_the_profiling_run_steps_the_workers_too(pair):
    """The KV budget's profiling run (engine/memory.py) over 2 ranks: rank 1 computes the Thinker's
    worst-case steps with rank 0 (their collectives meet: no hang) and answers its memory figures
    (a CPU rank: none, so rank 0's room decides); the engine started after it answers as one
    process does (the next test: the profile left nothing behind on any rank)."""
    from omnivox.engine.memory import budget_after_warmup
    from memory_fake import Fake

    import torch
    one, two = pair
    cpu = torch.device("cpu")
    fake = Fake(total=64 * 2**20, held={"cpu": 16 * 2**20}, cpu=True)
    two.engine_config = EngineConfig(max_running=3, token_budget=16)  # small worst cases (the next test sets its own)
    budget = budget_after_warmup(two.family, two, {"thinker": cpu, "talker": cpu}, 0.9, fake)
    assert budget.stage_mb == {"thinker": (0.9 * 64 - 16) / 2, "talker": (0.9 * 64 - 16) / 2}
    assert budget.ranks == {} and two.tp.failed is None and all(p.poll() is None for p in two.tp.workers.procs)
    assert two.tp.steps == 2  # the prefill chunk and the decode step, mirrored


@pytest.mark.parametrize("config", list(CONFIGS))
def test_two_ranks_equal_one_process(pair, config):
    one, two = pair
    reqs = mixed_requests(one) if config == "batched" else [  # short prompts: two fit, not their growth
        dict(prompt_ids=chat([1300 + 7 * i + k for k in range(6 + 2 * i)]), greedy=True, max_tokens=10, max_frames=14)
        for i in range(6)]
    want, _ = _generate(one, CONFIGS[config], reqs)
    got, stats = _generate(two, CONFIGS[config], reqs)
    for w, g in zip(want, got, strict=True):
        assert g.text_ids == w.text_ids
        np.testing.assert_array_equal(g.codes, w.codes)
        np.testing.assert_allclose(g.audio, w.audio, rtol=0, atol=STREAM_ATOL)
    assert any(o.codes.shape[0] for o in got)
    if config == "batched":
        assert got[4].codes.shape[0] == 0  # the text-only reply
    else:
        assert stats.preemptions > 0 and stats.kv_pages_free == stats.kv_pages_total
    assert two.tp.sent_bytes > 0


def test_a_killed_worker_fails_the_engine_cleanly(tiny_reference):
    omni = Omni(model=tiny_reference[1], progress=False, tensor_parallel_size=2)
    try:
        handle = omni.submit(prompt_ids=chat([1500, 1501]), max_tokens=4000, return_audio=False, greedy=True,
                             ignore_eos=True)
        events = iter(handle)
        assert isinstance(next(events), TextDelta)  # it runs
        worker = omni.tp.workers.procs[0]
        worker.send_signal(signal.SIGKILL)
        start = time.monotonic()
        last = None
        for ev in events:  # bounded: the engine fails it within FAIL_WITHIN_S
            last = ev
            if isinstance(ev, (Failed, Finished)) or time.monotonic() - start > FAIL_WITHIN_S:
                break
        assert isinstance(last, Failed) and last.status == 503 and last.code == "engine_failed", last
        assert time.monotonic() - start < FAIL_WITHIN_S
        _wait_for(lambda: not omni.engine.alive, FAIL_WITHIN_S, "the engine stops (/health 503)")
        with pytest.raises(EngineFailed):
            omni.submit(prompt_ids=chat([1502]), max_tokens=2)
    finally:
        omni.close()
    assert all(p.poll() is not None for p in omni.tp.workers.procs)


def test_workers_exit_when_the_driver_is_killed(tiny_reference):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from omnivox import Omni
        omni = Omni(model={str(tiny_reference[1])!r}, progress=False, tensor_parallel_size=2)
        print(" ".join(str(p.pid) for p in omni.tp.workers.procs), flush=True)
        time.sleep(600)
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = driver.stdout.readline()  # bounded by the worker start-up (60 s rendezvous)
        pids = [int(x) for x in line.split()]
        assert pids, "the driver printed no worker pid"
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        _wait_for(lambda: all(_gone(pid) for pid in pids), FAIL_WITHIN_S, "the workers exit with their driver")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


def test_target_features_are_whole_on_rank_0(pair):
    """A drafter's target features (speculative/drafter.py `absorb`) under tensor parallelism equal one
    process's: every rank's layer outputs are reduced inside the layer."""
    from speculative.features import attach

    prompt = chat([1000 + 3 * k for k in range(20)])
    got = []
    for omni in pair:
        if omni._engine is not None:  # a fresh engine (as `_generate`), its Thinker tapped
            omni._engine.shutdown()
            omni._engine = None
        omni.engine_config = CONFIGS["batched"]
        rec = attach(omni, (0, 1))
        out = omni.generate(prompt_ids=prompt, greedy=True, max_tokens=5, return_audio=False)
        got.append(rec.by_position(len(prompt) + len(out.text_ids) - 1))
    assert not got[0].isnan().any()
    np.testing.assert_allclose(got[1].numpy(), got[0].numpy(), rtol=0, atol=1e-5)
