"""A real `omnivox serve` as a load balancer sees it: HTTP answers while the model loads
(/health/live 200, /health, /health/ready and other routes 503 `loading`), /health 200 and
readiness once it serves (a request sent the moment /health answers 200 is served), and a drain
on SIGTERM that lets every running stream and realtime response finish while new work, and work
still waiting for capacity, gets 503 `draining` at once (a new realtime session: 1013; a realtime
response.create: an `error` event), then exits 0; at the drain's timeout what still runs ends with
an `error` event, and the process exits within the stated bound; a second signal exits at once.

The slow load is real: the server's cache has no demo yet and another process (this test) holds
the demo's build lock, as a server building it would; the server's load waits on that lock until
the test has written the demo and lets go."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import shutil
import signal
import time

import httpx
import pytest
import websockets
from api_helpers import MODEL, ROOT, expected_samples, running_server, wait_for
from websockets.exceptions import ConnectionClosed

from omnivox.api.lifecycle import exit_bound
from omnivox.demo import build_lock

STREAMS, FRAMES = 8, 200  # 16 s of speech each: many seconds of engine steps on the demo
LONG_FRAMES = 1000  # a stream no test waits for
LONG_TOKENS = 2000  # text that holds a Thinker slot for many seconds
DRAIN_TIMEOUT = 300  # a bound for liveness only (the streams finish long before)
CUT_AFTER_S = 2  # a drain that times out


@pytest.fixture
def empty_cache(tmp_path, demo_cache):
    """(a cache without the demo, where the server looks for it, the session's built demo)."""
    cache = tmp_path / "cache"
    return cache, cache / demo_cache[1].name, demo_cache[1]


def readiness(url: str) -> httpx.Response:
    return httpx.get(url + "/health/ready", timeout=10)


def speech_chat(i: int, frames: int, tokens: int = 4) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Stream {i}, please."}],
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}, "stream": True,
            "max_tokens": tokens, "ignore_eos": True, "max_audio_frames": frames}


async def stream_chunks(client: httpx.AsyncClient, url: str, body: dict, heard: asyncio.Event) -> list:
    """Every `data:` of one streamed chat (chunks as dicts, then "[DONE]"); `heard` once audio comes."""
    out = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            out.append(json.loads(data) if data.startswith("{") else data)
            if data.startswith("{") and any(_audio_of(c) for c in out[-1].get("choices", [])):
                heard.set()
    return out


def _audio_of(choice: dict) -> str | None:
    return ((choice.get("delta") or {}).get("audio") or {}).get("data")


async def stream(client: httpx.AsyncClient, url: str, body: dict, heard: asyncio.Event) -> tuple[int, int | None]:
    """(pcm samples received, audio frames the final usage reports) of one streamed chat."""
    samples, frames = 0, None
    for chunk in await stream_chunks(client, url, body, heard):
        if chunk == "[DONE]":
            continue
        assert "error" not in chunk, chunk
        if chunk.get("usage"):
            frames = chunk["usage"]["completion_tokens_details"]["audio_tokens"]
        samples += sum(len(base64.b64decode(_audio_of(c))) // 2 for c in chunk["choices"] if _audio_of(c))
    return samples, frames


async def realtime_reply(url: str, heard: asyncio.Event) -> tuple[str, int, int]:
    """One realtime session's spoken response: (its response.done status, its pcm samples, the
    code the server closes the session with once the drain is over)."""
    async with websockets.connect(url.replace("http", "ws", 1) + "/v1/realtime", max_size=None) as ws:
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello there."}]}}))
        await ws.send(json.dumps({"type": "response.create", "response": {"omnivox": {"max_audio_frames": FRAMES, "greedy": True}}}))
        samples, status = 0, None
        try:
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), DRAIN_TIMEOUT))
                if event["type"] == "response.output_audio.delta":
                    samples += len(base64.b64decode(event["delta"])) // 2
                    heard.set()
                elif event["type"] == "response.done":
                    status = event["response"]["status"]
                elif event["type"] == "error":
                    raise AssertionError(event)
        except ConnectionClosed as closed:
            return status, samples, closed.rcvd.code


async def refused_socket(url: str) -> ConnectionClosed:
    with pytest.raises(ConnectionClosed) as closed:  # (a loading server answers late on a loaded machine)
        async with websockets.connect(url.replace("http", "ws", 1) + "/v1/realtime", open_timeout=60) as ws:
            await asyncio.wait_for(ws.recv(), 30)
    return closed.value


async def until(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(0.05)


def served_at_first_health(url: str) -> httpx.Response:
    """Poll /health until it first answers 200 (503 `loading` with Retry-After until then, while
    /health/live answers 200 at every poll) and send a chat the moment it does: the chat's reply."""
    with httpx.Client(timeout=60) as client:
        deadline = time.monotonic() + 90
        while (health := client.get(url + "/health")).status_code != 200:
            assert health.status_code == 503 and health.json()["status"] in ("loading", "warming_up"), health.text
            assert int(health.headers["Retry-After"]) > 0
            assert client.get(url + "/health/live").status_code == 200
            assert time.monotonic() < deadline, "/health never answered 200"
            time.sleep(0.02)
        return client.post(url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})


def test_loading_then_ready_then_a_second_signal_exits_at_once(empty_cache):
    cache, folder, built = empty_cache
    with contextlib.ExitStack() as lock:
        lock.enter_context(build_lock(folder))
        with running_server(cache, ready=False) as (url, proc, log):
            health = httpx.get(url + "/health", timeout=10)
            assert health.status_code == 503 and health.json()["status"] == "loading", health.text
            assert int(health.headers["Retry-After"]) > 0
            assert httpx.get(url + "/health/live", timeout=10).json()["status"] == "loading"
            r = readiness(url)
            assert r.status_code == 503 and r.json() == {
                "ready": False, "state": "loading", "draining": False, "running": 0, "waiting": 0,
                "kv_free_ratio": {}, "realtime_sessions": 0}
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
                r = httpx.request(method, url + path, json=speech_chat(0, 1), timeout=10)
                assert r.status_code == 503 and r.json()["error"]["code"] == "loading", r.text
                assert int(r.headers["Retry-After"]) > 0
            closed = asyncio.run(refused_socket(url))
            assert closed.rcvd.code == 1013 and "loading" in closed.rcvd.reason, closed

            shutil.copytree(built, folder)  # the other builder is done and lets go: the load goes on
            lock.close()
            first = served_at_first_health(url)
            assert first.status_code == 200, first.text
            body = readiness(url).json()
            assert body == {"ready": True, "state": "serving", "draining": False, "running": 0, "waiting": 0,
                            "kv_free_ratio": {"thinker": 1.0, "talker": 1.0}, "realtime_sessions": 0}
            assert httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"] == MODEL

            async def second_signal():
                async with httpx.AsyncClient(timeout=120) as client:
                    heard = asyncio.Event()
                    long = asyncio.ensure_future(stream(client, url, speech_chat(0, LONG_FRAMES), heard))
                    await asyncio.wait_for(heard.wait(), 60)
                    proc.send_signal(signal.SIGTERM)
                    await until(lambda: asyncio.to_thread(lambda: readiness(url).json()["draining"]),
                                what="the drain to start")
                    proc.send_signal(signal.SIGTERM)
                    with pytest.raises(httpx.HTTPError):  # cut: the server is gone
                        await long
            asyncio.run(second_signal())
            assert proc.wait(timeout=30) == 128 + signal.SIGTERM


def test_sigterm_while_loading_exits_0(empty_cache):
    cache, folder, _ = empty_cache
    with build_lock(folder):
        with running_server(cache, ready=False) as (url, proc, log):
            assert readiness(url).json()["state"] == "loading"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, log.read_text()


async def waiting(client: httpx.AsyncClient, url: str, n: int) -> bool:
    """Whether n requests wait for capacity (/health/ready's `waiting`)."""
    return (await client.get(url + "/health/ready")).json()["waiting"] == n


def test_drain_lets_running_streams_finish(demo_cache):
    async def drain(url: str, proc) -> tuple[list, tuple, httpx.Response, ConnectionClosed, dict]:
        async with httpx.AsyncClient(timeout=DRAIN_TIMEOUT) as client:
            heard = [asyncio.Event() for _ in range(STREAMS)]
            streams = [asyncio.ensure_future(stream(client, url, speech_chat(i, FRAMES), heard[i]))
                       for i in range(STREAMS)]
            heard.append(asyncio.Event())
            session = asyncio.ensure_future(realtime_reply(url, heard[-1]))
            await asyncio.wait_for(asyncio.gather(*(h.wait() for h in heard)), DRAIN_TIMEOUT)  # every one speaks
            proc.send_signal(signal.SIGTERM)
            report = {}

            async def draining() -> bool:
                report.update((await client.get(url + "/health/ready")).json())
                return report["draining"]
            await until(draining, what="the drain to start")
            late = await client.post(url + "/v1/chat/completions", json=speech_chat(9, 1))
            closed = await refused_socket(url)
            return await asyncio.gather(*streams), await session, late, closed, report

    # fifo: every stream starts at once, also on a loaded machine (nothing waits for capacity)
    with running_server(demo_cache[0], "--drain-timeout", str(DRAIN_TIMEOUT), "--scheduling", "fifo") \
            as (url, proc, log):
        replies, (status, samples, code), late, closed, report = asyncio.run(drain(url, proc))
        assert proc.wait(timeout=DRAIN_TIMEOUT + 5) == 0, log.read_text()[-3000:]
        text = log.read_text()
    assert "SIGTERM: draining" in text and "Traceback" not in text, text[-3000:]
    assert replies == [(expected_samples(FRAMES), FRAMES)] * STREAMS
    assert late.status_code == 503 and late.json()["error"]["code"] == "draining", late.text
    assert int(late.headers["Retry-After"]) > 0
    assert closed.rcvd.code == 1013 and "draining" in closed.rcvd.reason, closed
    assert not report["ready"] and report["state"] == "draining" and report["realtime_sessions"] == 1, report
    # the realtime response ran to its frame limit too (greedy: the demo's reply never ends sooner),
    # then the session was closed as the server left: 1012, "service restart"
    assert (status, samples, code) == ("incomplete", expected_samples(FRAMES), 1012)


def test_at_the_drain_timeout_streams_end_with_an_error_event(demo_cache):
    """--drain-timeout passes with streams still running: each ends with an `error` event (code
    `draining`) and [DONE], never a 500 or a traceback; a stream waiting for a Thinker slot
    (--max-running 2, held by the running streams' long text) got 503 `draining` at SIGTERM, while
    the others still ran; a realtime response.create meanwhile an `error` event; the process exits
    0 within the bound the README states."""
    async def drain(url: str, proc) -> tuple[list, httpx.Response, dict, float]:
        async with httpx.AsyncClient(timeout=60) as client:
            heard = [asyncio.Event() for _ in range(2)]
            running = [asyncio.ensure_future(stream_chunks(client, url, speech_chat(i, LONG_FRAMES, LONG_TOKENS),
                                                           heard[i])) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(h.wait() for h in heard)), 60)
            queued = asyncio.ensure_future(client.post(url + "/v1/chat/completions", json=speech_chat(2, 1)))
            await until(lambda: waiting(client, url, 1), what="a stream to wait for capacity")
            async with websockets.connect(url.replace("http", "ws", 1) + "/v1/realtime") as ws:
                assert json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "session.created"
                proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                refused = await queued
                assert not any(r.done() for r in running)  # refused at once, not at the timeout
                await ws.send(json.dumps({"type": "response.create"}))
                error = json.loads(await asyncio.wait_for(ws.recv(), 30))
            return await asyncio.gather(*running), refused, error, signalled

    with running_server(demo_cache[0], "--drain-timeout", str(CUT_AFTER_S), "--max-running", "2",
                        "--scheduling", "fifo") as (url, proc, log):
        replies, refused, error, signalled = asyncio.run(drain(url, proc))
        assert proc.wait(timeout=max(0.0, signalled + exit_bound(CUT_AFTER_S) - time.monotonic())) == 0
        text = log.read_text()
    assert "drain timeout: 2 request(s) still running are cut" in text and "Traceback" not in text, text[-3000:]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining", refused.text
    assert error["type"] == "error" and error["error"]["code"] == "draining", error
    for chunks in replies:
        assert chunks[-1] == "[DONE]" and chunks[-2]["error"]["code"] == "draining", chunks[-3:]
        assert "--drain-timeout" in chunks[-2]["error"]["message"]
        assert any(_audio_of(c) for chunk in chunks[:-2] for c in chunk["choices"])  # it had been speaking
    assert f"--drain-timeout + {exit_bound(0):g} s" in (ROOT / "README.md").read_text()  # the bound stated
