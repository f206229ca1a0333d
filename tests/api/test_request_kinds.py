"""Which requests a listener plays (`playing`: paced by `--scheduling slack`) and which are batch
work, as each route decides it at submission: streamed spoken chat replies, streamed speech and
realtime responses play; non-streamed replies, text-only replies and offline calls are batch. Each
check reads the request the engine would run (no step is taken)."""
from __future__ import annotations

import pytest

from omnivox.api.convert import plan_request
from omnivox.api.protocol import ChatRequest, SpeechRequest
from omnivox.api.realtime.protocol import Generation
from omnivox.api.speech import SpeechService
from omnivox.serving import ChatParams, SpeechParams

AUDIO = {"modalities": ["text", "audio"], "audio": {"voice": "chelsie", "format": "pcm16"}}


def engine_request(model, prompt, opts):
    """The engine's request for (prompt, options), built as a submission builds it (not admitted)."""
    return model.engine.stages.new_request(prompt, opts)


@pytest.mark.parametrize("body,playing", [({"stream": True, **AUDIO}, True), ({"stream": False, **AUDIO}, False),
                                          ({"stream": True}, False)], ids=["streamed-audio", "whole", "text-only"])
def test_chat_completions_play_only_streamed_speech(demo_omni, body, playing):
    req = ChatRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **body})
    plan = plan_request(req, demo_omni, "served")
    prepared = demo_omni.prepare_chat(plan.messages, plan.params)
    assert engine_request(demo_omni, prepared.prompt, prepared.options).playing is playing


@pytest.mark.parametrize("body,playing", [({"stream_format": "audio"}, True), ({"stream_format": "sse"}, True),
                                          ({"stream": True}, True), ({}, False)],
                         ids=["stream-audio", "sse", "stream-true", "whole-file"])
def test_speech_plays_only_when_streamed(demo_omni, body, playing):
    service = SpeechService(demo_omni, "served", metrics=None, pools=None, voices=None)
    plan = service.plan(SpeechRequest.model_validate({"input": "Hello there.", "response_format": "pcm", **body}))
    assert plan.params.playing is playing


def test_realtime_responses_play_their_audio():
    assert Generation().chat_params().playing and Generation().speech_params().playing
    assert not Generation(modalities=("text",)).chat_params().playing


def test_offline_calls_are_batch_unless_asked_and_text_only_never_plays(demo_omni):
    prompt = demo_omni.build_prompt([{"role": "user", "content": "Hi"}])
    assert not engine_request(demo_omni, prompt, demo_omni.options(ChatParams())).playing
    assert engine_request(demo_omni, prompt, demo_omni.options(ChatParams(playing=True))).playing
    text_only = demo_omni.options(ChatParams(playing=True, return_audio=False))
    assert not engine_request(demo_omni, prompt, text_only).playing
    speech = demo_omni._speech_params(SpeechParams(playing=True))
    assert speech.playing and not demo_omni._speech_params(SpeechParams()).playing


def test_fish_s2_requests_carry_their_kind():
    from omnivox import FishTTS

    tts = FishTTS(progress=False)
    try:
        prompt = tts.build_prompt("Hello there.")
        assert not engine_request(tts, prompt, tts.options(SpeechParams())).playing
        assert engine_request(tts, prompt, tts.options(SpeechParams(playing=True))).playing
    finally:
        tts.close()
