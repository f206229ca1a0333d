"""Where each stage runs: a device per stage (`Placement`), the loops that step them, and the one
way a tensor crosses from one stage's device to another's (`hand_over`).

A family names its stages (Qwen3-Omni: `thinker`, `talker` with its code predictor, `vocoder`,
`encoder`; Fish S2: `slow_ar`, `vocoder`); a stage the placement does not name runs on the default
device. The loader puts each stage's weights on its device; from then on a stage takes its device
from its own weights, and its KV pool and state live there.

Loops (`EngineConfig.stage_loops`): "device" (default) steps the stages of each device in their own
thread, all devices at once, joined at the end of every step; "one" steps every stage in one
thread; an explicit split ("thinker,talker+vocoder": loops separated by commas, the stages of a
loop joined by "+") puts stages of one device in separate loops (tests on CPU). NOTE: two loops on
one CUDA device would launch on its one default stream from two threads while a lazy CUDA-graph
capture may be running there: refused (`loop_groups`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from omnivox.errors import InputError

# NOTE: held by every cross-device copy and by every CUDA-graph capture: a copy issued from one
# loop's thread on another loop's device while that device captures would invalidate the capture.
CROSSING = threading.RLock()


class PlacementError(InputError):
    """A placement (or per-stage KV budget) that names an unknown stage or device: a start-up error."""


_SIDE_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def hand_over(produce: Callable[[], torch.Tensor], device: torch.device,
              static_on: torch.device | None = None) -> torch.Tensor:
    """Rows a producer stage computes on its own device (`produce()`), copied to a consumer's device
    once. The declared crossing between stages: nothing else mixes two stages' tensors.

    `static_on`: the producer's device when `produce` reads only weights and host values, nothing a
    step writes (the Thinker's word embeddings of voiced ids). On CUDA it then runs on a side stream
    there, not queued behind the producer loop's steps on the device's default stream (which every
    thread shares): the consumer's loop does not wait for the producer's. Rows a step wrote (the
    accept-layer rows) stay in order on the default stream."""
    with CROSSING:
        if static_on is None or static_on.type != "cuda" or static_on == torch.device(device):
            return produce().to(device)
        stream = _SIDE_STREAMS.get(static_on)
        if stream is None:
            stream = _SIDE_STREAMS[static_on] = torch.cuda.Stream(static_on)
        with torch.cuda.stream(stream):
            return produce().to(device)  # to the host: waits for the side stream only


def _parse_pairs(text: str, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise PlacementError(f"{what}: expected stage=value pairs separated by commas, got {part!r}")
        key = key.strip()
        if key in out:
            raise PlacementError(f"{what}: stage {key!r} is named twice")
        out[key] = value.strip()
    return out


@dataclass(frozen=True)
class Placement:
    """A device per named stage; the others run on `default`."""

    devices: dict[str, str] = field(default_factory=dict)
    default: str = "cpu"

    @classmethod
    def parse(cls, text: str | dict | "Placement" | None, default: str = "cpu") -> "Placement":
        """`thinker=cuda:0,talker=cuda:1` (or a dict, or a Placement); every device is checked."""
        if isinstance(text, Placement):
            return text
        pairs = dict(text) if isinstance(text, dict) else _parse_pairs(text or "", "placement")
        for key, dev in [*pairs.items(), ("default", default)]:
            try:
                torch.device(dev)
            except (RuntimeError, TypeError):
                raise PlacementError(f"placement: {key}={dev!r} is not a device (cpu, cuda, cuda:1, ...)") from None
        return cls({k: str(v) for k, v in pairs.items()}, str(default))

    def check(self, stages: tuple[str, ...]) -> "Placement":
        """Itself, once every key names one of the family's `stages`."""
        unknown = sorted(set(self.devices) - set(stages))
        if unknown:
            raise PlacementError(f"placement names unknown stage(s) {', '.join(unknown)}; "
                                 f"this model's stages are {', '.join(stages)}")
        return self

    def device(self, stage: str) -> torch.device:
        return torch.device(self.devices.get(stage, self.default))


def parse_kv_budget(value: float | str | dict | None, stages: tuple[str, ...] | None) -> float | dict[str, float] | None:
    """`--kv-cache-mb`: a total (float) or `thinker=MB,talker=MB` per KV-caching stage (`stages`;
    None: any names, the syntax only: the family is not known yet)."""
    if value is None or isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
        value = _parse_pairs(value, "kv-cache-mb")
    out: dict[str, float] = {}
    for key, mb in value.items():
        if stages is not None and key not in stages:
            raise PlacementError(f"kv-cache-mb names {key!r}; the stages with a KV cache are {', '.join(stages)}")
        try:
            out[key] = float(mb)
        except ValueError:
            raise PlacementError(f"kv-cache-mb: {key}={mb!r} is not a number of MB") from None
        if not 0 < out[key] <= 2**24:
            raise PlacementError(f"kv-cache-mb: {key}={mb!r} must be a positive number of MB")
    missing = [s for s in stages or () if s not in out]
    if missing:
        raise PlacementError(f"kv-cache-mb names no budget for {', '.join(missing)}")
    return out


def loop_groups(spec: str, devices: dict[str, torch.device]) -> list[list[str]]:
    """The stages each loop steps, in step order (`devices`: every stage's device, in step order)."""
    order = list(devices)
    if spec == "one":
        return [order]
    if spec == "device":
        by_device: dict[torch.device, list[str]] = {}
        for name, dev in devices.items():
            by_device.setdefault(dev, []).append(name)
        return list(by_device.values())
    groups = [[s.strip() for s in part.split("+") if s.strip()] for part in spec.split(",") if part.strip()]
    named = [s for g in groups for s in g]
    unknown = sorted(set(named) - set(order))
    if unknown or len(named) != len(set(named)):
        raise PlacementError(f"stage loops {spec!r}: " + (f"unknown stage(s) {', '.join(unknown)}; "
                             if unknown else "a stage is named twice; ") + f"the stages are {', '.join(order)}")
    groups += [[s] for s in order if s not in named]  # unnamed stages: a loop each
    for g in groups:
        if len({devices[s] for s in g}) > 1:
            raise PlacementError(f"stage loops {spec!r}: {'+'.join(g)} are on different devices; a loop steps one device")
    cuda = [devices[g[0]] for g in groups if devices[g[0]].type == "cuda"]
    if len(cuda) != len(set(cuda)):
        raise PlacementError(f"stage loops {spec!r}: two loops on one CUDA device; place the stages on "
                             "separate devices (or cpu) instead")
    return [sorted(g, key=order.index) for g in sorted(groups, key=lambda g: min(order.index(s) for s in g))]
