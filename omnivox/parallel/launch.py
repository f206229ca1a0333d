"""Tensor parallelism's processes: the driver (rank 0, the process that serves) and compute-only
workers (ranks 1..N-1, a family's worker module: Qwen3-Omni's `models/qwen3_omni/tp_worker.py`).

The driver runs everything it runs without TP; at the Thinker stage's compute seam it hands the
step (bucket, packed inputs, metadata) to `TPExecutor`, which broadcasts it and then computes its
own shard; each worker receives the same step and computes its shard, so the collectives inside
the sharded layers meet. Workers never schedule, so they cannot diverge.

Two launchers start the workers, chosen in one place (`choose_launcher`); both run the worker
module's same loop (`run(RankSpec)`):
- "process" (the default): local subprocesses, `python -m <worker> --rank R ...`, ranks on
  consecutive devices from the Thinker's; the store and gloo listen on 127.0.0.1 only. A worker exits when its stdin
  (the driver's control pipe) closes, so a driver that dies, even by SIGKILL, leaves no worker.
- "ray" (`ray_workers.py`): Ray actors, rank r in bundle r of this process's placement group
  (bundle 0 is the driver's own: a Ray Serve replica that reserved `placement_group_bundles`), so
  one replica may span machines; the store listens on the driver node's IP, each rank's gloo
  sockets on its own node's IP (no authentication: keep the cluster's network closed, README),
  each actor's device is its bundle's (one GPU, else the CPU). Picked by itself when ray is already imported and initialized
  and this process is in a placement group, or by `launcher="ray"` / OMNIVOX_TP_LAUNCHER=ray. The
  actors are the driver's (Ray ends them with it); ray is imported only then.

Lifecycle: `TensorParallel.start` starts the workers (each gets a `RankSpec`: its rank, the
rendezvous, the checkpoint), forms one gloo (NCCL on CUDA) process group of its own (no
process-global `init_process_group`: a test may hold two), and checks every rank loaded its shard.
A worker that dies or raises (it exits) makes the driver's next collective fail at once (the
socket closes), and a monitor thread reports a dead worker (a process that exited, an actor that
died or whose loop ended) within `MONITOR_S` even while the engine is idle: `on_failure` (the
engine fails every request with 503 `engine_failed` and stops, so /health answers 503). `close()`
sends `stop`, then ends the workers (pipes closed, actors killed).
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from omnivox.parallel.group import TPGroup, WorkerFailure, host_store, init_group
from omnivox.parallel.ranks import STOP_TIMEOUT_S, RankSpec, Workers
from omnivox.tensors import map_tensors

INIT_TIMEOUT_S = 60.0  # rendezvous and every collective (a dead peer fails at once: its socket closes)
MONITOR_S = 0.5


def tp_device(base: torch.device, rank: int, same_device: bool = False) -> torch.device:
    """Rank r's device: consecutive CUDA devices from the Thinker's (or all on it: `same_device`)."""
    if base.type != "cuda" or same_device:
        return base
    return torch.device("cuda", (base.index or 0) + rank)


# ---- steps over the group: one pickled object from rank 0 ------------------------------------
def to_device(obj: Any, device: torch.device | str) -> Any:
    """`obj` (a step's inputs, its metadata) with every tensor on `device`."""
    return map_tensors(lambda t: t.to(device), obj)


def send(group: TPGroup, obj: Any) -> int:
    """Rank 0: broadcast `obj` (tensors moved to the host); returns its size in bytes."""
    data = pickle.dumps(to_device(obj, "cpu"), protocol=pickle.HIGHEST_PROTOCOL)
    group.broadcast_bytes(data)
    return len(data)


def receive(group: TPGroup, device: torch.device) -> Any:
    """A worker: the next object rank 0 sends, its tensors on `device`."""
    return to_device(pickle.loads(group.broadcast_bytes(None)), device)


def gather_memory(group: TPGroup, row: tuple[int, int, int]) -> list[tuple[int, int, int]]:
    """Every rank's (total, held, peak) bytes, in rank order (one all-gather; float64 holds them exactly)."""
    where = group.device if group.backend == "nccl" else torch.device("cpu")
    rows = group.all_gather(torch.tensor([row], dtype=torch.float64, device=where), dim=0)
    return [tuple(int(v) for v in r) for r in rows.tolist()]


def measured_row(memory, device: torch.device) -> tuple[int, int, int]:
    """A worker's answer to `rank_memory` (`memory`: engine/memory.py's DeviceMemory, measuring
    since `profile_begin`); (0, 0, 0) for a device it does not measure (the CPU)."""
    if not memory.measures(device):
        return 0, 0, 0
    peak = memory.end(device)
    return (*memory.info(device), peak)


# ---- the workers' launchers ------------------------------------------------------------------------
LAUNCHERS = ("process", "ray")


def choose_launcher(explicit: str | None = None) -> str:
    """`explicit`, else OMNIVOX_TP_LAUNCHER, else "ray" when this process runs inside Ray in a
    placement group (a Ray Serve replica that reserved one), else "process".
    NOTE: never imports ray (a server without Ray must not pay for it); it asks only a ray that
    something else already imported and initialized."""
    name = explicit or os.environ.get("OMNIVOX_TP_LAUNCHER") or ("ray" if _in_placement_group() else "process")
    if name not in LAUNCHERS:
        raise ValueError(f"unknown tensor-parallel launcher {name!r} (one of {', '.join(LAUNCHERS)})")
    return name


def _in_placement_group() -> bool:
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    from ray.util import get_current_placement_group  # NOTE: it would start Ray if none were initialized
    return get_current_placement_group() is not None


class ProcessWorkers:
    """Ranks as local subprocesses, `python -m <worker> <spec.argv()>`, their stdin a control pipe."""

    def __init__(self, worker: str, specs: list[RankSpec]):
        self.procs = [subprocess.Popen([sys.executable, "-m", worker, *spec.argv()], stdin=subprocess.PIPE,
                                       stdout=sys.stderr.fileno() if _has_fileno() else None, env=_worker_env())
                      for spec in specs]

    def dead(self) -> str | None:
        for rank, p in enumerate(self.procs, 1):
            if p.poll() is not None:
                return f"tensor-parallel worker rank {rank} exited (code {p.returncode})"
        return None

    def stop(self) -> None:
        for p in self.procs:
            _stop(p)


# ---- the driver ---------------------------------------------------------------------------------
@dataclass
class TPSetup:
    """What a worker needs to mirror the driver's Thinker stage (sent when an engine starts)."""

    engine_config: Any
    suppressed_ids: list[int]
    blocks: int


class TensorParallel:
    """The driver's handle on its workers and their process group."""

    def __init__(self, size: int, group: TPGroup, workers: Workers, device: torch.device):
        self.size, self.group, self.workers, self.device = size, group, workers, device
        self.failed: WorkerFailure | None = None
        self.on_failure: Callable[[WorkerFailure], None] | None = None
        self.sent_bytes = 0  # what the last step broadcast
        self.sent_total = self.steps = 0  # all steps broadcast so far (benchmarks/tensor_parallel.py)
        self._closed = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="omnivox-tp-monitor", daemon=True)
        self._monitor.start()

    @classmethod
    def start(cls, size: int, worker: str, folder, dtype: str, device: torch.device, load: Callable[[TPGroup], Any],
              same_device: bool = False, launcher: str | None = None, quantization: str = "",
              fp8_compute: str = "auto") -> tuple["TensorParallel", Any]:
        """Start ranks 1..size-1 (the `worker` module's `run`, by `choose_launcher(launcher)`), form the
        group, then `load(group)` this rank's model (each worker loads its own shard meanwhile); a rank
        that fails to start is a start-up error."""
        on_ray = choose_launcher(launcher) == "ray"
        if on_ray:
            from omnivox.parallel import ray_workers  # imports ray

            host, devices = ray_workers.node_ip(), [ray_workers.rank_device(device)] * (size - 1)
        else:
            same_device = same_device or os.environ.get("OMNIVOX_TP_SAME_DEVICE") == "1"  # gpu_verify: 2 ranks, 1 GPU
            host, devices = "127.0.0.1", [tp_device(device, rank, same_device) for rank in range(1, size)]
        store = host_store(size, timeout_s=INIT_TIMEOUT_S, host=host)
        specs = [RankSpec(rank, size, host, store.port, str(folder), dtype, str(dev), _backend() or "",
                          quantization=quantization, fp8_compute=fp8_compute)
                 for rank, dev in enumerate(devices, 1)]
        workers = ray_workers.RayWorkers(worker, specs) if on_ray else ProcessWorkers(worker, specs)
        try:
            group = init_group(0, size, store.port, device, store=store, timeout_s=INIT_TIMEOUT_S, backend=_backend(),
                               host=host)
            model = load(group)
            ok = group.all_reduce(torch.ones(1, device=device))  # every rank loaded its shard
            if int(ok.item()) != size:
                raise WorkerFailure("a tensor-parallel rank failed to load its shard")
        except Exception as e:
            reason = workers.dead() or "no worker had stopped"
            workers.stop()
            raise WorkerFailure(f"tensor-parallel workers failed to start ({reason}; see their log above): "
                                f"{type(e).__name__}: {str(e)[:300]}") from None
        return cls(size, group, workers, device), model

    def setup(self, setup: TPSetup) -> None:
        self._send(("setup", setup))

    def step(self, bucket: int | None, inputs: Any, meta: Any) -> None:
        """Broadcast one compute step (before the driver computes its own shard)."""
        self.sent_bytes = self._send(("step", bucket, inputs, meta))
        self.sent_total += self.sent_bytes
        self.steps += 1

    def profile_begin(self) -> None:
        """Each worker starts measuring its device's peak (the profiling run, engine/memory.py)."""
        self._send(("profile",))

    def rank_memory(self) -> list[tuple[int, int, int]]:
        """Each worker's (total, held, peak) bytes since `profile_begin`, ranks 1.. in order."""
        self._send(("memory",))
        return gather_memory(self.group, (0, 0, 0))[1:]

    def _send(self, message) -> int:
        if self.failed is not None:
            raise self.failed
        if self._closed.is_set():
            raise WorkerFailure("the tensor-parallel workers were stopped (the model was closed)")
        try:
            return send(self.group, message)
        except WorkerFailure as e:  # a peer's socket closed: it died or raised
            raise self.fail(str(e))

    def fail(self, message: str) -> WorkerFailure:
        """Record the group's failure (once) and tell the engine; returns the error."""
        if self.failed is None:
            self.failed = WorkerFailure(message)
            if self.on_failure is not None:
                self.on_failure(self.failed)
        return self.failed

    def _watch(self) -> None:
        while not self._closed.wait(MONITOR_S):
            dead = self.workers.dead()
            if dead and not self._closed.is_set():
                self.fail(dead)
                return

    def close(self) -> None:
        """Stop every worker (a stop message, then its launcher ends them; killed if they linger)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self.failed is None:
            try:
                send(self.group, ("stop",))
            except WorkerFailure:
                pass
        self.workers.stop()


def _stop(p: subprocess.Popen) -> None:
    try:
        if p.stdin:
            p.stdin.close()  # the worker's watchdog exits on EOF
        p.wait(timeout=STOP_TIMEOUT_S)
    except (subprocess.TimeoutExpired, OSError):
        p.kill()
        p.wait()


def _worker_env() -> dict[str, str]:
    """The environment a worker starts with: the driver's, with this omnivox first on the path
    (NOTE: a driver that found omnivox through sys.path, e.g. a script in a checkout, would
    otherwise start workers that import another copy: the installed one)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def _backend() -> str | None:
    """OMNIVOX_TP_BACKEND=gloo forces gloo on CUDA (two ranks on one GPU: gpu_verify's tp phase)."""
    return os.environ.get("OMNIVOX_TP_BACKEND") or None


def _has_fileno() -> bool:
    try:
        sys.stderr.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False
