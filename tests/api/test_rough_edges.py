"""HTTP rough edges on real servers, through the official openai client where it has the call:
chat's `audio` without `modalities` asks for speech (explicit `modalities` still decide), and
vLLM-Omni's speaker-cache benchmark body for speech (a saved voice's name with `ref_text` and no
`ref_audio`) speaks with the saved voice, whose own transcript wins over `ref_text`."""
from __future__ import annotations

import io

import httpx
import openai
import pytest
from api_helpers import MODEL
from speech_helpers import FISH, reference_wav

TOKENS, FRAMES = 4, 3
TRANSCRIPT = "a short reference"


@pytest.fixture(scope="module")
def qwen(qwen_server):
    return openai.OpenAI(base_url=qwen_server[0] + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def fish(fish_server):
    url = fish_server[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    sample = ("ref.wav", io.BytesIO(reference_wav(seed=1)), "audio/wav")
    client.audio.voices.create(name="alice", audio_sample=sample, consent="cons_1",
                               extra_body={"transcript": TRANSCRIPT})
    yield url
    httpx.delete(f"{url}/v1/audio/voices/alice", timeout=60).raise_for_status()  # the server is shared


# ---- chat: `audio` alone asks for speech -------------------------------------------------------
def chat(client: openai.OpenAI, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}],
                                          temperature=0, max_tokens=TOKENS, extra_body={"max_audio_frames": FRAMES},
                                          **kw).choices[0].message


def test_chat_audio_without_modalities_speaks(qwen):
    spoken = chat(qwen, modalities=["text", "audio"], audio={"voice": "chelsie", "format": "wav"})
    assert spoken.audio is not None and spoken.audio.data
    inferred = chat(qwen, audio={"voice": "chelsie", "format": "wav"})  # no modalities
    assert inferred.audio is not None, "audio without modalities returned no speech"
    assert inferred.content == spoken.content and inferred.audio.data == spoken.audio.data  # greedy: equal
    assert chat(qwen, audio={"format": "wav"}).audio is not None  # SGLang-Omni's shape: no voice either


def test_chat_explicit_modalities_still_decide(qwen):
    text_only = chat(qwen, modalities=["text"], audio={"voice": "chelsie", "format": "wav"})
    assert text_only.audio is None and text_only.content  # ["text"] given: text, whatever `audio` says
    assert chat(qwen).audio is None  # neither: text, as before


# ---- speech: vLLM-Omni's speaker-cache body ----------------------------------------------------
def speak(url: str, **body) -> httpx.Response:
    body = {"model": FISH, "input": "Hello there, friend.", "response_format": "pcm", "seed": 3, "max_frames": 12,
            **body}
    return httpx.post(url + "/v1/audio/speech", json=body, timeout=60)


def test_saved_voice_with_ref_text_uses_the_saved_voice(fish):
    plain = speak(fish, voice="alice")
    assert plain.status_code == 200 and len(plain.content) > 0, plain.text
    same = speak(fish, voice="alice", ref_text=TRANSCRIPT)  # vLLM-Omni's bench_speaker_cache.py body
    assert same.status_code == 200, same.text
    assert same.content == plain.content and "x-omnivox-warning" not in same.headers
    other = speak(fish, voice="alice", ref_text="some other words entirely")
    assert other.status_code == 200, other.text
    assert other.content == plain.content  # the saved voice's own transcript wins
    assert "ref_text ignored" in other.headers["x-omnivox-warning"] and "alice" in other.headers["x-omnivox-warning"]
    assert other.content != speak(fish).content  # and it is the saved voice, not the default one
    client = openai.OpenAI(base_url=fish + "/v1", api_key="none", max_retries=0, timeout=60)
    via_client = client.audio.speech.create(model=FISH, input="Hello there, friend.", voice="alice",
                                            response_format="pcm",
                                            extra_body={"ref_text": TRANSCRIPT, "seed": 3, "max_frames": 12})
    assert via_client.content == plain.content


def test_ref_text_alone_says_what_is_missing(fish):
    r = speak(fish, ref_text=TRANSCRIPT)  # the default voice: no clip for the transcript to go with
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "ref_text" and "ref_audio" in err["message"] and "saved voice" in err["message"], err
    r = speak(fish, voice="nobody", ref_text=TRANSCRIPT)  # a name that is no saved voice
    assert r.status_code == 400 and r.json()["error"]["param"] == "voice", r.text
    assert "unknown voice 'nobody'" in r.json()["error"]["message"]
