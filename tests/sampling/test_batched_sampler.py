"""The batched Qwen sampler: the per-row HF rules (tests/sampling/per_row_rules.py) on counter noise."""
import dataclasses

import pytest
import torch

from host_guard import no_host_reads
from omnivox.sampling import noise
from omnivox.sampling.batched import SamplingTensors, penalize, sample, seen_mask, warp
from omnivox.sampling.params import SamplingParams
from per_row_rules import apply_repetition_penalty
from per_row_rules import warp as old_warp

V = 64
GREEDY = SamplingParams(greedy=True)
PARAMS = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.2, top_p=0.8),
          SamplingParams(temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.3), GREEDY,
          SamplingParams(temperature=0.0, repetition_penalty=1.5), SamplingParams(), SamplingParams(top_k=1),
          SamplingParams(temperature=2.0, top_k=200, top_p=0.5)]


def randn(*shape, seed=0, scale=3.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def processed(row: torch.Tensor, p: SamplingParams, seen_ids, suppress) -> torch.Tensor:
    """What today's `choose` argmaxes on (greedy) or warps (sampled)."""
    x = apply_repetition_penalty(row, torch.tensor(sorted(seen_ids), dtype=torch.long), p.repetition_penalty)
    return x if suppress is None else x.masked_fill(suppress, float("-inf"))


def chi2_quantile(dof: int, z: float = 3.0902) -> float:
    """The p = 1e-3 upper quantile of chi-square (Wilson-Hilferty; within 2 % for dof >= 2)."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def batch(params, seeds=None, steps=None):
    n = len(params)
    return SamplingTensors.build(params, list(range(n)) if seeds is None else seeds,
                                 [0] * n if steps is None else steps, "cpu")


def test_build_rounds_like_todays_comparison():
    t = batch([SamplingParams(top_p=0.9), SamplingParams(top_p=0.3), GREEDY])
    assert t.top_p_cut[0] == torch.tensor(1 - 0.9, dtype=torch.float32)  # float32(0.0999...98), not 1 - f32(0.9)
    assert t.top_p_cut[0] != 1 - torch.tensor(0.9, dtype=torch.float32)
    assert t.greedy.tolist() == [False, False, True] and t.temperature[2] == 1.0
    assert (t.any_sampled, t.max_top_k, t.any_top_p, t.any_penalty) == (True, 0, True, False)


def test_greedy_rows_are_exact_argmax_with_penalty_and_suppression():
    logits = randn(8, V).bfloat16().float()  # bf16 values: many exact ties
    logits[3, 10] = logits[3, 11] = logits[3].max() + 1  # a tie for the top: first index wins
    hist = [[1, 2, 3], [], [int(logits[2].argmax()), 5], [], [int(logits[4].argmax())], [7, 7], [], [0]]
    suppress = torch.zeros(V, dtype=torch.bool)
    suppress[[0, 12, int(logits[0].argmax())]] = True
    t = batch(PARAMS, steps=list(range(8)))
    got = sample(logits, t, noise.TALKER, seen=seen_mask(hist, V, "cpu"), suppress=suppress)
    for b, p in enumerate(PARAMS):
        if p.is_greedy:
            assert int(got[b]) == int(torch.argmax(processed(logits[b], p, hist[b], suppress)))
    assert int(got[3]) == 10  # tie for the top: the first index, as torch.argmax
    assert int(got[4]) != int(logits[4].argmax())  # the penalty moved the greedy choice
    for b in range(8):
        assert 0 <= int(got[b]) < V and not suppress[got[b]]


def test_warp_equals_todays_rules_row_by_row():
    logits = randn(len(PARAMS), V, seed=1)
    hist = [[b, b + 1] for b in range(len(PARAMS))]
    t = batch(PARAMS)
    x = penalize(logits, seen_mask(hist, V, "cpu"), t.penalty)
    w = warp(x, t)
    for b, p in enumerate(PARAMS):
        want = processed(logits[b], p, hist[b], None)
        assert torch.equal(x[b], want)
        if not p.is_greedy:
            assert torch.equal(w[b], old_warp(want, p))


def test_ties_at_the_top_p_boundary_break_by_id():
    """bf16-valued logits tie often. Today's unstable sort keeps an unspecified subset of the tokens
    tied at the cut; ours (stable) keeps the highest ids. Same count, same set away from the cut."""
    x = randn(200, V, seed=2).bfloat16().float()
    params = [SamplingParams(top_p=0.2 + 0.1 * (b % 8)) for b in range(200)]
    w = warp(x, batch(params))
    for b, p in enumerate(params):
        old = torch.isfinite(old_warp(x[b], p))
        new = torch.isfinite(w[b])
        assert int(old.sum()) == int(new.sum())
        cut_value = x[b][new].min()
        assert torch.equal(old[x[b] != cut_value], new[x[b] != cut_value])
        tied = (x[b] == cut_value).nonzero().flatten()
        kept_tied = tied[new[tied]]
        assert torch.equal(kept_tied, tied[len(tied) - len(kept_tied):])  # the highest ids of the tie


def test_same_row_alone_or_in_any_batch_for_many_steps():
    p, seed = SamplingParams(temperature=1.1, top_k=30, top_p=0.95, repetition_penalty=1.2), 2**64 - 3
    others = [PARAMS[i % len(PARAMS)] for i in range(31)]
    for step in range(40):
        logits = randn(32, V, seed=100 + step)
        seen = randn(32, V, seed=200 + step) > 2
        alone = sample(logits[:1], batch([p], [seed], [step]), noise.THINKER, seen=seen[:1])
        for size, pos in ((8, 5), (32, 31)):
            params = others[:size - 1]
            params = params[:pos] + [p] + params[pos:]
            seeds = [7 * i + step for i in range(size)]
            seeds[pos] = seed
            rows = torch.arange(1, size)
            rows = torch.cat([rows[:pos], torch.tensor([0]), rows[pos:]])
            got = sample(logits[rows], batch(params, seeds, [step] * size), noise.THINKER, seen=seen[rows])
            assert int(got[pos]) == int(alone[0])


def test_steps_and_streams_change_the_draw():
    logits = torch.zeros(1, V)
    t = [batch([SamplingParams()], [3], [s]) for s in range(20)]
    draws = [int(sample(logits, ti, noise.THINKER)) for ti in t]
    assert len(set(draws)) > 10
    assert [int(sample(logits, ti, noise.TALKER)) for ti in t] != draws


@pytest.mark.parametrize("p", [SamplingParams(), SamplingParams(temperature=0.7, top_k=5),
                               SamplingParams(temperature=1.3, top_p=0.8),
                               SamplingParams(temperature=0.8, top_k=6, top_p=0.9)])
def test_frequencies_match_todays_warp(p):
    """1e5 draws of one fixed row (half over steps of one seed, half over seeds) against
    softmax(today's warp): chi-square below the p = 1e-3 quantile, removed ids never drawn."""
    logits = randn(16, seed=7, scale=1.5)
    probs = old_warp(logits, p).softmax(-1).double()
    n = 50_000
    over_steps = batch([p] * n, [12345] * n, list(range(n)))
    over_seeds = batch([p] * n, list(range(n)), [0] * n)
    draws = torch.cat([sample(logits.expand(n, -1), t, noise.THINKER) for t in (over_steps, over_seeds)])
    counts = torch.bincount(draws, minlength=16).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0
    expected = probs[kept] * 2 * n
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < chi2_quantile(int(kept.sum()) - 1)
    assert float((counts / (2 * n) - probs).abs().max()) < 0.01


def test_bad_rows_return_minus_one_and_leave_the_others_alone():
    params = [SamplingParams(temperature=0.9, top_k=8), GREEDY, SamplingParams(temperature=1.5, top_p=0.7),
              GREEDY, SamplingParams(), SamplingParams(temperature=0.01)]
    logits = randn(6, V, seed=3)
    t = batch(params, steps=[4] * 6)
    clean = sample(logits, t, noise.TALKER)
    bad = logits.clone()
    bad[1, 5] = float("nan")  # greedy row, NaN
    bad[2, 9] = float("inf")  # sampled row, +inf
    bad[3] = float("-inf")  # all -inf
    bad[5, 0] = 1e37  # finite, but / 0.01 overflows to +inf
    got = sample(bad, t, noise.TALKER)
    assert got.tolist() == [clean[0], -1, -1, -1, clean[4], -1]
    suppress_all = torch.ones(V, dtype=torch.bool)
    assert sample(logits, t, noise.TALKER, suppress=suppress_all).tolist() == [-1] * 6
    nan_sampled = logits.clone()
    nan_sampled[0, 3] = float("nan")
    assert sample(nan_sampled, t, noise.TALKER).tolist() == [-1, *clean[1:].tolist()]


def test_flags_on_change_nothing():
    """Graph capture runs every rule: each is the identity on its 'off' rows."""
    logits = randn(8, V, seed=4)
    seen = randn(8, V, seed=5) > 1
    for params in (PARAMS, [GREEDY] * 8, [SamplingParams(temperature=0.5)] * 8):
        t = batch(params, steps=[9] * 8)
        on = dataclasses.replace(t, any_sampled=True, max_top_k=V, any_top_p=True, any_penalty=True)
        assert torch.equal(sample(logits, t, noise.THINKER, seen=seen), sample(logits, on, noise.THINKER, seen=seen))


@pytest.mark.parametrize("suppress_rows", [False, True])
def test_no_host_reads_and_op_count_independent_of_batch(suppress_rows):
    vocab, counts = 3072, []
    for size in (1, 8, 32):
        params = [PARAMS[2]] + [PARAMS[i % len(PARAMS)] for i in range(1, size)]  # flags all on at every size
        t = batch(params, steps=list(range(size)))
        logits = randn(size, vocab, seed=size)
        seen = randn(size, vocab, seed=size + 1) > 2
        suppress = torch.zeros(size if suppress_rows else 1, vocab, dtype=torch.bool)
        suppress[:, -3:] = True
        with no_host_reads() as mode:
            out = sample(logits, t, noise.TALKER, seen=seen, suppress=suppress)
        counts.append(mode.total)
        assert out.shape == (size,)
    assert counts[0] == counts[1] == counts[2], counts
