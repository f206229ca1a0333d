"""The KV budget from the device's memory (`--gpu-memory-utilization`, the peers' convention), used
when `--kv-cache-mb` is left out and a KV-caching stage runs on CUDA.

After the weights load, a profiling run (vLLM's `profile_run`) steps each stage once at its worst
case with dummy inputs: its real forward over padding rows (`Stage.profile_steps`: an AR stage's
prefill chunk of `token_budget` tokens and its decode step of `max_running` rows, a vocoder's
`max_running` streams of a chunk's frames) over a scratch KV of one page, in a throwaway copy of
the stage graph. Then, per device (the stages on it):

    KV bytes = utilization x total - held - activations - graphs

- `held`: what this process holds there after loading and profiling (`memory_reserved`: weights
  and the allocator's cache, after `empty_cache`);
- `activations`: the highest peak (`max_memory_allocated` above what was allocated before) of any
  one worst-case step of its stages: one loop steps a CUDA device's stages one at a time;
- `graphs`: with CUDA graphs on, each stage's decode peak again: its graphs, captured at warm-up
  after this budget, keep their own memory pool for good;

shared equally by its KV-caching stages (Qwen3-Omni's Thinker and Talker on one GPU: half each;
under `--placement` each device budgets its own stages). Tensor parallelism: every rank measures
its own device the same way (`parallel/launch.py`'s `rank_memory`), and the Thinker's budget is the
least any rank has room for. Stages on the CPU keep the family's default share.

Only this process's own memory is counted, never another's: two servers (or replicas) on one GPU
share it honestly when their utilizations add up to at most 1 (e.g. 0.45 each).
NOTE: not counted, and left to the `1 - utilization` margin: activations of shapes the profile's
padding rows do not reach (attention over a long context: the paged kernels do not materialise
scores; a media encoder's long input), NCCL's buffers, and other processes. The profile
over-counts one thing: every padding row of the prefill chunk samples, so its logits
(`token_budget` rows instead of at most `max_running`) are counted whole.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from omnivox.errors import OmnivoxError

if TYPE_CHECKING:
    from omnivox.engine.graph import StageGraph

GIB = 2**30


class DeviceMemory:
    """What a device's memory reads (the seam tests replace): CUDA's allocator figures. The CPU is
    not measured (its stages keep the family's default KV)."""

    def measures(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def info(self, device: torch.device) -> tuple[int, int]:
        """(total bytes, bytes this process holds there)."""
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[1], torch.cuda.memory_reserved(device)

    def begin(self, device: torch.device) -> None:
        """Start measuring a peak on `device`."""
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        self._base = torch.cuda.memory_allocated(device)

    def end(self, device: torch.device) -> int:
        """Bytes allocated at the peak since `begin`, above what was allocated then."""
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - self._base)


CUDA = DeviceMemory()


def indexed(device: torch.device) -> torch.device:
    """"cuda" as the device it means ("cuda:N", the current one): one key per device."""
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)


def peak(memory: DeviceMemory, device: torch.device, run: Callable[[], object]) -> int:
    memory.begin(device)
    run()
    return memory.end(device)


@dataclass
class DeviceRoom:
    """One device's budget and its parts (bytes)."""

    where: str  # the device ("cuda:0"), or "tensor-parallel rank N"
    total: int
    utilization: float
    held: int
    activations: int = 0
    graphs: int = 0
    stages: list[str] = field(default_factory=list)  # its KV-caching stages

    @property
    def kv(self) -> float:
        return self.utilization * self.total - self.held - self.activations - self.graphs

    def describe(self) -> str:
        return (f"{self.where}: {self.utilization:g} x {self.total / GIB:.1f} GiB - held {self.held / GIB:.2f} - "
                f"activations {self.activations / GIB:.2f} - cuda graphs {self.graphs / GIB:.2f} = "
                f"{self.kv / GIB:.2f} GiB KV")


@dataclass
class KVBudget:
    """MB of KV per KV-caching stage, and how each measured device's share came about."""

    stage_mb: dict[str, float]
    rooms: list[DeviceRoom]
    ranks: dict[str, list[DeviceRoom]] = field(default_factory=dict)  # stage -> its other TP ranks' rooms

    def describe(self) -> str:
        """The start-up line's part: each device's arithmetic, then each stage's MB."""
        parts = [r.describe() for r in self.rooms]
        parts += [f"{stage}'s {r.describe()}" for stage, rs in self.ranks.items() for r in rs]
        return "KV budget " + "; ".join(parts) + " -> " + ", ".join(f"{s} {mb:.0f} MB" for s, mb in self.stage_mb.items())


@dataclass
class Profile:
    """A profiling run's peaks (bytes) per device, and per stage those of its other TP ranks."""

    activations: dict[torch.device, int] = field(default_factory=dict)
    graphs: dict[torch.device, int] = field(default_factory=dict)
    ranks: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)  # (total, held, peak) per rank 1..


def profile(graph: "StageGraph", memory: DeviceMemory, graphs: bool) -> Profile:
    """Step each measured stage's worst cases once (`Stage.profile_steps`) and take the peaks; the
    graph is a throwaway (scratch KV). `graphs`: CUDA graphs will be captured on CUDA devices (their
    pools count)."""
    from omnivox.engine.graph import on_device

    out = Profile()
    for stage in graph.stages.values():
        dev, mirror = indexed(stage.device), getattr(stage, "mirror", None)
        if not memory.measures(dev):
            continue
        if mirror is not None:
            mirror.profile_begin()
        try:
            with on_device(dev):
                peaks = {kind: peak(memory, dev, run) for kind, run in stage.profile_steps().items()}
        except torch.cuda.OutOfMemoryError:
            raise OmnivoxError(f"the {stage.name} stage's worst-case step (the KV budget's profiling run) ran out of "
                               f"memory on {dev}: lower --max-running, or try --quantization fp8 or --placement") from None
        if not peaks:
            continue
        out.activations[dev] = max(out.activations.get(dev, 0), *peaks.values())
        if graphs and dev.type == "cuda" and mirror is None:  # a mirrored stage runs eagerly
            out.graphs[dev] = out.graphs.get(dev, 0) + peaks.get("decode", 0)
        if mirror is not None:
            out.ranks[stage.name] = mirror.rank_memory()
    return out


def kv_budget_from_memory(stage_devices: dict[str, torch.device], utilization: float, default_mb: float,
                          memory: DeviceMemory = CUDA, measured: Profile | None = None) -> KVBudget | None:
    """The KV budget per KV-caching stage (`stage_devices`: each one's device), or None when none is
    on a measured device (the caller keeps its default). `default_mb`: the family's total default,
    shared equally by the stages off CUDA; `measured`: the profiling run's peaks. One-line error
    when a device (or a TP rank) has no room left at `utilization`."""
    if not 0 < utilization <= 1:
        raise OmnivoxError(f"--gpu-memory-utilization {utilization:g} must be in (0, 1]")
    if not any(memory.measures(d) for d in stage_devices.values()):
        return None
    measured = measured or Profile()
    out = KVBudget({}, [])
    for stage, device in stage_devices.items():
        device = indexed(device)
        if not memory.measures(device):
            out.stage_mb[stage] = default_mb / len(stage_devices)
            continue
        room = next((r for r in out.rooms if r.where == str(device)), None)
        if room is None:
            total, held = memory.info(device)
            room = DeviceRoom(str(device), total, utilization, held, measured.activations.get(device, 0),
                              measured.graphs.get(device, 0))
            out.rooms.append(room)
        room.stages.append(stage)
    for room in out.rooms:
        _check(room, len(room.stages))
        out.stage_mb.update({s: room.kv / 2**20 / len(room.stages) for s in room.stages})
    for stage, rows in measured.ranks.items():  # TP: the least room of any rank
        ranks = [DeviceRoom(f"tensor-parallel rank {i}", total, utilization, held, p, 0, [stage])
                 for i, (total, held, p) in enumerate(rows, 1) if total > 0]  # total 0: not measured (CPU)
        for r in ranks:
            _check(r, 1)
        if ranks and stage in out.stage_mb:
            out.ranks[stage] = ranks
            out.stage_mb[stage] = min(out.stage_mb[stage], *(r.kv / 2**20 for r in ranks))
    return out


def _check(room: DeviceRoom, stages: int) -> None:
    if room.kv < 2**20 * stages:
        raise OmnivoxError(f"--gpu-memory-utilization {room.utilization:g} of {room.where} ({room.total / GIB:.1f} GiB) "
                           f"leaves no KV room: this process holds {room.held / GIB:.1f} GiB there and its "
                           f"warm-up peaked at {(room.activations + room.graphs) / GIB:.1f} GiB more (raise it, or "
                           "try --quantization fp8, --placement, a lower --max-running or --kv-cache-mb)")


SCRATCH_MB = 1e-6  # the profiling run's KV: one page a stage (its padding rows write the dummy slot only)


def budget_after_warmup(family, loaded, stage_devices: dict[str, torch.device], utilization: float,
                        memory: DeviceMemory = CUDA) -> KVBudget | None:
    """The KV budget of a loaded model (`family`'s, under its `engine_config`): profile a
    throwaway copy of its stage graph over a scratch KV, then size from what is left (None when no
    KV stage is on a measured device: the caller keeps the default)."""
    import gc
    from dataclasses import replace

    if not any(memory.measures(d) for d in stage_devices.values()):
        return None
    cfg = loaded.engine_config
    scratch = replace(cfg, kv_cache_mb=SCRATCH_MB, kv_stage_mb=tuple((s, SCRATCH_MB) for s in stage_devices),
                      cuda_graphs="off")
    graph = family.stage_graph(loaded, scratch)
    try:
        measured = profile(graph, memory, graphs=cfg.cuda_graphs == "auto")
    finally:
        graph.close()
        del graph
        if any(d.type == "cuda" for d in stage_devices.values()):
            gc.collect()  # the scratch stages' memory (held in cycles) is back before `held` is read
    return kv_budget_from_memory(stage_devices, utilization, loaded.default_kv_mb(), memory, measured)
