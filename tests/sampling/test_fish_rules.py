"""S2's sampling rules, batched on the counter noise (spec 10): fish-speech and SGLang-Omni modes."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from host_guard import no_host_reads
from omnivox.errors import InputError
from omnivox.models.fish_s2.sampler import FishSamplingParams
from per_row_rules import windowed_penalty as old_penalty
from per_row_rules import fish_filter_top_p_top_k as old_filter
from omnivox.models.fish_s2.tiny import TINY_CONFIG as CFG
from omnivox.sampling import noise
from omnivox.sampling.batched import penalize
from omnivox.sampling.fish_rules import (FishState, FishTensors, filter_top_p_top_k, recent_mask, sample_residual,
                                         sample_semantic, semantic_bias, sglang_repeat, tempered)

V = CFG.text.vocab_size
SEM = torch.arange(CFG.semantic_begin, CFG.semantic_end + 1)
A = CFG.semantic_begin + 7  # a semantic id the crafted logits favour


def randn(*shape, seed=0, scale=3.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def tensors(params, seeds=None):
    return FishTensors.build(params, list(range(len(params))) if seeds is None else seeds, "cpu")


def semantic_logits(batch, a_logit=None):
    """[B, V]: about 0 on the semantic ids (distinct even in bf16, so no ties), -1e9 elsewhere,
    `a_logit` on A."""
    x = torch.full((batch, V), -1e9)
    x[:, SEM] = -torch.arange(len(SEM)) * 1e-3
    if a_logit is not None:
        x[:, A] = a_logit
    return x


def kept(logits, top_p, top_k):
    out = filter_top_p_top_k(logits[None], torch.tensor([top_k]), torch.tensor([top_p]))[0][0]
    return set(torch.isfinite(out).nonzero().flatten().tolist())


def test_filter_equals_the_old_rule_on_tie_free_logits():
    x = randn(16, V, seed=1)
    top_p = torch.linspace(0.05, 1.0, 16)
    top_k = torch.tensor([0, 1, 2, 5, 30, 0, 100, 600] * 2)
    assert torch.equal(filter_top_p_top_k(x, top_k, top_p)[0], old_filter(x, top_p, top_k))
    two = filter_top_p_top_k(x, top_k, top_p, top_p.flip(0))  # one sort, two thresholds
    assert torch.equal(two[1], old_filter(x, top_p.flip(0), top_k))


def test_top_p_removes_crossing_token_and_top_k():
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    assert kept(logits, 0.7, 0) == {0}  # HF would keep {0, 1}
    assert kept(logits, 0.85, 0) == {0, 1}
    assert kept(logits, 0.1, 0) == {0}  # rank 0 always kept
    x = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    assert kept(x, 1.0, 2) == {0, 1}
    assert kept(x, 1.0, 1) == {0}
    assert kept(torch.tensor([1.0, 2.0, 2.0, 0.0]), 1.0, 1) == {1}  # a tie at the cut breaks by id


def test_filter_before_temperature():
    logits = randn(V, seed=0)
    biased = logits + semantic_bias(CFG, V, "cpu")
    survivors = kept(biased, 0.7, 20)
    assert len(survivors) > 1
    n = 2000
    for temp in (0.1, 1.0, 5.0):
        p = FishSamplingParams(temperature=temp, top_p=0.7, top_k=20)
        tokens = sample_semantic(logits.expand(n, V), tensors([p] * n), FishState.fresh(n), CFG)  # prefill step
        seen = set(tokens.tolist())
        assert seen <= survivors  # the surviving set ignores temperature
        if temp == 5.0:
            assert seen == survivors  # a hot draw reaches every survivor, no more


@pytest.mark.parametrize("mode", ["fish", "sglang"])
def test_draw_frequencies_match_the_filtered_softmax(mode):
    """1e5 prefill draws over seeds (a 24-id vocabulary, 16 of them semantic, so it runs fast)
    against softmax(tempered(old filter)): chi-square below the p = 1e-3 quantile (Wilson-Hilferty)."""
    cfg, vocab = SimpleNamespace(semantic_begin=4, semantic_end=19, eos_id=2), 24
    logits = torch.randperm(vocab, generator=torch.Generator().manual_seed(5)) * 0.2 - 2.0  # no ties, even in bf16
    p = FishSamplingParams(temperature=0.7, top_p=0.9, top_k=8, mode=mode)
    x = logits + semantic_bias(cfg, vocab, "cpu")
    if mode == "sglang":
        x = x.bfloat16().float()
    probs = tempered(old_filter(x[None], torch.tensor([0.9]), torch.tensor([8])), torch.tensor([0.7]))
    probs = probs[0].softmax(-1).double()
    n = 100_000
    tokens = sample_semantic(logits.expand(n, vocab), tensors([p] * n), FishState.fresh(n), cfg)
    counts = torch.bincount(tokens, minlength=vocab).double()
    support = probs > 0
    assert counts[~support].sum() == 0
    dof = int(support.sum()) - 1
    chi2 = float(((counts[support] - n * probs[support]) ** 2 / (n * probs[support])).sum())
    assert dof >= 3 and chi2 < dof * (1 - 2 / (9 * dof) + 3.0902 * (2 / (9 * dof)) ** 0.5) ** 3
    assert float((counts / n - probs).abs().max()) < 0.01


def test_constrained_decoding_in_both_modes_and_mixed_batches():
    logits = torch.zeros(6, V)
    logits[:, 5:100] = 1e4  # huge text logits
    logits[:, 400:] = 1e4
    params = [FishSamplingParams(temperature=2.0, top_p=1.0, top_k=0 if i % 2 else 30,
                                 mode="fish" if i % 3 else "sglang") for i in range(6)]
    t, st = tensors(params), FishState.fresh(6)
    for _ in range(20):
        tok = sample_semantic(logits, t, st, CFG)
        assert bool((((tok >= CFG.semantic_begin) & (tok <= CFG.semantic_end)) | (tok == CFG.eos_id)).all())


def test_ras_takes_the_fallback_exactly_when_the_rule_says():
    """Normal draw forced to A (top_p 0.5 keeps only A); the RAS draw (temp 1, top_p 0.9) can
    pick others. Cases per row block: prefill with A windowed, decode with A windowed, decode
    without A, A outside a 3-long window, an sglang row with A windowed."""
    n = 64
    fish = FishSamplingParams(temperature=1.0, top_p=0.5, top_k=0)
    short = dataclasses.replace(fish, ras_window=3)
    sgl = FishSamplingParams(temperature=1.0, top_p=0.5, top_k=30, mode="sglang")
    params = [fish] * 3 * n + [short] * n + [sgl] * n
    st = FishState.fresh(5 * n)
    st.window[:n, -2] = A
    st.window[n:2 * n, 4] = A
    st.window[2 * n:3 * n] = SEM[20]
    st.window[3 * n:4 * n, 0] = A  # outside the last 3
    st.window[4 * n:, -1] = A
    st.steps[n:] = 3
    before = st.window.clone()
    logits = semantic_logits(5 * n, 5.0)  # p(A) ~ 0.7 untempered
    t = tensors(params)
    tokens = sample_semantic(logits, t, st, CFG)
    fallback_rows = torch.zeros(5 * n, dtype=torch.bool)
    fallback_rows[n:2 * n] = True
    assert bool((tokens[~fallback_rows] == A).all())
    # the fallback rows take the RAS draw: filter at top_p 0.9, temperature 1, RAS noise stream
    x = logits[n:2 * n] + semantic_bias(CFG, V, "cpu")
    ras = old_filter(x, torch.full((n,), 0.9), torch.zeros(n, dtype=torch.long))
    want = (ras + noise.gumbel(t.seed[n:2 * n], noise.FISH_RAS, torch.full((n,), 3), V)).argmax(-1)
    assert torch.equal(tokens[n:2 * n], want) and bool((want != A).any()) and bool((want == A).any())
    # windows: the prefill row and the sglang rows are untouched, fish decode rows shift in the token
    assert torch.equal(st.window[:n], before[:n]) and torch.equal(st.window[4 * n:], before[4 * n:])
    assert torch.equal(st.window[n:4 * n, -1], tokens[n:4 * n])
    assert torch.equal(st.window[n:4 * n, :-1], before[n:4 * n, 1:])
    assert torch.equal(st.history[:, -1], tokens) and bool((st.steps == torch.tensor([1] * n + [4] * 4 * n)).all())


def test_prefill_token_is_not_windowed_and_eos_is_never_replaced():
    p = FishSamplingParams(temperature=1.0, top_p=0.5, top_k=0)
    st = FishState.fresh(1)
    logits = semantic_logits(1, 5.0)
    assert int(sample_semantic(logits, tensors([p]), st, CFG)) == A and not st.window.any()
    assert int(sample_semantic(logits, tensors([p]), st, CFG)) == A  # zeros: A is no repeat
    assert int(st.window[0, -1]) == A
    outs = [int(sample_semantic(logits, tensors([p], [s]), st, CFG)) for s in range(30)]
    assert any(o != A for o in outs)  # A repeats -> fallback draws used
    eos = torch.full((1, V), -1e9)
    eos[0, CFG.eos_id] = 0.0
    st2 = FishState.fresh(1)
    st2.window[:] = CFG.eos_id
    st2.steps[:] = 5
    assert int(sample_semantic(eos, tensors([p]), st2, CFG)) == CFG.eos_id


def test_sglang_penalty_and_bf16_rounding():
    """top_k = 1 makes the draw deterministic: the token is the argmax of the processed logits."""
    b_id = A + 1
    rows = [("fish", [b_id], 16, 2.0, 2.1), ("sglang", [], 16, 2.0, 2.1), ("sglang", [b_id], 16, 2.0, 2.1),
            ("sglang", [b_id] + [A + 5] * 8, 4, 2.0, 2.1), ("sglang", [b_id], 16, -1.0, -0.95),
            ("fish", [], 16, 1.0, 1.0 + 2 ** -10), ("sglang", [], 16, 1.0, 1.0 + 2 ** -10)]
    want = [b_id, b_id, A, b_id, A, b_id, A]  # the last: equal in bf16, the lower id wins the tie
    logits = semantic_logits(len(rows), -5.0)
    st = FishState.fresh(len(rows))
    params = []
    for r, (mode, hist, window, a, b) in enumerate(rows):
        logits[r, SEM] = -5.0
        logits[r, A], logits[r, b_id] = a, b
        if hist:
            st.history[r, -len(hist):] = torch.tensor(hist)
        st.steps[r] = len(hist)
        params.append(FishSamplingParams(mode=mode, top_k=1, penalty_window=window))
    assert sample_semantic(logits, tensors(params), st, CFG).tolist() == want


def test_sglang_penalty_equals_the_old_rule():
    x = randn(8, V, seed=3)
    history = torch.randint(1, V, (8, 16), generator=torch.Generator().manual_seed(4))
    history[:, :5] = -1
    history[2, 7:] = history[2, 6]  # duplicates
    penalty = torch.linspace(1.0, 2.0, 8)
    for w in (4, 16):
        new = penalize(x, recent_mask(history, torch.full((8,), w), V), penalty)
        assert torch.equal(new, old_penalty(x, history[:, -w:], penalty))


def test_sglang_ras_trigger():
    def repeat(hist, steps, w=4):
        h = torch.full((1, 16), -1)
        if hist:
            h[0, -len(hist):] = torch.tensor(hist)
        return bool(sglang_repeat(h, torch.tensor([steps]), torch.tensor([w]))[0])
    assert repeat([5, 6, 5, 7], 4) and repeat([9, 9], 4) and repeat([1, 2, 3, 4, 8, 8], 12)
    assert not repeat([5, 6, 7, 8], 4) and not repeat([5, 5, 6, 7, 8], 5)  # the duplicate is older than 4
    assert not repeat([5, 6, 5, 7], 3)  # fewer than 4 drawn
    assert not repeat([], 9) and repeat([3, 1, 2, 3], 9, w=4) and not repeat([3, 1, 2, 3], 9, w=3)
    # a triggered row draws at ras temperature / top_p: A (p ~ 0.85) alone survives top_p 0.8, not 0.9
    n = 400
    logits = semantic_logits(2 * n, 5.878)
    st = FishState.fresh(2 * n)
    st.history[:, -4:] = torch.tensor([SEM[1], SEM[2], SEM[1], SEM[3]])
    st.history[n:, -2] = SEM[4]
    st.steps[:] = 4
    t = tensors([FishSamplingParams(mode="sglang")] * 2 * n)
    tokens = sample_semantic(logits, t, st, CFG)
    assert bool((tokens[n:] == A).all())
    x = (logits[:n] + semantic_bias(CFG, V, "cpu")).bfloat16().float()
    x = old_penalty(x, st.history[:n, :-1], torch.full((n,), 1.1))  # the history before this step's push
    kept_ras = old_filter(x, torch.full((n,), 0.9), torch.full((n,), 30))
    want = (kept_ras + noise.gumbel(t.seed[:n], noise.FISH_SEMANTIC, torch.full((n,), 4), V)).argmax(-1)
    assert torch.equal(tokens[:n], want) and bool((want != A).any())


def test_sglang_draws_are_keyed_on_seed_and_step():
    p = FishSamplingParams(mode="sglang", temperature=0.8, top_p=0.8, top_k=30)
    st = FishState.fresh(1)
    toks = [int(sample_semantic(semantic_logits(1, 20.0), tensors([p], [11]), st, CFG)) for _ in range(6)]
    assert toks[:4] == [A] * 4  # RAS needs >= 4 drawn tokens; penalty 1.1 cannot beat +20
    logits = randn(1, V, seed=1)
    runs = {}
    for key, seed in (("a", 11), ("b", 11), ("c", 12)):
        st = FishState.fresh(1)
        runs[key] = [int(sample_semantic(logits, tensors([p], [seed]), st, CFG)) for _ in range(8)]
    assert runs["a"] == runs["b"] != runs["c"]


def test_same_row_alone_or_in_a_mixed_batch_for_many_steps():
    others = [FishSamplingParams(mode="sglang", temperature=0.5), FishSamplingParams(temperature=1.3, top_k=0),
              FishSamplingParams(mode="sglang", top_k=3, greedy_residual=False), FishSamplingParams(top_p=0.95)]
    for target in (FishSamplingParams(), FishSamplingParams(mode="sglang")):
        params = others[:2] + [target] + others[2:] + others[:3]  # 8 rows, the target at 2
        alone, batched = FishState.fresh(1), FishState.fresh(8)
        t1 = tensors([target], [2**64 - 9])
        t8 = tensors(params, [11, 12, 2**64 - 9, 14, 15, 16, 17, 18])
        for step in range(30):
            logits = randn(8, V, seed=step, scale=2.0)
            logits[:, CFG.eos_id] = -10
            a = sample_semantic(logits[2:3], t1, alone, CFG)
            b = sample_semantic(logits, t8, batched, CFG)
            assert int(a[0]) == int(b[2])
            r = randn(8, CFG.codebook_size, seed=100 + step)
            assert int(sample_residual(r[2:3], t1, alone.steps, 1, 16)[0]) == \
                int(sample_residual(r, t8, batched.steps, 1, 16)[2])
        assert torch.equal(alone.window[0], batched.window[2]) and torch.equal(alone.history[0], batched.history[2])


def test_residual_codes():
    r = randn(4, CFG.codebook_size, seed=2)
    sgl = FishSamplingParams(mode="sglang")
    steps = torch.tensor([3, 3, 3, 3])
    assert torch.equal(sample_residual(r, tensors([sgl] * 4), steps, 1, 16), r.argmax(-1))
    masked = sample_residual(r, tensors([dataclasses.replace(sgl, mask_residual_overflow=True)] * 4), steps, 1, 16)
    assert torch.equal(masked, r[:, :16].argmax(-1))
    fish = FishSamplingParams(top_k=5, top_p=0.9)
    params = [fish, sgl, dataclasses.replace(fish, mask_residual_overflow=True), dataclasses.replace(fish, greedy_residual=True)]
    n = 500
    out = torch.stack([sample_residual(r, tensors(params, [s] * 4), steps, 2, 16) for s in range(n)])  # [n, 4]
    assert set(out[:, 0].tolist()) <= kept(r[0], 0.9, 5) and len(set(out[:, 0].tolist())) > 1
    assert bool((out[:, 1] == r[1].argmax()).all()) and bool((out[:, 3] == r[3].argmax()).all())
    assert set(out[:, 2].tolist()) <= kept(r[2, :16], 0.9, 5)
    assert not torch.equal(out[:, 0], torch.stack([sample_residual(r, tensors(params, [s] * 4), steps, 3, 16)
                                                   for s in range(n)])[:, 0])  # codebooks have own streams


@pytest.mark.parametrize("mode", ["fish", "sglang"])
@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_a_temperature_below_the_greedy_limit_is_argmax_in_both_ars(mode, temperature):
    """Greedy rows draw nothing: the argmax of the constrained (sglang: penalised) logits whatever
    the seed, even where RAS would resample a repeated token (fish: A repeats, so RAS would fire),
    and argmax residual codes; a sampling row beside them draws as it does alone."""
    greedy = FishSamplingParams(mode=mode, temperature=temperature)
    assert greedy.greedy and greedy.residual_is_greedy
    sampled = FishSamplingParams(mode=mode, greedy_residual=False)
    logits = semantic_logits(2, a_logit=0.5)
    runs = []
    for seed in range(4):
        st, alone = FishState.fresh(2), FishState.fresh(1)
        t, t1 = tensors([greedy, sampled], [seed, seed]), tensors([sampled], [seed])
        got = [sample_semantic(logits, t, st, CFG) for _ in range(6)]
        want_sampled = [int(sample_semantic(logits[1:], t1, alone, CFG)[0]) for _ in range(6)]
        assert [int(g[1]) for g in got] == want_sampled
        runs.append([int(g[0]) for g in got])
        r = randn(2, CFG.codebook_size, seed=seed)
        codes = sample_residual(r, t, st.steps, 1, 16)
        assert int(codes[0]) == int(r[0].argmax()) and int(codes[1]) == int(sample_residual(r[1:], t1, alone.steps, 1, 16)[0])
    want = int((logits[0] + semantic_bias(CFG, V, "cpu")).argmax()) if mode == "fish" else None
    assert all(run == runs[0] for run in runs)  # no seed changes a greedy row
    if want is not None:
        assert runs[0] == [want] * 6 == [A] * 6  # RAS never replaces the repeated argmax


def test_bad_rows_return_minus_one_and_leave_the_others_alone():
    params = [FishSamplingParams(), FishSamplingParams(mode="sglang"), FishSamplingParams(), FishSamplingParams(),
              FishSamplingParams(mode="sglang", greedy_residual=False)]
    logits = randn(5, V, seed=9)
    st_clean, st_bad = FishState.fresh(5), FishState.fresh(5)
    st_clean.steps[:] = st_bad.steps[:] = 6
    clean = sample_semantic(logits, tensors(params), st_clean, CFG)
    bad = logits.clone()
    bad[1, CFG.semantic_begin + 3] = float("nan")
    bad[2, CFG.semantic_begin + 5] = float("inf")
    bad[3, SEM] = float("-inf")
    bad[3, CFG.eos_id] = float("-inf")  # every allowed id at -inf (text ids may stay finite)
    got = sample_semantic(bad, tensors(params), st_bad, CFG)
    assert got.tolist() == [clean[0], -1, -1, -1, clean[4]]
    r = randn(5, CFG.codebook_size, seed=10)
    clean_r = sample_residual(r, tensors(params), st_clean.steps, 1, 16)
    r[[1, 2], 4] = float("nan")
    r[3, 0] = float("inf")
    assert sample_residual(r, tensors(params), st_clean.steps, 1, 16).tolist() == [clean_r[0], -1, -1, -1, clean_r[4]]


def test_flags_on_change_nothing():
    logits = randn(6, V, seed=11)
    for params in ([FishSamplingParams()] * 6, [FishSamplingParams(mode="sglang")] * 6):
        t = tensors(params)
        on = dataclasses.replace(t, any_fish=True, any_sglang=True, any_residual_sampled=True, any_overflow_mask=True,
                                 any_greedy=True)
        s1, s2 = FishState.fresh(6), FishState.fresh(6)
        for _ in range(8):
            assert torch.equal(sample_semantic(logits, t, s1, CFG), sample_semantic(logits, on, s2, CFG))
        r = randn(6, CFG.codebook_size, seed=12)
        assert torch.equal(sample_residual(r, t, s1.steps, 1, 16), sample_residual(r, on, s2.steps, 1, 16))


def test_build_checks_the_windows():
    with pytest.raises(InputError):
        tensors([FishSamplingParams(ras_window=11)])
    with pytest.raises(InputError):
        tensors([FishSamplingParams(penalty_window=17)])
    t = tensors([FishSamplingParams(mode="sglang", top_k=0), FishSamplingParams(mode="sglang", top_k=7),
                 FishSamplingParams(top_k=0)])
    assert t.semantic_top_k.tolist() == [30, 7, 0] and t.top_k.tolist() == [0, 7, 0]
    assert t.penalty.tolist() == [pytest.approx(1.1), pytest.approx(1.1), 1.0]


@pytest.mark.parametrize("which", ["semantic", "residual"])
def test_no_host_reads_and_op_count_independent_of_batch(which):
    counts = []
    for size in (1, 8, 32):
        params = [FishSamplingParams(mode="sglang" if i % 2 else "fish", greedy_residual=i % 3 == 0,
                                     mask_residual_overflow=i % 4 == 0) for i in range(size)]
        t = dataclasses.replace(tensors(params), any_fish=True, any_sglang=True, any_residual_sampled=True,
                                any_overflow_mask=True, any_greedy=True)
        st = FishState.fresh(size)
        st.steps[:] = 5
        logits = randn(size, V if which == "semantic" else CFG.codebook_size, seed=size)
        with no_host_reads() as mode:
            if which == "semantic":
                out = sample_semantic(logits, t, st, CFG)
            else:
                out = sample_residual(logits, t, st.steps, 1, 16)
        counts.append(mode.total)
        assert out.shape == (size,)
    assert counts[0] == counts[1] == counts[2], counts
