"""Tensor parallelism's processes: the driver (rank 0, the process that serves) and compute-only
workers (ranks 1..N-1, a family's worker module: Qwen3-Omni's `models/qwen3_omni/tp_worker.py`).

The driver runs everything it runs without TP; at the Thinker stage's compute seam it hands the
step (bucket, packed inputs, metadata) to `TPExecutor`, which broadcasts it and then computes its
own shard; each worker receives the same step and computes its shard, so the collectives inside
the sharded layers meet. Workers never schedule, so they cannot diverge.

Lifecycle: `TensorParallel.start` spawns the workers (each gets its rank, the rendezvous port and
the checkpoint), forms one gloo (NCCL on CUDA) process group of its own (no process-global
`init_process_group`: a test may hold two), and checks every rank loaded its shard. A worker
exits when its stdin (the driver's control pipe) closes, so a driver that dies, even by SIGKILL,
leaves no worker behind; a worker that dies or raises (it exits) makes the driver's next
collective fail at once (the socket closes), and a monitor thread reports a dead worker within
`MONITOR_S` even while the engine is idle: `on_failure` (the engine fails every request with 503
`engine_failed` and stops, so /health answers 503).
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

from omnivox.errors import EngineFailed
from omnivox.parallel.group import TPGroup, host_store, init_group
from omnivox.tensors import map_tensors

INIT_TIMEOUT_S = 60.0  # rendezvous and every collective (a dead peer fails at once: its socket closes)
MONITOR_S = 0.5
STOP_TIMEOUT_S = 10.0


class WorkerFailure(EngineFailed):
    """A tensor-parallel rank died or raised: the engine cannot compute the Thinker any more."""


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


# ---- the driver ---------------------------------------------------------------------------------
@dataclass
class TPSetup:
    """What a worker needs to mirror the driver's Thinker stage (sent when an engine starts)."""

    engine_config: Any
    suppressed_ids: list[int]
    blocks: int


class TensorParallel:
    """The driver's handle on its workers and their process group."""

    def __init__(self, size: int, group: TPGroup, procs: list[subprocess.Popen], device: torch.device):
        self.size, self.group, self.procs, self.device = size, group, procs, device
        self.failed: WorkerFailure | None = None
        self.on_failure: Callable[[WorkerFailure], None] | None = None
        self.sent_bytes = 0  # what the last step broadcast
        self.sent_total = self.steps = 0  # all steps broadcast so far (benchmarks/tensor_parallel.py)
        self._closed = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="omnivox-tp-monitor", daemon=True)
        self._monitor.start()

    @classmethod
    def start(cls, size: int, worker: str, folder, dtype: str, device: torch.device, load: Callable[[TPGroup], Any],
              same_device: bool = False) -> tuple["TensorParallel", Any]:
        """Spawn ranks 1..size-1 (`python -m <worker>`), form the group, then `load(group)` this
        rank's model (each worker loads its own shard meanwhile); a rank that fails to start is a
        start-up error."""
        same_device = same_device or os.environ.get("OMNIVOX_TP_SAME_DEVICE") == "1"  # gpu_verify: 2 ranks, 1 GPU
        store = host_store(size, timeout_s=INIT_TIMEOUT_S)
        procs = []
        for rank in range(1, size):
            dev = tp_device(device, rank, same_device)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", worker, "--rank", str(rank), "--size", str(size),
                 "--port", str(store.port), "--folder", str(folder), "--dtype", dtype, "--device", str(dev),
                 "--backend", _backend() or ""],
                stdin=subprocess.PIPE, stdout=sys.stderr.fileno() if _has_fileno() else None, env=_worker_env()))
        try:
            group = init_group(0, size, store.port, device, store=store, timeout_s=INIT_TIMEOUT_S, backend=_backend())
            model = load(group)
            ok = group.all_reduce(torch.ones(1, device=device))  # every rank loaded its shard
            if int(ok.item()) != size:
                raise WorkerFailure("a tensor-parallel rank failed to load its shard")
        except Exception as e:
            for p in procs:
                _stop(p)
            codes = [p.returncode for p in procs]
            raise WorkerFailure(f"tensor-parallel workers failed to start (exit codes {codes}; see their log above): "
                                f"{type(e).__name__}: {str(e)[:300]}") from None
        return cls(size, group, procs, device), model

    def setup(self, setup: TPSetup) -> None:
        self._send(("setup", setup))

    def step(self, bucket: int | None, inputs: Any, meta: Any) -> None:
        """Broadcast one compute step (before the driver computes its own shard)."""
        self.sent_bytes = self._send(("step", bucket, inputs, meta))
        self.sent_total += self.sent_bytes
        self.steps += 1

    def _send(self, message) -> int:
        if self.failed is not None:
            raise self.failed
        if self._closed.is_set():
            raise WorkerFailure("the tensor-parallel workers were stopped (the model was closed)")
        try:
            return send(self.group, message)
        except RuntimeError as e:  # a peer's socket closed: it died or raised
            raise self.fail(f"a tensor-parallel worker stopped ({str(e).splitlines()[0][:200]})")

    def fail(self, message: str) -> WorkerFailure:
        """Record the group's failure (once) and tell the engine; returns the error."""
        if self.failed is None:
            self.failed = WorkerFailure(message)
            if self.on_failure is not None:
                self.on_failure(self.failed)
        return self.failed

    def _watch(self) -> None:
        while not self._closed.wait(MONITOR_S):
            dead = [(i + 1, p.returncode) for i, p in enumerate(self.procs) if p.poll() is not None]
            if dead:
                rank, code = dead[0]
                self.fail(f"tensor-parallel worker rank {rank} exited (code {code})")
                return

    def close(self) -> None:
        """Stop every worker (a stop message, then closing their pipes; killed if they linger)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self.failed is None:
            try:
                send(self.group, ("stop",))
            except RuntimeError:
                pass
        for p in self.procs:
            _stop(p)


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
