"""Tensor parallelism for the Qwen3-Omni Thinker, both sides: the driver's start (`start_sharded`)
and a compute-only rank's loop, `run(spec)`, which both launchers of `parallel.launch` call: a
subprocess (`python -m omnivox.models.qwen3_omni.tp_worker --rank R ...`: `main`) and a Ray actor
(`parallel/ray_workers.py`). A rank loads its shard of the Thinker, then runs what rank 0 sends:
`setup` (mirror a new engine's Thinker stage: its KV pool of this rank's heads, same pages),
`step` (compute the Thinker's step on its shard: the collectives meet rank 0's), `profile` and
`memory` (the profiling run that sizes the KV: measure this device's peak, then answer it with
this device's total and held bytes in one all-gather: engine/memory.py), `stop`.

It exits on any error (its peers' next collective then fails at once), and a subprocess also when
its stdin closes (the driver is gone, however it ended; an actor dies with its owner, the driver):
it never waits for a driver that will not come back.
"""
from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from omnivox.parallel.ranks import RankSpec


def start_sharded(size: int, folder, dtype: str, device: str, placement, progress: bool = True,
                  launcher: str | None = None, quantization: str | None = None, fp8_compute: str = "auto"):
    """(TensorParallel, this process's model as rank 0's shard): the workers started (this module,
    by `launcher`: see `parallel.launch.choose_launcher`); the other stages whole, here."""
    from omnivox.models.qwen3_omni.weights import check_shardable, load_model
    from omnivox.parallel.launch import TensorParallel

    check_shardable(folder, size, quantization)  # a size the model refuses: one line here, before any rank starts
    return TensorParallel.start(size, __name__, folder, dtype, placement.device("thinker"),
                                lambda group: load_model(folder, dtype=dtype, device=device, progress=progress,
                                                         placement=placement, tp=group, quantization=quantization,
                                                         fp8_compute=fp8_compute),
                                launcher=launcher, quantization=quantization or "", fp8_compute=fp8_compute)


def _watch_stdin() -> None:
    """Exit as soon as the driver's control pipe closes."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    finally:
        os._exit(0)


class ThinkerShard:
    """The driver's Thinker stage, compute only: its adapter's `compute` over this rank's pool."""

    def __init__(self, model, setup, device: torch.device):
        from omnivox.attention.backends import make_backend
        from omnivox.models.qwen3_omni.stages.graph import thinker_pool
        from omnivox.models.qwen3_omni.stages.thinker import ThinkerAdapter

        cfg = setup.engine_config
        self.adapter = ThinkerAdapter(model, cfg, None, setup.suppressed_ids)
        self.pool = thinker_pool(model, setup.blocks, cfg)
        self.backend = make_backend(cfg.attention_backend, device)

    @torch.no_grad()
    def compute(self, inputs, meta):
        from omnivox.stages.step import PagedContext
        return self.adapter.compute(inputs, PagedContext(self.pool, meta, self.backend))


def main(argv: list[str] | None = None) -> int:
    """A subprocess rank (the "process" launcher): `run` until stopped or its stdin closes."""
    from omnivox.parallel.ranks import RankSpec

    spec = RankSpec.parse(argv)
    threading.Thread(target=_watch_stdin, name="omnivox-tp-stdin", daemon=True).start()
    return run(spec)


def run(spec: RankSpec) -> int:
    """Rank `spec.rank`'s loop (`parallel.launch.RankSpec`): join the group, load this rank's shard,
    then run rank 0's messages; 0 after `stop`. NOTE: on any error it prints the traceback and ends
    the process (its sockets close, so the peers' collectives fail at once instead of waiting)."""
    torch.set_num_threads(max(1, torch.get_num_threads() // spec.size))

    from omnivox.models.qwen3_omni.weights import load_model
    from omnivox.parallel.group import init_group
    from omnivox.engine.memory import CUDA
    from omnivox.parallel.launch import INIT_TIMEOUT_S, gather_memory, measured_row, receive

    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        group = init_group(spec.rank, spec.size, spec.port, device, timeout_s=INIT_TIMEOUT_S,
                           backend=spec.backend or None, host=spec.host, bind=spec.bind or None)
        model = load_model(spec.folder, dtype=spec.dtype, device=device, progress=False, tp=group, only=("thinker",),
                           quantization=spec.quantization or None, fp8_compute=spec.fp8_compute)
        group.all_reduce(torch.ones(1, device=device))  # loaded: the driver checks every rank did
        shard = None
        while True:
            message = receive(group, device)
            if message[0] == "stop":
                return 0
            if message[0] == "setup":
                shard = ThinkerShard(model, message[1], device)
            elif message[0] == "profile":
                if CUDA.measures(device):
                    CUDA.begin(device)
            elif message[0] == "memory":
                gather_memory(group, measured_row(CUDA, device))
            else:
                _, _bucket, inputs, meta = message
                shard.compute(inputs, meta)
    except Exception:  # noqa: BLE001 - logged, then the exit fails the group
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
