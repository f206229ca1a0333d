"""The stage protocol: what the engine's graph asks of every stage.

A family's graph is an ordered list of stages joined by typed per-request streams (a request's
`route` names the stages it passes). A stage has one caller at a time: its loop's thread during
a step, the engine thread between steps (engine/graph.py); nothing here is thread-safe, and a stage
reads another's output only through the request's streams. The contract:

- `admit(req)`: take a request. May raise an `OmnivoxError`; then the request alone fails with
  its status (e.g. 413 `CannotFit`). A stage may hold an admitted request without work until
  its inputs exist (the Talker waits for the Thinker's first tokens).
- `has_work()`: would `step()` compute something now? Reads no device state. The engine thread
  sleeps while no stage has work, so a request held without work (a Talker waiting for text, a
  streamed prompt waiting for the user) must not count: that would be a busy loop.
- `step()`: one batched step over the requests with work. Per-request problems never raise:
  they come back as `(request, error)` pairs, and the graph fails exactly those requests.
- `done(req)`: this stage will produce nothing more for `req`.
- `remove(req)`: forget `req` and free all it holds here (KV pages, a state slot). Idempotent;
  called when a request finishes, fails or is aborted.
- `stats()`: {stats name: StageStats}; the names are stable, /metrics shows them.
- `kv_stats()`: a KV-caching stage's pages and their history (`KVStats`); None without a KV cache.
- `is_waiting(req)`: `req` is admitted but not running here yet (inputs missing, or queued for
  pages or a running slot); what /metrics and readiness call waiting.
- `profile_steps()`: the stage's worst-case steps as {kind: run} ("prefill", "decode": the shape
  its CUDA graphs hold), each one real step over dummy padding rows that writes only scratch state
  (the KV pool's dummy slot, scratch state rows); run once each, eagerly, by the profiling run that
  sizes the KV from the device's memory (engine/memory.py). Default: none.
- `warmup()`: capture the stage's CUDA graphs now (start-up, before any request); returns how many
  it holds.
- `device`: where its weights, KV pool and state live (taken from its weights; engine/placement.py);
  its graph runs its steps and warm-up under it, and groups stages into loops by it.
- `clock`: the only source of time for a stage's decisions (set by its graph: `engine/clock.py`).
- `scheduling`: the policy that orders, yields and caps the stage's rows, reading its graph's
  shared slack table (`engine/slack.py`; set by the graph).
- `last_step`: (tokens or frames computed, rows) of the stage's last `step()`: its graph measures
  the step's time against them (the slack table's step-cost model).
- `running_rows(playing)`: the rows of that kind (`Request.playing`) its next decode step would
  carry (admitted and started, not done).
- `reads_open_stream`: the stage reads its requests' prompt streams (`engine.prompt.PromptStream`)
  WHILE THEY ARE OPEN and emits output as input comes: lockstep, one piece of input taken at a
  step, its output in that step, the stream still open (the encoder stage: audio in, rows out; a
  duplex family: a frame in, a frame out). Such a stage counts a stream's pending input in
  `has_work`, takes it with `PromptStream.take` in `step`, and is `done` with a request only once
  its stream is closed and taken. False (default): the stage reads only what earlier stages wrote
  (a prompt stage reads a stream through its adapter and decides when it answers: the Thinker
  prefills an open stream and samples only once it is closed).
- `passes_input`: the stage only turns a request's input into the next stage's (the encoder): a
  request waits or runs as the next stage on its route says (`StageGraph.is_waiting`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from omnivox.engine.clock import Clock
from omnivox.engine.events import StageStats
from omnivox.engine.request import Request
from omnivox.engine.slack import Fifo, Policy, SlackTable

Failures = list[tuple[Request, BaseException]]


@dataclass(frozen=True)
class KVStats:
    pages_total: int
    pages_free: int  # cached prefixes count as free
    preemptions: int  # since start
    prefix_hit_tokens: int  # since start


class Stage(ABC):
    name: str
    device: torch.device
    clock: Clock = Clock()
    scheduling: Policy = Fifo(SlackTable(1.0, 1.0))
    last_step: tuple[int, int] = (0, 0)
    reads_open_stream: bool = False
    passes_input: bool = False

    @abstractmethod
    def admit(self, req: Request) -> None: ...

    @abstractmethod
    def has_work(self) -> bool: ...

    @abstractmethod
    def step(self) -> Failures: ...

    @abstractmethod
    def done(self, req: Request) -> bool: ...

    @abstractmethod
    def remove(self, req: Request) -> None: ...

    @abstractmethod
    def stats(self) -> dict[str, StageStats]: ...

    def kv_stats(self) -> KVStats | None:
        return None

    def is_waiting(self, req: Request) -> bool:
        return False

    def running_rows(self, playing: bool) -> int:
        return 0

    def profile_steps(self) -> dict[str, Callable[[], object]]:
        return {}

    def warmup(self) -> int:
        return 0
