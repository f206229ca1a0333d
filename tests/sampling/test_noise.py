"""Counter-based noise: a pure function of (seed, stream, step, index), uniform and decorrelated."""
import math

import pytest
import torch

from host_guard import no_host_reads
from omnivox.sampling import noise

M64 = (1 << 64) - 1


def splitmix_reference(seed: int, stream: int, step: int, index: int) -> int:
    """The documented chain on Python ints (mod 2**64), as an unsigned 64-bit word."""
    def mix(x):
        x &= M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
        return x ^ (x >> 31)
    golden = 0x9E3779B97F4A7C15
    key = mix(mix(seed + mix(stream)) + step * golden)
    return mix(key + index * golden)


def rows(seeds, steps):
    return torch.tensor(seeds, dtype=torch.int64), torch.tensor(steps, dtype=torch.int64)


def test_bits_equal_the_python_reference():
    cases = [(0, 1, 0), (noise.seed_to_int64(2**64 - 1), 3, 7), (-12345, 0x205, 2**40), (2**62 + 3, 2, 999)]
    seed, step = rows([c[0] for c in cases], [c[2] for c in cases])
    for stream in {c[1] for c in cases}:
        got = noise.bits(seed, stream, step, 50)
        for b, (s, _, t) in enumerate(cases):
            want = [splitmix_reference(s, stream, t, i) for i in range(50)]
            assert [v & M64 for v in got[b].tolist()] == want


def test_deterministic_and_independent_of_the_batch():
    seed, step = rows([5, -7, 2**63 - 1, 0, 5], [0, 3, 8, 1, 9])
    u = noise.uniform(seed, noise.THINKER, step, 300)
    assert torch.equal(u, noise.uniform(seed, noise.THINKER, step, 300))
    perm = torch.tensor([3, 0, 4, 2, 1])
    assert torch.equal(noise.uniform(seed[perm], noise.THINKER, step[perm], 300), u[perm])
    for b in range(5):  # a row alone draws what it draws in the batch, and a shorter n is a prefix
        assert torch.equal(noise.uniform(seed[b:b + 1], noise.THINKER, step[b:b + 1], 120), u[b:b + 1, :120])
    g = noise.gumbel(seed, noise.TALKER, step, 300)
    assert torch.equal(noise.gumbel(seed[perm], noise.TALKER, step[perm], 300), g[perm])


def test_strictly_inside_the_open_interval_and_uniform():
    seed, step = rows(list(range(20)), [0] * 20)
    u = noise.uniform(seed, noise.FISH_SEMANTIC, step, 10_000).flatten()  # 2e5 draws
    assert u.dtype == torch.float32 and float(u.min()) > 0 and float(u.max()) < 1
    assert float(u.min()) >= 2.0 ** -24 and float(u.max()) <= 1 - 2.0 ** -24
    counts = torch.histc(u, bins=10, min=0, max=1).double()
    expected = u.numel() / 10
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 27.88  # chi-square, 9 degrees of freedom, p = 0.001
    assert abs(float(u.double().mean()) - 0.5) < 0.005  # sd of the mean: 0.29 / sqrt(2e5) = 6.5e-4


def test_gumbel_moments_and_finiteness():
    seed, step = rows(list(range(20)), list(range(20)))
    g = noise.gumbel(seed, noise.FISH_RAS, step, 10_000).double().flatten()
    assert bool(torch.isfinite(g).all()) and float(g.min()) > -3.7 and float(g.max()) < 36.8
    assert abs(float(g.mean()) - 0.5772156649) < 0.015  # sd of the mean: 1.28 / sqrt(2e5) = 2.9e-3
    assert abs(float(g.var()) - math.pi ** 2 / 6) < 0.05


def corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


@pytest.mark.parametrize("change", ["stream", "step", "seed", "index"])
def test_neighbouring_keys_are_decorrelated(change):
    """Changing one key by one gives noise with correlation ~0 (|r| < 0.02, 6 sd at n = 1e5)."""
    seeds, steps = list(range(10)), list(range(10))
    seed, step = rows(seeds, steps)
    base = noise.uniform(seed, noise.code_predictor(1), step, 10_001)
    if change == "stream":
        other = noise.uniform(seed, noise.code_predictor(2), step, 10_001)
    elif change == "step":
        other = noise.uniform(seed, noise.code_predictor(1), step + 1, 10_001)
    elif change == "seed":
        other = noise.uniform(seed + 1, noise.code_predictor(1), step, 10_001)
    else:
        base, other = base[:, :-1], base[:, 1:]
    assert abs(corr(base, other)) < 0.02
    assert float((base == other).double().mean()) < 1e-3


def test_streams_are_distinct():
    streams = [noise.THINKER, noise.TALKER, noise.FISH_SEMANTIC, noise.FISH_RAS,
               *(noise.code_predictor(g) for g in range(1, 32)), *(noise.fish_residual(p) for p in range(1, 16))]
    assert len(set(streams)) == len(streams)


def test_seed_mapping():
    assert noise.seed_to_int64(0) == 0
    assert noise.seed_to_int64(2**64 - 1) == -1 == noise.seed_to_int64(-1)
    assert noise.seed_to_int64(2**63) == -2**63
    assert noise.seed_to_int64(2**63 - 1) == 2**63 - 1
    assert noise.seed_to_int64(2**64 + 5) == 5
    with pytest.raises(TypeError):
        noise.seed_to_int64(True)
    with pytest.raises(TypeError):
        noise.seed_to_int64(1.5)
    s = noise.draw_seed()
    assert 0 <= s < 2**63 and noise.seed_to_int64(s) == s and noise.draw_seed() != s


def test_no_host_reads():
    seed, step = rows([1, 2, 3], [4, 5, 6])
    with no_host_reads() as mode:
        noise.gumbel(seed, noise.THINKER, step, 64)
    assert mode.total > 0
    with pytest.raises(AssertionError):  # the guard is not vacuous
        with no_host_reads():
            seed[seed > 1]
    with pytest.raises(AssertionError):
        with no_host_reads():
            int(seed.sum())
