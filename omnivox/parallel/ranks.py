"""What a tensor-parallel worker rank is given (`RankSpec`) and how a launcher's ranks are watched and
ended (`Workers`): shared by the driver (`launch.py`) and both launchers (its subprocesses,
`ray_workers.py`'s actors)."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Protocol

STOP_TIMEOUT_S = 10.0  # how long ranks get to end after `stop` before they are ended by force


@dataclass(frozen=True)
class RankSpec:
    """What a worker rank needs: its place in the group, the rendezvous (rank 0's store at
    host:port), the checkpoint and its device; a subprocess gets it as arguments (`argv`/`parse`).
    `bind`: the address its own sockets listen on ("": `host`, right for local ranks; a Ray rank
    sets its node's IP)."""

    rank: int
    size: int
    host: str
    port: int
    folder: str
    dtype: str
    device: str
    backend: str = ""  # "" : NCCL on CUDA, gloo otherwise; "gloo": forced (OMNIVOX_TP_BACKEND)
    bind: str = ""
    quantization: str = ""  # "fp8": quantize the shard at load (`--quantization`); "": as the checkpoint is
    fp8_compute: str = "auto"

    def argv(self) -> list[str]:
        return [a for k, v in asdict(self).items() for a in (f"--{k}", str(v))]

    @classmethod
    def parse(cls, argv: list[str] | None = None) -> "RankSpec":
        p = argparse.ArgumentParser()
        for f in fields(cls):
            required = f.default is MISSING
            p.add_argument(f"--{f.name}", type=int if f.type == "int" else str, required=required,
                           default=None if required else f.default)
        return cls(**vars(p.parse_args(argv)))


class Workers(Protocol):
    """Ranks 1..N-1 as one launcher started them (`launch.ProcessWorkers`, `ray_workers.RayWorkers`)."""

    def dead(self) -> str | None:
        """None while every rank runs; else how the first one that stopped ended."""

    def stop(self) -> None:
        """Let the ranks end (they were sent `stop`, or are broken), ending by force any that linger."""
