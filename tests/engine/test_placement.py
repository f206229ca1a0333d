"""Stage placement on CPU: stages stepped by separate loops (threads joined every step) give the
same text ids and codes, and audio within the stream tolerance, as one loop; a placement or KV
budget that names an unknown stage is a start-up error naming the valid ones.

Two loops on 2 CPU cores contend for the GIL: these tests check outputs, never speed (the GPU
phase `placement` of scripts/gpu_verify.py measures the overlap)."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from omnivox import Omni
from omnivox.engine.config import EngineConfig
from omnivox.engine.placement import Placement, PlacementError, loop_groups, parse_kv_budget
from omnivox.models.fish_s2.tiny import write_tiny_checkpoint
from omnivox.models.qwen3_omni.stages.graph import split_kv_budget
from omnivox.models.registry import load
from omnivox import FishTTS
from omnivox.models.qwen3_omni.reference import generate_reference
from qwen_tiny import chat, mixed_requests

STREAM_ATOL = 3e-5  # streamed vs one-shot decode (tests/engine/test_engine.py)
LOOPS = ["thinker,talker+vocoder", "thinker,talker,vocoder"]


@pytest.fixture(scope="module")
def omni(tiny_reference):
    o = Omni(model=tiny_reference[1], progress=False, engine_config=EngineConfig(scheduling="fifo"))
    yield o
    o.close()


def _run(omni: Omni, cfg: EngineConfig, requests: list[dict]):
    """The requests submitted together under `cfg` (a fresh engine over the same weights)."""
    omni.close()
    omni.engine_config = cfg
    try:
        out = omni.generate(requests)
        stats = omni.engine.stats()
        loops = omni.engine.stages.loops
    finally:
        omni.close()
    return out, stats, loops


def _assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.text_ids == w.text_ids
        np.testing.assert_array_equal(g.codes, w.codes)
        np.testing.assert_allclose(g.audio, w.audio, rtol=0, atol=STREAM_ATOL)


@pytest.mark.parametrize("loops", LOOPS)
def test_loops_equal_one_loop(omni, loops):
    reqs = mixed_requests(omni)
    want, _, one = _run(omni, EngineConfig(scheduling="fifo", stage_loops="one"), reqs)
    got, stats, split = _run(omni, EngineConfig(scheduling="fifo", stage_loops=loops), reqs)
    assert one == [["encoder", "thinker", "talker", "vocoder"]]
    assert split == [(["encoder"] if i == 0 else []) + g.split("+") for i, g in enumerate(loops.split(","))]
    _assert_same(got, want)
    assert any(o.codes.shape[0] for o in got) and got[4].codes.shape[0] == 0  # spoken and text-only replies
    assert stats.stages["talker"].max_batch >= 2  # batched across requests in the Talker's own loop


def test_loops_with_preemption_and_slack_equal_the_reference(omni):
    prompts = [chat([1300 + 7 * i + k for k in range(6 + 2 * i)]) for i in range(6)]
    reqs = [dict(prompt_ids=p, greedy=True, max_tokens=10, max_frames=14) for p in prompts]
    expected = [generate_reference(omni, **r) for r in reqs]
    tight = EngineConfig(kv_cache_mb=0.047, block_size=4, prefix_cache=False, poison_freed_pages=True,
                         scheduling="fifo", stage_loops=LOOPS[0])
    got, stats, _ = _run(omni, tight, reqs)
    assert stats.preemptions > 0 and stats.kv_pages_free == stats.kv_pages_total
    _assert_same(got, expected)
    got, _, _ = _run(omni, replace(tight, scheduling="slack"), reqs)
    _assert_same(got, expected)


def test_fish_slow_ar_and_vocoder_loops_equal_one_loop(tmp_path):
    folder = write_tiny_checkpoint(tmp_path, seed=0)
    texts = ["Two loops, one answer.", "A second voice in the batch.", "Short."]
    outs = {}
    for loops in ("one", "slow_ar,vocoder"):
        tts = FishTTS(folder, progress=False, engine_config=EngineConfig(block_size=4, scheduling="fifo",
                                                                        stage_loops=loops))
        try:
            handles = [tts.submit(t, seed=5 + i, max_frames=20) for i, t in enumerate(texts)]
            outs[loops] = [h.collect() for h in handles]
            assert len(tts.engine.stages.loops) == (1 if loops == "one" else 2)
        finally:
            tts.close()
    for (fa, aa), (fb, ab) in zip(outs["one"], outs["slow_ar,vocoder"], strict=True):
        np.testing.assert_array_equal(fa.codes, fb.codes)
        np.testing.assert_allclose(aa, ab, rtol=0, atol=3e-4)
        assert fa.codes.shape[0] > 0


def test_placement_names_only_the_family_stages(tiny_reference):
    with pytest.raises(PlacementError, match="tlker.*thinker, talker, vocoder, encoder"):
        Omni(model=tiny_reference[1], progress=False, placement="tlker=cpu")
    with pytest.raises(PlacementError, match="not a device"):
        Placement.parse("thinker=gpu0")
    with pytest.raises(PlacementError, match="stage=value"):
        Placement.parse("thinker")
    with pytest.raises(PlacementError, match="slow_ar, vocoder"):  # before any weight loads
        load("fish-demo", placement="thinker=cpu")
    p = Placement.parse("talker=cpu", default="cpu").check(("thinker", "talker"))
    assert p.device("thinker") == p.device("talker") == torch.device("cpu")


def test_stage_loops_are_checked():
    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    three = {"thinker": gpu0, "talker": gpu1, "vocoder": gpu1}
    assert loop_groups("device", three) == [["thinker"], ["talker", "vocoder"]]
    assert loop_groups("one", three) == [["thinker", "talker", "vocoder"]]
    assert loop_groups("thinker", {"thinker": cpu, "talker": cpu, "vocoder": cpu}) == \
        [["thinker"], ["talker"], ["vocoder"]]  # unnamed stages: a loop each
    with pytest.raises(PlacementError, match="different devices"):
        loop_groups("thinker+talker,vocoder", three)
    with pytest.raises(PlacementError, match="two loops on one CUDA device"):
        loop_groups("thinker,talker,vocoder", three)
    with pytest.raises(PlacementError, match="unknown stage"):
        loop_groups("thinker,tlker", three)


def test_kv_budget_per_stage(omni):
    assert parse_kv_budget("thinker=3,talker=1", ("thinker", "talker")) == {"thinker": 3.0, "talker": 1.0}
    assert parse_kv_budget("64", ("thinker", "talker")) == 64.0
    with pytest.raises(PlacementError, match="no budget for talker"):
        parse_kv_budget("thinker=3", ("thinker", "talker"))
    with pytest.raises(PlacementError, match="stages with a KV cache are slow_ar"):
        parse_kv_budget("thinker=3", ("slow_ar",))
    half = split_kv_budget(omni.model, EngineConfig(kv_cache_mb=4.0))
    given = split_kv_budget(omni.model, EngineConfig(kv_cache_mb=4.0, kv_stage_mb=(("thinker", 3.0), ("talker", 1.0))))
    assert given[0] == pytest.approx(half[0] * 1.5, abs=1) and given[1] == pytest.approx(half[1] * 0.5, abs=1)
