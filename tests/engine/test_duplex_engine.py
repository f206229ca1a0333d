"""Moshi's duplex sessions on the engine (`MoshiServed.open_duplex`, the `DuplexModel` contract of
`omnivox/serving_duplex.py`) on the built-in demo: one AudioChunk of one frame per output frame, a
TextDelta per non-padding text token, the session's end; its length limit; refusals; and sampled
text drawn from moshi's distribution (softmax(logits / temp_text) over the top k) across seeds."""
from __future__ import annotations

import math
import time
from collections import Counter

import numpy as np
import pytest
import torch

from omnivox import Duplex
from omnivox.engine.clock import Clock, ManualClock
from omnivox.engine.config import EngineConfig
from omnivox.engine.events import AudioChunk, Finished, TextDelta
from omnivox.errors import InputError, Overloaded
from omnivox.engine.prompt import PromptStream
from omnivox.engine.request import FrameStream
from omnivox.engine.slack import Slack, SlackTable
from omnivox.models.moshi.served import MoshiServed, SessionInput
from omnivox.models.moshi.stages.graph import served_graph
from omnivox.models.moshi.stages.request import DuplexRequest
from omnivox.serving import SpeechParams
from omnivox.serving_duplex import DuplexModel, DuplexParams

F = 1920


@pytest.fixture(scope="module")
def served():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # 4 sessions at once (their windows' pages); fifo: no admission by frame deadline (these sessions
    # send faster than real time, on a loaded machine: the slack gate is tested on its own below)
    m = MoshiServed(engine_config=EngineConfig(max_running=32, kv_cache_mb=16, scheduling="fifo"))
    yield m
    m.close()
    torch.set_num_threads(threads)


def _pcm(frames: float, seed: int = 0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(int(frames * F))).astype(np.float32)


def test_a_session_streams_one_frame_out_per_frame_in(served):
    assert isinstance(served, DuplexModel) and served.frame_size == F and served.frame_rate == 12.5
    pcm = _pcm(5.5)  # 6 frames, the last zero-padded
    handle, audio_in = served.open_duplex(DuplexParams(greedy=True))
    for start in range(0, pcm.size, 1000):  # pieces that are not whole frames
        audio_in.push(pcm[start:start + 1000])
    audio_in.close()
    audio_in.close()  # idempotent
    events = list(handle)
    fin = events[-1]
    assert isinstance(fin, Finished) and fin.finish_reason == "stop", fin
    chunks = [e for e in events if isinstance(e, AudioChunk)]
    assert len(chunks) == 5 and all(c.frames == 1 and c.samples.shape == (F,) for c in chunks)  # 6 in, max_delay 1
    texts = [e for e in events if isinstance(e, TextDelta)]
    pieces = [served.tokenizer.piece(t) for t in fin.text_ids]
    assert [t.text for t in texts] == [p for p in pieces if p] and fin.text == "".join(pieces)
    # the same session given whole, offline (Duplex.converse: the same path, other pushes)
    out = Duplex().converse(pcm, greedy=True)
    assert np.array_equal(out.tokens, np.concatenate([np.array(fin.text_ids)[:, None], fin.codes], axis=1))
    np.testing.assert_array_equal(out.audio, np.concatenate([c.samples for c in chunks]))


def test_max_seconds_ends_the_session_with_length(served):
    handle, audio_in = served.open_duplex(DuplexParams(greedy=True, max_seconds=3 / 12.5))
    audio_in.push(_pcm(6))
    fin = handle.collect()[0]
    assert fin.finish_reason == "length" and len(fin.codes) == 2
    with pytest.raises(InputError, match="ended|closed"):
        audio_in.push(_pcm(1))


def test_refusals_are_one_line(served):
    handle, audio_in = served.open_duplex(DuplexParams(greedy=True))
    for bad, match in ((np.zeros((2, F)), "1-D"), (np.array([np.nan]), "NaN")):
        with pytest.raises(InputError, match=match):
            audio_in.push(bad)
    audio_in.close()
    assert handle.collect()[0].finish_reason == "stop"  # a session of no audio ends (and leaves its place)
    with pytest.raises(InputError, match="over this model's session limit"):
        served.check_duplex(DuplexParams(max_seconds=served.max_session_seconds + 1))
    with pytest.raises(InputError, match="full duplex"):
        served.speech("hello", SpeechParams())


def test_sessions_beyond_what_runs_at_once_are_refused(served):
    """A live session cannot wait in a queue: beyond `max_sessions` (the pages of that many
    windows) open_duplex is refused, and a place frees when a session ends."""
    pages = served.engine.stages.stages["lm"].alloc.num_blocks
    assert served.max_sessions == pages // served.session_pages == 4 < served.engine_config.max_running
    opened = [served.open_duplex(DuplexParams(greedy=True)) for _ in range(served.max_sessions)]
    with pytest.raises(Overloaded, match="at once"):
        served.open_duplex(DuplexParams(greedy=True))
    handle, audio_in = opened[0]
    audio_in.close()
    handle.collect()
    opened[0] = served.open_duplex(DuplexParams(greedy=True))
    for handle, audio_in in opened:
        audio_in.push(_pcm(1))
        audio_in.close()
        assert handle.collect()[0].finish_reason == "stop"


def test_sampled_text_follows_moshi_distribution(served):
    """Frame 1's text token is what step 0 drew; step 0's input is every stream's initial token, so
    its text logits are fixed: over 400 seeds the draws follow softmax(logits / temp_text) over
    the top k, and nothing outside it is drawn."""
    lm, cfg = served.lm, served.cfg
    init = torch.tensor([[cfg.text_card] + [cfg.card] * cfg.n_q])

    class One:  # attention over a single key is its value
        def attend(self, layer, q, k, v):
            return v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)

    with torch.no_grad():
        logits = lm.text_linear(lm.temporal(init, torch.zeros(1, dtype=torch.long), One()))[0, 0].float()
    temp, k, n = 1.0, 5, 400
    top = torch.topk(logits, k).indices
    want = dict(zip(top.tolist(), torch.softmax(logits[top] / temp, dim=0).tolist()))
    draws = []
    for wave in range(0, n, served.max_sessions):  # as many sessions at once as the server runs
        sessions = []
        for seed in range(wave, min(n, wave + served.max_sessions)):
            handle, audio_in = served.open_duplex(DuplexParams(seed=seed, temp_text=temp, top_k_text=k))
            audio_in.push(_pcm(2, seed))
            audio_in.close()
            sessions.append(handle)
        draws += [h.collect()[0].text_ids[0] for h in sessions]
    freq = Counter(draws)
    assert set(freq) <= set(want)
    worst = max(abs(freq[t] / n - p) for t, p in want.items())
    assert worst < 0.08, (freq, want)  # over 3 sigma at n = 400 (the draws are deterministic per seed)


def test_each_frame_is_due_a_frame_after_its_input_frame_arrived(served):
    """`AudioChunk.due` = the arrival (on the graph's clock, stamped as `SessionInput` sends the
    frame) of the input frame whose step makes it (frame j + the LM's max_delay) + one frame; the
    zero-padded last frame arrives at close. The graph is stepped here, on a ManualClock."""
    graph = served_graph(served, served.engine_config)
    graph.set_clock(clock := ManualClock(100.0))
    req = graph.new_request(None, served._options(DuplexParams(greedy=True)), stream=PromptStream())
    events = []
    req.push = events.append
    graph.admit(req, gate=False)
    audio_in = SessionInput(req, F, served._options)
    pcm, sent = _pcm(4.5), []
    for k, piece in enumerate(np.split(pcm, [1500, 2500, 3000, 5760, 7000])):  # frames end inside pieces
        clock.advance(0.03 + 0.01 * k)
        audio_in.push(piece)
        sent += [clock.now()] * (len(req.arrivals) - len(sent))  # the frames this push completed
        graph.step()
    clock.advance(0.5)
    audio_in.close()  # the last half frame, zero-padded, arrives now
    sent.append(clock.now())
    while not graph.step():
        clock.advance(0.01)
    assert req.arrivals == sent and len(sent) == 5
    chunks = [e for e in events if isinstance(e, AudioChunk)]
    delay, frame_s = served.cfg.max_delay, F / served.sample_rate
    assert delay == 1 and len(chunks) == len(sent) - delay
    assert [c.due for c in chunks] == [sent[j + delay] + frame_s for j in range(len(chunks))]
    assert all(c.time >= c.due - frame_s for c in chunks)  # made after its input frame came


STAGE_S = 0.02  # each stage's step on the ManualClock below: a session alone gets its frame within 0.9 x 80 ms


def _until(check, what: str, bound_s: float = 60.0) -> None:
    deadline = time.monotonic() + bound_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.mark.parametrize("scheduling", ["slack", "fifo"])
def test_admission_by_frame_deadline(served, scheduling, monkeypatch):
    """The engine's graph on a ManualClock that each stage's step moves by STAGE_S: one session
    sending 16 frames gets each frame 2 x STAGE_S after the previous (the first after 4), 40-80 ms;
    a second row would make a frame wait for a step in progress and then its own, over 80 ms.
    Under slack, `open_duplex` refuses the second session (Overloaded), leaving nothing behind, and
    the first goes on; under fifo it is admitted (only the KV bound gates)."""
    engine, graph = served.engine, served.engine.stages
    clock = ManualClock(1000.0)
    with engine._lock:  # the engine thread is idle (no request): it reads neither
        assert not graph.active
        graph.set_clock(clock)
        graph.set_scheduling(scheduling)
    for stage in graph.stages.values():
        def step(real=stage.step):
            clock.advance(STAGE_S)
            return real()
        monkeypatch.setattr(stage, "step", step)
    pages = graph.stages["lm"].alloc
    try:
        handle, audio_in = served.open_duplex(DuplexParams(greedy=True))  # the first is always admitted
        _until(lambda: handle.request_id in graph.active, "the first session's admission")
        req = graph.active[handle.request_id]
        audio_in.push(_pcm(16))
        _until(lambda: req.audio_frames == 15, "the first session's frames")
        if scheduling == "slack":
            assert graph.table.live.capacity == 1 and 0.04 < graph.table.live.measured_latency < 0.9 * 0.08
            assert engine.stats().live_capacity == 1  # what /metrics shows (omnivox_live_sessions_capacity)
            with pytest.raises(Overloaded, match="live sessions"):
                served.open_duplex(DuplexParams(greedy=True), request_id="second")
            assert list(graph.active) == [req.rid] and engine.stats().in_flight == 1  # nothing left behind
            second = None
        else:
            assert engine.stats().live_capacity is None
            second = served.open_duplex(DuplexParams(greedy=True), request_id="second")
            second[1].push(_pcm(2))
            second[1].close()
            assert second[0].collect()[0].finish_reason == "stop"
        audio_in.push(_pcm(3))  # the running session goes on
        audio_in.close()
        fin = handle.collect()[0]
        assert fin.finish_reason == "stop" and len(fin.codes) == 18
        _until(lambda: engine.stats().in_flight == 0, "the sessions' end")
        assert pages.num_free == pages.num_blocks and not graph.active
    finally:
        with engine._lock:
            graph.set_scheduling(served.engine_config.scheduling)
            graph.set_clock(Clock())


def test_a_live_session_is_urgent_by_its_waiting_frame():
    """Under slack a live session's slack is its waiting frame's deadline less now (none waiting:
    inf); it is never ahead, so it never yields, and it presses once that deadline is nearer than
    a step and the margin (here no stage is measured: the margin, 40 ms)."""
    req = DuplexRequest(rid="s", order=0, sample_rate=24000, clock=ManualClock(), playing=True,
                        stream=PromptStream(), frames=FrameStream(8), delay=1, frame_s=0.08, arrivals=[10.0])
    table = SlackTable(ttfa_target_s=1.0, stream_lead_s=1.0)
    table.requests[req.rid] = req
    policy = Slack(table)
    assert req.live and policy.urgency(req, 10.05) == math.inf and not table._pressed(10.05)  # waits on its user
    req.arrivals.append(10.08)  # input frame 1 makes output frame 0: due at 10.16
    assert policy.urgency(req, 10.1) == pytest.approx(0.06) and not table._pressed(10.1)
    assert table._pressed(10.13) and table._batch_yields(10.13) and not policy.yields(req, 10.13)
    req.frames.append([0] * 8)  # frame 0 made: frame 1 waits for input frame 2
    assert policy.urgency(req, 10.13) == math.inf
