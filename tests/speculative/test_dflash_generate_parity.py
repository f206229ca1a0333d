"""omnivox's DFlash speculation equals the reference's `dflash_generate` (PyPI `dflash` 0.1.0) driving
transformers' Qwen3-Omni Thinker (through a small wrapper: text positions, the `cache` keyword) with
the same draft, the built-in demo model's: the same greedy ids and the same acceptance length at
every step where both run a full block (near the end the reference shortens its block to what
is left, omnivox drafts fewer ids from a full one), also when the prompt's blocks are prefix-cache
hits (the draft's context for them is found in the same pages: nothing recomputed). transformers
suppresses no id, so neither does omnivox's Thinker here."""
import time

import pytest
import torch
from torch import nn

from omnivox import Omni

BLOCK = 8


class ThinkerTarget(nn.Module):
    """transformers' Thinker as `dflash_generate`'s target."""

    def __init__(self, thinker):
        super().__init__()
        self.thinker, self.lm_head = thinker, thinker.lm_head
        self.config = thinker.config.text_config

    @property
    def device(self):
        return self.lm_head.weight.device

    def get_input_embeddings(self):
        return self.thinker.get_input_embeddings()

    def forward(self, input_ids, position_ids, past_key_values, use_cache, logits_to_keep=0, output_hidden_states=False):
        out = self.thinker(input_ids=input_ids, position_ids=position_ids, cache=past_key_values, use_cache=use_cache,
                           output_hidden_states=output_hidden_states)
        if logits_to_keep:
            out.logits = out.logits[:, -logits_to_keep:]
        return out


@pytest.fixture(scope="module")
def reference():
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omnivox.models.qwen3_omni.demo import demo_model_path
    from omnivox.speculative.demo import demo_draft_folder

    target = Qwen3OmniMoeForConditionalGeneration.from_pretrained(demo_model_path(), dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(demo_draft_folder("dflash"), dtype=torch.float32).eval()
    return ThinkerTarget(target.thinker).eval(), draft


@pytest.fixture(scope="module")
def omni():
    o = Omni(progress=False, speculative_config={"method": "dflash", "model": "demo", "num_speculative_tokens": BLOCK - 1})
    adapter = o.engine.stages.stages["thinker"].adapter
    adapter.suppress = torch.zeros_like(adapter.suppress)  # as transformers' plain forward
    adapter.undraftable = set()
    yield o
    o.close()


def _omnivox_steps(omni, prompt: list[int], tokens: int) -> tuple[list[int], list[int]]:
    """(ids, tokens the row took at each step after its prefill)."""
    adapter = omni.engine.stages.stages["thinker"].adapter
    inner, taken = adapter.apply, []

    def apply(batch, out):
        result = inner(batch, out)
        taken.extend(result.accepted[i] for i in batch.sampled)
        return result
    adapter.apply = apply
    try:
        out = omni.generate(prompt_ids=prompt, greedy=True, max_tokens=tokens, ignore_eos=True, return_audio=False)
    finally:
        adapter.apply = inner
    return out.text_ids, taken[1:]


@pytest.mark.parametrize("words", ["the farmer counts his sheep by the river", "a quiet morning in the old city"])
def test_same_ids_and_acceptance_as_dflash_generate(reference, omni, words, monkeypatch):
    import dflash.model

    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)  # it synchronizes CUDA
    target, draft = reference
    prompt = omni.build_prompt([{"role": "user", "content": words}]).ids
    tokens = 40
    want = dflash.model.dflash_generate(draft, target, torch.tensor([prompt]), tokens, None, temperature=0.0,
                                        return_stats=True)
    hits = omni.engine.stats().prefix_hit_tokens
    for again in (False, True):  # again: the prompt's blocks come from the prefix cache, the draft's context too
        ids, taken = _omnivox_steps(omni, prompt, tokens)
        assert ids == want.output_ids[0, len(prompt):].tolist()
        produced, compared = 1, 0
        for ours, theirs in zip(taken, want.acceptance_lengths):
            if tokens - produced < BLOCK:
                break
            assert ours == theirs, f"{taken} {want.acceptance_lengths}"
            produced += ours
            compared += 1
        assert compared >= 3 and max(want.acceptance_lengths) > 1  # the draft accepts: a real comparison
    assert omni.engine.stats().prefix_hit_tokens - hits >= 16
