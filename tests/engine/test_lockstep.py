"""Lockstep streams (issue 37): a stage that declares `reads_open_stream` takes a request's open
prompt stream step by step and emits output while the stream stays open: one frame in, one step
out. A tiny duplex-like stage (it answers each input frame with one output frame) in a graph of its
own, stepped on a ManualClock: each frame appended before a step is answered by that step, the
request stays in flight while its stream is open, and it finishes once the stream is closed."""
from __future__ import annotations

import torch

from omnivox.engine.clock import ManualClock
from omnivox.engine.events import Finished, StageStats, TextDelta
from omnivox.engine.graph import StageGraph
from omnivox.engine.prompt import PromptStream
from omnivox.engine.request import Request
from omnivox.engine.stage import Failures, Stage


class Duplex(Stage):
    """Answers every input frame (a segment's ids) with one output frame (their sum), at once."""
    name = "duplex"
    reads_open_stream = True
    device = torch.device("cpu")

    def __init__(self):
        self.reqs: dict[str, Request] = {}
        self.closed: set[str] = set()

    def admit(self, req):
        self.reqs[req.rid] = req

    def has_work(self):
        return any(r.stream.pending() for r in self.reqs.values())

    def step(self) -> Failures:
        for req in self.reqs.values():
            segs, closed = req.stream.take()
            for seg in segs:
                if seg.ids:
                    req.emit_text(str(sum(seg.ids)), list(seg.ids))
            if closed:
                self.closed.add(req.rid)
        return []

    def done(self, req):
        return req.rid in self.closed

    def remove(self, req):
        self.reqs.pop(req.rid, None)

    def stats(self):
        return {self.name: StageStats()}


def test_one_frame_in_one_step_out_while_the_stream_stays_open():
    def factory(prompt, options, **fields):
        return Request(**fields, route=("duplex",), stream=prompt)

    graph = StageGraph([Duplex()], factory)
    graph.set_clock(ManualClock())
    stream, events = PromptStream(), []
    req = graph.new_request(stream, None, request_id="call")
    req.push = events.append
    graph.admit(req, gate=False)
    for k in range(5):  # 80 ms frames of a call: each answered by the step after it arrived
        assert not graph.has_work()
        stream.append([k, 10 * k])
        assert graph.has_work()
        assert graph.step() == []  # still in flight: the stream is open
        assert [e.text for e in events if isinstance(e, TextDelta)] == [str(11 * i) for i in range(k + 1)]
        assert req.listening and "call" in graph.active
    stream.close()
    assert graph.step() == [req]
    req.finish()
    assert isinstance(events[-1], Finished) and not graph.active
