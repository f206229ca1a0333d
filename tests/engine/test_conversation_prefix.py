"""Prefix keys extend over generated tokens: a follow-up turn whose prompt repeats the earlier
turn (its prompt and the ids the model generated, not re-tokenized text) reuses the KV of the
whole earlier turn, and answers exactly as without the cache."""
from pathlib import Path

import numpy as np
import pytest

from omnivox import Omni
from omnivox.audio.io import load_audio
from omnivox.audio.mel import log_mel, num_audio_tokens
from omnivox.engine.config import EngineConfig
from omnivox.models.qwen3_omni.reference import generate_reference
from qwen_tiny import ASSISTANT, AUDIO_END, AUDIO_PAD, AUDIO_START, IM_END, IM_START, NL, USER, chat

BLOCK = 4
MEDIA = Path(__file__).parent.parent / "media"


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
    want = generate_reference(omni, prompt_ids=follow, greedy=True, max_tokens=6, max_frames=4)
    assert got.text_ids == want.text_ids
    np.testing.assert_array_equal(got.codes, want.codes)


def test_a_spoken_follow_up_reuses_the_block_the_prompt_end_cut(tiny_reference):
    """A speaking request keeps the Talker's input rows of every cached media block: also the
    block that the prompt's end cuts (its last audio rows, then the first generated tokens), so
    a spoken follow-up turn reuses the whole earlier turn and answers exactly as without it."""
    block = 16
    omni = Omni(model=tiny_reference[1], progress=False, engine_config=EngineConfig(block_size=block))
    try:
        wave = load_audio(MEDIA / "speech_16k.wav")
        n = num_audio_tokens(log_mel(wave).shape[-1])

        def turn(k: int) -> list[int]:
            return chat([*range(1600, 1600 + k), AUDIO_START, *[AUDIO_PAD] * n, AUDIO_END])
        first = next(turn(k) for k in range(block) if (len(turn(k)) - 1) % block >= 8)
        P = len(first)
        last_pad = P - 1 - first[::-1].index(AUDIO_PAD)
        assert last_pad // block == (P - 1) // block  # the block the prompt's end cuts holds audio rows
        kw = dict(audio=[wave], greedy=True, speaker="ethan")
        reply = omni.generate(prompt_ids=first, ignore_eos=True, max_tokens=11, max_frames=3, **kw)
        follow = first + reply.text_ids + [IM_END, NL, IM_START, USER, NL, 1700, 1701, IM_END, NL,
                                           IM_START, ASSISTANT, NL]
        before = omni.engine.stats().prefix_hit_tokens
        got = omni.generate(prompt_ids=follow, max_tokens=6, max_frames=4, **kw)
        hit = omni.engine.stats().prefix_hit_tokens - before
        assert hit == (P + len(reply.text_ids) - 1) // block * block and hit > P
        want = generate_reference(omni, prompt_ids=follow, max_tokens=6, max_frames=4, **kw)
        assert got.text_ids == want.text_ids
        np.testing.assert_array_equal(got.codes, want.codes)
        assert len(got.codes) > 0
    finally:
        omni.close()
