"""Off-route model work: an S2 reference voice's codec encoding, done by the engine thread in
batches (a voice is no request: it has no route, pages or events). A caller (an API worker
thread) calls `encode(adapter, item)` and waits: the submission is queued, the engine wakes, and
its next loop turn runs `step()` before the request stages step. A step takes EVERY pending
submission and hands each adapter its items in one call, in the order they came (adapters are
grouped by equality). The S2 codec (`models/fish_s2/codec.py`) encodes one reference wave per call.

NOTE: a realtime turn's audio does NOT come here: it is a stage on the listening request's route
(`stages/encoder.py`), and no API thread waits on it. This queue is what is left of the old
blocking path, for references only, until S2's voice cloning gets a stage of its own.

Errors: an adapter's exception fails every item of its call, raised in each caller's thread. When
the engine stops (`close`), every pending submission fails with the engine's error, and later ones
are refused with it.
"""
from __future__ import annotations

import concurrent.futures
import threading
from abc import ABC, abstractmethod
from typing import Any, Callable

from omnivox.engine.events import StageStats


class OffRouteAdapter(ABC):
    """One kind of off-route encoding a family hands the engine. Adapters that compare equal batch
    together (e.g. a frozen dataclass over the same model)."""

    @abstractmethod
    def encode(self, items: list) -> list:
        """A step's submissions of this kind, in the order they came -> one result each, in the
        same order. Runs on the engine thread (or the caller's, without an engine); may advance
        state the items carry."""


class OffRouteQueue:
    name = "off_route"

    def __init__(self, wake: Callable[[], None], owner: threading.Thread):
        self.wake = wake  # tells the owner's loop there is work
        self.owner = owner  # the thread that steps this stage (the engine's)
        self.batch_stats = StageStats()  # a step's submissions (e.g. sessions' pushes) per step
        self._lock = threading.Lock()
        self._pending: list[tuple[OffRouteAdapter, Any, concurrent.futures.Future]] = []
        self._closed: BaseException | None = None

    # ---- any thread ---------------------------------------------------------------------------
    def encode(self, adapter: OffRouteAdapter, item: Any) -> Any:
        """`adapter`'s result for `item`, computed by the owner thread in its next step (its
        exception raised here). Called from the owner thread itself, it runs at once."""
        if threading.current_thread() is self.owner:  # NOTE: waiting on our own step would hang
            return adapter.encode([item])[0]
        return self.submit(adapter, item).result()

    def submit(self, adapter: OffRouteAdapter, item: Any) -> concurrent.futures.Future:
        """Queue `item`: its result (or exception) is set after the owner's next step."""
        result: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed is not None:
                raise self._closed
            self._pending.append((adapter, item, result))
        # NOTE: after the append: the owner checks `has_work` under its own lock before it sleeps,
        # and `wake` takes that lock, so a submission never lands between its check and its sleep
        self.wake()
        return result

    def has_work(self) -> bool:
        return bool(self._pending)

    def queued(self) -> int:
        """Submissions waiting for the next step."""
        return len(self._pending)

    # ---- the owner thread ---------------------------------------------------------------------
    def step(self) -> None:
        """Every pending submission: one `encode` call per adapter, results to their callers."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        self.batch_stats.record(len(pending))
        groups: dict[OffRouteAdapter, list[tuple[Any, concurrent.futures.Future]]] = {}
        for adapter, item, result in pending:
            groups.setdefault(adapter, []).append((item, result))
        for adapter, group in groups.items():
            try:
                outs = adapter.encode([item for item, _ in group])
                if len(outs) != len(group):
                    raise RuntimeError(f"{type(adapter).__name__}.encode gave {len(outs)} results for {len(group)} items")
            except BaseException as e:  # noqa: BLE001 - each caller raises it
                for _, result in group:
                    result.set_exception(e)
                continue
            for (_, result), out in zip(group, outs):
                result.set_result(out)

    def close(self, error: BaseException) -> None:
        """The owner stops: pending submissions fail with `error`, later ones are refused with it."""
        with self._lock:
            self._closed = self._closed or error
            pending, self._pending = self._pending, []
        for _, _, result in pending:  # NOTE: never leave a caller waiting on a result nobody will set
            result.set_exception(error)

    def stats(self) -> dict[str, StageStats]:
        return {self.name: self.batch_stats}
