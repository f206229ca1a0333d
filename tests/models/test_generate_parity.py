"""End-to-end greedy generation equals transformers' `generate`: Thinker ids, codec codes
and waveform, over several configs and inputs (text, real speech, an image, a video) and
every stop rule (end token, codec EOS, both length limits)."""
from pathlib import Path

import numpy as np
import pytest
import torch

from omnivox import Omni
from omnivox.audio.io import load_audio
from omnivox.audio.mel import log_mel, num_audio_tokens
from omnivox.models.qwen3_omni.image_processor import num_vision_tokens, preprocess_image, preprocess_video
from omnivox.models.qwen3_omni.reference import generate_reference
from qwen_tiny import (AUDIO_END, AUDIO_PAD, AUDIO_START, IM_END, IMAGE_PAD, VARIANT, VIDEO_PAD, VISION_END,
                       VISION_START, build_reference, chat, reference_generate)

MEDIA = Path(__file__).parent.parent / "media"
# The engine streams the vocoder frame by frame; in float32 the conv stack amplifies
# last-bit differences of chunked matmuls ~20x (one-shot fp32 itself is ~1.5e-5 from fp64).
FP32_WAVE_ATOL = 3e-5


def check(omni, ref, ids, max_tokens=12, max_frames=24, atol=FP32_WAVE_ATOL, **kw):
    ref_media = kw.pop("ref_media", {})
    want_ids, want_codes, want_wav = reference_generate(ref, ids, max_tokens, max_frames, **ref_media)
    out = omni.generate(prompt_ids=ids, greedy=True, max_tokens=max_tokens, max_frames=max_frames,
                        speaker="ethan", **kw)
    assert out.text_ids == want_ids
    np.testing.assert_array_equal(out.codes, want_codes)
    assert out.audio.shape == want_wav.shape == (1920 * want_codes.shape[0] - 555,)
    assert np.abs(want_wav).std() > 0.05  # a waveform that is not near-silence
    np.testing.assert_allclose(out.audio, want_wav, rtol=0, atol=atol)
    return out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    ref = build_reference()
    folder = tmp_path_factory.mktemp("base")
    ref.save_pretrained(folder, max_shard_size="20MB")  # sharded, with an index
    return ref, Omni(model=folder, progress=False)


def test_text_only_hits_both_length_limits(base):
    ref, omni = base
    out = check(omni, ref, chat([1000, 2000, 3000]))
    assert out.finish_reason == "length" and len(out.text_ids) == 12 and out.codes.shape == (24, 16)


def test_speech_input(base):
    ref, omni = base
    wave = load_audio(MEDIA / "speech_16k.wav")
    feats = log_mel(wave)
    n = num_audio_tokens(feats.shape[-1])
    ids = chat([AUDIO_START, *[AUDIO_PAD] * n, AUDIO_END, 1000, 2000])
    check(omni, ref, ids, audio=[wave], ref_media=dict(
        input_features=feats[None], feature_attention_mask=torch.ones(1, feats.shape[-1], dtype=torch.long)))


def test_non_square_image_input(base):
    ref, omni = base
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (70, 130, 3), dtype=np.uint8)
    pix, grid = preprocess_image(image, omni.processor.vision)
    n = num_vision_tokens(grid, 2)
    ids = chat([VISION_START, *[IMAGE_PAD] * n, VISION_END, 1000])
    check(omni, ref, ids, images=[image], ref_media=dict(pixel_values=pix, image_grid_thw=torch.tensor([grid])))


def test_short_video_input(base):
    ref, omni = base
    frames = np.random.default_rng(1).integers(0, 256, (4, 64, 96, 3), dtype=np.uint8)
    pix, grid, spg = preprocess_video(frames, 5.0, omni.processor.vision)
    n = num_vision_tokens(grid, 2)
    ids = chat([VISION_START, *[VIDEO_PAD] * n, VISION_END, 1000])
    check(omni, ref, ids, videos=[(frames, 5.0)], ref_media=dict(
        pixel_values_videos=pix, video_grid_thw=torch.tensor([grid]), video_second_per_grid=torch.tensor([spg])))


def _forced(tmp_path_factory, name, edit, variant=None):
    ref = build_reference(variant)
    with torch.no_grad():
        edit(ref)
    folder = tmp_path_factory.mktemp(name)
    ref.save_pretrained(folder)
    return ref, Omni(model=folder, progress=False)


def test_stops_on_im_end(tmp_path_factory):
    ids = chat([1000, 2000, 3000])
    probe = build_reference()
    natural = reference_generate(probe, ids, 12, 4)[0]
    target = natural[4]
    assert IM_END not in natural[:5]

    def edit(ref):  # <|im_end|> shadows the 5th token, so the Thinker ends there
        w = ref.thinker.lm_head.weight
        w[IM_END] = w[target] * 1.001
    ref, omni = _forced(tmp_path_factory, "imend", edit)
    out = check(omni, ref, ids, max_tokens=12, max_frames=30)
    assert out.text_ids[-1] == IM_END and len(out.text_ids) == 5
    # the text stopped by itself; the random Talker's audio runs on to its 30-frame limit, so the
    # reply was cut after all: "length" (Request.limit "audio")
    assert out.codes.shape[0] == 30 and out.finish_reason == "length"


def test_stops_on_codec_eos(tmp_path_factory):
    ids = chat([1000, 2000, 3000])
    probe = build_reference()
    _, codes, _ = reference_generate(probe, ids, 12, 24)
    target = int(codes[6, 0])

    def edit(ref):  # codec EOS shadows code0 of frame 6
        w = ref.talker.codec_head.weight
        w[2150] = w[target] * 1.001
    ref, omni = _forced(tmp_path_factory, "eos", edit)
    out = check(omni, ref, ids, max_tokens=12, max_frames=24)
    assert 0 < out.codes.shape[0] < 24


def test_variant_config_float64(tmp_path_factory):
    ref = build_reference(VARIANT).double()
    folder = tmp_path_factory.mktemp("variant")
    ref.save_pretrained(folder)
    omni = Omni(model=folder, dtype="float64", progress=False)
    wave = load_audio(MEDIA / "speech_16k.wav")[:16000]
    feats = log_mel(wave)
    n = num_audio_tokens(feats.shape[-1])
    ids = chat([AUDIO_START, *[AUDIO_PAD] * n, AUDIO_END, 1000], system=False)
    check(omni, ref, ids, max_tokens=9, max_frames=14, atol=1e-9, audio=[wave], ref_media=dict(
        input_features=feats[None].double(), feature_attention_mask=torch.ones(1, feats.shape[-1], dtype=torch.long)))


def test_single_token_answer_gives_text_only(base):
    _, omni = base
    out = omni.generate(prompt_ids=chat([1000]), greedy=True, max_tokens=1, max_frames=10)
    assert len(out.text_ids) == 1 and out.codes.shape == (0, 16) and out.audio.size == 0


def test_talker_that_ends_before_its_first_frame_gives_empty_audio(tmp_path_factory):
    """transformers crashes when the Talker's first code0 is codec EOS; omnivox answers text only."""
    def edit(ref):
        w = ref.talker.codec_head.weight
        w[2150] = w.abs().max() * 50 * torch.sign(torch.randn(w.shape[1], generator=torch.Generator().manual_seed(0)))
    ref, omni = _forced(tmp_path_factory, "eos0", edit)
    try:
        out = omni.generate(prompt_ids=chat([1000, 2000]), greedy=True, max_tokens=5, max_frames=10)
        alone = generate_reference(omni, prompt_ids=chat([1000, 2000]), greedy=True, max_tokens=5, max_frames=10)
    finally:
        omni.close()
    assert len(out.text_ids) == 5 and out.codes.shape == (0, 16) and out.audio.size == 0
    assert out.text_ids == alone.text_ids and alone.codes.shape == (0, 16)


def test_folder_without_tokenizer_is_driven_by_ids(base):
    from omnivox.errors import InputError
    _, omni = base
    assert omni.tokenizer is None
    with pytest.raises(InputError, match="prompt_ids"):
        omni.generate([{"role": "user", "content": "hi"}])
    out = omni.generate(prompt_ids=chat([1000]), greedy=True, max_tokens=2, max_frames=2, return_audio=False)
    assert len(out.text_ids) == 2 and out.text == "" and out.audio.size == 0
