"""Per-request state that lives on the device, one row (slot) per request, so a step reads and
writes the rows of any set of requests with a fixed number of ops: `gather(slots)` one
index_select per tensor, `scatter(slots, state)` one index_copy_ per tensor."""
from __future__ import annotations

from typing import Any, Callable, Generic, Sequence, TypeVar

import torch

from omnivox.layers.streaming_conv import BatchedState

S = TypeVar("S", bound=BatchedState)


class SlotPool(Generic[S]):
    """Rows of `fresh(n)` states; a taken slot starts fresh. The pool doubles when it is full."""

    def __init__(self, fresh: Callable[[int], S], capacity: int, on_grow: Callable[[], Any] | None = None):
        self.fresh, self.capacity = fresh, max(1, capacity)
        self.on_grow = on_grow  # the rows moved: e.g. drop CUDA graphs captured over the old ones
        self.state: S = fresh(self.capacity + 1)
        self.scratch = self.capacity  # a row no request owns: padding rows of a batch read and write it
        self.free = list(range(self.capacity))
        self.owner: dict[str, int] = {}

    def slot(self, rid: str) -> int:
        """The slot of request `rid`, taken (fresh) on first use."""
        s = self.owner.get(rid)
        if s is None:
            if not self.free:  # NOTE: a reallocation: captured graphs that read the old rows are stale
                self.state = type(self.state).concat([self.state, self.fresh(self.capacity)])
                self.free = list(range(self.capacity + 1, 2 * self.capacity + 1))
                self.capacity *= 2
                if self.on_grow is not None:
                    self.on_grow()
            s = self.owner[rid] = self.free.pop(0)
            self.state.assign(torch.tensor([s]), self.fresh(1))
        return s

    def slots(self, rids: Sequence[str]) -> torch.Tensor:
        return torch.tensor([self.slot(r) for r in rids])

    def slot_list(self, rids: Sequence[str]) -> list[int]:
        return [self.slot(r) for r in rids]

    def release(self, rid: str) -> None:
        s = self.owner.pop(rid, None)
        if s is not None:
            self.free.append(s)

    def gather(self, slots: torch.Tensor) -> S:
        return self.state.select(slots)

    def scatter(self, slots: torch.Tensor, state: S) -> None:
        self.state.assign(slots, state)
