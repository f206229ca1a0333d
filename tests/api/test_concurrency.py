"""32 concurrent streams through one server: each reply's decoded audio equals the same greedy
request run offline through the Python API (`generate_reference`, no engine, no batching)."""
from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest
from api_helpers import MODEL, expected_samples, metric, metric_sum, pcm16, reference_pcm, running_server
from omnivox.models.qwen3_omni.reference import generate_reference

N = 32
VOICES = ("chelsie", "ethan", "aiden")


@pytest.fixture(scope="module")
def server(demo_cache):
    with running_server(demo_cache[0], "--max-running", "32") as (url, _, _):
        yield url


def request(i: int) -> dict:
    r = {"messages": [{"role": "user", "content": f"Request number {i}: tell me about the number {i * 7}."}],
         "voice": VOICES[i % 3], "max_tokens": 4 + i % 5, "frames": 3 + i % 6}
    if i % 4 == 0:
        r["talker_instruction"] = f"Speak like speaker {i}."
    return r


async def one(client: openai.AsyncOpenAI, r: dict) -> tuple[str, np.ndarray, int]:
    extra = {"max_audio_frames": r["frames"]}
    if "talker_instruction" in r:
        extra["talker_instruction"] = r["talker_instruction"]
    stream = await client.chat.completions.create(
        model=MODEL, messages=r["messages"], modalities=["text", "audio"], audio={"voice": r["voice"], "format": "pcm16"},
        temperature=0, max_tokens=r["max_tokens"], stream=True, extra_body=extra)
    text, pcm, frames = "", [], None
    async for ch in stream:
        if ch.usage is not None:
            frames = ch.usage.completion_tokens_details.audio_tokens
        for c in ch.choices:
            text += c.delta.content or ""
            if c.delta.audio is not None:
                pcm.append(pcm16(base64.b64decode(c.delta.audio.data)))
    return text, np.concatenate(pcm), frames


async def run_all(url: str) -> list:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        return await asyncio.gather(*(one(client, request(i)) for i in range(N)))
    finally:
        await client.close()


def test_32_concurrent_streams_equal_offline(server, oracle):
    replies = asyncio.run(run_all(server))
    for i, (text, pcm, frames) in enumerate(replies):
        r = request(i)
        ref = generate_reference(oracle, r["messages"], greedy=True, max_tokens=r["max_tokens"], max_frames=r["frames"],
                                        speaker=r["voice"], talker_instruction=r.get("talker_instruction"))
        want = reference_pcm(ref)
        assert text == ref.text, i
        assert frames == ref.codes.shape[0] and pcm.shape[0] == expected_samples(frames), i
        assert pcm.shape == want.shape and np.abs(pcm - want).max() <= 2, i
    text = httpx.get(server + "/metrics").text
    assert metric(text, "omnivox_stage_batch_max", stage="talker") >= 2  # they really ran together
    assert metric(text, "omnivox_requests_in_flight") == 0
    assert metric_sum(text, "omnivox_chat_completions_total") == N
