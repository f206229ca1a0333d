"""A request whose sampling breaks (NaN or inf logits) fails alone: the requests batched with it
finish with exactly the answer they give alone. Validation keeps such values out of every API;
this test slips one past it to prove the sampler's own failure is isolated to its row."""
from dataclasses import replace

import numpy as np
import pytest

from omnivox import Omni
from omnivox.engine.events import Failed, Finished
from omnivox.sampling.params import SamplingParams
from omnivox.serving import ChatParams
from omnivox.models.qwen3_omni.reference import generate_reference
from qwen_tiny import chat


@pytest.fixture(scope="module")
def omni(tiny_reference):
    o = Omni(model=tiny_reference[1], progress=False)
    yield o
    o.close()


def _unvalidated(**fields) -> SamplingParams:
    p = SamplingParams()
    for k, v in fields.items():
        object.__setattr__(p, k, v)  # past __post_init__: what no API accepts
    return p


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_a_row_whose_sampling_breaks_fails_only_its_request(omni, stage):
    prompts = [chat([1400 + 13 * i + k for k in range(3 + i)]) for i in range(4)]
    good = [omni.submit(prompt_ids=p, greedy=True, max_tokens=6, max_frames=6) for p in prompts]
    opts = omni.options(ChatParams(greedy=True, max_tokens=6, max_frames=6))
    bad_params = _unvalidated(temperature=0.8, repetition_penalty=1e-40)  # logits / 1e-40 -> inf -> NaN
    bad_opts = replace(opts, **{stage: bad_params})
    bad = omni.engine.submit(omni.engine.stages.new_request(omni.build_prompt(prompt_ids=chat([1500, 1501, 1502])), bad_opts))
    finals = [next(ev for ev in h if isinstance(ev, (Finished, Failed))) for h in [*good, bad]]
    assert isinstance(finals[-1], Failed) and finals[-1].status == 400, finals[-1]
    assert "sampling" in finals[-1].message
    for p, fin in zip(prompts, finals[:-1]):
        assert isinstance(fin, Finished), fin
        alone = generate_reference(omni, prompt_ids=p, greedy=True, max_tokens=6, max_frames=6)
        assert fin.text_ids == alone.text_ids
        np.testing.assert_array_equal(fin.codes, alone.codes)
    assert omni.engine.stats().in_flight == 0
