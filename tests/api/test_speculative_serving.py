"""`omnivox serve --speculative-config '{"method": "dflash", "model": "demo"}'` on the demo model (what a
fresh clone runs): replies equal the offline reference without speculation, /metrics counts the
drafts by method, per draft position and as an acceptance-length histogram, the start-up line
names the draft's KV, and a request's `omnivox: {"speculative": false}` turns drafting off for it
(a misspelt switch is a 400; the server keeps serving)."""
import httpx
import openai
import pytest

from api_helpers import MODEL, metric, running_server
from omnivox.models.qwen3_omni.reference import generate_reference

SPEC = '{"method": "dflash", "model": "demo", "num_speculative_tokens": 7}'
LAB = dict(method="dflash", stage="thinker")


@pytest.fixture(scope="module")
def served(demo_cache):
    with running_server(demo_cache[0], "--speculative-config", SPEC) as (url, _, log):
        yield url, log


def _drafted(url: str) -> float:
    return metric(httpx.get(url + "/metrics").text, "omnivox_spec_draft_tokens_total", **LAB)


def test_dflash_server_answers_as_without_and_counts_drafts(served, oracle):
    url, log = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "the farmer counts his sheep by the river"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    ref = generate_reference(oracle, messages, greedy=True, max_tokens=24, return_audio=False)
    assert reply.choices[0].message.content == ref.text
    text = httpx.get(url + "/metrics").text
    assert _drafted(url) > 0 and metric(text, "omnivox_spec_draft_kv_bytes", **LAB) > 0
    assert metric(text, "omnivox_spec_position_drafted_total", position="0", **LAB) > 0
    assert metric(text, "omnivox_spec_acceptance_length_count", **LAB) > 0
    assert "each with the DFlash draft's KV" in log.read_text()

    before = _drafted(url)
    off = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24,
                                         extra_body={"omnivox": {"speculative": False}})
    assert off.choices[0].message.content == ref.text and _drafted(url) == before
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                       extra_body={"omnivox": {"speculate": False}})
    assert "speculate" in str(e.value)
    again = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    assert again.choices[0].message.content == ref.text and _drafted(url) > before
