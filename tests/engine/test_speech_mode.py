"""Qwen3-Omni text to speech: the Talker voices given text directly, with no Thinker decoding."""
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from omnivox import Omni
from omnivox.errors import InputError, status_of
from omnivox.models.qwen3_omni.types import PreparedPrompt
from omnivox.serving import ChatParams


@pytest.fixture(scope="module")
def demo(demo_omni):
    return demo_omni


def test_speech_ids_voice_exactly_like_a_thinker_reply(demo):
    msgs = [{"role": "user", "content": "Say something."}]
    chat = demo.generate(msgs, greedy=True, max_tokens=7, max_frames=30)
    # the chat reply stopped at the length limit, so its last token was replaced by tts_eos;
    # voicing all but that token (+ the end marker) is the same Talker input
    opts = replace(demo.options(ChatParams(greedy=True, max_frames=30)), speech_ids=tuple(chat.text_ids[:-1]))
    prompt = demo.build_prompt(msgs)
    thinker_steps = demo.engine.stats().stages["thinker"].steps
    spoken = demo.collect(demo.engine.submit(demo.engine.stages.new_request(prompt, opts)))
    np.testing.assert_array_equal(spoken.codes, chat.codes)
    assert spoken.audio.shape == chat.audio.shape
    assert demo.engine.stats().stages["thinker"].steps == thinker_steps  # Talker + vocoder only


def test_an_invalid_request_fails_on_the_callers_thread_never_under_the_engine_lock(demo):
    """The graph's request factory validates on the caller's thread: with another thread holding
    the engine's lock, a text-to-speech request whose prompt carries media raises its 400 at once."""
    opts = replace(demo.options(ChatParams(greedy=True, max_frames=4)), speech_ids=(1020, 1021))
    ids = demo.build_prompt([{"role": "user", "content": "Hi"}]).ids
    media = PreparedPrompt(ids=[*ids[:3], demo.cfg.thinker.audio_token_id, *ids[3:]])
    held, release, outcome = threading.Event(), threading.Event(), {}

    def hold() -> None:
        with demo.engine._lock:
            held.set()
            outcome["released_by_test"] = release.wait(timeout=30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(timeout=30)
    try:
        with pytest.raises(InputError, match="carry no media") as e:
            demo.engine.stages.new_request(media, opts)
    finally:
        release.set()
        holder.join()
    assert outcome["released_by_test"]  # the factory never waited for the lock
    assert status_of(e.value) == 400
    assert demo.engine.stats().in_flight == 0


def test_speak_returns_the_text_as_transcript(demo):
    from omnivox.engine.events import AudioChunk, Finished
    text = "Hello there, how are you today?"
    h = demo.submit(text, speaker="aiden", greedy=True, max_frames=60)
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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_to_full_length(dtype):
    o = Omni(dtype=dtype, progress=False)
    try:
        msgs = [{"role": "user", "content": [{"type": "audio", "audio": str(Path(__file__).parent.parent / "media" / "speech_16k.wav")},
                                             {"type": "text", "text": "hi"}]}]
        out = o.generate(msgs, greedy=True, ignore_eos=True, max_tokens=6, max_frames=10)
    finally:
        o.close()
    assert len(out.text_ids) == 6 and out.codes.shape == (10, 16)
    assert out.audio.shape == (10 * 1920 - 555,) and np.isfinite(out.audio).all() and out.audio.std() > 0.01
