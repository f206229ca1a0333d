"""Streaming-aware scheduling (`engine/slack.py`) on a simulated clock: the demo model's real stage
graph, driven step by step, with time moved by a cost model of each stage's step (fixed + per
token + per row), so every scenario plays the same on any machine. Each scenario runs under
`slack` and under `fifo`: slack keeps the streams gap-free where fifo stalls them."""
from __future__ import annotations

import itertools
import math

import pytest

from omnivox.engine.clock import ManualClock
from omnivox.engine.config import EngineConfig
from omnivox.api.metrics import ServerMetrics
from omnivox.engine.events import AudioChunk, EngineStats, Failed, Finished
from omnivox.engine.playback import PlaybackClock
from omnivox.engine.slack import HEADROOM, SlackTable, StepCost
from omnivox.models.qwen3_omni.bench import prompts
from omnivox.models.qwen3_omni.stages.graph import build as build_graph
from omnivox.serving import ChatParams

# seconds per step of each stage: (fixed, per input token, per row); a 80 ms frame
LIGHT = {"thinker": (0.002, 0.0002, 0.0005), "talker": (0.004, 0.0001, 0.001), "vocoder": (0.002, 0.0, 0.0005)}


class Sim:
    """The demo's stage graph on a ManualClock that each stage's step moves by its modelled cost."""

    def __init__(self, omni, policy: str, cost: dict = LIGHT, **cfg):
        cfg = EngineConfig(scheduling=policy, max_running=32, **cfg)
        self.omni, self.cost = omni, cost
        self.graph = build_graph(omni.model, cfg, omni.tokenizer, omni.suppressed_ids)
        self.clock = ManualClock(1000.0)
        self.graph.set_clock(self.clock)
        self.graph.set_scheduling(policy, cfg.stream_lead_s, cfg.ttfa_target_s)
        self.events: dict[str, list] = {}
        self.frames_per_step: dict[str, list[int]] = {}  # rid -> its frame count after each step
        self.batches: list[tuple[str, int, int]] = []  # (stage, tokens, rows) of every stage step, in order
        self._ids = itertools.count()
        for stage in self.graph.stages.values():
            stage.step = self._timed(stage)

    def _timed(self, stage):
        real = stage.step

        def step():
            out = real()
            tokens, rows = stage.last_step
            fixed, per_token, per_row = self.cost[stage.name]
            self.batches.append((stage.name, tokens, rows))
            if rows:
                self.clock.advance(fixed + per_token * tokens + per_row * rows)
            return out
        return step

    def submit(self, length: int, frames: int, tokens: int = 8, speak: bool = True, playing: bool = True) -> str:
        """A request; `playing`: a listener plays its audio as it streams (else batch work)."""
        rid = f"r{next(self._ids)}"
        ids = prompts(self.omni.cfg, 1, length, seed=len(self.events), tokenizer=self.omni.tokenizer)[0]
        opts = self.omni.options(ChatParams(greedy=True, ignore_eos=True, max_tokens=tokens, max_frames=frames,
                                            return_audio=speak, playing=playing))
        self.events[rid] = []
        self.frames_per_step[rid] = []
        req = self.graph.new_request(self.omni.build_prompt(prompt_ids=ids), opts, request_id=rid)
        req.push = self.events[rid].append
        self.graph.admit(req)
        return rid

    def step(self) -> None:
        if self.graph.has_work():
            for req in self.graph.step():
                req.finish()
        else:  # every stream yields: sleep until the first is due, as the engine does
            due = self.graph.next_due()
            assert due is not None, "no work, nothing due, requests in flight: a stuck graph"
            self.clock.advance(max(1e-3, due - self.clock.now()))
        for rid, req in self.graph.active.items():
            self.frames_per_step[rid].append(len(req.frames))

    def run_until(self, cond, limit: int = 3000) -> None:
        for _ in range(limit):
            if cond():
                return
            self.step()
        raise AssertionError("the scenario did not reach its state in time")

    def done(self) -> bool:
        return not self.graph.active

    def audio(self, rid: str) -> list[AudioChunk]:
        return [e for e in self.events[rid] if isinstance(e, AudioChunk)]

    def playback(self, rid: str) -> PlaybackClock:
        return PlaybackClock.replay((ev.time, ev.samples.shape[0] / ev.sample_rate) for ev in self.audio(rid))

    def finished(self, rid: str) -> Finished:
        final = self.events[rid][-1]
        assert isinstance(final, Finished), final
        return final


@pytest.fixture(scope="module")
def omni(demo_omni):
    return demo_omni


def test_a_long_prefill_arriving_while_eight_streams_play_stalls_none_of_them(omni):
    """Eight streams start; the moment all of them play, a 1500-token prompt arrives. fifo computes
    it in token-budget chunks (512 tokens: a step longer than the streams' first chunks), so
    streams stall; slack chunks it to fit the smallest slack, and no stream stalls."""
    stalled = {}
    for policy in ("fifo", "slack"):
        sim = Sim(omni, policy)
        streams = [sim.submit(32, frames=20) for _ in range(8)]
        sim.run_until(lambda: all(sim.audio(r) for r in streams))
        long = sim.submit(1500, frames=0, tokens=2, speak=False)
        sim.run_until(sim.done)
        assert isinstance(sim.events[long][-1], Finished)
        stalled[policy] = {r: round(sim.playback(r).stall_s, 4) for r in streams if not sim.playback(r).gap_free}
        assert all(sim.finished(r).codes.shape[0] == 20 for r in streams)
    assert stalled["fifo"], "the scenario must stall fifo, or it shows nothing"
    assert stalled["slack"] == {}, stalled


def test_a_stream_far_ahead_yields_to_one_that_starts(omni):
    """One stream runs alone until it is `stream_lead_s` ahead of its listener; then a second one
    arrives. Under slack the first makes no frame while it is ahead and the second has no audio
    yet (it yields those steps); under fifo it makes one every step. Both end complete."""
    for policy in ("fifo", "slack"):
        sim = Sim(omni, policy, stream_lead_s=0.5)
        a = sim.submit(32, frames=40)
        req_a = sim.graph.active[a]
        sim.run_until(lambda: sim.graph.table.lead(req_a, sim.clock.now()) >= 0.5)
        b = sim.submit(32, frames=10)
        before = len(req_a.frames)
        sim.run_until(lambda: bool(sim.audio(b)))
        made = len(req_a.frames) - before
        steps = len(sim.frames_per_step[b])
        if policy == "slack":
            assert made == 0, f"a stream {sim.graph.table.stream_lead_s} s ahead made {made} frames while another started"
        else:
            assert made == steps >= 1, (made, steps)
        sim.run_until(sim.done)
        assert sim.finished(a).codes.shape[0] == 40 and sim.finished(b).codes.shape[0] == 10
        assert sim.playback(a).gap_free


def test_admission_keeps_new_requests_waiting_instead_of_stalling_the_admitted(omni):
    """Sixteen streams at once where a step costs 9 ms + 6 ms per stream (about ten streams of 80 ms
    frames fit): fifo runs all sixteen, every step outlasts a frame and streams stall; slack
    starts only what it can serve in time, queues the rest (they wait, then play), and every
    stream is gap-free."""
    heavy = {"thinker": (0.002, 0.0001, 0.0005), "talker": (0.005, 0.0001, 0.004), "vocoder": (0.002, 0.0, 0.0015)}
    for policy in ("fifo", "slack"):
        sim = Sim(omni, policy, cost=heavy)
        streams = [sim.submit(32, frames=24) for _ in range(16)]
        most = 0
        while not sim.done():
            sim.step()
            most = max(most, sum(1 for r in sim.graph.active.values() if r not in sim.graph.queued))
        gap_free = [sim.playback(r).gap_free for r in streams]
        assert all(sim.finished(r).codes.shape[0] == 24 for r in streams)
        if policy == "fifo":
            assert most == 16 and sum(gap_free) <= 4, (most, gap_free)
        else:
            fit = (HEADROOM * 0.08 - 0.009) / 0.006
            assert most <= math.ceil(fit) + 1, (most, fit)
            assert all(gap_free), gap_free
            assert sim.graph.table.step_s <= 0.08


def test_requests_that_cannot_fit_fail_from_the_queue_without_blocking_it(omni):
    """A queued request whose admission fails (too long for the KV cache) fails alone; the one
    queued behind it still starts and finishes."""
    sim = Sim(omni, "slack", cost={"thinker": (0.002, 0.0001, 0.0005), "talker": (0.005, 0.0001, 0.004),
                                   "vocoder": (0.002, 0.0, 0.0015)}, kv_cache_mb=2)
    first = [sim.submit(32, frames=24) for _ in range(16)]
    sim.run_until(lambda: bool(sim.graph.queued))
    big = sim.submit(3000, frames=4)
    after = sim.submit(32, frames=4)
    sim.run_until(sim.done)
    assert isinstance(sim.events[big][-1], Failed) and sim.events[big][-1].status == 413
    assert sim.finished(after).codes.shape[0] == 4
    assert all(sim.finished(r).codes.shape[0] == 24 for r in first)


# ---- the parts, alone ---------------------------------------------------------------------------
def test_playback_stalls_resume_and_add_up_the_silence():
    clock = PlaybackClock()
    assert clock.slack(5.0) == math.inf and not clock.on_chunk(0.5, 10.0)
    assert clock.slack(10.2) == pytest.approx(0.3)
    assert not clock.on_chunk(0.5, 10.5)  # exactly as the first ran out: on time
    assert clock.on_chunk(0.5, 11.3)  # 0.3 s late: a stall; playback resumes with this chunk
    assert clock.stall_s == pytest.approx(0.3) and clock.underruns == 1
    assert clock.slack(11.5) == pytest.approx(0.3)  # the resumed playback, not the first one
    assert not clock.on_chunk(0.5, 11.7) and not clock.gap_free


def test_step_cost_fits_decode_rows_and_prefill_tokens():
    cost = StepCost()
    assert cost.predict(4, 4) is None
    for rows in (1, 2, 3, 4, 6, 8, 12, 16):
        cost.observe(rows, rows, 0.010 + 0.002 * rows)
    assert cost.predict(32, 32) == pytest.approx(0.074)
    cost.observe(8 + 100, 8, 0.026 + 100 * 0.0003)
    assert cost.per_token() == pytest.approx(0.0003)
    flat = StepCost()
    for _ in range(8):
        flat.observe(4, 4, 0.02)
    assert flat.predict(5, 5) == pytest.approx(0.02)  # one batch size seen: growth measured, not guessed


def test_slack_before_first_audio_counts_against_the_ttfa_target(omni):
    sim = Sim(omni, "slack", ttfa_target_s=0.5)
    rid = sim.submit(32, frames=4)
    req, table = sim.graph.active[rid], sim.graph.table
    assert isinstance(table, SlackTable)
    sim.clock.advance(0.2)
    assert table.slack(req, sim.clock.now()) == pytest.approx(0.3)
    sim.run_until(lambda: bool(sim.audio(rid)))
    first = sim.audio(rid)[0]
    assert table.slack(req, first.time) == pytest.approx(first.samples.shape[0] / first.sample_rate)
    sim.run_until(sim.done)


def test_s2_streams_under_slack_are_the_same_as_under_fifo():
    """The policy decides when rows step, never what they compute: seeded S2 requests at once
    give the same codes under both policies (S2's slow AR and vocoder read the table too), and as
    much audio. (The audio's floats differ by up to ~1e-3 on the random demo codec, as under fifo
    alone when the vocoder batches other rows together; Qwen3-Omni's audio under slack is checked
    against offline in tests/api/test_slack_serving.py.)"""
    import numpy as np

    from omnivox import FishTTS

    outs = {}
    for policy in ("fifo", "slack"):
        t = FishTTS(progress=False, engine_config=EngineConfig(scheduling=policy, stream_lead_s=0.2))
        try:
            handles = [t.submit(f"Sentence number {i} of the test.", seed=i, max_frames=12, playing=True)
                       for i in range(4)]
            outs[policy] = [[ev for ev in h] for h in handles]
        finally:
            t.close()
    for a, b in zip(outs["fifo"], outs["slack"]):
        fa, fb = a[-1], b[-1]
        assert isinstance(fa, Finished) and isinstance(fb, Finished)
        assert np.array_equal(fa.codes, fb.codes) and fa.codes.shape[0] > 0
        audio = lambda evs: np.concatenate([e.samples for e in evs if isinstance(e, AudioChunk)])  # noqa: E731
        assert audio(a).shape == audio(b).shape


# ---- batch work (no listener) beside playing streams -------------------------------------------
HEAVY = {"thinker": (0.002, 0.0001, 0.0005), "talker": (0.005, 0.0001, 0.02), "vocoder": (0.002, 0.0, 0.0015)}


def test_with_no_playing_stream_a_batch_set_steps_exactly_as_under_fifo(omni):
    """Four speaking requests nobody plays (an offline batch) and a text-only one, on a machine
    where four streams would outrun real time: slack steps them exactly as fifo does, the same
    batches of the same tokens in every stage step (all four at once: no capacity gate, no
    pacing), and they make the same codes and text."""
    runs = {}
    for policy in ("fifo", "slack"):
        sim = Sim(omni, policy, cost=HEAVY)
        rids = [sim.submit(24 + 4 * i, frames=3 + i % 2, tokens=3, playing=False) for i in range(4)]
        rids.append(sim.submit(40, frames=0, tokens=4, speak=False))
        sim.run_until(sim.done)
        runs[policy] = sim.batches, [(sim.finished(r).text_ids, sim.finished(r).codes.tolist()) for r in rids]
    assert runs["slack"][0] == runs["fifo"][0]
    assert max(rows for name, _, rows in runs["fifo"][0] if name == "talker") == 4
    assert runs["slack"][1] == runs["fifo"][1]


def test_batch_rows_yield_while_playing_streams_need_the_time(omni):
    """Two streams play; two batch requests arrive. With all four stepping, a step outlasts a
    frame (80 ms): fifo stalls the streams. Slack steps the batch rows only while every stream has
    enough audio buffered: in each step the policy made them yield, no batch row that was decoding
    made a frame; they still run beside the streams in the time left, and finish; the streams are
    gap-free; every request makes the same codes under both policies."""
    codes, stalled = {}, {}
    for policy in ("fifo", "slack"):
        sim = Sim(omni, policy, cost=HEAVY, stream_lead_s=0.4, first_chunk_frames=2)
        streams = [sim.submit(32, frames=20) for _ in range(2)]
        sim.run_until(lambda: all(sim.audio(r) for r in streams))
        batch = [sim.submit(32, frames=8, playing=False) for _ in range(2)]
        reqs = {r: sim.graph.active[r] for r in batch}
        if policy == "slack":  # /metrics shows both kinds
            stats = EngineStats()
            sim.graph.fill_stats(stats)
            assert stats.running_by_kind == {"playing": 2, "batch": 0} and stats.waiting_by_kind["batch"] == 2
            text = ServerMetrics().render(stats)
            assert 'omnivox_requests_running{kind="playing"} 2' in text.splitlines()
            assert 'omnivox_requests_waiting{kind="batch"} 2' in text.splitlines()
        yielded = alongside = 0
        while not sim.done():
            before = {r: len(q.frames) for r, q in reqs.items()}
            playing = any(not sim.graph.active[r].frames.final for r in streams if r in sim.graph.active)
            sim.step()
            made = {r: len(q.frames) - before[r] for r, q in reqs.items()}
            if policy == "slack" and sim.graph.table.batch_yields:
                yielded += 1
                assert not any(made[r] for r in batch if before[r] > 0), made
            alongside += playing and any(made.values())
        stalled[policy] = sum(not sim.playback(r).gap_free for r in streams)
        codes[policy] = [sim.finished(r).codes.tolist() for r in streams + batch]
        assert all(sim.finished(r).codes.shape[0] == 8 for r in batch)
        if policy == "slack":
            assert yielded > 0 and alongside > 0, (yielded, alongside)
    assert stalled["fifo"] > 0, "the scenario must stall fifo, or it shows nothing"
    assert stalled["slack"] == 0
    assert codes["slack"] == codes["fifo"]
