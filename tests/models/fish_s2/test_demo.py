"""The built-in S2 demo: written once into the cache, loaded like a real checkpoint, and its
codec has S2 Pro's time structure (2048 samples per frame at 44.1 kHz, the released windows)
while streaming exactly like the one-shot decode."""
import numpy as np
import pytest
import torch

from omnivox.models.fish_s2 import demo
from omnivox.models.fish_s2.demo import DEMO_CODEC, FISH_DEMO_VERSION, fish_demo_path
from omnivox.models.fish_s2.tiny import TINY_CONFIG, build_tiny_codec
from omnivox.models.fish_s2.weights import load_codec
from omnivox import FishTTS


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNIVOX_CACHE", str(tmp_path_factory.mktemp("cache")))
        (demo.cache_root() / "demo-fish-s2-v1").mkdir(parents=True)  # an old demo is never reused
        (demo.cache_root() / "demo-fish-s2-v1" / demo.MARKER).write_text("old")
        folder = fish_demo_path()
        assert folder.name == f"demo-fish-s2-v{FISH_DEMO_VERSION}" and FISH_DEMO_VERSION >= 2
        stamp = (folder / "codec.pth").stat().st_mtime_ns
        assert fish_demo_path() == folder and (folder / "codec.pth").stat().st_mtime_ns == stamp  # written once
        yield folder


def test_demo_codec_has_the_released_time_structure(demo_folder):
    codec = load_codec(demo_folder / "codec.pth")
    assert codec.cfg == DEMO_CODEC  # every size survives the round trip through shapes + codec_config.json
    cfg = codec.cfg
    assert (cfg.sample_rate, cfg.hop_length, cfg.encoder_rates, cfg.decoder_rates, cfg.downsample_factor) == (
        44100, 2048, (2, 4, 8, 8), (8, 8, 4, 2), (2, 2))
    assert (cfg.post_module.window, cfg.pre_module.window, cfg.encoder_transformer.window) == (128, 128, 512)
    assert cfg.semantic_codebook_size == TINY_CONFIG.codebook_size and cfg.num_codebooks == TINY_CONFIG.num_codebooks
    wave = torch.randn(1, 1, 44100, generator=torch.Generator().manual_seed(0)) * 0.1
    assert codec.encode(wave).shape == (1, 4, 22)  # ceil(44100 / 2048) frames of reference codes


def test_one_synthesized_frame_is_2048_samples(demo_folder):
    tts = FishTTS(demo_folder, progress=False)
    try:
        assert tts.is_demo and tts.sample_rate == 44100
        out = tts.speak("Hello there.", seed=1, max_frames=1, ignore_eos=True)
        assert out.codes.shape == (1, 4) and out.sample_rate == 44100
        assert out.audio.shape == (2048,) and np.isfinite(out.audio).all() and out.audio.std() > 1e-3
        three = tts.speak("Hello there.", seed=1, max_frames=3, ignore_eos=True)
        assert three.audio.shape == (3 * 2048,)
        np.testing.assert_allclose(three.audio[:2048], out.audio, atol=1e-5)  # causal: frame 0 is frame 0
    finally:
        tts.close()


def test_demo_codec_streams_exactly():
    codec = build_tiny_codec(seed=0, cfg=DEMO_CODEC).double()
    n = DEMO_CODEC.post_module.window + 12  # past the attention window
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, DEMO_CODEC.codebook_size, (1, DEMO_CODEC.num_codebooks, n), generator=g)
    codes[:, 0] = torch.randint(0, DEMO_CODEC.semantic_codebook_size, (1, n), generator=g)
    full = codec.decode(codes)
    assert full.shape == (1, 1, 2048 * n) and full.std() > 1e-3
    state, out, start = codec.init_stream(1, dtype=torch.float64), [], 0
    for size in [1, 2, 3, 7] * 40:
        if start >= n:
            break
        step = codec.decode_step(codes[..., start:start + size], state)
        assert step.shape[-1] == 2048 * min(size, n - start)
        out.append(step)
        start += size
    torch.testing.assert_close(torch.cat(out, dim=-1), full, rtol=1e-10, atol=1e-10)
