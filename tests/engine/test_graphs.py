"""The CUDA-graph runner's plumbing on CPU, with a fake graph that records the step function and
calls it again on the static buffers: bucket choice and eager fallback, inputs copied in at every
replay, a padded replay equal to the eager step at the same shape with no real page touched, and
whole generations (Thinker, Talker + code predictor, vocoder, S2) equal to eager ones."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from omnivox import Omni
from omnivox.engine.config import EngineConfig
from omnivox.engine.events import AudioChunk, Finished
from omnivox.models.qwen3_omni.stages.graph import build as build_qwen
from omnivox.stages.ar import PagedContext
from omnivox.stages.graphs import FakeGraph, GraphRunner, _clone
from omnivox import FishTTS
from omnivox.serving import ChatParams
from omnivox.models.qwen3_omni.reference import generate_reference
from qwen_tiny import chat

FAKE = dict(cuda_graphs="fake", graph_buckets=(1, 2, 4, 8))


class _Row:
    def __init__(self, n):
        self.n = n


def test_bucket_choice_and_eager_fallback():
    runner = GraphRunner(lambda inputs, ctx: {}, lambda meta: None, [8, 1, 4, 2], width=4, graph_factory=FakeGraph)
    assert [runner.bucket_for(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    decode = [_Row(1)] * 3
    assert runner.bucket(decode, [0, 1, 2]) == 4
    assert runner.bucket(decode, [0, 1]) is None  # a row that does not sample: not a decode step
    assert runner.bucket([_Row(1), _Row(5)], [0, 1]) is None  # a prefill chunk: eager
    assert runner.bucket([_Row(1)] * 9, list(range(9))) is None  # above the largest bucket


@dataclass
class _In:
    x: torch.Tensor
    k: int  # a host value


@dataclass
class _Out:
    y: torch.Tensor


def test_replays_copy_the_inputs_in_and_capture_once_per_signature():
    calls = []

    def compute(inputs, ctx):
        calls.append(1)
        return _Out(inputs.x * 2 + inputs.k)

    runner = GraphRunner(compute, lambda meta: None, [4], width=1, graph_factory=FakeGraph)
    for i in range(3):
        out = runner.run(4, _In(torch.full((4,), float(i)), 1), None)
        assert torch.equal(out.y, torch.full((4,), 2.0 * i + 1))
    assert len(runner.graphs) == 1 and runner.replays == 3
    runner.run(4, _In(torch.zeros(4), 2), None)  # another host value: another graph
    assert len(runner.graphs) == 2


def _steady(graph, reqs, stage: str, steps: int = 6):
    for r in reqs:
        graph.admit(r)
    for _ in range(steps):
        graph.step()
    s = graph.stages[stage]
    assert all(s.seqs[r.rid].num_computed > r.prompt_tokens for r in reqs)
    return s


def test_padded_replay_equals_the_eager_step_and_touches_no_real_page(tiny_reference):
    omni = Omni(model=tiny_reference[1], progress=False)
    graph = build_qwen(omni.model, EngineConfig(**FAKE), omni.tokenizer)
    events: list = []
    reqs = [graph.new_request(omni.build_prompt(prompt_ids=chat([1900 + 5 * i + k for k in range(4 + i)])),
                              omni.options(ChatParams(greedy=i != 1, temperature=0.9, top_k=30, seed=7 + i, ignore_eos=True,
                                                      max_tokens=30, return_audio=False)), request_id=f"r{i}")
            for i in range(3)]
    for req in reqs:
        req.push = events.append
    stage = _steady(graph, reqs, "thinker")
    runner, pool = stage.graphs, stage.pool
    seen = {}
    real_run = runner.run

    def run(bucket, inputs, meta):
        before = (pool.k.clone(), pool.v.clone())
        eager = stage.adapter.compute(_clone(inputs), PagedContext(pool, meta, stage.backend))
        after_eager = (pool.k.clone(), pool.v.clone())
        pool.k.copy_(before[0]), pool.v.copy_(before[1])
        meta.derived.clear()
        out = real_run(bucket, inputs, meta)
        seen.update(bucket=bucket, rows=len(meta.seq_lens_host), eager=eager.ids.clone(), graph=out.ids.clone())
        written = set(meta.write_slots.tolist())
        changed = set((pool.k != before[0]).any(dim=3).any(dim=2).any(dim=0).nonzero().flatten().tolist())  # slots
        seen.update(changed=changed, written=written, dummy=pool.dummy_slot, equal_pools=torch.equal(pool.k, after_eager[0])
                    and torch.equal(pool.v, after_eager[1]))
        return out

    runner.run = run
    graph.step()
    assert seen["bucket"] == 4 and seen["rows"] == 4  # 3 requests padded to the bucket of 4
    assert torch.equal(seen["graph"][:3], seen["eager"][:3])  # bit-equal real rows
    assert seen["equal_pools"]
    assert seen["changed"] <= seen["written"]  # only this step's own slots (and the dummy page)
    assert seen["dummy"] in seen["written"]
    omni.close()


@pytest.fixture(scope="module")
def pair(tiny_reference):
    eager = Omni(model=tiny_reference[1], progress=False)
    graphed = Omni(model=tiny_reference[1], progress=False, engine_config=EngineConfig(**FAKE))
    yield eager, graphed
    eager.close(), graphed.close()


def _run(omni, reqs):
    outs = []
    for h in [omni.submit(**r) for r in reqs]:
        audio, fin = [], None
        for ev in h:
            if isinstance(ev, AudioChunk):
                audio.append(ev.samples)
            elif isinstance(ev, Finished):
                fin = ev
        outs.append((fin, np.concatenate(audio) if audio else np.zeros(0)))
    return outs


def test_generation_with_graphs_equals_eager(pair):
    eager, graphed = pair
    reqs = [dict(prompt_ids=chat([2000 + 3 * i + k for k in range(3 + 2 * i)]), greedy=i % 2 == 0, temperature=0.8,
                 top_k=40, top_p=0.9, seed=50 + i, max_tokens=8 + i, max_frames=6 + 2 * i, speaker="ethan")
            for i in range(5)]
    want, got = _run(eager, reqs), _run(graphed, reqs)
    for (a, wa), (b, wb) in zip(want, got):
        assert a.text_ids == b.text_ids
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_allclose(wa, wb, rtol=0, atol=3e-5)
    stages = graphed.engine.stages.stages
    for name in ("thinker", "talker", "vocoder"):
        assert stages[name].graphs.replays > 0, name  # every loop really replayed
    assert len({k[0] for k in stages["thinker"].graphs.graphs}) >= 2  # several buckets


def test_s2_generation_with_graphs_equals_eager(tmp_path):
    from omnivox.models.fish_s2.tiny import write_tiny_checkpoint
    folder = write_tiny_checkpoint(tmp_path, seed=0)
    eager = FishTTS(model=folder, progress=False)
    graphed = FishTTS(model=folder, progress=False, engine_config=EngineConfig(**FAKE))
    try:
        reqs = [dict(text=f"Sentence {i}.", seed=10 + i, max_frames=12 + i, mode=("fish", "sglang")[i % 2])
                for i in range(3)]
        want = [eager.collect(h) for h in [eager.submit(**r) for r in reqs]]
        got = [graphed.collect(h) for h in [graphed.submit(**r) for r in reqs]]
        for a, b in zip(want, got):
            np.testing.assert_array_equal(a.codes, b.codes)
            # NOTE: a padded batch is another shape: fp32 round-off of the tiny codec, ~3e-5 seen
            np.testing.assert_allclose(a.audio, b.audio, rtol=0, atol=1e-4)
        assert graphed.engine.stages.stages["slow_ar"].graphs.replays > 0
    finally:
        eager.close(), graphed.close()


def test_warmup_captures_every_bucket_largest_first_and_changes_nothing(tiny_reference):
    omni = Omni(model=tiny_reference[1], progress=False, engine_config=EngineConfig(**FAKE))
    try:
        stages = omni.engine.stages
        pools = {n: (s.pool.k.clone(), s.pool.v.clone()) for n, s in stages.stages.items() if hasattr(s, "pool")
                 and hasattr(s.pool, "k")}
        line = stages.warmup()
        assert line.startswith("cuda graphs: 12 captured for thinker, talker, vocoder")  # 3 stages x 4 buckets
        for n, (k, v) in pools.items():
            pool = stages.stages[n].pool
            real = slice(0, pool.dummy_slot)
            assert torch.equal(pool.k[:, real], k[:, real]) and torch.equal(pool.v[:, real], v[:, real])
        want = generate_reference(omni, prompt_ids=chat([2100, 2101]), greedy=True, max_tokens=5, max_frames=4)
        got = omni.generate(prompt_ids=chat([2100, 2101]), greedy=True, max_tokens=5, max_frames=4)
        assert got.text_ids == want.text_ids
        np.testing.assert_array_equal(got.codes, want.codes)
    finally:
        omni.close()
