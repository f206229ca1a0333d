"""The engine batches requests without changing any answer: concurrent greedy requests
equal each request alone and transformers'; seeded sampling is batch-invariant; preemption,
chunked prefill and the prefix cache change nothing; cancelling frees every page."""
from pathlib import Path

import numpy as np
import pytest
import torch

from omnivox import Omni
from omnivox.audio.io import load_audio
from omnivox.audio.mel import log_mel, num_audio_tokens
from omnivox.engine.config import EngineConfig
from omnivox.engine.events import AudioChunk, Finished, TextDelta
from omnivox.models.qwen3_omni.image_processor import num_vision_tokens, preprocess_image
from omnivox.models.qwen3_omni.reference import generate_reference
from qwen_tiny import (AUDIO_END, AUDIO_PAD, AUDIO_START, IMAGE_PAD, VISION_END, VISION_START, chat,
                       reference_generate)

MEDIA = Path(__file__).parent.parent / "media"
# Streamed audio vs the one-shot decode in float32: the vocoder's conv stack amplifies
# last-bit differences of chunked matmuls ~20x; measured up to ~1.5e-5 (fp64 streaming is
# exact to 1e-14, see tests/models/test_code2wav.py).
STREAM_ATOL = 3e-5


@pytest.fixture(scope="module")
def ckpt(tiny_reference):
    return tiny_reference


@pytest.fixture(scope="module")
def omni(ckpt):
    # batch sizes are asserted (concurrent requests step together): fifo starts them at once, slack a
    # few a step while it measures its costs (tests/engine/test_slack_scheduling.py covers slack)
    o = Omni(model=ckpt[1], progress=False, engine_config=EngineConfig(scheduling="fifo"))
    yield o
    o.close()


def _requests(omni):
    """8 requests: different prompts, media and lengths."""
    wave = load_audio(MEDIA / "speech_16k.wav")
    feats = log_mel(wave)
    n_audio = num_audio_tokens(feats.shape[-1])
    image = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    pix, grid = preprocess_image(image, omni.processor.vision)
    n_img = num_vision_tokens(grid, 2)
    reqs = []
    for i in range(6):
        user = [1000 + 37 * i + k for k in range(2 + 3 * i)]
        reqs.append((dict(prompt_ids=chat(user, system=i % 2 == 0), max_tokens=6 + 2 * i, max_frames=8 + 3 * i), {}))
    reqs.append((dict(prompt_ids=chat([AUDIO_START, *[AUDIO_PAD] * n_audio, AUDIO_END, 500]), audio=[wave],
                      max_tokens=10, max_frames=12),
                 dict(input_features=feats[None], feature_attention_mask=torch.ones(1, feats.shape[-1], dtype=torch.long))))
    reqs.append((dict(prompt_ids=chat([VISION_START, *[IMAGE_PAD] * n_img, VISION_END, 501]), images=[image],
                      max_tokens=9, max_frames=15), dict(pixel_values=pix, image_grid_thw=torch.tensor([grid]))))
    return reqs


def test_concurrent_greedy_equals_alone_and_transformers(ckpt, omni):
    ref, _ = ckpt
    reqs = _requests(omni)
    handles = [omni.submit(greedy=True, speaker="ethan", **kw) for kw, _ in reqs]
    outs = []
    for h in handles:
        chunks, fin = [], None
        for ev in h:
            if isinstance(ev, AudioChunk):
                chunks.append(ev.samples)
            elif isinstance(ev, Finished):
                fin = ev
        outs.append((fin, np.concatenate(chunks)))
    stats = omni.engine.stats()
    for (kw, media), (fin, audio) in zip(reqs, outs):
        alone = generate_reference(omni, greedy=True, speaker="ethan", **kw)
        assert fin.text_ids == alone.text_ids
        np.testing.assert_array_equal(fin.codes, alone.codes)
        np.testing.assert_allclose(audio, alone.audio, rtol=0, atol=STREAM_ATOL)  # streamed == one-shot
        want_ids, want_codes, want_wav = reference_generate(ref, kw["prompt_ids"], kw["max_tokens"],
                                                            kw["max_frames"], **media)
        assert fin.text_ids == want_ids
        np.testing.assert_array_equal(fin.codes, want_codes)
        np.testing.assert_allclose(audio, want_wav, rtol=0, atol=1e-4)
        # speech started while the Thinker was still writing
        assert fin.first_audio_time < fin.text_done_time
    for stage in ("thinker", "talker", "code_predictor", "vocoder"):
        assert stats.stages[stage].max_batch >= 4, (stage, stats.stages[stage])
        assert stats.stages[stage].mean_batch > 1.5, (stage, stats.stages[stage])


def _sampled(omni, prompts, **kw):
    return omni.generate([dict(prompt_ids=p, seed=100 + i, temperature=0.8, top_k=40, max_tokens=7,
                               max_frames=10, **kw) for i, p in enumerate(prompts)])


def test_seeded_sampling_is_batch_invariant(omni):
    prompts = [chat([1200 + 11 * i + k for k in range(3 + i)]) for i in range(5)]
    together = _sampled(omni, prompts)
    for i, p in enumerate(prompts):
        alone = omni.generate(prompt_ids=p, seed=100 + i, temperature=0.8, top_k=40, max_tokens=7, max_frames=10)
        ref = generate_reference(omni, prompt_ids=p, seed=100 + i, temperature=0.8, top_k=40, max_tokens=7,
                                      max_frames=10)
        for other in (together[i], ref):
            assert other.text_ids == alone.text_ids
            np.testing.assert_array_equal(other.codes, alone.codes)
    assert len({tuple(o.text_ids) for o in together}) > 1  # really sampled, not one fixed answer


def _greedy_batch(omni, prompts, **kw):
    return omni.generate([dict(prompt_ids=p, greedy=True, max_tokens=10, max_frames=14, **kw) for p in prompts])


@pytest.mark.parametrize("scheduling", ["fifo", "slack"])
def test_preemption_with_poisoned_pages_changes_nothing(ckpt, omni, scheduling):
    """Under slack, Talker sequences are preempted while their last frame waits for text (found so:
    the recompute sampled that frame again, a repeated frame, until `TalkerAdapter.samples`)."""
    prompts = [chat([1300 + 7 * i + k for k in range(6 + 2 * i)]) for i in range(6)]
    expected = [generate_reference(omni, prompt_ids=p, greedy=True, max_tokens=10, max_frames=14) for p in prompts]
    # 12 pages of 4 tokens per stage: two prompts fit, but not their growth -> preemption
    tight = EngineConfig(kv_cache_mb=0.047, block_size=4, prefix_cache=False, poison_freed_pages=True,
                         scheduling=scheduling)
    small = Omni(model=ckpt[1], progress=False, engine_config=tight)
    try:
        got = _greedy_batch(small, prompts)
        stats = small.engine.stats()
    finally:
        small.close()
    assert stats.preemptions > 0
    for g, e in zip(got, expected):
        assert g.text_ids == e.text_ids
        np.testing.assert_array_equal(g.codes, e.codes)
        np.testing.assert_allclose(g.audio, e.audio, rtol=0, atol=STREAM_ATOL)
    assert stats.kv_pages_free == stats.kv_pages_total


def test_request_that_can_never_fit_fails_clearly(ckpt):
    small = Omni(model=ckpt[1], progress=False, engine_config=EngineConfig(kv_cache_mb=0.02, block_size=4))
    try:
        with pytest.raises(Exception, match="too large for the KV cache"):
            small.generate(prompt_ids=chat(list(range(1000, 1200))), max_tokens=5, max_frames=5)
        ok = small.generate(prompt_ids=chat([1000]), greedy=True, max_tokens=3, max_frames=2)
        assert len(ok.text_ids) == 3
    finally:
        small.close()


def test_chunked_prefill_gives_the_same_output(ckpt, omni):
    prompt = chat([1400 + k for k in range(45)])
    whole = omni.generate(prompt_ids=prompt, greedy=True, max_tokens=8, max_frames=10)
    chunked = Omni(model=ckpt[1], progress=False, engine_config=EngineConfig(token_budget=7))
    try:
        got = chunked.generate(prompt_ids=prompt, greedy=True, max_tokens=8, max_frames=10)
        steps = chunked.engine.stats().stages["thinker"].steps
    finally:
        chunked.close()
    assert steps >= len(prompt) // 7 + 8 - 1  # the prompt really went in several chunks
    assert got.text_ids == whole.text_ids
    np.testing.assert_array_equal(got.codes, whole.codes)


def test_prefix_cache_hits_repeats_and_keys_on_media(ckpt):
    o = Omni(model=ckpt[1], progress=False, engine_config=EngineConfig(block_size=4))
    try:
        img_a = np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        img_b = np.random.default_rng(2).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        pix, grid = preprocess_image(img_a, o.processor.vision)
        n = num_vision_tokens(grid, 2)
        prompt = chat([VISION_START, *[IMAGE_PAD] * n, VISION_END, *range(1500, 1520)])
        first = o.generate(prompt_ids=prompt, images=[img_a], greedy=True, max_tokens=6, max_frames=8)
        hits0 = o.engine.stats().prefix_hit_tokens
        again = o.generate(prompt_ids=prompt, images=[img_a], greedy=True, max_tokens=6, max_frames=8)
        hits1 = o.engine.stats().prefix_hit_tokens
        other = o.generate(prompt_ids=prompt, images=[img_b], greedy=True, max_tokens=6, max_frames=8)
        hits2 = o.engine.stats().prefix_hit_tokens
        fresh = generate_reference(o, prompt_ids=prompt, images=[img_b], greedy=True, max_tokens=6, max_frames=8)
    finally:
        o.close()
    assert hits0 == 0 and hits1 - hits0 >= len(prompt) - 8
    assert again.text_ids == first.text_ids
    np.testing.assert_array_equal(again.codes, first.codes)
    np.testing.assert_allclose(again.audio, first.audio, rtol=0, atol=1e-6)
    # a different image: only the blocks before the image (system turn + user header) may hit
    assert hits2 - hits1 <= 8
    assert other.text_ids == fresh.text_ids
    np.testing.assert_array_equal(other.codes, fresh.codes)


def test_cancel_mid_stream_returns_every_page(omni):
    handle = omni.submit(prompt_ids=chat(list(range(1600, 1640))), greedy=True, max_tokens=200, max_frames=200)
    seen = 0
    for ev in handle:
        if isinstance(ev, (TextDelta, AudioChunk)):
            seen += 1
            if seen == 6:
                handle.cancel()
        if isinstance(ev, Finished):
            assert ev.finish_reason == "abort"
            break
    stats = omni.engine.stats()
    assert stats.kv_pages_free == stats.kv_pages_total
    assert stats.in_flight == 0


def test_stream_events_in_order(omni):
    events = list(omni.stream(prompt_ids=chat([1700, 1701]), greedy=True, max_tokens=5, max_frames=6))
    kinds = [type(e).__name__ for e in events]
    assert kinds[-1] == "Finished" and "AudioChunk" in kinds and "TextDelta" in kinds
    chunks = [e for e in events if isinstance(e, AudioChunk)]
    first = chunks[0].frames  # 1, or more when steps are slow (auto first chunk)
    assert 1 <= first <= 4 and chunks[0].samples.shape == (first * 1920 - 555,)  # the lead dropped once
    assert sum(c.frames for c in chunks) == events[-1].codes.shape[0]
    assert all(a.time <= b.time for a, b in zip(events, events[1:]))
