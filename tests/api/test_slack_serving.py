"""`omnivox serve --scheduling slack` end to end: concurrent streamed chat replies with speech are
the same as offline (the policy decides when rows step, never what they compute), and /metrics
shows the listener's side (slack of each chunk, stall seconds) and the capacity queue."""
from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from api_helpers import MODEL, metric, pcm16, reference_pcm, running_server, wait_for
from omnivox.models.qwen3_omni.reference import generate_reference

TOKENS, FRAMES = 8, 12


@pytest.fixture(scope="module")
def served(demo_cache):
    with running_server(demo_cache[0], "--scheduling", "slack", "--stream-lead-s", "0.5") as (url, _, log):
        yield url, log


def streamed(url: str, text: str) -> np.ndarray:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], modalities=["text", "audio"],
        audio={"voice": "chelsie", "format": "pcm16"}, temperature=0, max_tokens=TOKENS, stream=True,
        extra_body={"max_audio_frames": FRAMES})
    pcm = [pcm16(base64.b64decode(c.delta.audio.data)) for ch in chunks for c in ch.choices if c.delta.audio]
    return np.concatenate(pcm)


def test_concurrent_streams_under_slack_equal_offline_and_metrics_show_the_listeners(served, oracle):
    url, log = served
    texts = [f"Say something about the number {i}." for i in range(6)]
    with ThreadPoolExecutor(len(texts)) as pool:
        got = list(pool.map(lambda t: streamed(url, t), texts))
    for text, pcm in zip(texts, got):
        ref = generate_reference(oracle, [{"role": "user", "content": text}], greedy=True, max_tokens=TOKENS,
                                        max_frames=FRAMES, speaker="chelsie")
        want = reference_pcm(ref)
        assert pcm.shape == want.shape and np.abs(pcm - want).max() <= 2
    wait_for(lambda: metric(httpx.get(url + "/metrics").text, "omnivox_requests_in_flight") == 0,
             what="every request to end")
    text = httpx.get(url + "/metrics").text
    chunks = metric(text, "omnivox_audio_chunks_total")
    # every chunk after a stream's first has its slack observed
    assert metric(text, "omnivox_audio_slack_seconds_count") == chunks - len(texts) > 0
    underruns, stall = metric(text, "omnivox_audio_underruns_total"), metric(text, "omnivox_audio_stall_seconds_total")
    assert (underruns == 0) == (stall == 0) and stall >= 0
    assert metric(text, "omnivox_requests_waiting_capacity") == 0
    assert "scheduling slack" in log.read_text()
