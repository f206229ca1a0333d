"""Invariant 2.2.7: sampler rules (fish mode) and the SGLang-Omni mode."""
import pytest
import torch

from omnivox.errors import InputError
from omnivox.models.fish_s2.sampler import (FishSamplingParams, SemanticState, exponential_race, filter_top_p_top_k,
                                            make_generator, sample_residual, sample_semantic)
from omnivox.models.fish_s2.tiny import TINY_CONFIG as CFG

V = CFG.text.vocab_size


def kept(logits, top_p, top_k):
    out = filter_top_p_top_k(logits[None], torch.tensor([top_p]), torch.tensor([top_k]))[0]
    return set(torch.isfinite(out).nonzero().flatten().tolist())


def test_top_p_removes_crossing_token_and_top_k():
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    assert kept(logits, 0.7, 0) == {0}  # HF would keep {0, 1}
    assert kept(logits, 0.85, 0) == {0, 1}
    assert kept(logits, 0.1, 0) == {0}  # rank 0 always kept
    x = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    assert kept(x, 1.0, 2) == {0, 1}
    assert kept(x, 1.0, 1) == {0}


def test_filter_before_temperature():
    logits = torch.randn(V, generator=torch.Generator().manual_seed(0)) * 3
    for t in (0.1, 1.0, 5.0):
        p = FishSamplingParams(temperature=t, top_p=0.7, top_k=20, seed=1)
        seen = set()
        for s in range(200):
            st = SemanticState.fresh(1)
            seen.add(int(sample_semantic(logits[None], [p], st, [make_generator(s)], CFG)[0]))
        biased = logits.clone()
        biased[:CFG.semantic_begin] = float("-inf")
        biased[CFG.semantic_end + 1:] = float("-inf")
        biased[CFG.eos_id] = logits[CFG.eos_id]
        survivors = kept(biased, 0.7, 20)
        assert seen <= survivors  # the surviving set ignores temperature
        if t == 5.0:
            assert seen == survivors and len(survivors) > 1  # a hot draw reaches every survivor, no more


def test_exponential_race_is_categorical():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    g = make_generator(0)
    draws = torch.stack([exponential_race(probs[None], [g]) for _ in range(4000)]).flatten()
    counts = torch.bincount(draws, minlength=4).double()
    expected = probs.double() * 4000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27  # p = 0.001 with 3 degrees of freedom


@pytest.mark.parametrize("mode", ["fish", "sglang"])
def test_constrained_decoding(mode):
    logits = torch.zeros(4, V)
    logits[:, 5:100] = 1e4  # huge text logits
    logits[:, 400:] = 1e4
    p = [FishSamplingParams(temperature=2.0, top_p=1.0, top_k=0 if mode == "fish" else 30, mode=mode, seed=i)
         for i in range(4)]
    st = SemanticState.fresh(4)
    gens = [make_generator(i) for i in range(4)]
    for _ in range(20):
        t = sample_semantic(logits, p, st, gens, CFG)
        assert bool((((t >= CFG.semantic_begin) & (t <= CFG.semantic_end)) | (t == CFG.eos_id)).all())


def test_ras_fallback_exactly_on_repeat():
    """Normal draw is forced to token A; the RAS draw (temp 1, top_p 0.9) can pick others."""
    a = CFG.semantic_begin + 7
    logits = torch.full((1, V), -1e9)
    logits[0, CFG.semantic_begin:CFG.semantic_end + 1] = 0.0
    logits[0, a] = 5.0  # p(A) ~ 0.7 untempered: top_p 0.5 keeps only A for the normal draw
    p = [FishSamplingParams(temperature=1.0, top_p=0.5, top_k=0, seed=0)]
    st = SemanticState.fresh(1)
    g = [make_generator(0)]
    first = sample_semantic(logits, p, st, g, CFG)  # prefill: no RAS, not windowed
    assert int(first) == a and not st.window.any()
    second = sample_semantic(logits, p, st, g, CFG)  # window all zeros: A is not a repeat
    assert int(second) == a and int(st.window[0, -1]) == a
    outs = [int(sample_semantic(logits, p, st, g, CFG)) for _ in range(30)]
    assert any(o != a for o in outs)  # A repeats -> fallback draws used
    # a non-semantic normal draw (EOS) is never replaced
    logits2 = torch.full((1, V), -1e9)
    logits2[0, CFG.eos_id] = 0.0
    st2 = SemanticState.fresh(1)
    st2.window[:] = CFG.eos_id
    st2.steps[:] = 5
    assert int(sample_semantic(logits2, p, st2, g, CFG)) == CFG.eos_id


def test_sglang_mode():
    a = CFG.semantic_begin + 3
    logits = torch.full((1, V), -1e9)
    logits[0, CFG.semantic_begin:CFG.semantic_end + 1] = 0.0
    logits[0, a] = 20.0
    p = [FishSamplingParams(mode="sglang", temperature=0.8, top_p=0.8, top_k=30, seed=11)]
    st = SemanticState.fresh(1)
    toks = [int(sample_semantic(logits, p, st, [make_generator(0)], CFG)) for _ in range(6)]
    assert toks[:4] == [a] * 4  # RAS needs >= 4 generated tokens; penalty 1.1 cannot beat +20
    # seeded (seed, step) draws: a second run with another generator gives the same tokens
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(1))
    runs = []
    for gseed in (0, 99):
        st = SemanticState.fresh(1)
        runs.append([int(sample_semantic(logits, p, st, [make_generator(gseed)], CFG)) for _ in range(8)])
    assert runs[0] == runs[1]
    # residual codes: greedy in sglang mode, sampled in fish mode, optional overflow mask
    r = torch.randn(2, CFG.codebook_size, generator=torch.Generator().manual_seed(2))
    assert torch.equal(sample_residual(r, p * 2, [make_generator(0)] * 2, 16), r.argmax(-1))
    masked = sample_residual(r, [FishSamplingParams(mode="sglang", mask_residual_overflow=True)] * 2,
                             [make_generator(0)] * 2, 16)
    assert torch.equal(masked, r[:, :16].argmax(-1))
    with pytest.raises(InputError):
        FishSamplingParams(mode="sglang", top_k=50)
