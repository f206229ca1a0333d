"""The admission half of a paged AR stage's adapter: a request's lifecycle in the stage, from
admission (host-side preparation) through the moment its sequence exists and while its inputs
grow, to its end. The step half (`stages.step.ARStep`) computes the scheduled rows."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from omnivox.engine.events import StageStats
from omnivox.engine.request import Request
from omnivox.engine.scheduler import Seq
from omnivox.engine.stage import Failures, Stage


@dataclass(eq=False)
class SeqState:
    """What an AR adapter keeps per request, extended by each adapter (and by a mixin that reads
    more, e.g. `stages.streamed_prompt.StreamedState`): the request, its sequence once it exists,
    whether the stage is done with it."""

    req: Request
    seq: Seq | None = field(default=None, kw_only=True)
    done: bool = field(default=False, kw_only=True)


S = TypeVar("S", bound=SeqState)


class ARAdmission(ABC, Generic[S]):
    """When a request's inputs exist (its `Seq`), how they grow, and when it is over. Generic over
    the adapter's per-request state `S` (a `SeqState`)."""

    stage: Stage  # the PagedARStage that binds it (its allocator, scheduler, sequences and graphs)
    # the attention window in positions (a model constant, e.g. Moshi's `context`): the token at
    # position p sees keys p - window + 1 .. p (attention/metadata.py); None: every earlier key.
    # With a window, a sequence's pages behind it are freed as it advances (engine/scheduler.py:
    # sliding windows), it skips the prefix cache, and speculative decoding is refused.
    window: int | None = None
    states: dict[str, S]  # rid -> the adapter's per-request state

    def bind(self, stage: Stage) -> None:
        self.stage = stage

    def on_admit(self, req: Request) -> None:
        """At admission, before any step: host-side work on the request's own inputs (media
        encoding, positions). May raise OmnivoxError: the request then fails at admission."""

    @abstractmethod
    def start(self, req: Request) -> Seq | None:
        """The request's sequence once its inputs exist (None: not yet). May raise OmnivoxError."""

    def can_start(self, req: Request) -> bool:
        """Would `start` do something now (a sequence, or the request's end)? A waiting request
        that cannot start is no work: the engine sleeps instead of retrying it (default: yes)."""
        return True

    def prepare_step(self) -> Failures:
        """Before scheduling: take inputs that became known (default: nothing); returns the
        requests that failed in doing so."""
        return []

    def inputs_arrived(self) -> bool:
        """Would `prepare_step` make a waiting sequence ready now? (default: no)"""
        return False

    def done(self, req: Request) -> bool:
        st = self.states.get(req.rid)
        return st is not None and st.done

    def forget(self, req: Request) -> None:
        """Drop the adapter's per-request state (the stage frees the pages)."""
        self.states.pop(req.rid, None)

    def max_len(self) -> int:
        """The most tokens a sequence can hold (its block-table width under CUDA graphs, unless a
        `window` bounds that)."""
        return self.stage.alloc.num_blocks * self.stage.cfg.block_size

    def prefix_limit(self, seq: Seq, blocks: int) -> int:
        """How many cached prefix blocks `seq` may take (default: all)."""
        return blocks

    def stats(self) -> dict[str, StageStats]:
        return {}
