"""Prefix keys extend over generated tokens: a follow-up turn whose prompt repeats the earlier
turn (its prompt and the ids the model generated, not re-tokenized text) reuses the KV of the
whole earlier turn, and answers exactly as without the cache."""
import numpy as np
import pytest

from omnivox import Omni
from omnivox.engine.config import EngineConfig
from qwen_tiny import ASSISTANT, IM_END, IM_START, NL, USER, chat

BLOCK = 4


@pytest.fixture(scope="module")
def omni(tiny_reference):
    o = Omni(model=tiny_reference[1], progress=False, engine_config=EngineConfig(block_size=BLOCK))
    yield o
    o.close()


def test_follow_up_turn_reuses_the_earlier_reply(omni):
    first = chat([1600 + k for k in range(9)])
    reply = omni.generate(prompt_ids=first, greedy=True, ignore_eos=True, max_tokens=11, max_frames=3)
    follow = first + reply.text_ids + [IM_END, NL, IM_START, USER, NL, 1700, 1701, 1702, IM_END, NL,
                                       IM_START, ASSISTANT, NL]
    before = omni.engine.stats().prefix_hit_tokens
    got = omni.generate(prompt_ids=follow, greedy=True, max_tokens=6, max_frames=4)
    hit = omni.engine.stats().prefix_hit_tokens - before
    # every full block of the earlier turn whose KV was computed: its prompt and all generated
    # tokens but the last (which was never an input)
    assert hit == (len(first) + len(reply.text_ids) - 1) // BLOCK * BLOCK
    assert hit > len(first)  # more than the earlier prompt alone
    want = omni.generate_reference(prompt_ids=follow, greedy=True, max_tokens=6, max_frames=4)
    assert got.text_ids == want.text_ids
    np.testing.assert_array_equal(got.codes, want.codes)
