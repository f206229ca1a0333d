"""The peers' chat dialects and the chat audio formats on a real Qwen3-Omni demo server, through
the official openai client where it has the call: OpenAI's voice names (`voice="alloy"`),
`audio` without a voice (SGLang-Omni's client), no `model`, vLLM-Omni's top-level `modality` on
every streamed chunk and a complete wav per streamed audio delta, mp3 / opus replies, SGLang-
Omni's `talker_max_new_tokens`, peer fields refused, and video over HTTP (`video_url` data: URLs
of mp4 and webm, or a local file under --allowed-local-media-path). Greedy replies must equal the
same request run offline (int16 within 2 LSB)."""
from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest
from media_helpers import make_video, still
from api_helpers import (MODEL, SAMPLE_RATE, expected_samples, metric, pcm16, read_pcm16, reference_pcm,
                         running_server)
from omnivox.models.qwen3_omni.reference import generate_reference

TOKENS, FRAMES = 6, 5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("chatmedia")


@pytest.fixture(scope="module")
def server(demo_cache, folder):
    with running_server(demo_cache[0], "--allowed-local-media-path", str(folder), "--voice-alias", "alloy=aiden",
                        "--voice-alias", "robot=chelsie") as (url, _, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=60)


def user(text: str, *media: dict) -> list[dict]:
    return [{"role": "user", "content": [*media, {"type": "text", "text": text}]}]


def speak(client, messages, voice="chelsie", fmt="wav", **extra):
    return client.chat.completions.create(
        model=MODEL, messages=messages, modalities=["text", "audio"], audio={"voice": voice, "format": fmt},
        temperature=0, max_tokens=TOKENS, extra_body={"max_audio_frames": FRAMES, **extra})


def audio_of(reply) -> np.ndarray:
    samples, rate = read_pcm16(base64.b64decode(reply.choices[0].message.audio.data))
    assert rate == SAMPLE_RATE
    return samples


def post(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def assert_same_audio(got: np.ndarray, out) -> None:
    want = reference_pcm(out)
    assert got.shape == want.shape and np.abs(got - want).max() <= 2


# ---- voices ---------------------------------------------------------------------------------
def test_openai_voice_names_through_the_openai_client(client, oracle):
    messages = user("Hello!")
    for name, voice in (("alloy", "aiden"), ("nova", "chelsie"), ("echo", "ethan"), ("robot", "chelsie")):
        ref = generate_reference(oracle, messages, greedy=True, max_tokens=TOKENS, max_frames=FRAMES, speaker=voice)
        assert_same_audio(audio_of(speak(client, messages, voice=name)), ref)  # alloy: --voice-alias alloy=aiden
    with pytest.raises(openai.BadRequestError, match="unknown voice 'bogus'"):
        speak(client, messages, voice="bogus")


def test_audio_without_voice_and_without_model(server, oracle):
    """SGLang-Omni's chat client: `audio: {"format": "wav"}` and no voice; no model either."""
    messages = user("Hello!")
    ref = generate_reference(oracle, messages, greedy=True, max_tokens=TOKENS, max_frames=FRAMES)  # default speaker
    for audio in ({"format": "wav"}, {"voice": "default", "format": "wav"}, None):
        body = {"messages": messages, "modalities": ["text", "audio"], "temperature": 0, "max_tokens": TOKENS,
                "max_audio_frames": FRAMES, **({"audio": audio} if audio else {})}
        r = post(server, **body)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["content"] == ref.text
        assert_same_audio(read_pcm16(base64.b64decode(msg["audio"]["data"]))[0], ref)


# ---- streaming: modality on every chunk, one wav per audio delta --------------------------------------
def stream_chunks(client, fmt: str) -> list:
    return list(client.chat.completions.create(
        model=MODEL, messages=user("Tell me a story."), modalities=["text", "audio"],
        audio={"voice": "ethan", "format": fmt}, temperature=0, max_tokens=TOKENS, stream=True,
        extra_body={"max_audio_frames": FRAMES}))


def test_streamed_wav_deltas_each_decode_and_carry_modality(client, oracle):
    chunks = stream_chunks(client, "wav")
    pieces, text = [], ""
    for ch in chunks:
        modality = ch.model_extra["modality"]
        assert modality in ("text", "audio")
        for choice in ch.choices:
            if choice.delta.audio is not None:
                assert modality == "audio" and not choice.delta.content  # one modality per chunk
                samples, rate = read_pcm16(base64.b64decode(choice.delta.audio.data))  # a whole file on its own
                assert rate == SAMPLE_RATE and samples.shape[0] > 0
                pieces.append(samples)
            else:
                assert modality == "text"
                text += choice.delta.content or ""
    assert len(pieces) >= 2
    ref = generate_reference(oracle, user("Tell me a story."), greedy=True, max_tokens=TOKENS, max_frames=FRAMES,
                                    speaker="ethan")
    assert text == ref.text
    assert_same_audio(np.concatenate(pieces), ref)
    raw = [base64.b64decode(c.choices[0].delta.audio.data) for c in stream_chunks(client, "pcm16")
           if c.choices and c.choices[0].delta.audio is not None]
    assert all(d[:4] != b"RIFF" for d in raw)  # pcm16 stays raw pcm (OpenAI's behaviour)
    assert np.array_equal(np.concatenate([pcm16(d) for d in raw]), np.concatenate(pieces))


def test_modality_in_the_raw_stream(server):
    body = {"messages": user("Hi"), "modalities": ["text", "audio"], "audio": {"format": "wav"}, "stream": True,
            "temperature": 0, "max_tokens": 3, "max_audio_frames": 2}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events and all(e["modality"] in ("text", "audio") for e in events)
    assert {e["modality"] for e in events} == {"text", "audio"}
    assert all(("audio" in e["choices"][0]["delta"]) == (e["modality"] == "audio") for e in events if e["choices"])


# ---- non-streamed formats -----------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_non_streamed_mp3_and_opus(client, fmt):
    wav = speak(client, user("Count to three."), voice="aiden")
    reply = speak(client, user("Count to three."), voice="aiden", fmt=fmt)
    data = base64.b64decode(reply.choices[0].message.audio.data)
    assert data[:4] == b"OggS" if fmt == "opus" else data[:2] == b"\xff\xf3"  # an Ogg page | an MPEG-2 mp3 frame
    samples = audio_of(reply)  # 24 kHz mono, the same length: the LAME tag / final granule trim the padding
    frames = reply.usage.completion_tokens_details.audio_tokens
    assert samples.shape[0] == expected_samples(frames) == audio_of(wav).shape[0]
    assert reply.choices[0].message.content == wav.choices[0].message.content


# ---- the peers' chat fields -------------------------------------------------------------------------
def test_talker_max_new_tokens_is_max_audio_frames(server):
    base = {"messages": user("Hi"), "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"},
            "temperature": 0, "max_tokens": TOKENS}
    a = post(server, **base, max_audio_frames=3).json()
    b = post(server, **base, talker_max_new_tokens=3).json()
    assert a["usage"]["completion_tokens_details"]["audio_tokens"] == 3
    assert a["choices"][0]["message"]["audio"]["data"] == b["choices"][0]["message"]["audio"]["data"]
    r = post(server, **base, max_audio_frames=3, talker_max_new_tokens=4)
    assert r.status_code == 400 and r.json()["error"]["param"] == "talker_max_new_tokens"


def test_ignore_eos_reaches_the_engine(oracle):
    """vLLM's benchmark sends ignore_eos (the demo never stops early, so it is checked on the plan)."""
    from omnivox.api.convert import plan_request
    from omnivox.api.protocol import ChatRequest
    req = ChatRequest.model_validate({"messages": user("Hi"), "max_tokens": 4, "ignore_eos": True})
    assert plan_request(req, oracle, MODEL).params.ignore_eos is True
    assert plan_request(req.model_copy(update={"ignore_eos": False}), oracle, MODEL).params.ignore_eos is False


CHAT_REFUSED = [("min_p", 0.1), ("audios", ["/tmp/a.wav"]), ("images", ["/tmp/a.png"]), ("videos", ["/tmp/a.mp4"]),
                ("video_fps", 1.0), ("video_max_frames", 8), ("video_max_pixels", 1000), ("stage_sampling", {"a": {}}),
                ("stage_params", {"a": {}}), ("image_generation", {"size": "64x64"})]


@pytest.mark.parametrize("field,value", CHAT_REFUSED, ids=[f for f, _ in CHAT_REFUSED])
def test_peer_chat_fields_that_cannot_be_honoured_are_a_400(server, field, value):
    r = post(server, messages=user("Hi"), max_tokens=2, **{field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "not supported" in err["message"] and err["code"] == "unsupported_parameter"
    assert post(server, messages=user("Hi"), max_tokens=2, min_p=0, audios=[], stage_params={}).status_code == 200


# ---- video over HTTP ----------------------------------------------------------------------------
def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


@pytest.mark.parametrize("fmt,codec,mime", [("mp4", "libx264", "video/mp4"), ("webm", "libvpx", "video/webm")])
def test_video_url_equals_offline(client, oracle, folder, fmt, codec, mime):
    data = make_video(fmt, codec, frames=12, fps=6, audio=True)
    url = f"data:{mime};base64," + base64.b64encode(data).decode()
    messages = user("What happens in the video?", video_part(url))
    reply = speak(client, messages)
    ref = generate_reference(oracle, messages, greedy=True, max_tokens=TOKENS, max_frames=FRAMES, speaker="chelsie")
    prompt = oracle.build_prompt(messages)
    assert len(prompt.visual) == 1 and reply.usage.prompt_tokens == len(prompt.ids)
    assert reply.choices[0].message.content == ref.text
    assert_same_audio(audio_of(reply), ref)
    # the audio track is not used: the same video without one gives the same prompt and reply
    silent_video = make_video(fmt, codec, frames=12, fps=6, audio=False)
    silent = "data:" + mime + ";base64," + base64.b64encode(silent_video).decode()
    assert oracle.build_prompt(user("What happens in the video?", video_part(silent))).ids == prompt.ids
    again = speak(client, user("What happens in the video?", video_part(silent)))
    assert again.choices[0].message.content == ref.text and again.usage.prompt_tokens == reply.usage.prompt_tokens
    # and a local file under --allowed-local-media-path answers like the data: URL
    (folder / f"clip.{fmt}").write_bytes(data)
    for local in (f"clip.{fmt}", "file://" + str(folder / f"clip.{fmt}")):
        got = speak(client, user("What happens in the video?", video_part(local)))
        assert got.choices[0].message.content == ref.text and got.usage.prompt_tokens == reply.usage.prompt_tokens


def test_local_image_equals_its_data_url(client, folder):
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (30, 40, 3), dtype=np.uint8)).save(buf, "PNG")
    (folder / "cat.png").write_bytes(buf.getvalue())
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    inline = speak(client, user("Describe it.", {"type": "image_url", "image_url": {"url": url}}))
    local = speak(client, user("Describe it.", {"type": "image_url", "image_url": {"url": "cat.png"}}))
    assert local.choices[0].message.content == inline.choices[0].message.content
    assert local.usage.prompt_tokens == inline.usage.prompt_tokens
    assert np.array_equal(audio_of(local), audio_of(inline))


BAD_VIDEOS = [
    ("not a video", "data:video/mp4;base64," + base64.b64encode(b"\x00\x00\x00\x18ftypmp42 junk" * 4).decode(),
     "messages", "video"),
    ("unknown container", "data:video/mp4;base64," + base64.b64encode(b"hello world, not a video").decode(),
     "messages", "not an mp4/mov or webm/mkv"),
    ("bad base64", "data:video/mp4;base64,@@@@", "messages[0].content[0].video_url.url", "base64"),
    ("http", "https://example.com/clip.mp4", "messages[0].content[0].video_url.url", "fetches nothing"),
    ("outside", "../../../../etc/passwd", "messages[0].content[0].video_url.url", "not a readable file"),
    ("missing", "nothing.mp4", "messages[0].content[0].video_url.url", "not a readable file"),
]


@pytest.mark.parametrize("name,url,param,words", BAD_VIDEOS, ids=[b[0] for b in BAD_VIDEOS])
def test_bad_video_is_a_clear_400(server, name, url, param, words):
    r = post(server, messages=user("What is this?", video_part(url)), max_tokens=2)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert post(server, messages=user("Hi"), max_tokens=2).status_code == 200  # the server goes on serving


# ---- media prefix keys: what the model reads, not only the pixels --------------------------------
def png(w: int, h: int, color: tuple[int, int, int]) -> dict:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, "PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}


def still_video(fps: int, color: tuple[int, int, int]) -> dict:
    data = make_video(frames=4, fps=fps, audio=False, frame=still(color))  # 4 equal frames: equal patches at any fps
    return video_part("data:video/mp4;base64," + base64.b64encode(data).decode())


def hit_tokens(url: str) -> float:
    return metric(httpx.get(url + "/metrics", timeout=30).text, "omnivox_prefix_cache_hit_tokens_total")


def text_reply(url: str, client, oracle, messages, check: bool = True) -> tuple[float, int]:
    """Ask for a greedy text reply; with `check` it must equal the offline reference (a fresh,
    cache-less computation). Returns (the prompt tokens it took from the prefix cache, its first
    media position)."""
    before = hit_tokens(url)
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=TOKENS)
    if check:
        ref = generate_reference(oracle, messages, greedy=True, max_tokens=TOKENS, return_audio=False)
        assert reply.choices[0].message.content == ref.text
    th = oracle.cfg.thinker
    ids = oracle.build_prompt(messages).ids
    first_media = next(i for i, t in enumerate(ids) if t in (th.image_token_id, th.video_token_id))
    return hit_tokens(url) - before, first_media


@pytest.mark.parametrize("pair", ["image", "video"])
def test_media_that_looks_alike_never_shares_cached_rows(server, client, oracle, pair):
    """A uniform image and its transpose have equal patches, and so do a still video's frames at
    1 and 2 fps: only the grid (positions) and the seconds per grid step tell them apart. Each one
    after its twin (both orders) answers as if computed fresh, taking no cached row past the text
    before its media; identical media still hit."""
    if pair == "image":
        twins = [(png(64, 256, (90, 140, 30)), png(256, 64, (90, 140, 30))),
                 (png(256, 64, (20, 60, 200)), png(64, 256, (20, 60, 200)))]
    else:
        twins = [(still_video(1, (40, 120, 200)), still_video(2, (40, 120, 200))),
                 (still_video(2, (200, 30, 60)), still_video(1, (200, 30, 60)))]
        assert oracle.build_prompt(user("What is this?", twins[0][0])).visual[0].pixel_values.equal(
            oracle.build_prompt(user("What is this?", twins[0][1])).visual[0].pixel_values)  # the trap: equal patches
    for a, b in twins:
        text_reply(server, client, oracle, user("What is this?", a), check=False)  # its rows into the cache
        hit, first_media = text_reply(server, client, oracle, user("What is this?", b))
        assert hit <= first_media, (hit, first_media)
    messages = user("What is this?", twins[1][1])  # asked before: its media rows come from the cache
    hit, _ = text_reply(server, client, oracle, messages)
    assert hit >= len(oracle.build_prompt(messages).ids) - 16  # all but the prompt's last, partial page
