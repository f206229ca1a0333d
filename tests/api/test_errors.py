"""Bad requests get a 4xx in OpenAI's error shape with a message that says what to fix, and the
server goes on serving after each; a client that disconnects mid-stream frees its KV pages."""
from __future__ import annotations

import base64
import json

import httpx
import openai
import pytest
from api_helpers import MODEL, SPEECH, b64_file, metric, running_server, wait_for

MAX_BODY_MB = 1


@pytest.fixture(scope="module")
def server(demo_cache):
    with running_server(demo_cache[0], "--max-body-mb", str(MAX_BODY_MB)) as (url, _, _):
        yield url


def body(**over) -> dict:
    b = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    b.update(over)
    return b


def post(url: str, payload, timeout=60, **kw) -> httpx.Response:
    if isinstance(payload, (bytes, str)):  # raw bodies, sent as JSON (other types get 415)
        kw["headers"] = {"Content-Type": "application/json", **kw.get("headers", {})}
        return httpx.post(url + "/v1/chat/completions", content=payload, timeout=timeout, **kw)
    return httpx.post(url + "/v1/chat/completions", json=payload, timeout=timeout, **kw)


def assert_error(r: httpx.Response, status: int, *words: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    for w in words:
        assert w in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def assert_serving(url: str) -> None:
    r = post(url, body(modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"}, max_audio_frames=2))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["audio"]["data"]


def audio_part(data: str, fmt: str = "wav") -> list[dict]:
    return [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": data, "format": fmt}},
                                         {"type": "text", "text": "Hi"}]}]


CASES = [
    # (name, payload, status, words in the message, param)
    ("malformed json", b'{"model": "x", "messages": [', 400, ("not valid JSON",), None),
    ("not an object", b"[1, 2]", 400, ("object",), None),
    ("missing messages", {"model": MODEL}, 400, ("Field required",), "messages"),
    ("temperature type", body(temperature="hot"), 400, ("valid number", "hot"), "temperature"),
    ("max_tokens type", body(max_tokens="8"), 400, ("valid integer",), "max_tokens"),
    ("stream type", body(stream="yes"), 400, ("boolean",), "stream"),
    ("content type", body(messages=[{"role": "user", "content": 5}]), 400, ("string",), "messages[0].content"),
    ("bad role", body(messages=[{"role": "robot", "content": "x"}]), 400, ("'user'",), "messages[0].role"),
    ("unknown part", body(messages=[{"role": "user", "content": [{"type": "hologram"}]}]), 400,
     ("hologram", "input_audio"), "messages[0].content[0]"),
    ("bad base64", body(messages=audio_part("not base64 at all!")), 400, ("base64",),
     "messages[0].content[0].input_audio.data"),
    ("not audio", body(messages=audio_part(base64.b64encode(b"hello, this is not audio" * 20).decode())), 400,
     ("is not a RIFF/WAVE file",), "messages"),
    ("input audio format", body(messages=audio_part(b64_file(SPEECH), "aac")), 400, ("aac", "wav"),
     "messages[0].content[0].input_audio.format"),
    ("output audio format", body(modalities=["text", "audio"], audio={"voice": "ethan", "format": "aac"}), 400,
     ("aac", "wav", "pcm16"), "audio.format"),  # mp3 is encoded now
    ("stream flac", body(modalities=["text", "audio"], audio={"voice": "ethan", "format": "flac"}, stream=True), 400,
     ("pcm16",), "audio.format"),
    ("image url", body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}]), 400, ("data: URL",),
     "messages[0].content[0].image_url.url"),
    ("bad image", body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"nope").decode()}}]}]),
     400, ("image",), "messages"),
    ("prompt over context", body(messages=[{"role": "user", "content": "hello " * 5000}]), 400,
     ("context", "4096"), "messages"),
    ("temperature range", body(temperature=2.5), 400, ("less than or equal to 2",), "temperature"),
    ("top_p zero", body(top_p=0), 400, ("greater than 0",), "top_p"),
    ("top_p range", body(top_p=1.5), 400, ("less than or equal to 1",), "top_p"),
    ("max_tokens zero", body(max_tokens=0), 400, ("greater than or equal to 1",), "max_tokens"),
    ("top_k negative", body(top_k=-1), 400, ("greater than or equal to 0",), "top_k"),
    ("talker temperature", body(talker_temperature=9), 400, ("less than or equal to 2",), "talker_temperature"),
    ("negative frames", body(max_audio_frames=-1), 400, ("greater than or equal to 0",), "max_audio_frames"),
    ("seed type", body(seed="lucky"), 400, ("valid integer",), "seed"),
    ("n", body(n=2), 400, ("n must be 1",), "n"),
    ("stop", body(stop=["x"]), 400, ("stop",), "stop"),
    ("modalities", body(modalities=["audio"]), 400, ('["text"]',), "modalities"),
    ("modality value", body(modalities=["smell"]), 400, ("'audio'",), "modalities[0]"),
    ("unknown voice", body(modalities=["text", "audio"], audio={"voice": "bogus", "format": "wav"}), 400,
     ("bogus", "aiden, chelsie, ethan"), "audio.voice"),  # alloy is an OpenAI alias now
    ("unknown model", body(model="gpt-4o-audio-preview"), 404, ("gpt-4o-audio-preview", MODEL), "model"),
]


@pytest.mark.parametrize("name,payload,status,words,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request_then_service(server, name, payload, status, words, param):
    assert_error(post(server, payload), status, *words, param=param)
    assert_serving(server)


def test_oversize_body_then_service(server):
    big = body(messages=[{"role": "user", "content": "x" * (MAX_BODY_MB * 2**20 + 10)}])
    assert_error(post(server, big), 413, "at most", "--max-body-mb")

    def chunks():  # no content-length: the limit is enforced while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 65536):
            yield data[i:i + 65536]
    r = httpx.post(server + "/v1/chat/completions", content=chunks(), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert_error(r, 413, "at most")
    assert_serving(server)


def test_routes_and_methods(server):
    assert_error(httpx.get(server + "/v1/nothing"), 404, "no route")
    assert_error(httpx.get(server + "/v1/chat/completions"), 405, "GET")
    assert_error(httpx.get(server + "/v1/models/other"), 404, "other")
    assert_serving(server)


def test_openai_client_sees_clear_errors(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="unknown voice 'bogus'"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       modalities=["text", "audio"], audio={"voice": "bogus", "format": "wav"})
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert reply.choices[0].message.content is not None


def _kv(url: str) -> dict[str, tuple[float, float]]:
    text = httpx.get(url + "/metrics").text
    return {s: (metric(text, "omnivox_kv_cache_pages_free", stage=s), metric(text, "omnivox_kv_cache_pages_total", stage=s))
            for s in ("thinker", "talker")} | {"_": (metric(text, "omnivox_requests_in_flight"),
                                                    metric(text, "omnivox_engine_requests_aborted_total"))}


def test_disconnect_mid_stream_frees_pages(server):
    assert_serving(server)
    idle = _kv(server)
    assert idle["thinker"][0] == idle["thinker"][1] and idle["talker"][0] == idle["talker"][1]
    aborted_before = idle["_"][1]
    payload = body(messages=[{"role": "user", "content": "Please talk for a long time."}], max_tokens=3000,
                   max_audio_frames=3000, temperature=0, stream=True, modalities=["text", "audio"],
                   audio={"voice": "aiden", "format": "pcm16"})
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server + "/v1/chat/completions", json=payload) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # NOTE: held: a dropped httpx line iterator closes the response
            for line in lines:
                if '"audio"' in line:  # the first audio delta: the request holds pages in both stages
                    break
            busy = _kv(server)
            assert busy["_"][0] == 1
            assert busy["thinker"][0] < busy["thinker"][1] and busy["talker"][0] < busy["talker"][1]
        # leaving the block closes the connection mid-stream
    def freed() -> bool:
        now = _kv(server)
        return now["_"][0] == 0 and now["thinker"][0] == now["thinker"][1] and now["talker"][0] == now["talker"][1]

    wait_for(freed, what="the disconnect to end the request and free its pages")
    now = _kv(server)
    assert now["thinker"] == idle["thinker"] and now["talker"] == idle["talker"] and now["_"][0] == 0
    assert now["_"][1] == aborted_before + 1  # freed by the abort, not by running to the end
    wait_for(lambda: metric(httpx.get(server + "/metrics").text, "omnivox_client_disconnects_total") >= 1,
             what="the disconnect to be counted")
    assert_serving(server)


def test_disconnect_while_waiting_for_a_non_streaming_reply(server):
    before = _kv(server)
    payload = body(messages=[{"role": "user", "content": "A long answer, please."}], max_tokens=3000,
                   max_audio_frames=3000, temperature=0, modalities=["text", "audio"],
                   audio={"voice": "chelsie", "format": "wav"})
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        post(server, payload, timeout=httpx.Timeout(60, read=1.0))
    wait_for(lambda: _kv(server)["_"][0] == 0, what="the disconnect to end the request")
    after = _kv(server)
    assert after["_"][0] == 0 and after["_"][1] == before["_"][1] + 1
    assert after["thinker"] == before["thinker"] and after["talker"] == before["talker"]
    assert_serving(server)
