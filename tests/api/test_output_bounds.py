"""Output bounds against a real `omnivox serve --max-output-tokens --max-audio-seconds` (issues 17
and 33): a request asking for more than the server allows in OpenAI's or omnivox's own fields is
answered 400 at once, naming the field and the limit, instead of running for minutes (speech
`max_frames: 100000`), being cut silently (chat `max_tokens` past the context) or failing on the KV
cache with a 413 that never names max_tokens; the server then serves an ordinary request. The
peers' "at most" fields (`max_new_tokens`, `talker_max_new_tokens`) and realtime sessions are
clamped to the limits instead (their clients send 2048, 4096 or "inf" whatever the server): the
peers' own request shapes get audio within the limits."""
from __future__ import annotations

import asyncio
import base64
import json

import httpx
import pytest
import websockets
from api_helpers import MODEL, metric, running_server, wait_for
from realtime_helpers import recv_until, ws_url
from speech_helpers import FISH, reference_wav

MAX_TOKENS, MAX_SECONDS = 32, 2.0
QWEN_FRAMES = 25  # 2 s at 12.5 frames/s (80 ms)
QUICK = 30.0  # a refusal comes at once; the unfixed 100000-frame speech request ran 14.5 minutes


@pytest.fixture(scope="module")
def qwen_server(demo_cache):
    # --log-level info also writes every request line: test_a_key_in_a_url_is_not_logged reads them
    with running_server(demo_cache[0], "--max-output-tokens", str(MAX_TOKENS), "--max-audio-seconds",
                        str(MAX_SECONDS), "--log-level", "info") as (url, _, log):
        yield url, log


@pytest.fixture
def qwen(qwen_server):
    return qwen_server[0]


@pytest.fixture(scope="module")
def fish(demo_cache, tmp_path_factory):
    media = tmp_path_factory.mktemp("fishmedia")
    (media / "ref.wav").write_bytes(reference_wav(samples=8192, seed=1))
    with running_server(demo_cache[0], "--model", "fish-demo", "--voices-dir", str(tmp_path_factory.mktemp("voices")),
                        "--allowed-local-media-path", str(media), "--max-audio-seconds", str(FISH_SECONDS),
                        "--max-output-tokens", str(MAX_TOKENS)) as (url, _, _):
        yield url, media


FISH_SECONDS = 1.0  # S2's demo speaks slower than Qwen3-Omni's: a shorter limit keeps its tests quick
FISH_FRAMES = int(FISH_SECONDS * 44100 / 2048)  # S2's 21.5 Hz frames, not Qwen3-Omni's 12.5


def _chat(url: str, timeout: float = QUICK, content: str = "hi", **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def _speech(url: str, model: str = MODEL, **fields) -> httpx.Response:
    body = {"model": model, "input": "Hello there.", "response_format": "wav", **fields}
    return httpx.post(url + "/v1/audio/speech", json=body, timeout=QUICK)


def _refused(r: httpx.Response, param: str, *words: str, code: str = "invalid_value") -> str:
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err
    for word in (param, *words):
        assert word in err["message"], err["message"]
    return err["message"]


@pytest.mark.parametrize("field,value", [("max_tokens", 5000), ("max_tokens", 1_000_000),
                                         ("max_completion_tokens", MAX_TOKENS + 1)])
def test_chat_max_tokens_over_the_limit(qwen, field, value):
    _refused(_chat(qwen, modalities=["text"], **{field: value}), field, str(value), f"{MAX_TOKENS} tokens")
    ok = _chat(qwen, timeout=60, modalities=["text"], **{field: MAX_TOKENS})
    assert ok.status_code == 200, ok.text[:500]


def test_chat_audio_frames_over_the_limit(qwen):
    _refused(_chat(qwen, modalities=["text", "audio"], max_tokens=2, max_audio_frames=100_000), "max_audio_frames",
             f"{QWEN_FRAMES} frames", f"{MAX_SECONDS:.1f} s")


def test_speech_frames_over_the_limit(qwen):
    _refused(_speech(qwen, max_frames=100_000), "max_frames", f"{QWEN_FRAMES} frames", f"{MAX_SECONDS:.1f} s")
    ok = _speech(qwen, max_frames=QWEN_FRAMES)
    assert ok.status_code == 200, ok.text[:500]


def _clamped(url: str, field: str) -> float:
    try:
        return metric(httpx.get(url + "/metrics", timeout=QUICK).text, "omnivox_requests_clamped_total", field=field)
    except KeyError:
        return 0.0


def test_the_peers_at_most_fields_are_clamped(qwen):
    """SGLang-Omni's talker_max_new_tokens and the peers' max_new_tokens mean "at most": above the
    limit they are clamped, said in X-Omnivox-Warning and counted; a reply the limit cut ends with
    finish_reason "length" (chat) / X-Omnivox-Finish-Reason (speech)."""
    before = _clamped(qwen, "talker_max_new_tokens"), _clamped(qwen, "max_new_tokens")
    r = _chat(qwen, timeout=60, modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"}, max_tokens=30,
              temperature=0, talker_max_new_tokens=100_000, ignore_eos=True)
    assert r.status_code == 200, r.text[:500]
    body = r.json()
    assert body["usage"]["completion_tokens_details"]["audio_tokens"] == QWEN_FRAMES  # ignore_eos: to the limit
    assert body["choices"][0]["finish_reason"] == "length"
    warning = r.headers["x-omnivox-warning"]
    assert "talker_max_new_tokens 100000" in warning and "clamped" in warning
    s = _speech(qwen, max_new_tokens=2048)
    assert s.status_code == 200 and s.content[:4] == b"RIFF", s.text[:500]
    frames = (len(s.content) - 44) // 2 // 1920 + 1  # 1920 samples a frame, less the vocoder's 555-sample seam
    assert frames <= QWEN_FRAMES and "max_new_tokens 2048" in s.headers["x-omnivox-warning"]
    assert s.headers["x-omnivox-finish-reason"] == ("length" if frames == QWEN_FRAMES else "stop")
    assert (_clamped(qwen, "talker_max_new_tokens"), _clamped(qwen, "max_new_tokens")) == (before[0] + 1, before[1] + 1)


def _sse_audio(r: httpx.Response) -> tuple[bytes, dict]:
    """(the audio of speech.audio.delta events, the speech.audio.done event) of an SSE reply."""
    audio, done = b"", None
    for line in r.text.splitlines():
        if line.startswith("data: "):
            ev = json.loads(line[6:])
            if ev["type"] == "speech.audio.delta":
                audio += base64.b64decode(ev["audio"])
            elif ev["type"] == "speech.audio.done":
                done = ev
    return audio, done


def test_the_peers_speech_benchmarks_get_audio_within_the_limit(fish):
    """The request shapes of SGLang-Omni's TTS speed benchmark (benchmarks/eval/benchmark_tts_speed.py:
    a local ref_audio path, max_new_tokens 2048, wav, with and without stream) and vLLM-Omni's
    speaker-cache benchmark (benchmarks/fish-speech/bench_speaker_cache.py: no model, a data: URL
    ref_audio or an uploaded voice + ref_text, pcm, stream, max_new_tokens 2048): each gets 200 and
    audio within the server's limit (a 400 before: max_new_tokens 2048 is above even the bare demo's
    512-frame limit)."""
    url, media = fish
    data_url = "data:audio/wav;base64," + base64.b64encode((media / "ref.wav").read_bytes()).decode()
    sglang = {"model": FISH, "input": "The quick brown fox.", "response_format": "wav", "ref_audio": "ref.wav",
              "ref_text": "a reference clip", "max_new_tokens": 2048}
    r = httpx.post(url + "/v1/audio/speech", json=sglang, timeout=120)
    assert r.status_code == 200 and r.content[:4] == b"RIFF", r.text[:500]
    whole = (len(r.content) - 44) // 2
    streamed = httpx.post(url + "/v1/audio/speech", json={**sglang, "stream": True}, timeout=120)
    assert streamed.status_code == 200 and streamed.content[:4] == b"RIFF", streamed.text[:500]
    upload = httpx.post(url + "/v1/audio/voices", data={"name": "bench_voice", "consent": "true",
                                                        "ref_text": "a reference clip"},
                        files={"audio_sample": ("ref.wav", (media / "ref.wav").read_bytes(), "audio/wav")}, timeout=60)
    assert upload.status_code == 200, upload.text[:500]
    vllm = {"input": "The quick brown fox.", "voice": "default", "stream": True, "response_format": "pcm",
            "ref_audio": data_url, "ref_text": "a reference clip", "max_new_tokens": 2048}
    sizes = [whole, (len(streamed.content) - 44) // 2]
    for body in (vllm, {**vllm, "voice": "bench_voice", "ref_audio": None}):
        r = httpx.post(url + "/v1/audio/speech", json={k: v for k, v in body.items() if v is not None}, timeout=120)
        assert r.status_code == 200 and len(r.content) > 0, r.text[:500]
        sizes.append(len(r.content) // 2)
    assert all(0 < n <= FISH_FRAMES * 2048 for n in sizes), sizes
    sse = httpx.post(url + "/v1/audio/speech", json={**sglang, "stream_format": "sse"}, timeout=120)
    audio, done = _sse_audio(sse)
    assert 0 < len(audio) // 2 <= FISH_FRAMES * 2048
    assert done["finish_reason"] == ("length" if len(audio) // 2 == FISH_FRAMES * 2048 else "stop")


async def _realtime_reply(url: str, model: str, update: dict, response: dict) -> tuple[list[dict], list[dict]]:
    """One session: session.update, a user text item, response.create -> (the session events,
    the response's events up to response.done)."""
    async with websockets.connect(ws_url(url, model)) as ws:
        session = await recv_until(ws, "session.created")
        await ws.send(json.dumps({"type": "session.update", "session": update}))
        session += await recv_until(ws, "session.updated", "error")
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tell me a long story."}]}}))
        await ws.send(json.dumps({"type": "response.create", "response": response}))
        return session, await recv_until(ws, "response.done", timeout=120)


def _audio_samples(events: list[dict]) -> int:
    return sum(len(base64.b64decode(e["delta"])) // 2 for e in events if e["type"] == "response.output_audio.delta")


@pytest.mark.parametrize("family", ["qwen", "fish"])
def test_realtime_replies_stay_within_the_limits(qwen, fish, family):
    """Realtime sessions get the server's limits: "inf" and 4096 (what OpenAI's realtime clients
    send) are clamped to them, session.updated and response.created show the effective values,
    and a reply the audio limit cut says so (status_details.omnivox.limit)."""
    url, model = (qwen, MODEL) if family == "qwen" else (fish[0], FISH)
    frames, seconds = (QWEN_FRAMES, MAX_SECONDS) if family == "qwen" else (FISH_FRAMES, FISH_SECONDS)
    extra = {"omnivox": {"greedy": True}} if family == "qwen" else {}
    session, events = asyncio.run(_realtime_reply(url, model, {"max_output_tokens": "inf", **extra}, {
        "max_output_tokens": 4096, "omnivox": {"max_audio_frames": 100_000}}))
    created, updated = session[0]["session"], session[-1]["session"]
    assert session[-1]["type"] == "session.updated", session[-1]
    assert created["max_output_tokens"] <= MAX_TOKENS and created["omnivox"]["max_audio_frames"] <= frames
    assert updated["max_output_tokens"] == MAX_TOKENS  # "inf": the limit
    assert updated["omnivox"]["max_audio_frames"] == created["omnivox"]["max_audio_frames"]
    started = next(e for e in events if e["type"] == "response.created")["response"]
    assert started["max_output_tokens"] == MAX_TOKENS
    done = events[-1]["response"]
    assert done["usage"]["output_token_details"]["text_tokens"] <= MAX_TOKENS
    assert done["usage"]["output_token_details"]["audio_tokens"] <= frames
    assert 0 < _audio_samples(events) <= seconds * 24000
    if done["usage"]["output_token_details"]["audio_tokens"] == frames:
        assert done["status"] == "incomplete"
        assert done["status_details"] == {"type": "incomplete", "reason": "max_output_tokens",
                                          "omnivox": {"limit": "audio"}}


def _long_prompt(url: str, context: int) -> tuple[str, int]:
    """A prompt leaving fewer tokens of context than the demo's default max_tokens (16), and its length."""
    text = "a " * (context - 12 - 9)  # the demo tokenizer: one token per "a ", 9 for the turn around it
    r = _chat(url, timeout=60, content=text, modalities=["text"], max_tokens=1)
    assert r.status_code == 200, r.text[:500]
    prompt = r.json()["usage"]["prompt_tokens"]
    assert context - 16 < prompt < context
    return text, prompt


def test_chat_context_left(qwen):
    context = httpx.get(qwen + "/v1/models", timeout=QUICK).json()["data"][0]["max_model_len"]
    text, prompt = _long_prompt(qwen, context)
    # asked for more than the context leaves: a 400 naming max_tokens, the prompt and the context
    _refused(_chat(qwen, content=text, modalities=["text"], max_tokens=MAX_TOKENS), "max_tokens", str(prompt),
             str(context), code="context_length_exceeded")
    # omitted: what the context leaves, ending with finish_reason "length"
    r = _chat(qwen, timeout=60, content=text, modalities=["text"], ignore_eos=True)
    assert r.status_code == 200, r.text[:500]
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == context


def test_fish_speech_frames_over_the_limit(fish):
    url = fish[0]
    message = _refused(_speech(url, FISH, max_frames=100_000), "max_frames", f"{FISH_SECONDS:.1f} s")
    assert int(message.split("limit is ")[1].split(" frames")[0]) == FISH_FRAMES
    ok = _speech(url, FISH, max_frames=4)
    assert ok.status_code == 200, ok.text[:500]


def test_a_key_in_a_url_is_not_logged(qwen_server):
    """`omnivox serve --log-level info` writes each request line, with key-like query values as ***
    (omnivox/api/access_log.py, installed by serve)."""
    url, log = qwen_server
    assert httpx.get(url + "/health?api_key=sk-leak-1&probe=visible", timeout=QUICK).status_code == 200
    wait_for(lambda: "probe=visible" in log.read_text(errors="replace"), timeout=30, what="the request's log line")
    text = log.read_text(errors="replace")
    assert "sk-leak-1" not in text and "api_key=***" in text
