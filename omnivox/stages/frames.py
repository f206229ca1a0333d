"""The frame bookkeeping every speech AR stage shares (Qwen3-Omni's Talker, S2's Dual-AR).

Each sampling row of a step draws a first code, which may be the stage's end token, and a frame
(every codebook's code). `SpeechARAdapter.take_frames` applies the draws in one place: a draw
with a failed sample (-1) fails its request alone; the end token ends the request's frames
("stop"); otherwise the frame is kept, and ends them once the request's frame budget is spent
("length"); the other rows go on, and the family feeds each their frame back as the next input.
"""
from __future__ import annotations

from abc import abstractmethod
from typing import Iterable

from omnivox.engine.request import Request
from omnivox.sampling.batched import SamplingError
from omnivox.stages.admission import S
from omnivox.stages.ar import ARAdapter
from omnivox.stages.step import Row, StepBatch, StepResult

Draw = tuple[int, list[int]]  # (first code or end token, the frame's codes)


class SpeechARAdapter(ARAdapter[S]):
    """An AR adapter whose rows emit codec frames into `req.frames`."""

    @abstractmethod
    def frame_budget(self, req: Request) -> int:
        """How many frames `req` may emit."""

    @abstractmethod
    def end_frames(self, req: Request, reason: str) -> None:
        """`req` emits no more frames ("stop": it drew the end token, "length": budget spent);
        mark its frames final."""

    def take_frames(self, batch: StepBatch, draws: Iterable[Draw], eos: int,
                    source: str = "the logits") -> tuple[StepResult, list[tuple[int, Row, list[int]]]]:
        """Apply the sampling rows' draws, in `batch.sampled` order -> the step's result and the
        rows that go on: (index among the sampling rows, row, the frame they emitted)."""
        result, going = StepResult.none(len(batch.rows)), []
        for j, (i, (first, frame)) in enumerate(zip(batch.sampled, draws)):
            row = batch.rows[i]
            req = row.req
            if first < 0 or (first != eos and min(frame) < 0):
                result.failures.append((req, SamplingError(f"sampling failed: {source} hold no valid distribution "
                                                           "for these sampling values")))
                continue
            result.accepted[i] = 1
            if first != eos:
                req.frames.append(frame)
                if len(req.frames) < self.frame_budget(req):
                    going.append((j, row, frame))
                    continue
            if first != eos:
                req.limit = "audio"  # the frame budget cut it (the reply's last part: it wins over "tokens")
            self.end_frames(req, "stop" if first == eos else "length")
            result.finished.append(req)
        return result, going
