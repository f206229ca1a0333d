"""The encoder stage (issue 37): audio input is the first stage of a listening request's route.
Host log-mel pieces appended to several requests' prompt streams are encoded in one step (one embed
call, one windowed-attention call) and each request's rows equal the one-shot encoder on its clip;
the rows each piece makes are what the host side predicted (`AudioWindow.rows`); a replay of a clip
reads the rows already computed (one computation per prefix key); a bad piece fails its request
alone. On the Qwen graph, driven in this thread on a ManualClock, appending audio never waits on
the engine and its rows are in the Thinker after the next step. The off-route queue (S2 references)
fails what is pending when the engine stops."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from omnivox.engine.clock import ManualClock
from omnivox.engine.config import EngineConfig
from omnivox.engine.engine import Engine
from omnivox.engine.graph import StageGraph
from omnivox.engine.off_route import OffRouteAdapter
from omnivox.engine.prompt import AudioPiece, HostRows, PromptStream, Segment
from omnivox.engine.request import Request
from omnivox.errors import InputError, Overloaded
from omnivox.models.qwen3_omni.audio_encoder import AudioEncoder
from omnivox.models.qwen3_omni.audio_stream import AudioStreamBatch, AudioWindow
from omnivox.models.qwen3_omni.config import AudioEncoderConfig
from omnivox.models.qwen3_omni.demo import TINY_CONFIG
from omnivox.models.qwen3_omni.random_init import randomize_
from omnivox.stages.encoder import EncoderStage

PAD = 7  # any id: the stage passes ids through


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


def _request(rid: str) -> Request:
    return Request(rid, 0, 0, push=lambda ev: None, stream=PromptStream(), encoded=PromptStream())


class Clip:
    """A clip as the host side sends it: pieces with the rows each makes final (`AudioWindow.rows`)."""

    def __init__(self, window: AudioWindow):
        self.window, self.rows, self.frames, self.n = window, HostRows(), 0, 0

    def piece(self, frames: np.ndarray, final: bool = False) -> Segment:
        self.frames += frames.shape[1]
        n = self.window.rows(self.frames, final) - self.n
        seg = Segment([PAD] * n, keys=[("clip", id(self), self.n + r) for r in range(n)],
                      audio=AudioPiece(frames, self.rows, self.n, final, self.window.window_chunks))
        self.n += n
        return seg


def _rows(req: Request) -> list:
    segs, _ = req.encoded.take()
    return [s.embeds for s in segs if s.embeds is not None]


def _as_tensor(x) -> torch.Tensor:
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


@torch.no_grad()
def test_requests_are_encoded_in_one_batched_step(encoder):
    # (frames, window in chunks): windows of 1 and 2 chunks batch together; 70 frames is a clip
    # shorter than one chunk (its flush embeds a short chunk of its own length)
    clips = [(1234, 1), (555, 2), (800, 2), (70, 1)]
    feats = [np.random.default_rng(n).standard_normal((128, n)) for n, _ in clips]
    stage = EncoderStage(AudioStreamBatch(encoder))
    reqs = [_request(f"r{i}") for i in range(len(clips))]
    hosts = [Clip(AudioWindow(w, 2 * encoder.cfg.n_window)) for _, w in clips]
    for req in reqs:
        stage.admit(req)
    embeds, windows = Calls(encoder, "embed_chunks"), Calls(encoder, "encode_windows")
    try:
        for req, host, f in zip(reqs, hosts, feats):
            req.stream.extend([host.piece(f)])
        assert stage.has_work() and stage.step() == []
        assert (embeds.n, windows.n) == (1, 1)  # every request's chunks; every request's complete windows
        pushed = [_rows(r) for r in reqs]
        for req, host, f in zip(reqs, hosts, feats):
            req.stream.extend([host.piece(f[:, :0], final=True)])
            req.stream.close()
        assert stage.step() == []
        assert (embeds.n, windows.n) == (3, 2)  # whole-chunk tails together, the 70-frame clip alone
    finally:
        del encoder.embed_chunks, encoder.encode_windows
    assert stage.batch_stats.max_batch == len(clips) and stage.stats()["encoder"] is stage.batch_stats
    for (_, w), f, req, host, a in zip(clips, feats, reqs, hosts, pushed):
        b = _rows(req)
        got = torch.cat([_as_tensor(x) for x in a + b])
        torch.testing.assert_close(got, encoder([torch.from_numpy(f)], window_chunks=w), atol=1e-12, rtol=0)
        assert host.rows.n == host.n == got.shape[0]  # the host side's count; the rows kept on the host
        np.testing.assert_array_equal(host.rows.rows(), got.numpy())
        assert req.encoded.closed and stage.done(req)


@torch.no_grad()
def test_a_replay_reads_the_rows_already_computed(encoder):
    """A second request with the same clip's pieces (a re-opened turn) gets the first computation's
    rows, bit for bit, from the host record, whatever its own batch computed."""
    window = AudioWindow(1, 2 * encoder.cfg.n_window)
    f = np.random.default_rng(3).standard_normal((128, 450))
    host = Clip(window)
    pieces = [host.piece(f[:, :250]), host.piece(f[:, 250:]), host.piece(f[:, :0], final=True)]
    stage = EncoderStage(AudioStreamBatch(encoder))
    first, again = _request("first"), _request("again")
    stage.admit(first)
    first.stream.extend(pieces)
    stage.step()
    want = host.rows.rows()
    stage.admit(again)
    again.stream.extend(pieces[:2])  # and a piece with a new row later: replays may run ahead
    stage.step()
    got = _rows(again)
    assert all(isinstance(x, np.ndarray) for x in got if len(x))  # read back, not recomputed rows
    np.testing.assert_array_equal(np.concatenate([x for x in got if len(x)]), want[:sum(map(len, got))])


def test_a_bad_piece_fails_its_request_alone(encoder):
    stage = EncoderStage(AudioStreamBatch(encoder))
    bad, good = _request("bad"), _request("good")
    stage.admit(bad)
    stage.admit(good)
    bad.stream.extend([Segment([], audio=AudioPiece(np.zeros((80, 100), np.float32), HostRows(), 0))])
    host = Clip(AudioWindow(1, 2 * encoder.cfg.n_window))
    good.stream.extend([host.piece(np.zeros((128, 100), np.float32))])
    (failed, error), = stage.step()
    assert failed is bad and isinstance(error, InputError) and "log-mel" in str(error)
    assert [len(x) for x in _rows(good)] == [13]


def test_rows_enter_the_thinker_in_the_step_after_their_audio(tiny_reference):
    """The Qwen graph on a ManualClock, stepped in this thread: the caller's appends return with no
    step run (nobody waits on the engine), and each step puts the rows of the audio appended before
    it into the Thinker's prompt and computes them."""
    from omnivox import Omni
    from omnivox.models.qwen3_omni.stages.graph import build
    from omnivox.serving import ChatParams
    from qwen_tiny import AUDIO_PAD, AUDIO_START, chat

    omni = Omni(model=tiny_reference[1], progress=False, engine_config=EngineConfig(block_size=4))
    graph = build(omni.model, omni.engine_config, omni.tokenizer, omni.suppressed_ids)
    graph.set_clock(clock := ManualClock())
    head = chat([1800])[:-3] + [AUDIO_START]
    stream = PromptStream()
    req = graph.new_request(omni.processor.from_ids(head), omni.options(ChatParams(greedy=True, max_tokens=2)),
                            request_id="turn", stream=stream)
    req.push = lambda ev: None
    graph.admit(req, gate=False)
    assert req.route == ("encoder", "thinker", "talker", "vocoder")
    window = omni.audio_window(1.0)
    host, thinker = Clip(window), graph.stages["thinker"]
    feats = np.random.default_rng(0).standard_normal((128, 3 * window.chunk_frames)).astype(np.float32)
    expected = len(head)
    for k in range(3):
        seg = host.piece(feats[:, k * window.chunk_frames:(k + 1) * window.chunk_frames])
        seg.ids = [AUDIO_PAD] * len(seg.ids)
        stream.extend([seg])  # the API's whole part: it returns at once
        assert len(req.prompt.ids) == expected  # nothing of it in the Thinker before a step
        graph.step()
        expected += len(seg.ids)
        assert len(req.prompt.ids) == expected and thinker.seqs["turn"].num_computed == expected
        assert host.rows.n == host.n > 0
    assert clock.now() == 0.0 and stream.closed is False and req.listening
    graph.remove(req)
    graph.close()
    omni.close()


# ---- the off-route queue (S2 reference voices) ---------------------------------------------------
class Gate(OffRouteAdapter):
    """Holds the engine thread inside a step until opened, so what is submitted meanwhile waits."""

    def __init__(self):
        self.entered, self.opened = threading.Event(), threading.Event()

    def encode(self, items: list) -> list:
        self.entered.set()
        assert self.opened.wait(30)
        return items


def _wait_for(cond, limit: float = 30.0) -> None:
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_off_route_queue_fails_its_callers_and_pending_work_at_shutdown():
    engine = Engine(StageGraph([], None), EngineConfig())

    class Broken(OffRouteAdapter):
        def encode(self, items):
            raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        engine.encoder.encode(Broken(), 1)
    gate = Gate()
    engine.encoder.submit(gate, None)
    assert gate.entered.wait(30)
    with ThreadPoolExecutor(3) as pool:
        waiting = [pool.submit(engine.encoder.encode, Gate(), None) for _ in range(2)]
        _wait_for(lambda: engine.encoder.queued() == 2)
        stopping = pool.submit(engine.shutdown)
        _wait_for(lambda: engine._stop)  # asked to stop while its step still runs: the work stays pending
        gate.opened.set()
        stopping.result(timeout=30)
        for f in waiting:
            with pytest.raises(Overloaded, match="shutting down"):
                f.result(timeout=30)
    with pytest.raises(Overloaded, match="shutting down"):
        engine.encoder.encode(Gate(), None)
