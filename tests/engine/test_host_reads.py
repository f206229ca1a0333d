"""A decode step of every stage reads the device from the host at most once, through
`omnivox.engine.host` (its sampled ids; the vocoder its audio): no `.item()`, `.tolist()`,
truth value, `nonzero`, boolean-mask indexing or copy to the CPU anywhere else in the step."""
from __future__ import annotations

import pytest
import torch

from host_guard import HostRead, no_host_reads
from omnivox.engine import host
from omnivox.engine.config import EngineConfig
from omnivox.engine.events import AudioChunk
from omnivox.models.fish_s2.stages.graph import build as build_fish
from omnivox.models.qwen3_omni.stages.graph import build as build_qwen
from omnivox import FishTTS
from omnivox.serving import ChatParams, SpeechParams

def _steady_step(graph, reqs, stages: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """Step until every stage in `stages` decodes in the same step, then run one guarded step;
    returns the reads each stage made in it."""
    for req in reqs:
        graph.admit(req)
    for _ in range(60):
        batch = {n: graph.stages[n].stats()[n].steps for n in stages}
        before = dict(host.counts)
        per_stage: dict[str, dict[str, int]] = {}
        originals = {n: graph.stages[n].step for n in stages}

        def wrap(name):
            def step():
                start = dict(host.counts)
                out = originals[name]()
                per_stage[name] = {k: host.counts[k] - start.get(k, 0) for k in ("ids", "audio")}
                return out
            return step

        for n in stages:
            graph.stages[n].step = wrap(n)
        try:
            decoding = all(not graph.stages[n].waiting if hasattr(graph.stages[n], "waiting") else True for n in stages)
            if decoding and all(batch[n] > 2 for n in stages):
                with no_host_reads(host.reading):
                    graph.step()
            else:
                graph.step()
        finally:
            for n in stages:
                del graph.stages[n].step
        ran = all(graph.stages[n].stats()[n].steps == batch[n] + 1 for n in stages)
        if decoding and ran and all(batch[n] > 2 for n in stages):
            assert sum(host.counts.values()) - sum(before.values()) == sum(sum(r.values()) for r in per_stage.values())
            return per_stage
    raise AssertionError("the stages never decoded together")


def _push(reqs, events: list) -> None:
    """Where the requests' events go (what `Engine.submit` sets: their handle)."""
    for req in reqs:
        req.push = events.append


def test_qwen_decode_step_reads_once_per_stage(tiny_reference):
    from omnivox import Omni
    omni = Omni(model=tiny_reference[1], progress=False)
    graph = build_qwen(omni.model, EngineConfig(), omni.tokenizer)
    events: list = []
    reqs = [graph.new_request(omni.build_prompt(prompt_ids=[151644, 872, 198, 1000 + i, 1001, 151645, 198,
                                                                   151644, 77091, 198]),
                              omni.options(ChatParams(greedy=i % 2 == 0, temperature=0.7, top_k=20, top_p=0.9, seed=i,
                                                      ignore_eos=True, max_tokens=40, max_frames=40)), request_id=f"r{i}")
            for i in range(3)]
    _push(reqs, events)
    reads = _steady_step(graph, reqs, ("thinker", "talker", "vocoder"))
    assert reads == {"thinker": {"ids": 1, "audio": 0}, "talker": {"ids": 1, "audio": 0},
                     "vocoder": {"ids": 0, "audio": 1}}, reads
    assert any(isinstance(e, AudioChunk) for e in events)


def test_fish_decode_step_reads_once_per_stage(tmp_path):
    from omnivox.models.fish_s2.tiny import write_tiny_checkpoint
    tts = FishTTS(model=write_tiny_checkpoint(tmp_path, seed=0), progress=False)
    graph = build_fish(tts.slow, tts.fast, tts.codec, EngineConfig())
    events: list = []
    reqs = [graph.new_request(tts.build_prompt(f"Sentence number {i}."),
                              tts.options(SpeechParams(seed=i, max_frames=40), ignore_eos=True, mode=("fish", "sglang")[i % 2]),
                              request_id=f"f{i}") for i in range(3)]
    _push(reqs, events)
    reads = _steady_step(graph, reqs, ("slow_ar", "vocoder"))
    assert reads == {"slow_ar": {"ids": 1, "audio": 0}, "vocoder": {"ids": 0, "audio": 1}}, reads


def test_the_guard_catches_a_host_read():
    x = torch.arange(4.0)
    with pytest.raises(HostRead):
        with no_host_reads(host.reading):
            x.sum().item()
    with pytest.raises(HostRead):
        with no_host_reads(host.reading):
            x[x > 1]
