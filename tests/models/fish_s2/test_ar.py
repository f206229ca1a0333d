"""Invariants 2.2.2-2.2.4 and 2.2.8: slow AR KV cache == full forward, MCF, fast AR incremental ==
teacher-forced (batched == per request, cache reuse without zeroing), interleaved bf16 RoPE."""
import math

import pytest
import torch

from omnivox.layers.attention import DenseKVCache
from omnivox.layers.rotary import rotate_half
from omnivox.models.fish_s2.blocks import apply_rope, rope_freqs, rope_tables
from omnivox.models.fish_s2.fast_ar import decode_frame
from omnivox.models.fish_s2.tiny import TINY_CONFIG, build_tiny_llm

CFG = TINY_CONFIG
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


@pytest.fixture(scope="module")
def models():
    return build_tiny_llm(seed=3)


def random_matrix(t: int, gen: torch.Generator, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] mixing text and semantic positions; codes [B, T, N] (c0 consistent)."""
    ids = torch.randint(0, CFG.semantic_begin, (batch, t), generator=gen)
    codes = torch.randint(0, CFG.codebook_size, (batch, t, CFG.num_codebooks), generator=gen)
    semantic = torch.rand(batch, t, generator=gen) < 0.5
    ids = torch.where(semantic, CFG.semantic_begin + codes[..., 0], ids)
    codes = torch.where(semantic[..., None], codes, 0)
    return ids, codes


def positions(b: int, start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n).expand(b, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_slow_cached_equals_full(models, dtype):
    slow = build_tiny_llm(seed=3)[0].to(dtype)
    gen = torch.Generator().manual_seed(0)
    ids, codes = random_matrix(24, gen)
    b, t = ids.shape
    with torch.no_grad():
        full = slow.logits(slow(ids, codes, positions(b, 0, t)).hidden)  # [B, T, V]
        for splits in ([t], [5, 7, 12], [1, 1, 10, 12], [16, 8]):
            cache, got, start = DenseKVCache(), [], 0
            for n in splits:
                out = slow(ids[:, start:start + n], codes[:, start:start + n], positions(b, start, n), cache)
                got.append(slow.logits(out.hidden))
                start += n
            torch.testing.assert_close(torch.cat(got, 1), full, rtol=TOL[dtype], atol=TOL[dtype])
        # prefill then one-token decode steps, each fed back as a full column
        cache = DenseKVCache()
        pre = slow(ids[:, :10], codes[:, :10], positions(b, 0, 10), cache)
        got = [slow.logits(pre.hidden)]
        for p in range(10, t):
            got.append(slow.logits(slow(ids[:, p:p + 1], codes[:, p:p + 1], positions(b, p, 1), cache).hidden))
        torch.testing.assert_close(torch.cat(got, 1), full, rtol=TOL[dtype], atol=TOL[dtype])


def test_mcf_embedding(models):
    slow = models[0].double()
    gen = torch.Generator().manual_seed(1)
    ids, codes = random_matrix(12, gen)
    text = (ids < CFG.semantic_begin) | (ids > CFG.semantic_end)
    noisy = torch.where(text[..., None], torch.randint(0, CFG.codebook_size, codes.shape, generator=gen), codes)
    pos = positions(2, 0, 12)
    with torch.no_grad():
        assert torch.equal(slow(ids, codes, pos).hidden, slow(ids, noisy, pos).hidden)
        emb = slow.embed(ids, codes)
        b, p = torch.nonzero(~text)[0].tolist()
        cb = slow.codebook_embeddings.weight
        expect = (slow.embeddings.weight[ids[b, p]]
                  + sum(cb[i * CFG.codebook_size + codes[b, p, i]] for i in range(CFG.num_codebooks)))
        expect = expect / math.sqrt(CFG.num_codebooks + 1)
        torch.testing.assert_close(emb[b, p], expect, rtol=1e-12, atol=1e-12)
        assert int(codes[b, p, 0]) == int(ids[b, p]) - CFG.semantic_begin
        b, p = torch.nonzero(text)[0].tolist()
        assert torch.equal(emb[b, p], slow.embeddings.weight[ids[b, p]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fast_incremental_equals_teacher_forced(models, dtype):
    fast = build_tiny_llm(seed=3)[1].to(dtype)
    gen = torch.Generator().manual_seed(2)
    n = CFG.num_codebooks
    h = torch.randn(3, CFG.fast.dim, generator=gen, dtype=dtype)
    codes = torch.randint(0, CFG.codebook_size, (3, n), generator=gen)
    cache = fast.new_cache()
    with torch.no_grad():
        ref = fast.teacher_forced(h, codes)  # [B, N, K]
        for frame in range(3):  # cache reused across frames, never zeroed
            seen = []

            def forced(logits, p):
                seen.append(logits)
                return codes[:, p]
            if frame == 1:  # fill the cache with garbage from another frame first
                decode_frame(fast, h.flip(0), codes[:, 0].flip(0), cache, lambda lg, p: codes[:, p].flip(0))
            out = decode_frame(fast, h, codes[:, 0], cache, forced)
            assert torch.equal(out, codes)
            torch.testing.assert_close(torch.stack(seen, 1), ref[:, 1:], rtol=TOL[dtype], atol=TOL[dtype])
        zeroed = fast.new_cache()
        seen_fresh = []
        decode_frame(fast, h, codes[:, 0], zeroed, lambda lg, p: (seen_fresh.append(lg), codes[:, p])[1])
        torch.testing.assert_close(torch.stack(seen_fresh, 1), ref[:, 1:], rtol=TOL[dtype], atol=TOL[dtype])


def test_fast_batched_equals_per_request(models):
    fast = models[1].double()
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(4, CFG.fast.dim, generator=gen, dtype=torch.float64)
    c0 = torch.randint(0, CFG.codebook_size, (4,), generator=gen)
    greedy = lambda logits, p: logits.argmax(-1)  # noqa: E731
    with torch.no_grad():
        batched = decode_frame(fast, h, c0, fast.new_cache(), greedy)
        single = torch.cat([decode_frame(fast, h[i:i + 1], c0[i:i + 1], fast.new_cache(), greedy) for i in range(4)])
    assert torch.equal(batched, single)
    assert len({tuple(r) for r in batched.tolist()}) > 1


def test_rope_interleaved_and_bf16_tables():
    for head_dim, base, n in ((CFG.text.head_dim, CFG.text.rope_base, 300), (CFG.fast.head_dim, 1e6, 11),
                              (128, 1e6, 4096), (64, 1e4, 2048)):
        cos, sin = rope_tables(torch.arange(n), rope_freqs(head_dim, base))
        assert cos.dtype == torch.bfloat16 and sin.dtype == torch.bfloat16
        x = torch.randn(1, 2, n, head_dim)
        out = apply_rope(x, cos, sin)
        # reference: complex multiplication of consecutive pairs by bf16-rounded e^{i angle}
        z = torch.view_as_complex(x.reshape(1, 2, n, head_dim // 2, 2).contiguous())
        rot = torch.complex(cos.float(), sin.float())
        expect = torch.view_as_real(z * rot).flatten(-2)
        torch.testing.assert_close(out, expect, rtol=1e-6, atol=1e-6)
        exact = torch.arange(n)[:, None].float() * rope_freqs(head_dim, base)
        assert not torch.equal(cos.float(), exact.cos())  # tables really are rounded
        half = x * torch.cat((cos, cos), -1).float() + rotate_half(x) * torch.cat((sin, sin), -1).float()
        assert not torch.allclose(out, half, atol=1e-3)  # rotate-half is a different convention
    x = torch.randn(1, 1, 5, 16, dtype=torch.bfloat16)
    cos, sin = rope_tables(torch.arange(5), rope_freqs(16, 1e6))
    assert apply_rope(x, cos, sin).dtype == torch.bfloat16
