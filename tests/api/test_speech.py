"""`POST /v1/audio/speech` on both families through the official `openai` client: whole files,
streamed bytes (equal to the whole reply for the same seeded request), SSE, OpenAI-shaped 4xx
for bad requests (each followed by a good one), chat on a TTS model, and disconnect = cancel."""
from __future__ import annotations

import base64
import json
import time

import httpx
import numpy as np
import openai
import pytest
from api_helpers import MODEL, expected_samples, metric, pcm16, reference_pcm, running_server
from speech_helpers import FISH, FISH_RATE, decode, reference_wav, split_wav


@pytest.fixture(scope="module")
def qwen(demo_cache):
    with running_server(demo_cache[0]) as (url, _, _):
        yield url


@pytest.fixture(scope="module")
def fish(demo_cache, tmp_path_factory):
    voices = tmp_path_factory.mktemp("voices")
    with running_server(demo_cache[0], "--model", "fish-demo", "--voices-dir", str(voices)) as (url, _, _):
        yield url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def speak(url: str, model: str, fmt: str = "pcm", voice="default", **extra) -> bytes:
    return client(url).audio.speech.create(model=model, input="Hello there, friend.", voice=voice,
                                           response_format=fmt, extra_body=extra).content


def speak_streamed(url: str, model: str, fmt: str, voice="default", **extra) -> tuple[list[bytes], dict]:
    with client(url).audio.speech.with_streaming_response.create(
            model=model, input="Hello there, friend.", voice=voice, response_format=fmt, stream_format="audio",
            extra_body=extra) as r:
        return list(r.iter_bytes()), dict(r.headers)


# ---- Qwen3-Omni: the Talker voices the input ---------------------------------------------------------
def test_qwen_speech_equals_offline_talker(qwen, oracle):
    data = speak(qwen, MODEL, "wav", voice="chelsie", temperature=0, max_frames=6)
    riff, rate, size, pcm = split_wav(data)
    assert rate == 24000 and size == len(pcm) and riff == 36 + size
    want = oracle.speak("Hello there, friend.", speaker="chelsie", greedy=True, max_frames=6)
    assert want.codes.shape[0] == 6
    assert len(pcm) // 2 == expected_samples(6)
    np.testing.assert_array_equal(pcm16(pcm), reference_pcm(want))


def test_qwen_streamed_pcm_equals_whole(qwen):
    whole = speak(qwen, MODEL, "pcm", voice="ethan", seed=7, max_frames=5)
    parts, headers = speak_streamed(qwen, MODEL, "pcm", voice={"id": "ethan"}, seed=7, max_frames=5)
    assert headers["x-sample-rate"] == "24000" and len(parts) >= 2  # decoded frames arrive as they come
    assert b"".join(parts) == whole and len(whole) // 2 == expected_samples(5)
    default = speak(qwen, MODEL, "pcm", seed=7, max_frames=5)  # default = the model's default speaker (ethan)
    assert default == whole


def test_qwen_rejects_cloning_and_unknown_voices(qwen):
    c = client(qwen)
    with pytest.raises(openai.BadRequestError, match="unknown voice 'bogus'"):  # nova: an OpenAI alias now
        c.audio.speech.create(model=MODEL, input="Hi", voice="bogus", response_format="wav")
    with pytest.raises(openai.BadRequestError, match="references .voice cloning. need a Fish S2"):
        speak(qwen, MODEL, references=[{"audio": base64.b64encode(reference_wav()).decode(), "text": "x"}])
    with pytest.raises(openai.BadRequestError, match="no voice cloning"):
        c.audio.voices.create(name="v1", audio_sample=("a.wav", reference_wav(), "audio/wav"), consent="c",
                              extra_body={"transcript": "hi"})
    assert httpx.get(qwen + "/v1/audio/voices").json() == {"object": "list", "data": []}
    assert len(speak(qwen, MODEL, max_frames=2, seed=1)) == 2 * expected_samples(2)


# ---- Fish S2 -------------------------------------------------------------------------------
def test_fish_wav_stream_and_formats(fish):
    whole = speak(fish, FISH, "wav", seed=3, max_frames=30)
    riff, rate, size, pcm = split_wav(whole)
    assert rate == FISH_RATE and size == len(pcm) > 0 and riff == 36 + size
    parts, headers = speak_streamed(fish, FISH, "wav", seed=3, max_frames=30)
    assert headers["content-type"] == "audio/wav" and headers["x-sample-rate"] == str(FISH_RATE)
    assert len(parts) >= 3  # the header, then frames as they are decoded
    streamed = b"".join(parts)
    s_riff, s_rate, s_size, s_pcm = split_wav(streamed)
    assert (s_riff, s_size, s_rate) == (0xFFFFFFFF, 0xFFFFFFFF, FISH_RATE) and s_pcm == pcm
    samples, rate = decode(streamed)  # a streamed wav is still a readable file
    assert rate == FISH_RATE and np.array_equal(samples, pcm16(pcm))
    assert speak(fish, FISH, "pcm", seed=3, max_frames=30) == pcm
    assert b"".join(speak_streamed(fish, FISH, "pcm", seed=3, max_frames=30)[0]) == pcm
    flac, rate = decode(speak(fish, FISH, "flac", seed=3, max_frames=30))
    assert rate == FISH_RATE and np.array_equal(flac, pcm16(pcm))
    assert speak(fish, FISH, "pcm", seed=4, max_frames=30) != pcm  # the seed matters


def test_fish_sse_and_inline_reference(fish):
    ref = {"audio": base64.b64encode(reference_wav()).decode(), "text": "a short reference"}
    pcm = speak(fish, FISH, "pcm", seed=5, max_frames=20, references=[ref])
    assert pcm != speak(fish, FISH, "pcm", seed=5, max_frames=20)  # the reference changes the prompt
    body = {"model": FISH, "input": "Hello there, friend.", "voice": "default", "response_format": "pcm",
            "stream_format": "sse", "seed": 5, "max_frames": 20, "references": [ref]}
    events = []
    with httpx.stream("POST", fish + "/v1/audio/speech", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] <= 20
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == pcm


BAD = [
    ({"input": ""}, "input", "input is empty"),
    ({"input": "x" * 4097}, "input", "limit is 4096"),
    ({"voice": "nobody"}, "voice", "unknown voice 'nobody'"),
    ({"voice": "../../etc/passwd"}, "voice", "unknown voice"),
    ({"response_format": "aac"}, "response_format", "not supported"),  # mp3 is encoded now
    ({"response_format": "flac", "stream_format": "audio"}, "response_format", "flac cannot be streamed"),
    ({"stream_format": "chunks"}, "stream_format", "not supported"),
    ({"speed": 1.5}, "speed", "speed other than 1.0"),
    ({"speed": 9.0}, "speed", "less than or equal to 4"),
    ({"references": [{"audio": "not base64!", "text": "x"}]}, "references[0].audio", "not valid base64"),
    ({"references": [{"audio": base64.b64encode(b"RIFF junk").decode(), "text": "x"}]}, "references[0].audio", "cannot decode"),
    ({"references": [{"audio": "AAAA"}]}, "references[0].text", "Field required"),
    ({"instructions": "whisper"}, "instructions", "not supported by S2"),
    ({"temperature": 5.0}, "temperature", "less than or equal to 2"),
    ({"top_k": -1}, "top_k", "greater than or equal to 0"),
    ({"max_frames": 0}, "max_frames", "greater than or equal to 1"),
    ({"seed": "1"}, "seed", "valid integer"),
    ({"model": "tts-1"}, "model", "not served here"),
]


@pytest.mark.parametrize("over,param,words", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_fish_bad_requests_get_openai_errors(fish, over, param, words):
    body = {"model": FISH, "input": "Hi", "voice": "default", "response_format": "wav", "max_frames": 3, **over}
    r = httpx.post(fish + "/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == (404 if param == "model" else 400), r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"].endswith("_error")
    assert words in err["message"] and (err["param"] or "").startswith(param.split("[")[0]), err
    ok = httpx.post(fish + "/v1/audio/speech", json={**body, **dict(BAD_FREE)}, timeout=60)
    assert ok.status_code == 200 and ok.content[:4] == b"RIFF"  # the server goes on serving


BAD_FREE = {"model": FISH, "input": "Hi", "voice": "default", "response_format": "wav", "speed": 1.0,
            "stream_format": None, "references": None, "instructions": None, "temperature": None, "top_k": None,
            "max_frames": 3, "seed": None}


def test_chat_on_a_tts_model_is_a_clear_400(fish):
    with pytest.raises(openai.BadRequestError, match="text-to-speech model"):
        client(fish).chat.completions.create(model=FISH, messages=[{"role": "user", "content": "Hi"}])
    card = httpx.get(fish + "/v1/models").json()["data"][0]
    assert card["id"] == FISH and card["sample_rate"] == FISH_RATE and card["modalities"] == ["audio"]
    assert card["voices"][0] == "default"


def _load(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics").text
    return metric(text, "omnivox_requests_in_flight"), metric(text, "omnivox_engine_requests_aborted_total")


def test_disconnect_mid_stream_cancels(fish):
    _, aborted = _load(fish)
    body = {"model": FISH, "input": "Please talk for a long time.", "voice": "default", "response_format": "pcm",
            "stream_format": "audio", "seed": 0, "max_frames": 400}  # seed 0 runs all 400 frames
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", fish + "/v1/audio/speech", json=body) as r:
            assert r.status_code == 200
            chunks = r.iter_bytes()
            next(chunks)  # the first decoded audio: the request is running
            assert _load(fish)[0] == 1
    deadline = time.monotonic() + 20
    while _load(fish)[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    in_flight, after = _load(fish)
    assert in_flight == 0 and after == aborted + 1  # aborted, not run to the end
    assert metric(httpx.get(fish + "/metrics").text, "omnivox_client_disconnects_total") >= 1
