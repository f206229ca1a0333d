"""Tensor parallelism for the Qwen3-Omni Thinker, both sides: the driver's start (`start_sharded`)
and a compute-only rank, `python -m omnivox.models.qwen3_omni.tp_worker --rank R ...` (started by
`parallel.launch.TensorParallel.start`). A rank loads its shard of the Thinker, then runs what rank 0 sends:
`setup` (mirror a new engine's Thinker stage: its KV pool of this rank's heads, same pages),
`step` (compute the Thinker's step on its shard: the collectives meet rank 0's), `stop`.

It exits when its stdin closes (the driver is gone, however it ended) and on any error (its peers'
next collective then fails at once): it never waits for a driver that will not come back.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import traceback

import torch


def start_sharded(size: int, folder, dtype: str, device: str, placement, progress: bool = True):
    """(TensorParallel, this process's model as rank 0's shard): the workers started (this module),
    on consecutive devices from the Thinker's placement device; the other stages whole, here."""
    from omnivox.models.qwen3_omni.weights import load_model
    from omnivox.parallel.launch import TensorParallel

    return TensorParallel.start(size, __name__, folder, dtype, placement.device("thinker"),
                                lambda group: load_model(folder, dtype=dtype, device=device, progress=progress,
                                                         placement=placement, tp=group))


def _watch_stdin() -> None:
    """Exit as soon as the driver's control pipe closes."""
    try:
        while sys.stdin.buffer.read(4096):
            pass
    finally:
        os._exit(0)


class ThinkerReplica:
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
    p = argparse.ArgumentParser()
    for name in ("rank", "size", "port"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--folder", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="")
    a = p.parse_args(argv)
    threading.Thread(target=_watch_stdin, name="omnivox-tp-stdin", daemon=True).start()
    torch.set_num_threads(max(1, torch.get_num_threads() // a.size))

    from omnivox.models.qwen3_omni.weights import load_model
    from omnivox.parallel.group import init_group
    from omnivox.parallel.launch import INIT_TIMEOUT_S, receive

    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        group = init_group(a.rank, a.size, a.port, device, timeout_s=INIT_TIMEOUT_S, backend=a.backend or None)
        model = load_model(a.folder, dtype=a.dtype, device=device, progress=False, tp=group, only=("thinker",))
        group.all_reduce(torch.ones(1, device=device))  # loaded: the driver checks every rank did
        replica = None
        while True:
            message = receive(group, device)
            if message[0] == "stop":
                return 0
            if message[0] == "setup":
                replica = ThinkerReplica(model, message[1], device)
            else:
                _, _bucket, inputs, meta = message
                replica.compute(inputs, meta)
    except Exception:  # noqa: BLE001 - logged, then the exit fails the group
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
