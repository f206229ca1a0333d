"""A seeded fuzz run over `/v1/realtime` (issue 18 item 7) against a real `omnivox serve`: three
sessions send random client events, valid ones and mutated ones (a field replaced by an edge value
or a value of the wrong kind, a key dropped or added, a wrong type, raw non-JSON text, binary
frames), while two other sessions each speak a scripted turn and get its reply. No `error` event
says `server_error`, no connection is closed with 1011, the server's log holds no traceback, and
both scripted turns get their spoken reply. Bounded to about 15 s of fuzzing. The server runs one
realtime worker and gives idle turns' pages back after 0.5 s, so those paths run under the fuzz too
(and a last session checks that the flag reached it: its idle turn is released)."""
from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import time

import websockets
from websockets.exceptions import ConnectionClosed

import httpx

from api_helpers import running_server, wait_for
from realtime_helpers import b64, pieces, speech_pcm, ws_url

SEED = int(os.environ.get("OMNIVOX_FUZZ_SEED", "18"))  # another seed explores further
FUZZERS = 3
FUZZ_S = 15.0  # ~3,500 messages on a quiet 2-core machine (25 s gave ~5,900)
SPEECH = speech_pcm(lead_ms=100, tail_ms=400)
JUNK = [None, True, -1, 0, 2**70, -2**70, 1e308, -0.0, 0.5, "", "x" * 3000, "\u0000\ud7ff\u202e", [], {}, [[[[]]]],
        {"type": "realtime"}, "ethan", "server_vad", "inf", [1, "a", None], {"a": {"b": {"c": 1}}}]


def templates(rng: random.Random, item_ids: list[str]) -> list[dict]:
    piece = SPEECH[rng.randrange(0, len(SPEECH) - 4800):][:rng.choice([0, 240, 2400, 4800, 24000])]
    known = rng.choice(item_ids) if item_ids else "item_none"
    return [
        {"type": "session.update", "session": {"type": "realtime", "instructions": "Answer briefly.",
                                               "audio": {"input": {"turn_detection": None},
                                                         "output": {"voice": "ethan"}},
                                               "max_output_tokens": 3,
                                               "omnivox": {"max_audio_frames": 3, "seed": 1, "temperature": 0.7}}},
        {"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": {
            "type": "server_vad", "threshold": 0.5, "silence_duration_ms": 200, "prefix_padding_ms": 100,
            "create_response": rng.random() < 0.5, "interrupt_response": True}}}}},
        {"type": "input_audio_buffer.append", "audio": b64(piece)},
        {"type": "input_audio_buffer.append", "audio": b64(piece)},
        {"type": "input_audio_buffer.commit"},
        {"type": "input_audio_buffer.clear"},
        {"type": "conversation.item.create", "previous_item_id": rng.choice([None, "root", known]),
         "item": {"type": "message", "role": rng.choice(["user", "system", "assistant"]),
                  "content": [{"type": "input_text", "text": "Hello there, how are you?"}]}},
        {"type": "conversation.item.create",
         "item": {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": b64(piece)}]}},
        {"type": "conversation.item.truncate", "item_id": known, "content_index": 0, "audio_end_ms": 40},
        {"type": "conversation.item.delete", "item_id": known},
        {"type": "conversation.item.retrieve", "item_id": known},
        {"type": "response.create", "response": {"max_output_tokens": 3, "output_modalities": ["text"]}},
        {"type": "response.create", "response": {"max_output_tokens": 3, "output_modalities": ["audio"],
                                                 "omnivox": {"max_audio_frames": 3}}},
        {"type": "response.cancel"},
        {"type": "output_audio_buffer.clear"},
    ]


def mutate(rng: random.Random, event: dict) -> dict:
    """One change somewhere in the event: a value replaced, a key dropped or added, the type."""
    event = copy.deepcopy(event)
    paths, stack = [], [(event, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                paths.append(path + (k,))
                stack.append((v, path + (k,)))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                paths.append(path + (i,))
                stack.append((v, path + (i,)))
    path = rng.choice(paths)
    parent = event
    for key in path[:-1]:
        parent = parent[key]
    how = rng.random()
    if how < 0.6:
        parent[path[-1]] = rng.choice(JUNK)
    elif how < 0.8 and isinstance(parent, dict):
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[rng.choice(["extra", "omnivox", "event_id", "type", "response", "session"])] = rng.choice(JUNK)
    else:
        event["type"] = rng.choice(["", "response.create ", "session.create", "x" * 200, "error"])
    return event


def message(rng: random.Random, item_ids: list[str]) -> str | bytes:
    roll = rng.random()
    if roll < 0.04:
        return rng.choice([b"\x00\x01binary", b""])
    if roll < 0.1:
        return rng.choice(["", "{", "[]", "null", "42", '{"type": 5}', '{"type": "session.update"',
                           '{"type": "response.create", "response": ' + "[" * 5000 + "]" * 5000 + "}"])
    event = rng.choice(templates(rng, item_ids))
    return json.dumps(mutate(rng, event) if roll < 0.6 else event)


def released(url: str) -> float:
    """omnivox_realtime_idle_turn_releases_total"""
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("omnivox_realtime_idle_turn_releases_total "):
            return float(line.split()[1])
    raise AssertionError("no omnivox_realtime_idle_turn_releases_total in /metrics")


def tracebacks(log: str) -> set[str]:
    """Each distinct traceback in the log, as its last frame and its error."""
    out = set()
    for block in log.split("Traceback (most recent call last):")[1:]:
        lines = [ln for ln in block.splitlines() if ln.strip()]
        frames = [ln.strip() for ln in lines if ln.strip().startswith("File ")]
        error = next((ln for ln in lines if not ln.startswith(" ")), "?")
        out.add(f"{frames[-1] if frames else '?'}\n  {error}")
    return out


async def fuzz(url: str, seed: int, until: float, report: dict) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        item_ids: list[str] = []
        try:
            async with websockets.connect(ws_url(url), max_size=None) as ws:
                async def listen():
                    async for raw in ws:
                        ev = json.loads(raw)
                        report["events"] += 1
                        if ev["type"] == "error" and ev["error"].get("code") == "server_error":
                            report["server_errors"].append(ev)
                        item = ev.get("item")
                        if isinstance(item, dict) and item.get("id"):
                            item_ids.append(item["id"])

                listener = asyncio.ensure_future(listen())
                while time.monotonic() < until and not listener.done():
                    await ws.send(message(rng, item_ids))
                    report["sent"] += 1
                    await asyncio.sleep(rng.choice([0, 0, 0.001, 0.01, 0.05]))
                listener.cancel()
                await asyncio.gather(listener, return_exceptions=True)
        except ConnectionClosed as e:
            report["closes"].append(e.rcvd.code if e.rcvd else None)


async def scripted_turn(url: str, seed: int) -> dict:
    """A manual turn of speech and its spoken reply: the response.done."""
    async with websockets.connect(ws_url(url), max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "audio": {"input": {"turn_detection": None}}, "max_output_tokens": 3,
            "omnivox": {"max_audio_frames": 3, "seed": seed}}}))
        for p in pieces(SPEECH, seed):
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(p)}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create"}))
        audio = 0
        while True:
            ev = json.loads(await asyncio.wait_for(ws.recv(), 60))
            assert ev["type"] != "error", ev
            if ev["type"] == "response.output_audio.delta":
                audio += len(ev["delta"])
            if ev["type"] == "response.done":
                return {"status": ev["response"]["status"], "audio": audio}


def test_realtime_fuzz(demo_cache):
    report = {"sent": 0, "events": 0, "server_errors": [], "closes": []}

    async def run(url):
        until = time.monotonic() + FUZZ_S
        fuzzers = [asyncio.ensure_future(fuzz(url, SEED + i, until, report)) for i in range(FUZZERS)]
        await asyncio.sleep(1.0)  # the scripted turns run among the fuzzers, not before them
        turns = await asyncio.gather(*(scripted_turn(url, i) for i in range(2)))
        await asyncio.gather(*fuzzers)
        before = released(url)
        async with websockets.connect(ws_url(url), max_size=None) as ws:  # a turn left open, then idle
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "audio": {"input": {"turn_detection": None}}}}))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(SPEECH)}))
            await asyncio.to_thread(wait_for, lambda: released(url) > before, what="the idle turn's release")
        return turns

    with running_server(demo_cache[0], "--max-running", "8", "--realtime-workers", "1",
                        "--realtime-turn-idle-s", "0.5") as (url, proc, log):
        turns = asyncio.run(run(url))
        assert proc.poll() is None
        text = log.read_text(errors="replace")
    print(f"fuzz: {report['sent']} messages sent, {report['events']} events back, closes {report['closes']}")
    assert report["sent"] > 300, report["sent"]
    assert "Traceback" not in text, "\n\n".join(sorted(tracebacks(text)))
    assert not report["server_errors"], report["server_errors"][:3]
    assert 1011 not in report["closes"], report["closes"]
    for turn in turns:
        assert turn["status"] in ("completed", "incomplete") and turn["audio"] > 0, turn
