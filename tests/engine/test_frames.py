"""The speech AR stages' shared frame bookkeeping (stages/frames.py), on made-up draws: what each
kind of draw does to its request, its row's accepted count and the step's result."""
from __future__ import annotations

from types import SimpleNamespace

from omnivox.sampling.batched import SamplingError
from omnivox.stages.frames import SpeechARAdapter
from omnivox.stages.step import Row, StepBatch

EOS = 99


class Frames(list):
    final = False


class Adapter(SpeechARAdapter):
    def __init__(self, budgets: dict[str, int]):
        self.budgets, self.ended = budgets, {}

    def frame_budget(self, req) -> int:
        return self.budgets[req.rid]

    def end_frames(self, req, reason: str) -> None:
        self.ended[req.rid] = reason
        req.frames.final = True

    def start(self, req):
        raise NotImplementedError

    def inputs(self, batch):
        raise NotImplementedError

    def compute(self, inputs, ctx):
        raise NotImplementedError

    def apply(self, batch, out):
        raise NotImplementedError


def _row(rid: str) -> Row:
    return Row(SimpleNamespace(rid=rid, frames=Frames()), seq=None, start=0, n=1)


def test_take_frames_applies_each_kind_of_draw():
    names = ["prefill", "ends", "spent", "bad_code", "bad_first", "goes_on"]
    rows = [_row(n) for n in names]
    adapter = Adapter({"ends": 5, "spent": 1, "bad_code": 5, "bad_first": 5, "goes_on": 5})
    draws = [(EOS, [EOS, -1, -1]), (3, [3, 4, 5]), (6, [6, -1, 7]), (-1, [-1, 1, 2]), (8, [8, 9, 10])]
    batch = StepBatch(rows, sampled=[1, 2, 3, 4, 5], meta=None)

    result, going = adapter.take_frames(batch, draws, EOS, "the test's logits")

    assert result.accepted == [0, 1, 1, 0, 0, 1]
    assert [r.rid for r in result.finished] == ["ends", "spent"]
    assert adapter.ended == {"ends": "stop", "spent": "length"}
    assert [req.rid for req, _ in result.failures] == ["bad_code", "bad_first"]
    assert all(isinstance(e, SamplingError) and "the test's logits" in str(e) for _, e in result.failures)
    by_name = {r.req.rid: r.req.frames for r in rows}
    assert by_name["ends"] == [] and by_name["ends"].final  # the end token is no frame
    assert by_name["spent"] == [[3, 4, 5]] and by_name["spent"].final
    assert by_name["bad_code"] == [] and by_name["bad_first"] == [] and not by_name["bad_code"].final
    assert [(j, row.req.rid, frame) for j, row, frame in going] == [(4, "goes_on", [8, 9, 10])]
    assert by_name["goes_on"] == [[8, 9, 10]] and not by_name["goes_on"].final
