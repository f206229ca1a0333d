"""Saved voices on the S2 demo server: create (multipart, as `client.audio.voices.create` sends it)
-> list -> speak with it == speak with the same reference inline -> delete -> 4xx on use;
unsafe names refused over raw HTTP (nothing written outside the folder); size and count limits."""
from __future__ import annotations

import base64
import http.client
import io
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from api_helpers import running_server
from speech_helpers import FISH, reference_wav

MAX_VOICES = 3
SAMPLE_LIMIT = 0.05  # MB


@pytest.fixture(scope="module")
def fish(demo_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("voiceroot")
    folder = root / "voices"
    with running_server(demo_cache[0], "--model", "fish-demo", "--voices-dir", str(folder), "--max-voices",
                        str(MAX_VOICES), "--max-voice-sample-mb", str(SAMPLE_LIMIT)) as (url, _, _):
        yield url, root, folder


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def create(url: str, name: str, audio: bytes, transcript: str | None = "a short reference", consent="cons_1"):
    extra = {"transcript": transcript} if transcript is not None else None
    return client(url).audio.voices.create(name=name, audio_sample=("ref.wav", io.BytesIO(audio), "audio/wav"),
                                           consent=consent, extra_body=extra)


def speak_pcm(url: str, **kw) -> bytes:
    return client(url).audio.speech.create(model=FISH, input="Hello there.", response_format="pcm",
                                           **{"voice": "default", **kw}).content


def test_saved_voice_round_trip(fish):
    url, _, folder = fish
    wav = reference_wav(seed=1)
    v = create(url, "alice", wav)
    assert (v.id, v.name, v.object, v.type) == ("alice", "alice", "audio.voice", "audio_sample")
    assert (folder / "alice.voice").is_file()
    listed = httpx.get(url + "/v1/audio/voices").json()
    assert listed["object"] == "list" and [d["id"] for d in listed["data"]] == ["alice"]
    assert "alice" in httpx.get(url + "/v1/models").json()["data"][0]["voices"]
    saved = speak_pcm(url, voice="alice", extra_body={"seed": 2, "max_frames": 20})
    inline = speak_pcm(url, extra_body={"seed": 2, "max_frames": 20, "references": [
        {"audio": base64.b64encode(wav).decode(), "text": "a short reference"}]})
    assert saved == inline and len(saved) > 0
    assert saved != speak_pcm(url, extra_body={"seed": 2, "max_frames": 20})
    assert speak_pcm(url, voice={"id": "alice"}, extra_body={"seed": 2, "max_frames": 20}) == saved
    with pytest.raises(openai.ConflictError, match="already exists"):
        create(url, "alice", wav)
    gone = client(url).audio.voices.delete("alice")
    assert (gone.id, gone.deleted, gone.object) == ("alice", True, "audio.voice.deleted")
    assert not (folder / "alice.voice").exists()
    with pytest.raises(openai.BadRequestError, match="unknown voice 'alice'"):
        speak_pcm(url, voice="alice", extra_body={"max_frames": 3})
    with pytest.raises(openai.NotFoundError):
        client(url).audio.voices.delete("alice")
    assert httpx.get(url + "/v1/audio/voices").json()["data"] == []


def _raw(url: str, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> tuple[int, bytes]:
    """One request with the path sent byte for byte (no client-side normalisation)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


UNSAFE = ["..", "../evil", "..%2fevil", "a/b", "a\\b", "/etc/passwd", "a\x00b", "x" * 65, "a.b", " ", "default"]


@pytest.mark.parametrize("name", UNSAFE, ids=range(len(UNSAFE)))
def test_unsafe_names_are_refused_over_raw_http(fish, name):
    url, root, folder = fish
    form = httpx.Request("POST", url, data={"name": name, "consent": "c", "transcript": "t"},
                         files={"audio_sample": ("r.wav", reference_wav(), "audio/wav")})
    body = form.read()
    status, reply = _raw(url, "POST", "/v1/audio/voices", body, {"Content-Type": form.headers["content-type"]})
    assert status == 400 and b"invalid_voice_name" in reply, reply
    written = [p.name for p in root.rglob("*")]
    assert not any(n.endswith(".voice") and n != "victim.voice" for n in written), written  # nothing saved anywhere


RAW_PATHS = ["/v1/audio/voices/..%2f..%2fetc%2fpasswd", "/v1/audio/voices/..%2F", "/v1/audio/voices/%2e%2e",
             "/v1/audio/voices/%2Fetc%2Fpasswd", "/v1/audio/voices/a%5Cb", "/v1/audio/voices/a%00b",
             "/v1/audio/voices/" + "y" * 65]


@pytest.mark.parametrize("path", RAW_PATHS, ids=range(len(RAW_PATHS)))
def test_unsafe_delete_paths_are_refused(fish, path):
    url, root, _ = fish
    victim = root / "victim.voice"
    victim.write_bytes(b"keep me")
    status, reply = _raw(url, "DELETE", path)
    assert 400 <= status < 500 and b'"error"' in reply, (status, reply)
    assert victim.read_bytes() == b"keep me"
    status, _ = _raw(url, "DELETE", "/v1/audio/voices/..%2fvictim")
    assert status == 400 and victim.exists()


def test_limits_and_bad_samples(fish):
    url, _, folder = fish
    big = reference_wav(samples=int(SAMPLE_LIMIT * 2**20))  # ~2 bytes per sample: twice the limit
    with pytest.raises(openai.APIStatusError, match="limit is") as e:
        create(url, "big", big)
    assert e.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="transcript"):
        create(url, "notext", reference_wav(), transcript=None)
    with pytest.raises(openai.BadRequestError, match="audio_sample"):
        create(url, "junk", b"RIFF not really audio")
    names = [f"v{i}" for i in range(MAX_VOICES)]
    for n in names:
        create(url, n, reference_wav(seed=hash(n) % 100))
    with pytest.raises(openai.ConflictError, match="at most 3 voices"):
        create(url, "onemore", reference_wav())
    for n in names:
        client(url).audio.voices.delete(n)
    assert create(url, "onemore", reference_wav()).id == "onemore"  # room again; the server goes on serving
    client(url).audio.voices.delete("onemore")
    assert sorted(p.name for p in folder.iterdir()) == [".lock"]  # no sidecar, no temporary file left
