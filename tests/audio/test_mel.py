"""Log-mel front end vs transformers' WhisperFeatureExtractor as Qwen3-Omni's processor calls it."""
from pathlib import Path

import numpy as np
import pytest
import torch

from omnivox.audio.io import load_audio
from omnivox.audio.mel import log_mel, mel_filters, num_audio_tokens
from omnivox.errors import InputError

MEDIA = Path(__file__).resolve().parents[1] / "media"
CLIPS = ["speech_16k.wav", "speech_long_16k.wav", "speech_22k.flac"]


@pytest.fixture(scope="module")
def extractor():
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400)


def reference(extractor, waves: list[np.ndarray]) -> list[torch.Tensor]:
    """The valid frames the model receives: the processor's audio kwargs and attention mask."""
    out = extractor(waves, sampling_rate=16000, padding=True, truncation=False,
                    return_attention_mask=True, return_tensors="pt")
    lengths = out["attention_mask"].sum(-1).tolist()
    return [out["input_features"][i, :, :n] for i, n in enumerate(lengths)]


def noise_clip(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = 0.2 * rng.standard_normal(n).astype(np.float32)
    x[n // 3: n // 2] = 0.0  # a digital-silence stretch, so the (max - 8) floor binds
    return x


def test_filters_match_reference():
    from transformers.audio_utils import mel_filter_bank

    ref = mel_filter_bank(num_frequency_bins=201, num_mel_filters=128, min_frequency=0.0, max_frequency=8000.0,
                          sampling_rate=16000, norm="slaney", mel_scale="slaney")
    np.testing.assert_array_equal(mel_filters(), ref)


@pytest.mark.parametrize("name", CLIPS)
def test_speech_clip_matches_reference(extractor, name):
    wave = load_audio(MEDIA / name)
    (ref,) = reference(extractor, [wave])
    ours = log_mel(wave)
    assert ours.dtype == torch.float32 and ours.shape == (128, len(wave) // 160) == ref.shape
    # Same float32 operations in the same order: bit-identical today; 1e-5 is the contract.
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("n", [16001, 3333, 12345, 479, 48159])
def test_noise_clip_matches_reference(extractor, n):
    assert n % 160 != 0
    wave = noise_clip(n, seed=n)
    (ref,) = reference(extractor, [wave])
    ours = log_mel(wave)
    assert ours.shape == ref.shape == (128, n // 160)
    if n > 2000:  # the silent stretch spans whole frames: they sit on the (max - 8) floor
        assert abs(ours.min().item() - (ours.max().item() - 2.0)) < 1e-5
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_multi_clip_call_reproduced_with_pad_to(extractor):
    """Several clips in one processor call: shorter clips are zero-padded before the STFT and get
    ceil(len / 160) valid frames; `pad_to` reproduces that, plain `log_mel` does not."""
    waves = [noise_clip(n, seed=n) for n in (16001, 3333, 9120)]
    longest = max(len(w) for w in waves)
    refs = reference(extractor, waves)
    assert [r.shape[1] for r in refs] == [100, 21, 57]
    for wave, ref in zip(waves, refs):
        ours = log_mel(wave, pad_to=longest)
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    solo = log_mel(waves[1])
    assert solo.shape[1] == 20  # 3333 // 160 alone, 21 inside the call


def test_num_audio_tokens_spec_examples():
    assert [num_audio_tokens(t) for t in (100, 250, 1234, 70)] == [13, 33, 161, 9]
    assert num_audio_tokens(0) == 0 and num_audio_tokens(1) == 1 and num_audio_tokens(200) == 26


def test_num_audio_tokens_matches_transformers():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths as model_len
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths as proc_len

    frames = torch.arange(0, 3001)
    ours = torch.tensor([num_audio_tokens(int(t)) for t in frames])
    assert torch.equal(ours, proc_len(frames, 50))
    assert torch.equal(ours, model_len(frames, 50))


@pytest.mark.parametrize("bad", [np.zeros(200, np.float32), np.zeros(0, np.float32),
                                 np.zeros((2, 4000), np.float32)])
def test_unusable_waveform_raises_input_error(bad):
    with pytest.raises(InputError):
        log_mel(bad)
