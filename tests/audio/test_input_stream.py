"""Streaming resampler and causal log-mel: equal to the offline front end where they should be,
and bit-identical whatever the chunking."""
from pathlib import Path

import numpy as np
import pytest
import torch

from omnivox.audio.io import encode_pcm16, load_audio, resample
from omnivox.audio.mel import log_mel
from omnivox.audio.input_stream import CausalLogMel, StreamResampler, pcm16_to_float
from omnivox.errors import InputError

MEDIA = Path(__file__).resolve().parents[1] / "media"


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    return load_audio(MEDIA / "speech_16k.wav")


@pytest.fixture(scope="module")
def speech_24k_pcm(speech) -> bytes:
    """The committed speech as a realtime client sends it: 24 kHz pcm16."""
    return encode_pcm16(resample(speech, 16000, 24000))


def chunk_sizes(total: int, rate: int, seed: int, lo_ms: float = 20, hi_ms: float = 100) -> list[int]:
    rng = np.random.default_rng(seed)
    sizes, n = [], 0
    while n < total:
        sizes.append(int(rng.integers(int(lo_ms * rate / 1000), int(hi_ms * rate / 1000) + 1)))
        n += sizes[-1]
    return sizes


def split(x, sizes):
    out, i = [], 0
    for s in sizes:
        out.append(x[i:i + s])
        i += s
    return out


def stream(obj, pieces, push="push"):
    outs = [getattr(obj, push)(p) for p in pieces]
    return outs, obj.flush()


def resample_stream(x, orig, target, sizes, pcm=False):
    r = StreamResampler(orig, target)
    outs, tail = stream(r, split(x, sizes), "push_pcm16" if pcm else "push")
    return np.concatenate(outs + [tail])


def mel_stream(wave, sizes, **kw):
    fe = CausalLogMel(**kw)
    outs, tail = stream(fe, split(wave, sizes))
    return torch.cat(outs, dim=1), tail


@pytest.mark.parametrize("orig,target", [(24000, 16000), (16000, 24000), (48000, 16000), (22050, 16000),
                                         (8000, 16000), (16000, 16000)])
def test_resampler_equals_offline_resample(orig, target):
    x = (0.3 * np.random.default_rng(orig).standard_normal(orig // 2 + 77)).astype(np.float32)
    expected = resample(x, orig, target)
    out = resample_stream(x, orig, target, chunk_sizes(len(x), orig, seed=1))
    assert out.dtype == np.float32 and out.shape == expected.shape == (-(-len(x) * target // orig),)
    np.testing.assert_allclose(out, expected, atol=1e-6, rtol=0)  # float64 inside, one float32 rounding


def test_resampler_chunking_invariant_bitwise(speech_24k_pcm):
    """pcm16 bytes in 20-100 ms pieces, in byte pieces that split samples, and all at once."""
    whole = resample_stream(speech_24k_pcm, 24000, 16000, [len(speech_24k_pcm)], pcm=True)
    for seed in range(3):
        sizes = [2 * s for s in chunk_sizes(len(speech_24k_pcm) // 2, 24000, seed)]
        assert np.array_equal(resample_stream(speech_24k_pcm, 24000, 16000, sizes, pcm=True), whole)
    odd = chunk_sizes(len(speech_24k_pcm), 24000, seed=9, lo_ms=0.02, hi_ms=0.5)  # 1..12 bytes
    assert any(s % 2 for s in odd)
    assert np.array_equal(resample_stream(speech_24k_pcm, 24000, 16000, odd, pcm=True), whole)
    floats = pcm16_to_float(speech_24k_pcm)
    assert np.array_equal(resample_stream(floats, 24000, 16000, chunk_sizes(len(floats), 24000, 4)), whole)


def test_resampler_is_causal_with_small_lookahead():
    """An output sample is emitted once its filter's newest tap has arrived: for 24 -> 16 kHz,
    after 1 s of input all but the last ~10 outputs (15 input samples of look-ahead) are out."""
    r = StreamResampler(24000, 16000)
    out = r.push(np.zeros(24000, np.float32))
    assert 16000 - 11 <= len(out) < 16000 and r.samples_out == len(out)
    assert len(r.flush()) == 16000 - len(out)
    with pytest.raises(RuntimeError):
        r.push(np.zeros(10, np.float32))


def test_resampler_rejects_bad_input():
    r = StreamResampler(24000)
    with pytest.raises(InputError):
        r.push(np.array([0.0, np.nan]))
    with pytest.raises(InputError):
        r.push(np.zeros((2, 10)))
    r = StreamResampler(24000)
    r.push_pcm16(b"\x01\x02\x03")
    with pytest.raises(InputError):  # the stream ended inside a sample
        r.flush()


def test_fixed_peak_equals_reference_on_complete_windows(speech):
    """With the clip's own peak as a fixed floor, every frame whose window lies inside the clip is
    the reference's (the mel sum is reordered: ~1e-7); flush then ends at the reference count."""
    ref = log_mel(speech)
    peak = float(ref.max()) * 4.0 - 4.0  # back to log10 units
    out, tail = mel_stream(speech, chunk_sizes(len(speech), 16000, seed=0), peak=peak, running=False)
    assert out.shape[1] == (len(speech) - 40) // 160 and out.shape[1] + tail.shape[1] == ref.shape[1]
    torch.testing.assert_close(out, ref[:, :out.shape[1]], atol=1e-5, rtol=0)
    # a clip whose last window pokes past its end: that frame is not emitted until flush
    cut = speech[:160 * 100 + 30]
    ref_cut = log_mel(cut)
    out, tail = mel_stream(cut, [len(cut)], peak=float(ref_cut.max()) * 4 - 4, running=False)
    assert out.shape[1] == 99 and tail.shape[1] == 1 and ref_cut.shape[1] == 100
    torch.testing.assert_close(out, ref_cut[:, :99], atol=1e-5, rtol=0)
    assert (tail[:, 0] - ref_cut[:, 99]).abs().max() > 1e-3  # zeros past the end, not a reflection


def test_running_peak_floor(speech):
    """The running floor is never above the clip's: features are <= the reference's, and equal from
    the frame holding the clip's peak on."""
    ref = log_mel(speech)
    fe = CausalLogMel()
    out = torch.cat([fe.push(speech), fe.flush()], dim=1)
    assert out.shape == ref.shape
    assert (out <= ref + 1e-6).all()
    peak_frame = int(ref.amax(dim=0).argmax())
    torch.testing.assert_close(out[:, peak_frame:], ref[:, peak_frame:], atol=1e-5, rtol=0)
    assert abs(fe.peak - (float(ref.max()) * 4 - 4)) < 1e-5
    # a prior from an earlier turn: the floor starts there, so the early frames match too
    prior = CausalLogMel(peak=fe.peak)
    out = torch.cat([prior.push(speech), prior.flush()], dim=1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kw", [{}, {"peak": 0.5, "running": False}])
def test_log_mel_chunking_invariant_bitwise(speech, kw):
    whole, whole_tail = mel_stream(speech, [len(speech)], **kw)
    for seed in range(3):
        out, tail = mel_stream(speech, chunk_sizes(len(speech), 16000, seed), **kw)
        assert torch.equal(out, whole) and torch.equal(tail, whole_tail)
    out, tail = mel_stream(speech, chunk_sizes(len(speech), 16000, seed=5, lo_ms=0.1, hi_ms=12), **kw)
    assert torch.equal(out, whole) and torch.equal(tail, whole_tail)


def test_log_mel_start():
    """Frame 0 needs 201 samples (its reflect-padded left half mirrors x[1..200]); then one frame
    per 160 samples, each emitted when its window ends."""
    x = (0.1 * np.random.default_rng(0).standard_normal(1000)).astype(np.float32)
    fe = CausalLogMel()
    assert fe.push(x[:200]).shape == (128, 0) and fe.peak is None
    assert fe.push(x[200:201]).shape == (128, 1)
    assert fe.push(x[201:359]).shape == (128, 0)
    assert fe.push(x[359:360]).shape == (128, 1)  # frame 1: x[-40:360], reflected on the left
    ref = log_mel(x)
    out = torch.cat([CausalLogMel(peak=float(ref.max()) * 4 - 4, running=False).push(x)], dim=1)
    torch.testing.assert_close(out, ref[:, :out.shape[1]], atol=1e-5, rtol=0)
    assert CausalLogMel().flush().shape == (128, 0)
    with pytest.raises(ValueError):
        CausalLogMel(running=False)


def test_resampler_one_large_append_equals_small_ones_in_bounded_memory():
    """A 60 s append (as one 15 MiB realtime append could carry) gives the output of 20 ms appends,
    bit for bit, while its peak allocation stays a few times the append's own size (the filter's
    work arrays are per 1 s window; taken whole they would be ~31 float64 per output sample)."""
    import tracemalloc
    rng = np.random.default_rng(3)
    pcm = (rng.standard_normal(60 * 24000) * 4000).clip(-32768, 32767).astype("<i2").tobytes()
    small = StreamResampler(24000, 16000)
    step = 2 * 480
    ref = np.concatenate([small.push_pcm16(pcm[i:i + step]) for i in range(0, len(pcm), step)] + [small.flush()])
    big = StreamResampler(24000, 16000)
    tracemalloc.start()
    try:
        out = big.push_pcm16(pcm)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    out = np.concatenate([out, big.flush()])
    assert np.array_equal(out, ref)
    # the append is 2.9 MB; its float32 output 3.8 MB (twice, while concatenated); whole: ~250 MB
    assert peak < 8 * len(pcm), f"peak {peak / 1e6:.0f} MB for a {len(pcm) / 1e6:.1f} MB append"
