"""A hostile or broken request fails only itself: sampling values that would give NaN never
reach the other streams, large bodies never stall the event loop, and a tiny audio upload that
declares an absurd rate or length is refused before it allocates anything."""
from __future__ import annotations

import asyncio
import base64
import struct
import threading
import time

import httpx
import numpy as np
import pytest
from api_helpers import MODEL, expected_samples, pcm16, reference_pcm
from speech_helpers import FISH
from omnivox.models.qwen3_omni.reference import generate_reference

N = 8
# /health slower than this means a stalled event loop. Quiet, the slowest poll takes ~0.15 s (while
# 10 MB of body arrive); the stalls this guards against take 7-13 s (tokenizing the 10.8 MB
# message or parsing the 100,000 parts with the stdlib on the loop).
STALL_S = 2.0


@pytest.fixture(scope="module")
def server(qwen_server):
    """(url, pid) of the session's Qwen3-Omni server: its 32 running slots hold the N streams and the
    hostile requests at once."""
    return qwen_server


def _stream_body(i: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Stream {i} says hello to {i * 3}."}],
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}, "stream": True,
            "temperature": 0, "max_tokens": 5 + i % 3, "max_audio_frames": 4 + i % 4}


async def _one_stream(client: httpx.AsyncClient, url: str, i: int, started: asyncio.Event) -> tuple[str, np.ndarray]:
    text, pcm = "", []
    async with client.stream("POST", url + "/v1/chat/completions", json=_stream_body(i)) as r:
        started.set()  # the reply's head comes with its first event: the request is running
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            import json
            ch = json.loads(line[6:])
            assert "error" not in ch, ch
            for c in ch.get("choices", []):
                text += c["delta"].get("content") or ""
                if c["delta"].get("audio"):
                    pcm.append(pcm16(base64.b64decode(c["delta"]["audio"]["data"])))
    return text, np.concatenate(pcm) if pcm else np.zeros(0, np.int32)


HOSTILE = [  # (extra fields, expected status)
    ({"temperature": 1e-45}, 200),  # below 1e-5: greedy, the limit of sampling
    ({"temperature": 0.8, "repetition_penalty": 1e-40}, 400),
    ({"temperature": 0, "talker_temperature": 1e-45}, 200),
    ({"temperature": 0.8, "talker_repetition_penalty": 1e-40}, 400),
]


async def _hostile(client: httpx.AsyncClient, url: str, extra: dict) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hostile values."}],
            "modalities": ["text", "audio"], "audio": {"voice": "ethan"}, "max_tokens": 6, "max_audio_frames": 5,
            **extra}
    return await client.post(url + "/v1/chat/completions", json=body)


async def _mixed(url: str):
    async with httpx.AsyncClient(timeout=120) as client:
        started = [asyncio.Event() for _ in range(N)]
        streams = [asyncio.create_task(_one_stream(client, url, i, started[i])) for i in range(N)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)  # the hostile ones join them
        hostile = await asyncio.gather(*(_hostile(client, url, extra) for extra, _ in HOSTILE))
        return await asyncio.gather(*streams), hostile


def test_hostile_sampling_values_fail_only_themselves(server, oracle):
    url, _ = server
    replies, hostile = asyncio.run(_mixed(url))
    for (extra, status), r in zip(HOSTILE, hostile):
        assert r.status_code == status, (extra, r.text)
        if status == 400:
            assert "repetition_penalty" in r.json()["error"]["message"]
    greedy = generate_reference(oracle, [{"role": "user", "content": "Hostile values."}], greedy=True, max_tokens=6,
                                       max_frames=5, speaker="ethan")
    assert hostile[0].json()["choices"][0]["message"]["content"] == greedy.text  # argmax Thinker
    assert hostile[2].json()["choices"][0]["message"]["content"] == greedy.text
    for i, (text, pcm) in enumerate(replies):  # every other stream finished with the right audio
        b = _stream_body(i)
        ref = generate_reference(oracle, b["messages"], greedy=True, max_tokens=b["max_tokens"],
                                        max_frames=b["max_audio_frames"], speaker="ethan")
        assert text == ref.text, i
        want = reference_pcm(ref)
        assert pcm.shape == want.shape == (expected_samples(ref.codes.shape[0]),) and np.abs(pcm - want).max() <= 2


def _health_while(url: str, send) -> tuple[list[float], httpx.Response]:
    """Latencies of GET /health polled while `send()` runs in another thread, and its response."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", send()))
    t.start()
    waits = []
    while t.is_alive():
        start = time.monotonic()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        waits.append(time.monotonic() - start)
        time.sleep(0.02)
    t.join()
    return waits, out["r"]


def test_huge_message_never_stalls_the_event_loop(server):
    url, _ = server
    text = "lorem ipsum dolor sit amet " * 400_000  # ~10.8 MB: more than can fit the context
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    waits, r = _health_while(url, lambda: httpx.post(url + "/v1/chat/completions", json=body, timeout=60))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert max(waits) < STALL_S, waits
    instruction = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"],
                   "audio": {"voice": "ethan"}, "talker_instruction": "x" * 100_000}
    r = httpx.post(url + "/v1/chat/completions", json=instruction, timeout=60)
    assert r.status_code == 400 and "talker_instruction" in r.json()["error"]["message"]


def test_talker_instruction_is_bounded_in_tokens(server):
    """Under the character limit but over the token limit (emoji take several tokens each): refused
    before the Talker sees it, while the server keeps answering."""
    url, _ = server
    instruction = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"],
                   "audio": {"voice": "ethan"}, "max_tokens": 2, "max_audio_frames": 2,
                   "talker_instruction": "\U0001f3b5\u4e00" * 2000}  # 4000 characters
    waits, r = _health_while(url, lambda: httpx.post(url + "/v1/chat/completions", json=instruction, timeout=60))
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "talker_instruction" and err["code"] == "input_too_long", err
    assert "tokens; the limit is 1024" in err["message"]
    assert max(waits) < STALL_S, waits
    ok = httpx.post(url + "/v1/chat/completions", json={**instruction, "talker_instruction": "Warmly."}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens_details"]["talker_instruction_tokens"] > 0


def _wav(rate: int, samples: int) -> bytes:
    data = b"\x00\x01" * samples
    size = len(data)
    fmt = struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
    return b"RIFF" + struct.pack("<I", 36 + size) + b"WAVEfmt " + fmt + b"data" + struct.pack("<I", size) + data


def _rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _silent_flac(seconds: int, rate: int = 8000) -> bytes:
    import io

    import soundfile as sf
    buf = io.BytesIO()
    sf.write(buf, np.zeros(rate * seconds, np.int16), rate, format="FLAC")
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["wav-1hz", "flac-400s"])
def test_tiny_audio_bomb_is_refused_before_it_allocates(server, kind):
    url, pid = server
    # 8 KB of wav at 1 Hz (4000 s: resampled to 16 kHz it would be 64M samples); 9 KB of flac
    # holding 400 s of silence (decoded, 13 MB; the header says 400 s, over the 300 s limit)
    data, fmt, why = (_wav(1, 4000), "wav", "sample rate") if kind == "wav-1hz" else (_silent_flac(400), "flac", "long")
    assert len(data) < 10_000
    before = _rss_mb(pid)
    body = {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}},
        {"type": "text", "text": "What is this?"}]}], "max_tokens": 3}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    assert _rss_mb(pid) - before < 50
    ok = httpx.post(url + "/v1/chat/completions", timeout=60,
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200


@pytest.fixture(scope="module")
def fish(fish_server):
    return fish_server[0]


def test_many_part_multipart_never_stalls_the_event_loop(fish):
    boundary = "b0undary"
    part = f"--{boundary}\r\nContent-Disposition: form-data; name=\"x\"\r\n\r\ny\r\n".encode()
    body = part * 100_000 + f"--{boundary}--\r\n".encode()  # ~6 MB of parts
    headers = {"content-type": f"multipart/form-data; boundary={boundary}"}
    waits, r = _health_while(fish, lambda: httpx.post(fish + "/v1/audio/voices", content=body, headers=headers,
                                                      timeout=60))
    assert r.status_code == 400 and "parts" in r.json()["error"]["message"], r.text[:300]
    assert max(waits) < STALL_S, waits
    speech = httpx.post(fish + "/v1/audio/speech", timeout=60,
                        json={"model": FISH, "input": "Still serving.", "response_format": "pcm", "max_frames": 5})
    assert speech.status_code == 200 and len(speech.content) > 0
