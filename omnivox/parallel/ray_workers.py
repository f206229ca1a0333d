"""Tensor-parallel ranks as Ray actors (the "ray" launcher of `launch.py`): rank r runs in bundle r
of the driver's placement group, so one Ray Serve replica's ranks may sit on several machines.

The driver (rank 0) runs in bundle 0 of a placement group of at least N bundles, e.g. a replica
deployed with
    placement_group_bundles=[{"CPU": 1, "GPU": 1}] + [{"GPU": 1}] * (N - 1)    # CUDA (NCCL)
    placement_group_bundles=[{"CPU": 1}] + [{"CPU": 0.5}] * (N - 1)            # CPU (gloo)
Each rank's actor asks for exactly its bundle's CPUs and GPUs, so the bundle holds that one rank;
on CUDA Ray makes the bundle's GPU the actor's only one (its `cuda:0`). The ranks meet at a store
on the driver node's IP; each rank's gloo sockets listen on its own node's IP (never on every
interface). The actors are named `omnivox-tp-<group>-rank<r>` and owned by the
driver: Ray ends them when it dies (what the subprocess's stdin pipe does).

NOTE: this module imports ray; `launch.TensorParallel.start` imports it only for this launcher.
"""
from __future__ import annotations

import dataclasses
import importlib
import uuid

import ray
import torch
from ray.util.placement_group import PlacementGroup, get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from omnivox.parallel.ranks import STOP_TIMEOUT_S, RankSpec


def node_ip() -> str:
    """Where ranks on other machines reach the driver's rendezvous: this node's IP."""
    return ray.util.get_node_ip_address()


def rank_device(device: torch.device | str) -> torch.device:
    """A rank's device: its bundle's one GPU when the driver's Thinker is on CUDA, else the CPU."""
    return torch.device("cuda", 0) if torch.device(device).type == "cuda" else torch.device("cpu")


@ray.remote(max_restarts=0)  # a restarted rank could not rejoin its group: a dead one fails the engine
class RankActor:
    """One rank: the worker module's loop (the same `run` a subprocess rank calls)."""

    def run(self, worker: str, spec: RankSpec) -> int:
        return importlib.import_module(worker).run(dataclasses.replace(spec, bind=node_ip()))  # its own node's


class RayWorkers:
    """Ranks 1..N-1 as `RankActor`s in `placement_group` (this process's own by default)."""

    def __init__(self, worker: str, specs: list[RankSpec], placement_group: PlacementGroup | None = None):
        pg = placement_group or get_current_placement_group()
        if pg is None:
            raise RuntimeError("the Ray tensor-parallel launcher runs in a placement group (bundle r for rank r); "
                               "this process has none")
        bundles = pg.bundle_specs
        for spec in specs:
            if spec.rank >= len(bundles):
                raise ValueError(f"tensor-parallel size {spec.size} needs a placement group of {spec.size} bundles "
                                 f"(0: the driver, r: rank r); this one has {len(bundles)}")
            if spec.device.startswith("cuda") and bundles[spec.rank].get("GPU", 0) <= 0:
                raise ValueError(f"rank {spec.rank} runs on CUDA but its bundle {bundles[spec.rank]} has no GPU")
        group = uuid.uuid4().hex[:8]
        self.names = [f"omnivox-tp-{group}-rank{spec.rank}" for spec in specs]
        self.actors = [RankActor.options(
            name=name, num_cpus=bundles[spec.rank].get("CPU", 0), num_gpus=bundles[spec.rank].get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=spec.rank),
        ).remote() for name, spec in zip(self.names, specs)]
        self.runs = [actor.run.remote(worker, spec) for actor, spec in zip(self.actors, specs)]  # each ends at `stop`

    def dead(self) -> str | None:
        ready, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        if not ready:
            return None
        rank = min(self.runs.index(ref) for ref in ready) + 1
        try:
            ray.get(self.runs[rank - 1])
            return f"tensor-parallel worker rank {rank} (Ray actor) ended its loop"
        except ray.exceptions.RayError as e:
            return f"tensor-parallel worker rank {rank} (Ray actor) died: {str(e).strip().splitlines()[0][:200]}"

    def stop(self) -> None:
        """Kill every actor (after `stop` their loops have nothing left to do) and wait until Ray has
        ended them (their runs resolve), at most STOP_TIMEOUT_S."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        ray.wait(self.runs, num_returns=len(self.runs), timeout=STOP_TIMEOUT_S)
