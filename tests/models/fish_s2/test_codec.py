"""Invariant 2.2.5: codec lengths, prefix invariance, exact streaming, encoder shape/causality."""
import random

import pytest
import torch

from omnivox.audio.io import load_audio
from omnivox.layers.streaming_conv import BatchedState
from omnivox.models.fish_s2.codec import CodecStreamState
from omnivox.models.fish_s2.reference import encode_reference
from omnivox.models.fish_s2.tiny import TINY_CODEC, build_tiny_codec

HOP = TINY_CODEC.hop_length
WINDOW = TINY_CODEC.post_module.window
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


@pytest.fixture(scope="module")
def codec64():
    return build_tiny_codec(seed=5).double()


def random_codes(b: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, TINY_CODEC.codebook_size, (b, TINY_CODEC.num_codebooks, n), generator=g)
    codes[:, 0] = torch.randint(0, TINY_CODEC.semantic_codebook_size, (b, n), generator=g)
    return codes


def test_length_and_prefix_invariance(codec64):
    n = 3 * WINDOW
    codes = random_codes(2, n, 0)
    full = codec64.decode(codes)
    assert full.shape == (2, 1, HOP * n)
    assert full.abs().max() < 1 and full.std() > 1e-3
    for k in (1, 5, WINDOW + 3):
        torch.testing.assert_close(codec64.decode(codes[..., :k]), full[..., :HOP * k], rtol=1e-12, atol=1e-12)


def stream(codec, codes: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    state = codec.init_stream(codes.shape[0], dtype=next(codec.parameters()).dtype)
    out, start = [], 0
    for c in chunks:
        out.append(codec.decode_step(codes[..., start:start + c], state))
        start += c
        assert all(k.shape[2] == WINDOW - 1 for k in state.post.keys)  # state stays bounded
    assert start == codes.shape[-1]
    return torch.cat(out, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_streaming_equals_offline(dtype):
    codec = build_tiny_codec(seed=5).to(dtype)
    n = 3 * WINDOW + 5
    codes = random_codes(2, n, 1)
    full = codec.decode(codes)
    rng = random.Random(0)
    rand = []
    while sum(rand) < n:
        rand.append(min(rng.randint(1, 6), n - sum(rand)))
    for size in (1, 2, 3, 7, None):
        chunks = rand if size is None else [1] + [size] * ((n - 1) // size) + ([(n - 1) % size] if (n - 1) % size else [])
        assert chunks[0] == 1 or size is None
        torch.testing.assert_close(stream(codec, codes, chunks), full, rtol=TOL[dtype], atol=TOL[dtype])


def test_stream_state_select_concat(codec64):
    """Rows of different requests can be regrouped between chunks (engine batching)."""
    a, b = random_codes(1, 20, 2), random_codes(1, 20, 3)
    sa, sb = codec64.init_stream(1, dtype=torch.float64), codec64.init_stream(1, dtype=torch.float64)
    first_a, first_b = codec64.decode_step(a[..., :1], sa), codec64.decode_step(b[..., :4], sb)
    both = CodecStreamState.concat([sb, sa])
    assert isinstance(both, BatchedState)
    rest = codec64.decode_step(torch.cat([b[..., 4:14], a[..., 1:11]]), both)
    tail_a = codec64.decode_step(a[..., 11:], both.select([1]))
    got_a = torch.cat([first_a, rest[1:], tail_a], -1)
    got_b = torch.cat([first_b, rest[:1]], -1)
    torch.testing.assert_close(got_a, codec64.decode(a), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_b, codec64.decode(b[..., :14]), rtol=1e-12, atol=1e-12)


def test_clamp_does_not_mutate(codec64):
    codes = random_codes(1, 10, 4)
    big = codes.clone()
    big[0, 1:, 3] = 60  # >= 16 residual entries: clamped to 15
    big[0, 0, 5] = 500  # >= 64 semantic entries: clamped to 63
    before = big.clone()
    out = codec64.decode(big)
    assert torch.equal(big, before)
    clamped = codes.clone()
    clamped[0, 1:, 3] = TINY_CODEC.codebook_size - 1
    clamped[0, 0, 5] = TINY_CODEC.semantic_codebook_size - 1
    torch.testing.assert_close(out, codec64.decode(clamped), rtol=0, atol=0)


def test_encoder_shape_range_causality(codec64):
    g = torch.Generator().manual_seed(6)
    length = HOP * 30 + 5
    audio = (torch.randn(1, 1, length, generator=g, dtype=torch.float64) * 0.3)
    codes = codec64.encode(audio)
    n = -(-length // HOP)
    assert codes.shape == (1, TINY_CODEC.num_codebooks, n)
    assert 0 <= int(codes.min()) and int(codes[:, 0].max()) < TINY_CODEC.semantic_codebook_size
    assert int(codes[:, 1:].max()) < TINY_CODEC.codebook_size
    assert len(set(codes[0, 0].tolist())) > 1
    for k in (1, 9, 20):  # frame-aligned prefixes give prefixes of the codes
        assert torch.equal(codec64.encode(audio[..., :HOP * k]), codes[..., :k])
    wav = codec64.decode(codes)
    assert wav.shape == (1, 1, HOP * n)


def test_encode_real_speech(tiny_codec):
    media = __import__("pathlib").Path(__file__).parents[2] / "media"
    wav = load_audio(media / "speech_22k.flac", target_sr=44100)
    codes = encode_reference(tiny_codec, media / "speech_22k.flac")
    assert codes.shape == (TINY_CODEC.num_codebooks, -(-len(wav) // HOP))
    assert int(codes[0].max()) < TINY_CODEC.semantic_codebook_size and int(codes[1:].max()) < TINY_CODEC.codebook_size


def test_chunked_one_shot_transformer_equals_full_mask(codec64):
    tf = codec64.quantizer.post_module
    x = torch.randn(2, 70, TINY_CODEC.post_module.dim, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(tf(x, chunk=9), tf(x, chunk=10 ** 6), rtol=1e-12, atol=1e-12)
