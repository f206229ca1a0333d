"""A paged AR stage's admission of streamed prompts (`engine.prompt.PromptStream`, as the route's
encoder stage passes it on: `Request.encoded`), family-neutral:
a request whose prompt still grows (realtime input) has its sequence parked (computed, never
sampled) while the stream is open; before each step what the stream brought is absorbed, so at the
end of speech only the tail is left to prefill.

An adapter mixes `StreamedPromptAdmission` in ahead of `ARAdapter`. Its per-request states extend
`StreamedState`: `closed` is False while the stream may still grow (the adapter sets it False and
calls `absorb` when a streamed request is prepared); their `req` is a `StreamedRequest`. The adapter
supplies `context` (the model's length limit; None or 0: none) and `absorb_rows`: the family's
input rows and positions for a segment. The mixin does the rest: taking segments, the length
limit, the prompt's ids and the sequence's length, token budget and prefix keys."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from omnivox.engine.prompt import PromptStream, Segment
from omnivox.engine.stage import Failures
from omnivox.errors import ContextTooLong, InputError
from omnivox.stages.admission import ARAdmission, SeqState


class StreamedPrompt(Protocol):
    ids: list[int]  # the prompt so far: the stream's segments extend it


class StreamedRequest(Protocol):
    """What the mixin reads of a request (`engine.request.Request` with a family's prompt)."""

    encoded: PromptStream | None  # the prompt stream after the encoder stage (`stages/encoder.py`)
    prompt: StreamedPrompt


@dataclass(eq=False)
class StreamedState(SeqState):
    req: StreamedRequest
    closed: bool = field(default=True, kw_only=True)  # False while a streamed prompt may still grow


T = TypeVar("T", bound=StreamedState)


class StreamedPromptAdmission(ARAdmission[T]):
    context: int | None  # the model's length limit (None or 0: none)

    def inputs_arrived(self) -> bool:
        return any(not st.closed and st.req.encoded.pending() for st in self.states.values())

    def prepare_step(self) -> Failures:
        failures: Failures = []
        for st in self.states.values():
            if not st.closed:
                try:
                    self.absorb(st)
                except InputError as e:
                    failures.append((st.req, e))
        return failures

    def absorb(self, st: T) -> None:
        """Append what the stream brought since the last step to the request's prompt and its
        sequence (ready to compute it; parked while the stream stays open). Raises InputError."""
        req, seq = st.req, st.seq
        segs, st.closed = req.encoded.take()
        seq.parked = not st.closed
        for seg in (s for s in segs if s.ids):
            self.check_segment(seg)
            n, P = len(seg.ids), len(req.prompt.ids)
            if self.context and P + n + 1 > self.context:
                raise ContextTooLong(f"the conversation reached {P + n} tokens; the model's context is {self.context}")
            self.absorb_rows(st, seg)
            req.prompt.ids.extend(seg.ids)
            seq.num_tokens += n
            seq.max_tokens += n
            seq.extend_keys(list(seg.keys) if seg.keys is not None else list(seg.ids))

    def check_segment(self, seg: Segment) -> None:
        """Raise InputError for a segment the family cannot take (default: every one is fine)."""

    def absorb_rows(self, st: T, seg: Segment) -> None:
        """The family's part: `seg`'s input rows and positions, appended after the prompt's
        current ids (`st.req.prompt.ids` does not hold `seg.ids` yet)."""
        raise NotImplementedError
