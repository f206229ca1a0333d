"""Tensor parallelism's Ray launcher on one machine: a driver inside a Ray actor that holds a
placement group of 2 bundles (what a Ray Serve replica with `placement_group_bundles` is) builds
`Omni(tensor_parallel_size=2)`, which starts rank 1 as a Ray actor in bundle 1 by itself (gloo over
the node's address: 127.0.0.1 here); its Thinker token ids equal the unsharded model's, a killed rank fails the engine
(503 `engine_failed`) and close() leaves no actor behind.

One small local Ray for the module, started as `omnivox serve --replicas` starts its own (2 CPUs, no
dashboard, token authentication on; shut down by the fixture). Every wait is bounded."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from omnivox import Omni  # noqa: E402
from omnivox.errors import EngineFailed  # noqa: E402
from omnivox.parallel.launch import choose_launcher  # noqa: E402
from qwen_tiny import chat  # noqa: E402
from ray_helpers import own_ray  # noqa: E402

WAIT_S = 90  # any Ray call: start-up, one generate
FAIL_WITHIN_S = 10.0
TESTS = Path(__file__).resolve().parents[1]
REQUESTS = [dict(prompt_ids=chat([1300 + 7 * i + k for k in range(5 + 3 * i)]), greedy=True, max_tokens=8,
                 return_audio=False) for i in range(3)]


@pytest.fixture(scope="module")
def local_ray():
    """Ray as `omnivox serve --replicas` starts its own (token authentication on, loopback)."""
    # the Ray workers inherit this environment: this checkout's omnivox, this module and qwen_tiny
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), str(TESTS / "parallel")]
                                               + ([saved] if saved else []))
    try:
        with own_ray(num_cpus=2, object_store_memory=100 * 2**20, namespace="omnivox-tp-test", log_to_driver=False):
            yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


@ray.remote(num_cpus=1)
class Driver:
    """A Ray Serve replica's stand-in: rank 0 in bundle 0 of its placement group."""

    def __init__(self, folder: str):
        self.omni = Omni(model=folder, progress=False, tensor_parallel_size=2)
        self.handle = None

    def workers(self) -> tuple[str, list[str]]:
        assert self.omni.engine.alive  # started: a failure now reaches it
        return type(self.omni.tp.workers).__name__, self.omni.tp.workers.names

    def generate(self, requests: list[dict]) -> list[list[int]]:
        return [o.text_ids for o in self.omni.generate(requests)]

    def start_long(self) -> str:
        """A long request, running: its first event's type."""
        self.handle = iter(self.omni.submit(prompt_ids=chat([1500, 1501]), max_tokens=4000, return_audio=False,
                                            greedy=True, ignore_eos=True))
        return type(next(self.handle)).__name__

    def finish_long(self) -> dict:
        """The long request's last event (bounded by FAIL_WITHIN_S) and the engine's state after it."""
        start, last = time.monotonic(), None
        for last in self.handle:
            if type(last).__name__ in ("Failed", "Finished") or time.monotonic() - start > FAIL_WITHIN_S:
                break
        return dict(event=type(last).__name__, status=getattr(last, "status", None), code=getattr(last, "code", None),
                    waited=time.monotonic() - start, **self.settled())

    def settled(self) -> dict:
        """Once the engine stopped and the group recorded its failure (bounded by FAIL_WITHIN_S): both,
        and how a new request is refused."""
        start = time.monotonic()
        while (self.omni.engine.alive or self.omni.tp.failed is None) and time.monotonic() - start < FAIL_WITHIN_S:
            time.sleep(0.05)
        try:
            self.omni.submit(prompt_ids=chat([1502]), max_tokens=2)
            refused = None
        except EngineFailed as e:
            refused = e.status
        return dict(alive=self.omni.engine.alive, failure=repr(self.omni.tp.failed), refused=refused,
                    settled_in=time.monotonic() - start)

    def close(self) -> None:
        self.omni.close()


def _named() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("omnivox-tp-")}


@pytest.fixture
def driver(local_ray, tiny_reference):
    """A driver actor in bundle 0 of a fresh 2-bundle placement group (the replica's contract)."""
    pg = placement_group([{"CPU": 1}, {"CPU": 0.5}])
    assert pg.wait(WAIT_S)
    actor = Driver.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)).remote(str(tiny_reference[1]))
    yield actor
    ray.kill(actor)
    remove_placement_group(pg)


def test_ray_ranks_equal_one_process_and_close_leaves_no_actor(driver, tiny_reference):
    launcher, names = ray.get(driver.workers.remote(), timeout=WAIT_S)
    assert launcher == "RayWorkers" and len(names) == 1 and names[0].endswith("-rank1")
    assert set(names) <= _named()
    got = ray.get(driver.generate.remote(REQUESTS), timeout=WAIT_S)
    one = Omni(model=tiny_reference[1], progress=False)
    try:
        want = [o.text_ids for o in one.generate(REQUESTS)]
    finally:
        one.close()
    assert got == want and all(want)
    ray.get(driver.close.remote(), timeout=WAIT_S)
    assert not set(names) & _named()


def test_a_killed_ray_rank_fails_the_running_engine(driver):
    _, names = ray.get(driver.workers.remote(), timeout=WAIT_S)
    assert ray.get(driver.start_long.remote(), timeout=WAIT_S) == "TextDelta"  # it runs
    ray.kill(ray.get_actor(names[0]))
    out = ray.get(driver.finish_long.remote(), timeout=WAIT_S)
    assert (out["event"], out["status"], out["code"]) == ("Failed", 503, "engine_failed"), out
    assert out["waited"] < FAIL_WITHIN_S and not out["alive"] and out["refused"] == 503, out
    assert "WorkerFailure" in out["failure"], out
    ray.get(driver.close.remote(), timeout=WAIT_S)
    assert not set(names) & _named()


def test_the_monitor_reports_a_ray_rank_killed_while_idle(driver):
    _, names = ray.get(driver.workers.remote(), timeout=WAIT_S)
    ray.kill(ray.get_actor(names[0]))
    out = ray.get(driver.settled.remote(), timeout=WAIT_S)  # no step runs: only the monitor can tell
    assert "rank 1 (Ray actor) died" in out["failure"], out
    assert not out["alive"] and out["refused"] == 503 and out["settled_in"] < FAIL_WITHIN_S, out
    ray.get(driver.close.remote(), timeout=WAIT_S)
    assert not set(names) & _named()


def test_the_launcher_is_chosen_in_one_place(local_ray, monkeypatch):
    monkeypatch.delenv("OMNIVOX_TP_LAUNCHER", raising=False)
    assert choose_launcher() == "process"  # Ray is up, but this process is in no placement group
    assert choose_launcher("ray") == "ray"
    monkeypatch.setenv("OMNIVOX_TP_LAUNCHER", "ray")
    assert choose_launcher() == "ray"
    with pytest.raises(ValueError, match="launcher"):
        choose_launcher("mpi")
    # without Ray: subprocesses, and ray is never imported
    code = "import sys; from omnivox import Omni; from omnivox.parallel.launch import choose_launcher; " \
           "print(choose_launcher(), 'ray' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "OMNIVOX_TP_LAUNCHER"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S, env=env,
                         cwd=TESTS.parent)
    assert out.stdout.split() == ["process", "False"], out.stderr[-2000:]
