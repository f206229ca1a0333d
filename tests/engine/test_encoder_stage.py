"""The encoder stage (issue 19 item 3): model work outside requests (a realtime turn's AuT, an S2
reference's codec encoding) runs on the engine thread, every pending submission in one step. Several
sessions' pushes, submitted from their own threads, are encoded by one batched step (one embed call,
one windowed-attention call) and each session's rows still equal the one-shot encoder on its clip;
a failing batch fails its callers; shutdown fails what is pending and refuses what comes after."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from omnivox.engine.config import EngineConfig
from omnivox.engine.engine import Engine
from omnivox.engine.graph import StageGraph
from omnivox.errors import Overloaded
from omnivox.models.qwen3_omni.audio_encoder import AudioEncoder
from omnivox.models.qwen3_omni.audio_stream import AudioPush, AudioStreamEncoder
from omnivox.models.qwen3_omni.config import AudioEncoderConfig
from omnivox.models.qwen3_omni.demo import TINY_CONFIG
from omnivox.models.qwen3_omni.random_init import randomize_
from omnivox.engine.encoder import EncoderAdapter


class Gate(EncoderAdapter):
    """Holds the engine thread inside a step until opened, so what is submitted meanwhile waits
    for the same next step."""

    def __init__(self):
        self.entered, self.opened = threading.Event(), threading.Event()

    def encode(self, items: list) -> list:
        self.entered.set()
        assert self.opened.wait(30)
        return items


class Calls:
    """Counts calls of an encoder method."""

    def __init__(self, encoder: AudioEncoder, name: str):
        self.n, inner = 0, getattr(encoder, name)

        def counted(*args):
            self.n += 1
            return inner(*args)
        setattr(encoder, name, counted)


@pytest.fixture(scope="module")
def encoder() -> AudioEncoder:
    """The demo model's AuT shape with seeded weights, in fp64 (round-off far below the tolerance)."""
    enc = AudioEncoder(AudioEncoderConfig.from_hf(TINY_CONFIG["thinker_config"]["audio_config"]))
    randomize_(enc.named_parameters(), seed=0)
    return enc.double().eval()


@pytest.fixture
def engine():
    e = Engine(StageGraph([], None), EngineConfig())  # no request stages: the encoder stage alone
    yield e
    e.shutdown()


def _wait_for(cond, limit: float = 30.0) -> None:
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def _in_one_step(engine: Engine, calls: list) -> list:
    """Run `calls` from threads of their own while the engine is held in a step, so all of them are
    pending at once; then let it go: its next step takes them together."""
    gate = Gate()
    held = engine.encoder.submit(gate, None)
    assert gate.entered.wait(30)
    steps = engine.encoder.batch_stats.steps
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(c) for c in calls]
        _wait_for(lambda: engine.encoder.queued() == len(calls))
        gate.opened.set()
        out = [f.result(timeout=60) for f in futures]
    held.result(timeout=30)
    assert engine.encoder.batch_stats.steps == steps + 1  # the gate's step counted before; then one
    return out


@torch.no_grad()
def test_sessions_are_encoded_in_one_batched_step(engine, encoder):
    # (frames, window in chunks): windows of 1 and 2 chunks batch together; 70 frames is a clip
    # shorter than one chunk (its flush embeds a short chunk of its own length)
    clips = [(1234, 1), (555, 2), (800, 2), (70, 1)]
    feats = [torch.randn(128, n, generator=torch.Generator().manual_seed(n), dtype=torch.float64) for n, _ in clips]
    streams = {w: AudioStreamEncoder(encoder, w, stage=engine.encoder) for w in (1, 2)}
    states = [streams[w].new_state() for _, w in clips]
    embeds, windows = Calls(encoder, "embed_chunks"), Calls(encoder, "encode_windows")
    try:
        pushed = _in_one_step(engine, [lambda i=i: streams[clips[i][1]].push(states[i], feats[i])
                                       for i in range(len(clips))])
        assert engine.encoder.batch_stats.max_batch >= len(clips)
        assert (embeds.n, windows.n) == (1, 1)  # every session's chunks; every session's complete windows
        flushed = _in_one_step(engine, [lambda i=i: streams[clips[i][1]].flush(states[i])
                                        for i in range(len(clips))])
        assert (embeds.n, windows.n) == (3, 2)  # whole-chunk tails together, the 70-frame clip alone
    finally:
        del encoder.embed_chunks, encoder.encode_windows
    for (_, w), f, a, b in zip(clips, feats, pushed, flushed):
        torch.testing.assert_close(torch.cat([a, b]), encoder([f], window_chunks=w), atol=1e-12, rtol=0)
    assert engine.stats().stages["encoder"].max_batch >= len(clips)  # what /metrics shows


def test_a_failing_batch_fails_its_callers_and_the_engine_goes_on(engine, encoder):
    class Broken(EncoderAdapter):
        def encode(self, items):
            raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        engine.encoder.encode(Broken(), 1)
    stream = AudioStreamEncoder(encoder, 1, stage=engine.encoder)
    state = stream.new_state()
    with pytest.raises(ValueError, match="log-mel"):  # refused before it is queued: it fails alone
        stream.push(state, torch.zeros(80, 100, dtype=torch.float64))
    assert stream.push(state, torch.zeros(128, 100, dtype=torch.float64)).shape == (13, 32)


def test_shutdown_fails_pending_submissions(encoder):
    engine = Engine(StageGraph([], None), EngineConfig())
    gate = Gate()
    engine.encoder.submit(gate, None)
    assert gate.entered.wait(30)
    stream = AudioStreamEncoder(encoder, 1, stage=engine.encoder)
    with ThreadPoolExecutor(3) as pool:
        waiting = [pool.submit(stream.push, stream.new_state(), torch.zeros(128, 100, dtype=torch.float64))
                   for _ in range(2)]
        _wait_for(lambda: engine.encoder.queued() == 2)
        stopping = pool.submit(engine.shutdown)
        _wait_for(lambda: engine._stop)  # asked to stop while its step still runs: the pushes stay pending
        gate.opened.set()
        stopping.result(timeout=30)
        for f in waiting:
            with pytest.raises(Overloaded, match="shutting down"):
                f.result(timeout=30)
    with pytest.raises(Overloaded, match="shutting down"):
        stream.push(stream.new_state(), torch.zeros(128, 100, dtype=torch.float64))


@torch.no_grad()
def test_a_clip_pushed_twice_in_one_step_is_encoded_in_order(encoder):
    """Two clips, one of them pushed twice and flushed within one batch: rounds keep each clip's order."""
    stream = AudioStreamEncoder(encoder, 2)
    a, b = stream.new_state(), stream.new_state()
    fa = torch.randn(128, 450, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    fb = torch.randn(128, 230, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out = stream.batch.encode([AudioPush(a, fa[:, :250]), AudioPush(b, fb), AudioPush(a, fa[:, 250:]),
                               AudioPush(a, fa[:, :0], final=True), AudioPush(b, fb[:, :0], final=True)])
    torch.testing.assert_close(torch.cat([out[0], out[2], out[3]]), encoder([fa], window_chunks=2), atol=1e-12, rtol=0)
    torch.testing.assert_close(torch.cat([out[1], out[4]]), encoder([fb], window_chunks=2), atol=1e-12, rtol=0)
