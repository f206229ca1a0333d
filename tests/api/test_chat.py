"""`POST /v1/chat/completions` on a real server, through the official openai client: streaming
and non-streaming text + speech, speech and image input, the Talker-only instruction, Talker
sampling fields and the text hook plug-in. Greedy replies (temperature 0) must equal the same
request run offline through the Python API (int16 PCM within 2 LSB: pcm16 quantises)."""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
from omnivox.serving import ChatParams
from omnivox.models.qwen3_omni.reference import generate_reference
from api_helpers import (MODEL, ROOT, SAMPLE_RATE, SPEECH, b64_file, expected_samples, metric, pcm16,
                         reference_pcm, running_server, read_pcm16, wait_for)

TOKENS, FRAMES = 8, 6


@pytest.fixture(scope="module")
def served(demo_cache):
    with running_server(demo_cache[0], "--text-hook", "hook_plugin:make_hook") as (url, _, log):
        yield url, log


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def user(text: str, *media: dict) -> list[dict]:
    return [{"role": "user", "content": [*media, {"type": "text", "text": text}]}]


def speak(client, messages, voice="chelsie", frames=FRAMES, fmt="wav", **extra):
    return client.chat.completions.create(
        model=MODEL, messages=messages, modalities=["text", "audio"], audio={"voice": voice, "format": fmt},
        temperature=0, max_tokens=TOKENS, extra_body={"max_audio_frames": frames, **extra})


def stream(client, messages, voice="chelsie", frames=FRAMES, **extra):
    """(content, pcm int32 samples, transcript, usage, audio ids) of one streamed reply."""
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, modalities=["text", "audio"], audio={"voice": voice, "format": "pcm16"},
        temperature=0, max_tokens=TOKENS, stream=True, extra_body={"max_audio_frames": frames, **extra})
    content, pcm, transcript, usage, ids, finish = "", [], "", None, set(), None
    for ch in chunks:
        if ch.usage is not None:
            usage = ch.usage
        for choice in ch.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            if choice.delta.audio is not None:
                pcm.append(pcm16(base64.b64decode(choice.delta.audio.data)))
                transcript += choice.delta.audio.transcript or ""
                ids.add(choice.delta.audio.id)
    assert finish in ("stop", "length")
    return content, np.concatenate(pcm) if pcm else np.zeros(0, np.int32), transcript, usage, ids


def assert_same_audio(got: np.ndarray, out) -> None:
    want = reference_pcm(out)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 2


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(server + "/health").json()
    assert health["status"] == "healthy" and health["model"] == MODEL  # SGLang-Omni's tests look for it


def test_streaming_text_and_audio_equal_offline(client, oracle):
    messages = user("Tell me a story.")
    content, pcm, transcript, usage, ids = stream(client, messages)
    frames = usage.completion_tokens_details.audio_tokens
    ref = generate_reference(oracle, messages, greedy=True, max_tokens=TOKENS, max_frames=FRAMES, speaker="chelsie")
    assert frames == ref.codes.shape[0] > 0
    # 24 kHz pcm16: n frames of 80 ms, less the vocoder's 555-sample look-ahead
    assert pcm.shape[0] == expected_samples(frames)
    assert abs(pcm.shape[0] / SAMPLE_RATE - (frames * 0.08 - 555 / SAMPLE_RATE)) < 1e-9
    assert_same_audio(pcm, ref)
    assert content == ref.text
    assert usage.completion_tokens_details.text_tokens == len(ref.text_ids)
    assert usage.prompt_tokens == len(oracle.build_prompt(messages).ids)
    assert len(ids) == 1 and transcript  # one audio id per reply; the voiced text rides along


def test_non_streaming_wav_equals_offline(client, oracle):
    messages = user("What is the weather like?")
    reply = speak(client, messages, voice="ethan")
    msg = reply.choices[0].message
    ref = generate_reference(oracle, messages, greedy=True, max_tokens=TOKENS, max_frames=FRAMES, speaker="ethan")
    samples, rate = read_pcm16(base64.b64decode(msg.audio.data))
    assert rate == SAMPLE_RATE
    assert samples.shape[0] == expected_samples(reply.usage.completion_tokens_details.audio_tokens)
    assert_same_audio(samples, ref)
    assert msg.content == ref.text and reply.choices[0].finish_reason == ref.finish_reason
    assert msg.audio.id.startswith("audio_") and msg.audio.expires_at > reply.created
    assert msg.audio.transcript


def test_non_streaming_pcm16_and_flac(client, oracle):
    messages = user("Count to three.")
    ref = reference_pcm(generate_reference(oracle, messages, greedy=True, max_tokens=TOKENS, max_frames=FRAMES,
                                                  speaker="aiden"))
    raw = pcm16(base64.b64decode(speak(client, messages, voice="aiden", fmt="pcm16").choices[0].message.audio.data))
    flac, rate = read_pcm16(base64.b64decode(speak(client, messages, voice="aiden", fmt="flac").choices[0].message.audio.data))
    assert rate == SAMPLE_RATE and np.array_equal(raw, flac)
    assert raw.shape == ref.shape and np.abs(raw - ref).max() <= 2


def test_text_only(client, oracle):
    messages = user("Hello!")
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=TOKENS)
    ref = generate_reference(oracle, messages, greedy=True, max_tokens=TOKENS, return_audio=False)
    assert reply.choices[0].message.audio is None
    assert reply.choices[0].message.content == ref.text
    assert reply.usage.completion_tokens == len(ref.text_ids)


@pytest.mark.parametrize("path,fmt", [(SPEECH, "wav"), (ROOT / "tests" / "media" / "speech_22k.flac", "flac")])
def test_speech_input(client, oracle, path, fmt):
    part = {"type": "input_audio", "input_audio": {"data": b64_file(path), "format": fmt}}
    messages = user("What did the speaker say?", part)
    reply = speak(client, messages)
    ref = generate_reference(oracle, messages, greedy=True, max_tokens=TOKENS, max_frames=FRAMES, speaker="chelsie")
    prompt = oracle.build_prompt(messages)
    assert prompt.audio_token_counts and reply.usage.prompt_tokens == len(prompt.ids)
    assert reply.choices[0].message.content == ref.text
    assert_same_audio(read_pcm16(base64.b64decode(reply.choices[0].message.audio.data))[0], ref)


def test_image_input(client, oracle):
    from PIL import Image
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (36, 52, 3), dtype=np.uint8)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = user("Describe the picture.", {"type": "image_url", "image_url": {"url": url}})
    content, pcm, _, usage, _ = stream(client, messages)
    ref = generate_reference(oracle, messages, greedy=True, max_tokens=TOKENS, max_frames=FRAMES, speaker="chelsie")
    prompt = oracle.build_prompt(messages)
    assert len(prompt.visual) == 1 and usage.prompt_tokens == len(prompt.ids)
    assert content == ref.text
    assert_same_audio(pcm, ref)


def test_talker_instruction_reaches_only_the_talker(client, oracle):
    messages = user("Say something nice.")
    instruction = "Speak slowly, in a warm and low voice."
    plain = speak(client, messages)
    styled = speak(client, messages, talker_instruction=instruction)
    ref = generate_reference(oracle, messages, greedy=True, max_tokens=TOKENS, max_frames=FRAMES, speaker="chelsie",
                                    talker_instruction=instruction)
    styled_pcm = read_pcm16(base64.b64decode(styled.choices[0].message.audio.data))[0]
    plain_pcm = read_pcm16(base64.b64decode(plain.choices[0].message.audio.data))[0]
    assert styled.choices[0].message.content == plain.choices[0].message.content == ref.text  # the Thinker never sees it
    # the Thinker's prompt is the same; the Talker's instruction turn is counted on top of it
    turn = len(oracle.options(ChatParams(talker_instruction=instruction)).talker_instruction_ids)
    assert styled.usage.prompt_tokens_details.talker_instruction_tokens == turn > 0
    assert styled.usage.prompt_tokens == plain.usage.prompt_tokens + turn
    assert plain.usage.prompt_tokens_details.talker_instruction_tokens == 0
    assert_same_audio(styled_pcm, ref)
    assert styled_pcm.shape != plain_pcm.shape or np.abs(styled_pcm - plain_pcm).max() > 2


def test_talker_sampling_fields(client):
    def run(seed):
        r = speak(client, user("Sing."), talker_temperature=1.5, talker_top_k=0, seed=seed, frames=8)
        return r.choices[0].message.content, read_pcm16(base64.b64decode(r.choices[0].message.audio.data))[0]

    (t1, a1), (t2, a2), (t3, a3) = run(1), run(1), run(2)
    assert t1 == t2 == t3  # the Thinker stays greedy
    assert np.array_equal(a1, a2)  # a seeded sampled Talker repeats itself
    assert a1.shape != a3.shape or not np.array_equal(a1, a3)  # and samples: another seed, other speech


def test_text_hook_plugin_voices_what_it_returns(client, oracle):
    messages = user("Tell me about cats.")
    hooked = speak(client, messages, frames=10, metadata={"voice_text": "hello world"})
    plain = speak(client, messages, frames=10)
    assert hooked.choices[0].message.content == plain.choices[0].message.content  # the text is the Thinker's
    assert hooked.choices[0].message.audio.transcript.strip() == "hello world"
    ref = oracle.generate(messages, greedy=True, max_tokens=TOKENS, max_frames=10, speaker="chelsie",
                          text_hook=lambda delta, final: "hello world" if final else "")
    assert_same_audio(read_pcm16(base64.b64decode(hooked.choices[0].message.audio.data))[0], ref)


def test_metrics_after_audio(client, server, oracle):
    stream(client, user("One more."))
    text = httpx.get(server + "/metrics").text
    assert metric(text, "omnivox_time_to_first_audio_seconds_count") >= 1
    assert metric(text, "omnivox_real_time_factor_count") >= 1
    assert metric(text, "omnivox_audio_chunks_total") >= 2
    metric(text, "omnivox_audio_underruns_total")
    assert metric(text, "omnivox_requests_waiting", kind="playing") == metric(text, "omnivox_requests_waiting",
                                                                            kind="batch") == 0
    assert metric(text, "omnivox_kv_cache_pages_total", stage="thinker") > 0
    assert metric(text, "omnivox_kv_cache_pages_total", stage="talker") > 0
    # the weights by stage and dtype (the oracle loads the same checkpoint)
    assert metric(text, "omnivox_weight_bytes", dtype="float32", stage="talker") == \
        oracle.weight_bytes()["talker"]["float32"] > 0
    # a request is counted once its response is wholly sent, which the client may see first
    wait_for(lambda: metric(httpx.get(server + "/metrics").text, "omnivox_http_requests_total", code="200",
                            route="/v1/chat/completions") >= 1, what="the stream to be counted")


def test_a_raising_hook_voices_the_text_unchanged(client, oracle):
    messages = user("Tell me about dogs.")
    broken = speak(client, messages, metadata={"hook": "raise"})
    identity = oracle.generate(messages, greedy=True, max_tokens=TOKENS, max_frames=FRAMES, speaker="chelsie",
                               text_hook=lambda delta, final: delta)  # what "voiced unchanged" means
    assert broken.choices[0].message.content == identity.text
    assert_same_audio(read_pcm16(base64.b64decode(broken.choices[0].message.audio.data))[0], identity)


def test_a_500_names_no_exception_text_and_the_log_has_it(served, client):
    url, log = served
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": user("Hi"), "modalities": ["text", "audio"], "audio": {"voice": "chelsie"},
        "max_tokens": 2, "max_audio_frames": 2, "metadata": {"hook": "factory-raise"}})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "secret" not in r.text and "see the server log" in r.json()["error"]["message"], r.text
    wait_for(lambda: b"plug-in secret: /srv/omnivox/hook.key" in log.read_bytes(),  # the text is logged instead
             what="the exception text in the server log")
    assert speak(client, user("Hi")).choices[0].message.audio.data
