"""Invariant 2.2.9 (stop rules) and seeded requests identical alone and batched; end to end audio."""
import pytest
import torch

from omnivox.errors import InputError
from omnivox.models.fish_s2.reference import TTSRequest, codes_to_audio, generate
from omnivox.models.fish_s2.prompt import Reference, TextTokenizer, build_prompt
from omnivox.models.fish_s2.sampler import FishSamplingParams


@pytest.fixture(scope="module")
def setup(tiny_folder, tiny_llm, tiny_codec):
    cfg, slow, fast = tiny_llm
    tok = TextTokenizer(tiny_folder)
    ref = Reference("hello", tiny_codec.encode(torch.randn(1, 1, 80, generator=torch.Generator().manual_seed(0)) * 0.3)[0])
    prompts = [build_prompt(tok, cfg, "Hi.", [ref]), build_prompt(tok, cfg, "Good day!"),
               build_prompt(tok, cfg, "x", mode="sglang")]
    return cfg, slow, fast, prompts


def test_seeded_alone_equals_batched(setup):
    cfg, slow, fast, prompts = setup
    reqs = [TTSRequest(prompts[0], FishSamplingParams(seed=1), 12), TTSRequest(prompts[1], FishSamplingParams(seed=2), 7),
            TTSRequest(prompts[0], FishSamplingParams(seed=3, temperature=1.0, top_p=0.95), 12)]
    batched = generate(slow, fast, reqs)
    for r, b in zip(reqs, batched):
        alone = generate(slow, fast, [r])[0]
        assert torch.equal(alone.codes, b.codes) and alone.stop == b.stop
    assert batched[0].codes.shape[0] == cfg.num_codebooks
    assert not torch.equal(batched[0].codes, batched[2].codes)
    again = generate(slow, fast, reqs[:1])[0]
    assert torch.equal(again.codes, batched[0].codes)  # same seed, same tokens


def _eos_logit(monkeypatch, slow, cfg, value):
    """Pin the EOS logit (the model itself is untouched)."""
    orig = type(slow).logits

    def logits(h):
        out = orig(slow, h).clone()
        out[..., cfg.eos_id] = value
        return out
    monkeypatch.setattr(slow, "logits", logits)


def test_max_new_tokens_keeps_every_frame(setup, monkeypatch):
    cfg, slow, fast, prompts = setup
    _eos_logit(monkeypatch, slow, cfg, -1e9)
    out = generate(slow, fast, [TTSRequest(prompts[0], FishSamplingParams(seed=0), 9)])[0]
    assert out.stop == "length" and out.codes.shape == (cfg.num_codebooks, 9)


def test_eos_at_prefill_stops_immediately(setup, monkeypatch):
    cfg, slow, fast, prompts = setup
    _eos_logit(monkeypatch, slow, cfg, 1e9)
    out = generate(slow, fast, [TTSRequest(prompts[1], FishSamplingParams(seed=0), 9)])[0]
    assert out.stop == "eos" and out.codes.shape == (cfg.num_codebooks, 0)


def test_eos_mid_stream_drops_only_the_eos_frame(setup, monkeypatch):
    """EOS forced at the 6th sampling step: exactly the 5 frames before it are kept, and they
    equal the first 5 frames of an unforced run with the same seed."""
    cfg, slow, fast, prompts = setup
    req = TTSRequest(prompts[0], FishSamplingParams(seed=7), 20)
    _eos_logit(monkeypatch, slow, cfg, -1e9)
    free = generate(slow, fast, [req])[0]
    monkeypatch.undo()
    orig, calls = type(slow).logits, []

    def logits(h):
        calls.append(1)
        out = orig(slow, h).clone()
        out[..., cfg.eos_id] = 1e9 if len(calls) == 6 else -1e9
        return out
    monkeypatch.setattr(slow, "logits", logits)
    out = generate(slow, fast, [req])[0]
    assert out.stop == "eos" and out.codes.shape == (cfg.num_codebooks, 5)
    assert torch.equal(out.codes, free.codes[:, :5])


def test_prompt_too_long_refused(setup):
    cfg, slow, fast, _ = setup
    long = torch.zeros(cfg.num_rows, cfg.max_prompt_len + 1, dtype=torch.long)
    with pytest.raises(InputError, match="prompt has"):
        generate(slow, fast, [TTSRequest(long)])


def test_end_to_end_audio(setup, tiny_codec):
    cfg, slow, fast, prompts = setup
    out = generate(slow, fast, [TTSRequest(prompts[2], FishSamplingParams(mode="sglang", seed=4), 8)])[0]
    wav = codes_to_audio(tiny_codec, out.codes)
    assert wav.shape == (tiny_codec.cfg.hop_length * out.codes.shape[1],)
