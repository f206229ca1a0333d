"""Speculative decoding of the Thinker changes no answer: with drafts always right, always wrong,
from prompt lookup, or only on some rows of a batch, greedy and seeded requests (text, speech,
audio and image input) give the same text ids and codes as speculation off, across preemption,
chunked prefill and prefix-cache hits, and every page comes back."""
import numpy as np
import pytest
import torch

from omnivox import Omni
from omnivox.audio.io import load_audio
from omnivox.audio.mel import num_audio_tokens, log_mel
from omnivox.engine.config import EngineConfig, SpeculativeConfig
from omnivox.models.qwen3_omni.image_processor import num_vision_tokens, preprocess_image
from omnivox.speculative.ngram import propose
from qwen_tiny import AUDIO_END, AUDIO_PAD, AUDIO_START, IMAGE_PAD, VISION_END, VISION_START, chat
from speculative.features import same_outputs as _same
from test_engine import MEDIA

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SAMPLING = [dict(greedy=True), dict(seed=11, temperature=0.8, top_k=40),
            dict(seed=12, temperature=0.9, top_p=0.9, repetition_penalty=1.3)]


@pytest.fixture(scope="module")
def off(tiny_reference):
    o = Omni(model=tiny_reference[1], progress=False)
    yield o
    o.close()


@pytest.fixture(scope="module")
def on(tiny_reference):
    o = Omni(model=tiny_reference[1], progress=False, speculative_config=SPEC)
    yield o
    o.close()


def _thinker(omni):
    return omni.engine.stages.stages["thinker"]


def _oracle(expected, wrong: bool = False, rows=None):
    """Drafts from the answers speculation off gave (`expected`: full id sequences): always right,
    or always wrong (each id + 1); only for the sequences in `rows` when given."""
    def proposer(ids, k):
        for i, full in enumerate(expected):
            if (rows is None or i in rows) and len(full) > len(ids) and full[:len(ids)] == ids:
                cont = full[len(ids):len(ids) + k]
                return [t + 1 for t in cont] if wrong else cont
        return []
    return proposer


def _requests(omni):
    """Text-only, spoken, audio input and image input requests (small)."""
    wave = load_audio(MEDIA / "speech_16k.wav")[:16000]
    n_audio = num_audio_tokens(log_mel(wave).shape[-1])
    image = np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8)
    _, grid = preprocess_image(image, omni.processor.vision)
    return [dict(prompt_ids=chat([1000 + (k % 3) for k in range(12)]), max_tokens=14, return_audio=False),
            dict(prompt_ids=chat([1100 + k for k in range(5)]), max_tokens=12, max_frames=10),
            dict(prompt_ids=chat([AUDIO_START, *[AUDIO_PAD] * n_audio, AUDIO_END, 500]), audio=[wave],
                 max_tokens=10, max_frames=8),
            dict(prompt_ids=chat([VISION_START, *[IMAGE_PAD] * num_vision_tokens(grid, 2), VISION_END, 501]),
                 images=[image], max_tokens=9, max_frames=8)]


def _run(omni, reqs, proposer=None):
    """Outputs and the Thinker's (drafted, accepted, rows verified, steps) over this batch."""
    stage = _thinker(omni)
    if proposer is not None:
        stage.adapter.drafter.lookup = proposer
    s = stage.batch_stats
    before = (s.drafted, s.draft_accepted, s.verified, s.steps)
    outs = omni.generate(reqs)
    stats = omni.engine.stats()
    assert stats.kv_pages_free == stats.kv_pages_total
    return outs, tuple(a - b for a, b in zip((s.drafted, s.draft_accepted, s.verified, s.steps), before))


@pytest.mark.parametrize("kw", SAMPLING, ids=["greedy", "seeded", "penalty"])
def test_drafts_right_wrong_or_looked_up_change_nothing(off, on, kw):
    reqs = [dict(r, **kw) for r in _requests(off)]
    want = off.generate(reqs)
    full = [list(r["prompt_ids"]) + w.text_ids for r, w in zip(reqs, want)]
    right, (drafted, accepted, verified, steps) = _run(on, reqs, _oracle(full))
    _same(right, want)
    assert drafted > 0 and accepted == drafted  # every draft taken: fewer Thinker steps
    assert steps < sum(len(w.text_ids) for w in want)
    wrong, (drafted, accepted, verified, _) = _run(on, reqs, _oracle(full, wrong=True))
    _same(wrong, want)
    assert drafted > 0 and accepted == 0 and _thinker(on).batch_stats.mean_accepted_length >= 1
    mixed, (drafted, accepted, _, _) = _run(on, reqs, _oracle(full, rows={0, 3}))  # plain rows beside drafting ones
    _same(mixed, want)
    assert 0 < accepted == drafted
    _same(_run(on, reqs, _oracle_ngram(on))[0], want)


def _oracle_ngram(omni):
    spec = omni.engine_config.speculative
    return lambda ids, k: propose(ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max)


def test_preemption_chunked_prefill_and_prefix_hits_with_drafts(tiny_reference, off):
    prompts = [chat([1300 + 7 * i + k for k in range(6 + 2 * i)]) for i in range(5)]
    reqs = [dict(prompt_ids=p, greedy=True, max_tokens=12, max_frames=10) for p in prompts]
    want = off.generate(reqs)
    full = [list(p) + w.text_ids for p, w in zip(prompts, want)]
    for cfg, check in ((EngineConfig(kv_cache_mb=0.047, block_size=4, prefix_cache=False, poison_freed_pages=True,
                                     scheduling="fifo"),  # all start together: pages run out
                        lambda st: st.preemptions > 0),
                       (EngineConfig(token_budget=7, block_size=4), lambda st: True)):
        o = Omni(model=tiny_reference[1], progress=False, engine_config=cfg, speculative_config=SPEC)
        try:
            got, (drafted, accepted, _, _) = _run(o, reqs, _oracle(full, rows={0, 2, 4}))
            assert check(o.engine.stats()) and accepted == drafted > 0
            _same(got, want)
            # a follow-up turn repeating a reply made with drafts hits the cache past the prompt
            follow = dict(prompt_ids=full[1] + [1500, 1501], greedy=True, max_tokens=8, return_audio=False)
            hits = o.engine.stats().prefix_hit_tokens
            again, _ = _run(o, [follow])
            if cfg.prefix_cache:
                assert o.engine.stats().prefix_hit_tokens - hits > len(prompts[1])
            _same(again, [off.generate(**follow)])
        finally:
            o.close()


def test_metrics_name_drafted_accepted_and_mean_length():
    from omnivox.api.metrics import ServerMetrics
    from omnivox.engine.events import EngineStats, StageStats
    thinker = StageStats(steps=3, draft_method="dflash", draft_kv_bytes=4096)
    for drafted, accepted in ((4, 5), (4, 1), (3, 2)):  # tokens taken: all drafts + 1, none, one
        thinker.record_draft(drafted, accepted)
    text = ServerMetrics().render(EngineStats(stages={"thinker": thinker, "talker": StageStats(steps=3)}))
    lab = 'method="dflash",stage="thinker"'
    assert f'omnivox_spec_draft_tokens_total{{{lab}}} 11' in text
    assert f'omnivox_spec_accepted_tokens_total{{{lab}}} 5' in text
    assert f'omnivox_spec_mean_accepted_length{{{lab}}} 2.666666666666667' in text
    assert f'omnivox_spec_draft_kv_bytes{{{lab}}} 4096' in text
    # per draft position: drafted 3, 3, 3, 2 times; confirmed (positions 0-3, then 0): 2, 1, 1, 1
    for j, (d, a) in enumerate(((3, 2), (3, 1), (3, 1), (2, 1))):
        pos = f'method="dflash",position="{j}",stage="thinker"'
        assert f'omnivox_spec_position_drafted_total{{{pos}}} {d}' in text
        assert f'omnivox_spec_position_accepted_total{{{pos}}} {a}' in text
    # tokens taken per verifying row: 1, 2, 5 -> cumulative buckets
    for le, n in (("1", 1), ("2", 2), ("4", 2), ("5", 3), ("+Inf", 3)):
        assert f'omnivox_spec_acceptance_length_bucket{{{lab},le="{le}"}} {n}' in text
    assert f'omnivox_spec_acceptance_length_sum{{{lab}}} 8' in text
    assert 'stage="talker"' not in text.split("omnivox_spec_draft_tokens_total")[1]


def test_ngram_drafts_from_the_latest_match():
    assert propose([1, 2, 3, 4, 5, 1, 2, 3], 3, 2, 4) == [4, 5, 1]
    assert propose([1, 2, 1, 2, 1], 5, 2, 4) == [2, 1, 2, 1, 2]  # a loop shorter than k copies on
    assert propose([9, 1, 2, 8, 1, 2, 7, 1, 2], 2, 2, 2) == [7, 1]  # the latest of several matches
    assert propose([1, 2, 3], 3, 2, 4) == [] and propose([], 3, 1, 4) == []


@pytest.mark.parametrize("spec, message", [
    ("{not json", "not valid JSON"), ('["ngram"]', "JSON object"), ('{"num_speculative_tokens": 4}', "method"),
    ('{"method": "eagle"}', "'ngram', 'dflash', 'eagle3'"), ('{"method": "ngram", "k": 4}', "unknown speculative config key(s) k"),
    ('{"method": "eagle3"}', "model (a folder, or \"demo\") is needed by methods 'dflash' and 'eagle3'"),
    ('{"method": "ngram", "model": "demo"}', "and only by them"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "positive integer"),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 4}', "above prompt_lookup_max")])
def test_bad_speculative_configs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.parse(spec)
    assert SpeculativeConfig.parse(SPEC) == SpeculativeConfig(**SPEC) and SpeculativeConfig.parse(None) is None


def test_one_propose_call_per_step_for_every_drafting_row_and_settle_frees(on):
    """The drafter protocol: one `propose` per step holding all the step's drafting rows; `settle`
    crops verified rows to their computed positions and frees finished ones (0)."""
    stage = _thinker(on)
    drafter = stage.adapter.drafter
    calls, settled = [], []
    inner_propose, inner_settle, lookup = drafter.propose, drafter.settle, drafter.lookup
    drafter.lookup = lambda ids, k: [7] * k  # always something to verify
    drafter.propose = lambda rows, sampling: calls.append([r.rid for r in rows]) or inner_propose(rows, sampling)
    drafter.settle = lambda kept: settled.append(dict(kept)) or inner_settle(kept)
    try:
        reqs = [dict(prompt_ids=chat([1000 + (k % 3) for k in range(12)]), max_tokens=10, return_audio=False,
                     greedy=True) for _ in range(3)]
        steps = stage.batch_stats.steps
        on.generate(reqs)
        assert 0 < len(calls) <= stage.batch_stats.steps - steps
        assert max(len(c) for c in calls) == 3 and all(len(set(c)) == len(c) for c in calls)
        rids = {r for c in calls for r in c}
        assert {rid for s in settled for rid, n in s.items() if n == 0} >= rids  # every drafting row freed at the end
        assert any(n > 0 for s in settled for n in s.values())  # verified rows cropped to what they kept
    finally:
        drafter.propose, drafter.settle, drafter.lookup = inner_propose, inner_settle, lookup


def test_a_request_can_switch_speculation_off(on):
    """`speculative=False` (the API's `omnivox: {"speculative": false}`): that request drafts nothing,
    the others beside it still do."""
    stage = _thinker(on)
    drafter, s = stage.adapter.drafter, stage.batch_stats
    lookup, drafted = drafter.lookup, []
    drafter.lookup = lambda ids, k: drafted.append(len(ids)) or [7] * k
    try:
        base = dict(prompt_ids=chat([1000 + (k % 3) for k in range(12)]), max_tokens=8, return_audio=False, greedy=True)
        before = s.drafted
        on.generate(**dict(base, speculative=False))
        assert s.drafted == before and not drafted
        on.generate([dict(base, speculative=False), base])
        assert s.drafted > before and len(drafted) <= 8
    finally:
        drafter.lookup = lookup
