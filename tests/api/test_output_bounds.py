"""Output bounds against a real `omnivox serve --max-output-tokens --max-audio-seconds` (issue 17):
a request asking for more than the server allows is answered 400 at once, naming the field and the
limit, instead of running for minutes (speech `max_frames: 100000`), being cut silently (chat
`max_tokens` past the context) or failing on the KV cache with a 413 that never names max_tokens;
the server then serves an ordinary request."""
from __future__ import annotations

import httpx
import pytest
from api_helpers import MODEL, running_server, wait_for
from speech_helpers import FISH

MAX_TOKENS, MAX_SECONDS = 64, 2.0
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


@pytest.mark.parametrize("field", ["max_audio_frames", "talker_max_new_tokens"])
def test_chat_audio_frames_over_the_limit(qwen, field):
    _refused(_chat(qwen, modalities=["text", "audio"], max_tokens=2, **{field: 100_000}), field,
             f"{QWEN_FRAMES} frames", f"{MAX_SECONDS:.1f} s")


@pytest.mark.parametrize("field", ["max_frames", "max_new_tokens"])
def test_speech_frames_over_the_limit(qwen, field):
    _refused(_speech(qwen, **{field: 100_000}), field, f"{QWEN_FRAMES} frames", f"{MAX_SECONDS:.1f} s")
    ok = _speech(qwen, **{field: QWEN_FRAMES})
    assert ok.status_code == 200, ok.text[:500]


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


def test_fish_speech_frames_over_the_limit(demo_cache, tmp_path):
    with running_server(demo_cache[0], "--model", "fish-demo", "--voices-dir", str(tmp_path),
                        "--max-audio-seconds", str(MAX_SECONDS)) as (url, _, _):
        message = _refused(_speech(url, FISH, max_frames=100_000), "max_frames", f"{MAX_SECONDS:.1f} s")
        frames = int(message.split("limit is ")[1].split(" frames")[0])
        assert frames == int(MAX_SECONDS * 44100 / 2048)  # S2's 21.5 Hz frames, not Qwen3-Omni's 12.5
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
