"""Learned drafts (the demo model's trained DFlash draft and EAGLE-3 head) change no answer: greedy
and seeded requests (text, speech, audio in, image in, batched) give the same text ids, codes and
audio as speculation off, across preemption, chunked prefill and prefix-cache hits (DFlash finds
the draft's context for cached blocks under the same page ids; EAGLE-3 remakes a new row's
entries from the features stored there), and drafts are accepted; every page comes back."""
from pathlib import Path

import numpy as np
import pytest

from omnivox import Omni
from omnivox.engine.config import EngineConfig
from features import same_outputs as _same

SPECS = {method: {"method": method, "model": "demo", "num_speculative_tokens": 7} for method in ("dflash", "eagle3")}
WAVE = str(Path(__file__).parent.parent / "media" / "speech_16k.wav")
SAMPLING = [dict(greedy=True), dict(seed=11, temperature=0.8, top_k=40),
            dict(seed=12, temperature=0.7, top_p=0.9, repetition_penalty=1.3)]


def _user(*parts):
    return [{"role": "user", "content": list(parts) if len(parts) > 1 else parts[0]}]


def requests():
    image = np.random.default_rng(0).integers(0, 256, (40, 56, 3), dtype=np.uint8)
    return [dict(messages=_user("the farmer counts his sheep by the river and the sun goes down"), max_tokens=40,
                 return_audio=False),
            dict(messages=_user("a quiet morning in the old city"), max_tokens=10, max_frames=8),
            dict(messages=_user({"type": "audio", "audio": WAVE}, {"type": "text", "text": "what was said"}),
                 max_tokens=12, return_audio=False),
            dict(messages=_user({"type": "image", "image": image}, {"type": "text", "text": "what is this"}),
                 max_tokens=12, max_frames=6)]


@pytest.fixture(scope="module", params=sorted(SPECS))
def on(request):
    o = Omni(progress=False, speculative_config=SPECS[request.param])
    yield o
    o.close()


def _run(omni, reqs):
    s = omni.engine.stages.stages["thinker"].batch_stats
    before = (s.drafted, s.draft_accepted)
    outs = omni.generate(reqs)
    stats = omni.engine.stats()
    assert stats.kv_pages_free == stats.kv_pages_total
    return outs, s.drafted - before[0], s.draft_accepted - before[1]


@pytest.mark.parametrize("kw", SAMPLING, ids=["greedy", "seeded", "penalty"])
def test_a_learned_draft_changes_no_answer_and_accepts(demo_omni, on, kw):
    reqs = [dict(r, **kw) for r in requests()]
    want = demo_omni.generate(reqs)
    got, drafted, accepted = _run(on, reqs)
    _same(got, want)
    assert drafted > 0 and accepted > 0


@pytest.mark.parametrize("method", sorted(SPECS))
def test_with_preemption_chunked_prefill_and_prefix_hits(demo_omni, method):
    reqs = [dict(messages=_user(f"the farmer number {i} counts sheep " * (1 + i % 3)), greedy=True, max_tokens=24,
                 return_audio=False) for i in range(6)]
    want = demo_omni.generate(reqs)
    for cfg, check in ((EngineConfig(kv_cache_mb=0.4, block_size=4, prefix_cache=False, poison_freed_pages=True,
                                     scheduling="fifo"), lambda st: st.preemptions > 0),
                       (EngineConfig(token_budget=7, block_size=4), lambda st: True)):
        o = Omni(progress=False, engine_config=cfg, speculative_config=SPECS[method])
        try:
            got, drafted, accepted = _run(o, reqs)
            _same(got, want)
            assert check(o.engine.stats()) and accepted > 0
            # a follow-up turn repeating a reply hits the cache past the prompt, its draft context too
            follow = dict(messages=reqs[1]["messages"] + [{"role": "assistant", "content": got[1].text},
                                                          {"role": "user", "content": "and then"}],
                          greedy=True, max_tokens=16, return_audio=False)
            hits = o.engine.stats().prefix_hit_tokens
            again, drafted, accepted = _run(o, [follow])
            if cfg.prefix_cache:
                assert o.engine.stats().prefix_hit_tokens - hits > 16 and accepted > 0
            _same(again, [demo_omni.generate(**follow)])
        finally:
            o.close()


@pytest.mark.parametrize("method", sorted(SPECS))
def test_the_demo_draft_is_refused_for_another_thinker(tiny_reference, demo_omni, tmp_path, method):
    import json
    import shutil

    from omnivox.models.qwen3_omni.demo import DEMO_VERSION
    from omnivox.speculative.demo import check_demo_draft, demo_draft_folder
    from omnivox.speculative.fit import DraftMismatch

    with pytest.raises(DraftMismatch, match="draft vocab_size is 1088 but the Thinker's is 152064"):
        Omni(model=tiny_reference[1], progress=False, speculative_config=SPECS[method]).engine
    folder = tmp_path / "draft"
    shutil.copytree(demo_draft_folder(method), folder)
    check_demo_draft(folder, demo_omni.model, method, DEMO_VERSION)  # the demo Thinker it was trained for
    meta = json.loads((folder / "omnivox_demo.json").read_text())
    for key, value, message in (("thinker_sha256", "0" * 64, "trained for the demo Thinker 000000000000 but this "
                                 "Thinker is"), ("demo_version", 0, "trained for demo version 0")):
        (folder / "omnivox_demo.json").write_text(json.dumps({**meta, key: value}))
        with pytest.raises(DraftMismatch, match=message):
            check_demo_draft(folder, demo_omni.model, method, DEMO_VERSION)
    if method == "dflash":
        with pytest.raises(DraftMismatch, match="num_speculative_tokens is 8 but the draft's block_size 8 proposes at "
                                                "most 7"):
            Omni(progress=False, speculative_config=dict(SPECS[method], num_speculative_tokens=8)).engine
