"""Qwen3-Omni text to speech: the Talker voices given text directly, with no Thinker decoding."""
from dataclasses import replace

import numpy as np
import pytest

from omnivox import Omni
from omnivox.errors import InputError


@pytest.fixture(scope="module")
def demo():
    o = Omni(progress=False)
    yield o
    o.close()


def test_speech_ids_voice_exactly_like_a_thinker_reply(demo):
    msgs = [{"role": "user", "content": "Say something."}]
    chat = demo.generate(msgs, greedy=True, max_tokens=7, max_frames=30)
    # the chat reply stopped at the length limit, so its last token was replaced by tts_eos;
    # voicing all but that token (+ the end marker) is the same Talker input
    opts = replace(demo.options(greedy=True, max_frames=30), speech_ids=tuple(chat.text_ids[:-1]))
    prompt = demo.prepare(msgs)
    spoken = demo._collect(demo.engine.submit(prompt, opts))
    np.testing.assert_array_equal(spoken.codes, chat.codes)
    assert spoken.audio.shape == chat.audio.shape


def test_speak_returns_the_text_as_transcript(demo):
    from omnivox.engine.events import AudioChunk, Finished
    text = "Hello there, how are you today?"
    h = demo.submit_speech(text, speaker="aiden", greedy=True, max_frames=60)
    transcript, fin = "", None
    for ev in h:
        if isinstance(ev, AudioChunk):
            transcript += ev.transcript
        elif isinstance(ev, Finished):
            fin = ev
    assert fin.text_ids == demo.tokenizer.encode(text)
    assert transcript == text or fin.codes.shape[0] == 60  # all voiced unless the frame cap came first
    assert fin.codes.shape[0] > 0
    with pytest.raises(InputError):
        demo.speak("   ")
    with pytest.raises(InputError):
        demo.speak("hi", speaker="nobody")
