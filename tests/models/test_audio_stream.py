"""Incremental, windowed AuT: equal to the one-shot encoder with the same window, rows out as soon as
their window is complete; and the whole causal path's distance from the reference on real speech."""
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from omnivox.audio.io import encode_pcm16, load_audio, resample
from omnivox.audio.mel import log_mel, num_audio_tokens
from omnivox.audio.input_stream import CausalLogMel, StreamResampler
from omnivox.models.qwen3_omni.audio_encoder import AudioEncoder
from omnivox.models.qwen3_omni.audio_stream import AudioStreamEncoder, window_chunks_for
from omnivox.models.qwen3_omni.config import AudioEncoderConfig
from omnivox.models.qwen3_omni.demo import TINY_CONFIG
from omnivox.models.qwen3_omni.random_init import randomize_

MEDIA = Path(__file__).resolve().parents[1] / "media"


@pytest.fixture(scope="module")
def encoder() -> AudioEncoder:
    """The demo model's AuT shape (spec 2.2) with seeded weights that make every block matter."""
    enc = AudioEncoder(AudioEncoderConfig.from_hf(TINY_CONFIG["thinker_config"]["audio_config"]))
    randomize_(enc.named_parameters(), seed=0)
    return enc.double().eval()


def _feats(frames: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(128, frames, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _pieces(frames: int, seed: int, hi: int = 80) -> list[int]:
    rng, sizes = np.random.default_rng(seed), []
    while sum(sizes) < frames:
        sizes.append(int(rng.integers(1, hi + 1)))
    return sizes


def _incremental(stream: AudioStreamEncoder, feats: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    state, outs, i = stream.new_state(), [], 0
    for s in sizes:
        outs.append(stream.push(state, feats[:, i:i + s]))
        i += s
    outs.append(stream.flush(state))
    assert state.tokens_out == sum(o.shape[0] for o in outs)
    return torch.cat(outs)


@torch.no_grad()
@pytest.mark.parametrize("frames", [1234, 800, 250, 100, 199, 70, 1])
@pytest.mark.parametrize("window", [1, 2, 3, 8])
def test_incremental_equals_one_shot_fp64(encoder, frames, window):
    feats = _feats(frames, seed=frames + window)
    one_shot = encoder([feats], window_chunks=window)
    out = _incremental(AudioStreamEncoder(encoder, window), feats, _pieces(frames, seed=window))
    assert out.shape == one_shot.shape == (num_audio_tokens(frames), 32)
    torch.testing.assert_close(out, one_shot, atol=1e-12, rtol=0)


@torch.no_grad()
def test_incremental_equals_one_shot_fp32(encoder):
    enc32 = AudioEncoder(encoder.cfg).eval()
    enc32.load_state_dict({k: v.float() for k, v in encoder.state_dict().items()})
    for frames, window in [(1234, 1), (1234, 3), (555, 8), (80, 2)]:
        feats = _feats(frames, seed=frames, dtype=torch.float32)
        out = _incremental(AudioStreamEncoder(enc32, window), feats, _pieces(frames, seed=7))
        torch.testing.assert_close(out, enc32([feats], window_chunks=window), atol=1e-5, rtol=0)


@torch.no_grad()
def test_rows_come_out_when_their_window_is_complete(encoder):
    """Window of 2 chunks (2 s): 26 rows per 200 frames, emitted by the push that completes them,
    and never changed by later audio; the tail (partial chunk + open window) waits for flush."""
    stream = AudioStreamEncoder(encoder, window_chunks=2)
    feats = _feats(530, seed=1)
    state = stream.new_state()
    assert stream.push(state, feats[:, :199]).shape[0] == 0
    first = stream.push(state, feats[:, 199:200])
    assert first.shape[0] == 26
    assert stream.push(state, feats[:, 200:399]).shape[0] == 0
    assert stream.push(state, feats[:, 399:530]).shape[0] == 26  # 400 frames complete window 1
    tail = stream.flush(state)
    assert tail.shape[0] == num_audio_tokens(530) - 52 == 17  # chunk 4 (13) + 30 frames (4)
    with pytest.raises(RuntimeError):
        stream.push(state, feats[:, :1])
    edited = feats.clone()
    edited[:, 200:] += 1.0
    state = stream.new_state()
    # the same rows from one push of 200 frames as from 199 + 1; later audio changes nothing. Not
    # bit-equal: the CPU's conv/matmul kernels may split differently by input length (fp64 ulps)
    torch.testing.assert_close(stream.push(state, edited[:, :200]), first, atol=1e-12, rtol=0)


@torch.no_grad()
def test_default_window_is_the_reference(encoder):
    assert AudioStreamEncoder(encoder).window_chunks == encoder.chunks_per_window == 8
    feats = _feats(1234, seed=3)
    assert torch.equal(encoder([feats], window_chunks=8), encoder([feats]))
    torch.testing.assert_close(_incremental(AudioStreamEncoder(encoder), feats, [1234]), encoder([feats]),
                               atol=1e-12, rtol=0)
    cfg = encoder.cfg
    assert [window_chunks_for(s, cfg) for s in (0.2, 1, 1.4, 2, 8)] == [1, 1, 1, 2, 8]
    with pytest.raises(ValueError):
        AudioStreamEncoder(encoder, window_chunks=0)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a, b, dim=1)


@torch.no_grad()
def test_causal_path_close_to_reference_on_speech(encoder):
    """The committed speech as a realtime client sends it (24 kHz pcm16, 40 ms pieces) through the
    streaming resampler, the causal log-mel (running peak) and a 1 s window, against the reference
    front end (whole-clip floor, reflect padding) and the reference 8 s window on the 16 kHz file.
    Measured when written (this fixture's seeded weights): features max 0.82 / mean 0.0059; row
    cosine mean 0.9866 / min 0.9493, nearly all of it from the window (the reference features
    through the same 1 s window: 0.9865 / 0.9493; the causal features through the 8 s window:
    min > 0.9999). The bounds are loose on purpose: they catch a broken front end or window."""
    wave = load_audio(MEDIA / "speech_16k.wav")
    pcm = encode_pcm16(resample(wave, 16000, 24000))
    resampler, mel, stream = StreamResampler(24000, 16000), CausalLogMel(), AudioStreamEncoder(encoder, 1)
    state, feats, rows = stream.new_state(), [], []
    for i in range(0, len(pcm), 1920):
        f = mel.push(resampler.push_pcm16(pcm[i:i + 1920]))
        feats.append(f)
        rows.append(stream.push(state, f))
    feats += [mel.push(resampler.flush()), mel.flush()]
    rows += [stream.push(state, feats[-2]), stream.push(state, feats[-1]), stream.flush(state)]
    feats, rows = torch.cat(feats, dim=1), torch.cat(rows)

    ref_feats = log_mel(wave)
    ref_rows = encoder([ref_feats.double()])
    assert feats.shape == ref_feats.shape == (128, 252) and rows.shape == ref_rows.shape == (33, 32)
    diff = (feats - ref_feats).abs()
    assert diff.max() < 1.0 and diff.mean() < 0.01
    assert (feats[:, 30:] - ref_feats[:, 30:]).abs().mean() < 0.005  # past the running peak's climb
    cos = _cosine(rows, ref_rows)
    print(f"causal vs reference: features max {diff.max():.4f} mean {diff.mean():.5f}; "
          f"rows cosine mean {cos.mean():.4f} min {cos.min():.4f}")
    assert cos.mean() > 0.98 and cos.min() > 0.93
    # nearly all of that is the window: the reference features through the 1 s window score the same,
    same_window = _cosine(_incremental(stream, ref_feats.double(), [252]), ref_rows)
    assert abs(same_window.mean() - cos.mean()) < 1e-3
    # and the causal features through the reference window are close to the reference rows
    front_end_only = _cosine(_incremental(AudioStreamEncoder(encoder), feats.double(), [252]), ref_rows)
    print(f"front end only (8 s window): cosine min {front_end_only.min():.6f}")
    assert front_end_only.min() > 0.999
