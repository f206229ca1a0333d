"""AuT audio encoder vs the transformers reference `thinker.model.audio_tower`, in float64."""
from pathlib import Path

import pytest
import torch

from omnivox.audio.io import load_audio
from omnivox.audio.mel import log_mel, num_audio_tokens
from omnivox.models.qwen3_omni.audio_encoder import AudioEncoder
from omnivox.models.qwen3_omni.config import AudioEncoderConfig

MEDIA = Path(__file__).resolve().parents[1] / "media"
ATOL = 1e-10  # fp64 round-off; the reference loops over windows, we batch them


def _pair(variant=None):
    """(reference tower in fp64, our encoder in fp64 with the same weights)."""
    from qwen_tiny import build_reference

    ref = build_reference(variant).thinker.model.audio_tower.double().eval()
    cfg = AudioEncoderConfig.from_hf(ref.config.to_dict())
    ours = AudioEncoder(cfg).double().eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


@pytest.fixture(scope="module")
def pair():
    return _pair()


def _features(*frames: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(128, t, generator=g, dtype=torch.float64) for t in frames]


@torch.no_grad()
def _reference(ref, feats: list[torch.Tensor]) -> torch.Tensor:
    lens = torch.tensor([f.shape[1] for f in feats])
    return ref(torch.cat(feats, dim=1), feature_lens=lens).last_hidden_state


@torch.no_grad()
def test_batch_of_three_clips_matches_reference(pair):
    ref, ours = pair
    feats = _features(1234, 70, 100)
    expected = _reference(ref, feats)
    out = ours(feats)
    assert out.shape == (161 + 9 + 13, 32) == expected.shape
    assert [num_audio_tokens(f.shape[1]) for f in feats] == [161, 9, 13]
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_long_speech_clip_matches_reference(pair):
    """>8 s of speech: 882 frames -> 115 tokens in two attention windows (104 + 11)."""
    from transformers import WhisperFeatureExtractor

    ref, ours = pair
    wave = load_audio(MEDIA / "speech_long_16k.wav")
    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400)
    proc = fe([wave], sampling_rate=16000, padding=True, truncation=False, return_attention_mask=True,
              return_tensors="pt")
    expected = ref(proc["input_features"][0].double(),
                   feature_lens=proc["attention_mask"].sum(-1)).last_hidden_state
    mel = log_mel(wave).double()
    assert mel.shape[1] == 882 and num_audio_tokens(mel.shape[1]) == 115
    out = ours([mel])
    assert out.shape == expected.shape == (115, 32)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_attention_is_windowed_per_clip(pair):
    """Frames >= 800 of a clip only reach tokens >= 104 (the second window), and never other clips."""
    _, ours = pair
    feats = _features(1234, 250)
    base = ours(feats)
    edited = [feats[0].clone(), feats[1]]
    edited[0][:, 800:] += 1.0
    out = ours(edited)
    assert torch.equal(out[:104], base[:104])
    assert torch.equal(out[161:], base[161:])
    assert (out[104:161] - base[104:161]).abs().amax(dim=1).min() > 1e-3  # every later token moved
    edited[0][:, 799] += 1.0  # the last frame of chunk 7 belongs to window 1
    assert not torch.equal(ours(edited)[:104], base[:104])


@torch.no_grad()
def test_chunk_padding_dependence_matches_reference(pair):
    """A short clip alone is padded to its own length, next to a 100-frame clip to 100 frames; the
    conv stem sees that padding (its last token changes, then attention spreads it), as in the reference."""
    ref, ours = pair
    short, full = _features(70, 100, seed=3)
    alone, together = ours([short]), ours([short, full])[:9]
    torch.testing.assert_close(alone, _reference(ref, [short]), atol=ATOL, rtol=0)
    torch.testing.assert_close(together, _reference(ref, [short, full])[:9], atol=ATOL, rtol=0)
    assert (alone - together).abs().max() > 1e-4


@torch.no_grad()
def test_short_clips_only(pair):
    """Every clip under one chunk: the window (max chunk tokens x 8) spans each whole clip."""
    ref, ours = pair
    feats = _features(37, 99, 1, 64, seed=5)
    torch.testing.assert_close(ours(feats), _reference(ref, feats), atol=ATOL, rtol=0)


@torch.no_grad()
def test_variant_config_matches_reference():
    from qwen_tiny import VARIANT

    ref, ours = _pair(VARIANT)
    assert len(ours.layers) == 3 and ours.proj2.out_features == 48
    feats = _features(250, 37, 1000, seed=7)
    out = ours(feats)
    assert out.shape == (33 + 5 + 130, 48)
    torch.testing.assert_close(out, _reference(ref, feats), atol=ATOL, rtol=0)


def test_loads_on_disk_names_strictly(tiny_reference):
    from safetensors.torch import load_file

    _, folder = tiny_reference
    prefix = "thinker.audio_tower."
    tensors = {k[len(prefix):]: v for k, v in load_file(folder / "model.safetensors").items() if k.startswith(prefix)}
    cfg = AudioEncoderConfig.from_hf(_audio_config(folder))
    ours = AudioEncoder(cfg)
    ours.load_state_dict(tensors, strict=True)
    assert len(tensors) == 7 + 16 * cfg.encoder_layers + 6  # stem + conv_out, layers, head (525 for the real model)
    assert "positional_embedding" not in ours.state_dict()


def _audio_config(folder: Path) -> dict:
    import json

    return json.loads((folder / "config.json").read_text())["thinker_config"]["audio_config"]


@torch.no_grad()
def test_meta_build_then_reset_buffers(pair):
    """The loader builds on the meta device and calls reset_buffers(); the result must be unchanged."""
    _, ours = pair
    with torch.device("meta"):
        fresh = AudioEncoder(ours.cfg)
    fresh = fresh.to_empty(device="cpu").double()
    fresh.load_state_dict(ours.state_dict(), strict=True)
    fresh.reset_buffers()
    assert torch.equal(fresh.positional_embedding.double(), ours.positional_embedding)
    feats = _features(150, seed=9)
    assert torch.equal(fresh(feats), ours(feats))


@torch.no_grad()
def test_empty_inputs(pair):
    _, ours = pair
    assert ours([]).shape == (0, 32)
    feats = _features(120)
    torch.testing.assert_close(ours([torch.zeros(128, 0, dtype=torch.float64), feats[0]]), ours(feats))
