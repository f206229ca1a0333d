"""`POST /v1/audio/speech` on both families through the official `openai` client: whole files,
streamed bytes (equal to the whole reply for the same seeded request), SSE, mp3 (the default when
no format is sent) and Ogg Opus whole and streamed (a page per chunk), OpenAI-shaped 4xx
for bad requests (each followed by a good one), chat on a TTS model, and disconnect = cancel."""
from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest
from api_helpers import MODEL, expected_samples, metric, pcm16, reference_pcm, running_server, wait_for
from speech_helpers import FISH, FISH_RATE, decode, reference_wav, split_wav


@pytest.fixture(scope="module")
def qwen(qwen_server):
    return qwen_server[0]


@pytest.fixture(scope="module")
def fish(demo_cache, tmp_path_factory):
    voices = tmp_path_factory.mktemp("voices")
    # --first-chunk-frames 1: chunk counts are compared between requests (auto depends on timing)
    with running_server(demo_cache[0], "--model", "fish-demo", "--voices-dir", str(voices),
                        "--first-chunk-frames", "1") as (url, _, _):
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


# ---- formats: mp3 (OpenAI's default) and Ogg Opus, whole and streamed ------------------------------
@pytest.mark.parametrize("family", ["qwen", "fish"])
def test_no_format_is_mp3_through_the_openai_client(request, family):
    url, model, rate = (request.getfixturevalue(family), *{"qwen": (MODEL, 24000), "fish": (FISH, FISH_RATE)}[family])
    extra = {"seed": 3, "max_frames": 12}
    reply = client(url).audio.speech.create(model=model, input="Hello there, friend.", voice="alloy",
                                            extra_body=extra)  # no response_format: the client sends none
    raw = httpx.post(url + "/v1/audio/speech", json={"input": "Hello there, friend.", "voice": "alloy", **extra},
                     timeout=60)  # nor does this body (and no model: one model is served)
    assert reply.response.headers["content-type"] == raw.headers["content-type"] == "audio/mpeg"
    assert raw.content == reply.content
    samples, got = decode(reply.content)
    pcm = pcm16(speak(url, model, "pcm", voice="alloy", **extra))
    assert got == rate and samples.shape == pcm.shape  # the LAME tag's delay and padding are trimmed
    assert np.corrcoef(samples, pcm)[0, 1] > 0.7  # lossy, 64 kbps, but the same audio


def test_qwen_opus_whole_file(qwen):
    pcm = pcm16(speak(qwen, MODEL, "pcm", voice="ethan", seed=2, max_frames=6))
    r = httpx.post(qwen + "/v1/audio/speech", timeout=60, json={
        "input": "Hello there, friend.", "voice": "ethan", "response_format": "opus", "seed": 2, "max_frames": 6})
    assert r.headers["content-type"] == "audio/ogg" and r.content[:4] == b"OggS"
    samples, rate = decode(r.content)
    assert rate == 24000 == int(r.headers["x-sample-rate"]) and samples.shape == pcm.shape  # Opus runs at 24 kHz


def test_fish_opus_and_mp3_whole_and_streamed(fish):
    extra = {"seed": 3, "max_frames": 20}
    pcm = pcm16(speak(fish, FISH, "pcm", **extra))
    whole, rate = decode(speak(fish, FISH, "opus", **extra))
    want = round(pcm.shape[0] * 48000 / FISH_RATE)
    assert rate == 48000 and abs(whole.shape[0] - want) <= 1  # 44.1 kHz resampled to 48 kHz for Opus
    parts, headers = speak_streamed(fish, FISH, "opus", **extra)
    assert headers["content-type"] == "audio/ogg" and headers["x-sample-rate"] == "48000" and len(parts) >= 3
    streamed, rate = decode(b"".join(parts))
    assert rate == 48000 and streamed.shape == whole.shape  # the last page's granule trims the padding
    parts, headers = speak_streamed(fish, FISH, "mp3", **extra)
    assert headers["content-type"] == "audio/mpeg" and len(parts) >= 3
    streamed, rate = decode(b"".join(parts))
    # raw frames (no LAME tag): the codec's 1105-sample delay in front, up to two frames of padding behind
    assert rate == FISH_RATE and pcm.shape[0] <= streamed.shape[0] <= pcm.shape[0] + 1105 + 2 * 1152


def _sse_deltas(url: str, fmt: str) -> list[bytes]:
    body = {"input": "Hello there, friend.", "response_format": fmt, "stream_format": "sse", "seed": 3,
            "max_frames": 20}
    with httpx.stream("POST", url + "/v1/audio/speech", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    return [base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta"]


def test_opus_pages_are_flushed_with_every_chunk(fish):
    pcm = _sse_deltas(fish, "pcm")  # one delta per decoded chunk
    opus = _sse_deltas(fish, "opus")
    assert len(opus) == len(pcm) + 1 and all(d[:4] == b"OggS" for d in opus)  # whole pages; + the closing page
    first, rate = decode(opus[0])  # the headers and the first chunk's page: playable on their own
    assert rate == 48000 and first.shape[0] > 0.5 * (len(pcm[0]) // 2) * 48000 / FISH_RATE
    want = sum(len(d) // 2 for d in pcm) * 48000 / FISH_RATE
    assert abs(decode(b"".join(opus))[0].shape[0] - want) <= 1


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
    wait_for(lambda: _load(fish)[0] == 0, what="the disconnect to end the request")
    in_flight, after = _load(fish)
    assert in_flight == 0 and after == aborted + 1  # aborted, not run to the end
    wait_for(lambda: metric(httpx.get(fish + "/metrics").text, "omnivox_client_disconnects_total") >= 1,
             what="the disconnect to be counted")
