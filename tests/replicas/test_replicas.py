"""`omnivox serve --replicas` end to end: one local Ray instance and Serve application (an ingress,
two engine replicas on the built-in demo model: conftest.py's `cluster`), driven through Ray's
HTTP proxy with the official `openai` client: every route, realtime sessions pinned to one
replica, a shared prefix meeting one replica's prefix cache, and a replica killed mid-stream."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
from websockets.exceptions import ConnectionClosedError
from websockets.sync.client import connect as ws_connect

from api_helpers import metric, wait_for
from shared_cluster import API_KEY, KEY, MODEL

REPLICA = "x-omnivox-replica"
WAIT_S = 90.0


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)


def replica_metrics(url: str, replica: str) -> str:
    r = httpx.get(url + "/metrics", headers={REPLICA: replica}, timeout=30)
    assert r.headers[REPLICA] == replica
    return r.text


def test_every_route_answers_through_the_ingress(cluster):
    url, _ = cluster
    assert httpx.get(url + "/health/ready", timeout=30).json()["ready"] is True
    assert httpx.get(url + "/v1/models", headers=KEY, timeout=30).json()["data"][0]["id"] == MODEL
    assert httpx.get(url + "/v1/audio/voices", headers=KEY, timeout=30).status_code == 200
    c = client(url)
    plain = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "wav"})
    reply = plain.parse().choices[0].message
    assert plain.headers[REPLICA] and reply.content and len(reply.audio.data) > 1000
    chunks = list(c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
        modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"}))
    assert any(ch.choices and getattr(ch.choices[0].delta, "audio", None) for ch in chunks)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    speech = c.audio.speech.with_raw_response.create(model=MODEL, voice="ethan", input="hello there",
                                                     response_format="wav")
    assert speech.headers[REPLICA] and speech.content[:4] == b"RIFF"
    # the replica's own validation answers: the same errors as `omnivox serve`
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    assert httpx.get(url + "/nope", timeout=30).json()["error"]["message"].startswith("no route GET /nope")


async def one_session(url: str, n: int) -> list[str]:
    """A realtime session: created, updated, one text turn; the replica each session event names."""
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY)
    seen = []
    async with c.realtime.connect(model=MODEL) as conn:
        created = await asyncio.wait_for(conn.recv(), WAIT_S)
        seen.append(created.session.omnivox["replica"])
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 4,
                                           "omnivox": {"max_audio_frames": 3}})
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": f"hello {n}"}]})
        await conn.response.create()
        async def until_done():
            async for ev in conn:
                if ev.type == "session.updated":
                    seen.append(ev.session.omnivox["replica"])
                assert ev.type != "error", ev
                if ev.type == "response.done":
                    return ev
        done = await asyncio.wait_for(until_done(), WAIT_S)
        assert done.response.status in ("completed", "incomplete")  # incomplete: max_output_tokens
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 5})
        seen.append((await asyncio.wait_for(conn.recv(), WAIT_S)).session.omnivox["replica"])
    return seen


def test_realtime_sessions_each_stay_on_one_replica(cluster):
    url, _ = cluster

    async def run():
        return await asyncio.gather(*(one_session(url, n) for n in range(4)))

    sessions = asyncio.run(run())
    for seen in sessions:
        assert len(seen) == 3 and len(set(seen)) == 1, sessions
    print("sessions on", [s[0] for s in sessions])


def test_a_shared_prefix_lands_on_one_replica_and_hits_its_prefix_cache(cluster):
    url, _ = cluster
    c = client(url)
    system = {"role": "system", "content": "You answer briefly. " + "The reference text follows. " * 160}

    def ask(question: str) -> str:
        r = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=[system, {"role": "user", "content": question}], max_tokens=2,
            modalities=["text"])
        return r.headers[REPLICA]

    first = ask("first question")
    before = metric(replica_metrics(url, first), "omnivox_prefix_cache_hit_tokens_total")
    assert ask("second question") == first
    after = metric(replica_metrics(url, first), "omnivox_prefix_cache_hit_tokens_total")
    assert after - before > 500  # the ~1 K-token system prompt came from the cache


def readiness(url: str, replica: str) -> dict:
    return httpx.get(url + "/health/ready", headers={REPLICA: replica}, timeout=30).json()


def test_a_client_leaving_a_stream_stops_its_work_on_the_replica(cluster):
    """The client closes a long stream after three chunks: the replica aborts the request (Serve
    cancels the ingress's call, which cancels the replica's; the app sees `http.disconnect`)."""
    url, _ = cluster
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a long story"}], "max_tokens": 3000,
            "stream": True, "ignore_eos": True, "modalities": ["text", "audio"],
            "audio": {"voice": "ethan", "format": "pcm16"}}

    def figures(replica: str) -> tuple[float, float]:
        text = replica_metrics(url, replica)
        return metric(text, "omnivox_requests_in_flight"), metric(text, "omnivox_engine_requests_aborted_total")

    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=KEY, timeout=WAIT_S) as r:
        replica = r.headers[REPLICA]
        chunks = r.iter_bytes()  # NOTE: held: an abandoned iterator closes the connection (the client leaves)
        for _ in range(3):
            next(chunks)
        in_flight, aborted = figures(replica)
        assert in_flight == 1  # ~3000 tokens of speech: it runs for many seconds yet
        r.close()  # the client goes away mid-stream
        wait_for(lambda: figures(replica) == (0, aborted + 1), WAIT_S, "the abandoned request to be aborted")
    # ... and the ingress no longer counts it (what a drain waits for)
    from ray import serve
    from omnivox.replicas.app import APP_NAME
    ingress = serve.get_deployment_handle("Ingress", app_name=APP_NAME)
    wait_for(lambda: ingress.working.remote().result(timeout_s=WAIT_S) == 0, WAIT_S, "the ingress to let it go")


def replicas_running() -> list[str]:
    from ray import serve
    from omnivox.replicas.app import APP_NAME
    states = serve.status().applications[APP_NAME].deployments["Engine"].replica_states
    return states


def test_a_replica_killed_mid_stream_fails_visibly_and_is_replaced(cluster):
    """A realtime session and a streamed chat on one replica; SIGKILL it: the stream ends with an
    error event, the session gets an error event and close 1011, the other replica serves, and
    Serve starts a replacement."""
    url, engine = cluster
    c = client(url)
    with ws_connect(url.replace("http", "ws", 1) + f"/v1/realtime?model={MODEL}", open_timeout=WAIT_S,
                    additional_headers=KEY) as ws:
        victim = json.loads(ws.recv(WAIT_S))["session"]["omnivox"]["replica"]
        stream = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "tell a long story"}], max_tokens=3000, stream=True,
            modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"},
            extra_body={"ignore_eos": True}, extra_headers={REPLICA: victim})
        assert stream.headers[REPLICA] == victim
        pid = engine.whoami.remote(replica=victim).result(timeout_s=WAIT_S)["pid"]
        got, error = 0, None
        try:
            for _ in stream.parse():
                got += 1
                if got == 3:
                    os.kill(pid, signal.SIGKILL)
        except openai.APIError as e:
            error = e
        assert error is not None and "replica" in str(error), (got, error)
        events = []
        with pytest.raises(ConnectionClosedError) as closed:
            while True:
                events.append(json.loads(ws.recv(WAIT_S)))
        assert [e["error"]["code"] for e in events if e["type"] == "error"] == ["replica_failed"]
        assert closed.value.rcvd.code == 1011
    # the other replica serves new requests at once
    r = c.chat.completions.with_raw_response.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2, modalities=["text"])
    assert r.headers[REPLICA] != victim
    # Serve starts a replacement; it serves once loaded
    t = time.monotonic()
    wait_for(lambda: replicas_running().get("RUNNING", 0) == 2 and set(_ids(engine)) - {victim, r.headers[REPLICA]},
             WAIT_S, "a replacement replica")
    print(f"replacement serving {time.monotonic() - t:.1f} s after the kill was seen")


def _ids(engine) -> set[str]:
    return {engine.whoami.remote().result(timeout_s=WAIT_S)["replica"] for _ in range(6)}
