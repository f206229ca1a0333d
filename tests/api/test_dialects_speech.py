"""The peers' speech dialects on real servers: vLLM-Omni's S2 benchmark body (no `model`,
`ref_audio` / `ref_text`, `max_new_tokens`, voices uploaded with `ref_text`), SGLang-Omni's
(`speaker`, `references[].audio_path` / `ref_audio` / `data`), OpenAI's voice names, and the
local-media rule (a file is read only when its real path lies inside --allowed-local-media-path;
http(s) is a 400 and never fetched). Each spelling must clone exactly like omnivox's own
`references`, and a peer field that cannot be honoured is a 400, never silently dropped."""
from __future__ import annotations

import base64
import os
import socket
import threading

import httpx
import openai
import pytest
from api_helpers import running_server
from speech_helpers import FISH, reference_wav

TEXT = "a short reference"


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """root/media (the allowed folder) with a reference clip and traps; root/secret.wav outside it."""
    root = tmp_path_factory.mktemp("mediaroot")
    folder = root / "media"
    (folder / "sub").mkdir(parents=True)
    wav = reference_wav(samples=8192, seed=1)  # 4 codec frames
    for path in (folder / "ref.wav", folder / "sub" / "ref.wav", root / "secret.wav"):
        path.write_bytes(wav)
    (folder / "empty.wav").write_bytes(b"")
    (folder / "link_in.wav").symlink_to(folder / "ref.wav")
    (folder / "link_out.wav").symlink_to(root / "secret.wav")
    (folder / "dirlink").symlink_to(root, target_is_directory=True)
    os.mkfifo(folder / "fifo")
    return root, folder, wav


@pytest.fixture(scope="module")
def fish(demo_cache, media, tmp_path_factory):
    voices = tmp_path_factory.mktemp("voices")
    with running_server(demo_cache[0], "--model", "fish-demo", "--voices-dir", str(voices),
                        "--allowed-local-media-path", str(media[1]), "--voice-alias", "narrator=alice") as (url, _, _):
        yield url


@pytest.fixture(scope="module")
def qwen(qwen_server):  # no --allowed-local-media-path: local files are off
    return qwen_server[0]


def speak(url: str, **body) -> httpx.Response:
    body = {"input": "Hello there, friend.", "response_format": "pcm", **body}
    return httpx.post(url + "/v1/audio/speech", json=body, timeout=60)


def pcm(url: str, **body) -> bytes:
    r = speak(url, **body)
    assert r.status_code == 200, r.text
    return r.content


def error(r: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    return err


# ---- cloning: every spelling equals omnivox's own references -----------------------------------
def test_every_reference_spelling_clones_like_references(fish, media):
    _, folder, wav = media
    b64 = base64.b64encode(wav).decode()
    url = "data:audio/wav;base64," + b64
    same = {"seed": 5, "max_frames": 20}
    inline = pcm(fish, model=FISH, references=[{"audio": b64, "text": TEXT}], **same)
    assert inline != pcm(fish, **same)  # the reference matters
    spellings = [
        {"ref_audio": b64, "ref_text": TEXT},  # vLLM-Omni / SGLang-Omni
        {"ref_audio": url, "ref_text": TEXT},
        {"ref_audio": "ref.wav", "ref_text": TEXT},  # relative to the folder
        {"ref_audio": str(folder / "sub" / "ref.wav"), "ref_text": TEXT},
        {"ref_audio": "file://" + str(folder / "ref.wav"), "ref_text": TEXT},
        {"ref_audio": "sub/../link_in.wav", "ref_text": TEXT},  # a symlink that stays inside
        {"references": [{"audio_path": "sub/ref.wav", "text": TEXT}]},  # SGLang-Omni
        {"references": [{"audio_path": "file://" + str(folder / "ref.wav"), "text": TEXT}]},
        {"references": [{"ref_audio": url, "text": TEXT, "media_type": "audio/wav"}]},
        {"references": [{"data": b64, "text": TEXT}]},
        {"references": [{"audio": url, "text": TEXT}]},
        # the neutral values of the peers' other fields are accepted with it
        {"ref_audio": b64, "ref_text": TEXT, "task_type": "Base", "language": "Auto", "x_vector_only_mode": False,
         "sample_rate": 44100, "stage_params": {}},
    ]
    for body in spellings:
        assert pcm(fish, **body, **same) == inline, body


def test_vllm_omni_s2_benchmark_body(fish, media):
    """What vLLM-Omni's S2 benchmark sends: no model, ref_audio + ref_text, max_new_tokens."""
    wav = media[2]
    body = {"input": "Hello there, friend.", "ref_audio": "data:audio/wav;base64," + base64.b64encode(wav).decode(),
            "ref_text": TEXT, "max_new_tokens": 10, "seed": 5, "response_format": "wav"}
    r = httpx.post(fish + "/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 200 and r.content[:4] == b"RIFF"
    ref = pcm(fish, model=FISH, references=[{"audio": base64.b64encode(wav).decode(), "text": TEXT}], seed=5,
              max_frames=10)
    assert r.content[44:] == ref


def test_max_new_tokens_is_the_frame_limit(fish):
    assert pcm(fish, seed=2, max_new_tokens=7) == pcm(fish, seed=2, max_frames=7) == \
        pcm(fish, seed=2, max_frames=7, max_new_tokens=7)
    assert len(pcm(fish, seed=0, max_new_tokens=3)) == 3 * 2048 * 2  # seed 0 runs to the limit: 3 frames
    error(speak(fish, max_frames=7, max_new_tokens=8), 400, "max_new_tokens", "disagree")
    error(speak(fish, max_new_tokens=0), 400, "max_new_tokens", "greater than or equal to 1")


def test_reference_shape_errors(fish, media):
    b64 = base64.b64encode(media[2]).decode()
    error(speak(fish, ref_text=TEXT), 400, "ref_text", "send ref_audio with it")
    error(speak(fish, ref_audio=b64), 400, "ref_text", "needs ref_text")
    error(speak(fish, ref_audio=b64, ref_text=TEXT, references=[{"audio": b64, "text": TEXT}]), 400, "ref_audio",
          "not both")
    error(speak(fish, references=[{"audio": b64, "audio_path": "ref.wav", "text": TEXT}]), 400,
          "references[0].audio", "exactly one")
    error(speak(fish, references=[{"text": TEXT}]), 400, "references[0].audio", "exactly one")
    error(speak(fish, references=[{"audio": b64, "text": TEXT, "vq_codes": [1, 2]}]), 400,
          "references[0].vq_codes", "not supported")
    error(speak(fish, ref_audio="not base64!", ref_text=TEXT), 400, "ref_audio", "not a readable")  # read as a path
    error(speak(fish, ref_audio=base64.b64encode(b"RIFF junk").decode(), ref_text=TEXT), 400, "ref_audio",
          "ref_audio: ", "cannot decode")  # the model's error names the field that was sent
    error(speak(fish, references=[{"audio_path": "empty.wav", "text": TEXT}]), 400, "references[0].audio_path",
          "is empty")


PEER_REFUSED = [
    ({"task_type": "VoiceDesign"}, "task_type"),
    ({"language": "English"}, "language"),
    ({"x_vector_only_mode": True}, "x_vector_only_mode"),
    ({"non_streaming_mode": False}, "non_streaming_mode"),
    ({"initial_codec_chunk_frames": 4}, "initial_codec_chunk_frames"),
    ({"token_count": 100}, "token_count"),
    ({"duration_tokens": 100}, "duration_tokens"),
    ({"stage_params": {"talker": {"temperature": 0.5}}}, "stage_params"),
    ({"sample_rate": 16000}, "sample_rate"),
]


@pytest.mark.parametrize("over,param", PEER_REFUSED, ids=[p for _, p in PEER_REFUSED])
def test_peer_fields_that_cannot_be_honoured_are_a_400(fish, over, param):
    err = error(speak(fish, max_frames=3, **over), 400, param, "not supported")
    assert err["code"] == "unsupported_parameter"
    assert speak(fish, max_frames=3).status_code == 200


# ---- local files: inside the folder only ----------------------------------------------------------
class Listener:
    """A TCP socket that counts the connections made to it (none may come: nothing is fetched)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port, self.connections = self.sock.getsockname()[1], 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()


OUTSIDE = ["../secret.wav", "{root}/secret.wav", "file://{root}/secret.wav", "link_out.wav", "dirlink/secret.wav",
           "sub/../../secret.wav", "{folder}/../secret.wav"]
UNREADABLE = "not a readable file"
REFUSED = [("missing.wav", UNREADABLE), ("sub", UNREADABLE), ("fifo", UNREADABLE),
           ("file://otherhost/x.wav", "file://"), ("ftp://example.com/x.wav", "ftp:"),
           ("https://example.com/x.wav", "fetches nothing")]


@pytest.mark.parametrize("field", ["ref_audio", "audio_path"])
def test_local_paths_stay_inside_the_folder(fish, media, field):
    root, folder, _ = media

    def ask(path: str) -> httpx.Response:
        if field == "ref_audio":
            return speak(fish, ref_audio=path, ref_text=TEXT, max_frames=3)
        return speak(fish, references=[{"audio_path": path, "text": TEXT}], max_frames=3)

    param = "ref_audio" if field == "ref_audio" else "references[0].audio_path"
    for path in OUTSIDE:
        err = error(ask(path.format(root=root, folder=folder)), 400, param, "not a readable file")
        assert err["code"] == "media_path_not_allowed"
    for path, words in REFUSED:
        error(ask(path), 400, param, words)
    listener = Listener()
    try:
        err = error(ask(f"http://127.0.0.1:{listener.port}/ref.wav"), 400, param, "fetches nothing")
        assert err["code"] == "url_not_allowed"
    finally:
        listener.sock.close()
    assert listener.connections == 0  # refused before any connection, never fetched
    assert ask("ref.wav").status_code == 200  # and the server goes on serving


# ---- voices: uploads in the peers' spellings, OpenAI's names, --voice-alias ----------------------
def upload(url: str, name: str, wav: bytes, **fields) -> httpx.Response:
    return httpx.post(url + "/v1/audio/voices", data={"name": name, "consent": "c1", **fields},
                      files={"audio_sample": ("ref.wav", wav, "audio/wav")}, timeout=60)


def test_voice_upload_takes_ref_text_text_or_transcript(fish, media):
    wav = media[2]
    inline = pcm(fish, seed=2, max_frames=10, references=[{"audio": base64.b64encode(wav).decode(), "text": TEXT}])
    r = upload(fish, "alice", wav, ref_text=TEXT, speaker_description="warm narrator")  # vLLM-Omni's form
    assert r.status_code == 200, r.text
    assert upload(fish, "bob", wav, text=TEXT).status_code == 200
    assert upload(fish, "carol", wav, transcript=TEXT, ref_text=TEXT).status_code == 200  # the same twice: fine
    for name in ("alice", "bob", "carol", "narrator"):  # narrator: --voice-alias narrator=alice
        assert pcm(fish, voice=name, seed=2, max_frames=10) == inline, name
    cards = {c["id"]: c for c in httpx.get(fish + "/v1/audio/voices").json()["data"]}
    assert cards["alice"]["speaker_description"] == "warm narrator" and "speaker_description" not in cards["bob"]
    error(upload(fish, "dave", wav, transcript=TEXT, ref_text="something else"), 400, "transcript", "disagree")
    error(upload(fish, "erin", wav), 400, "transcript", "ref_text")
    for name in ("alice", "bob", "carol"):
        assert httpx.delete(fish + f"/v1/audio/voices/{name}").status_code == 200
    error(speak(fish, voice="narrator", max_frames=3), 400, "voice", "unknown voice 'alice'")  # its target is gone


def test_openai_voice_names_on_s2_are_its_default_voice(fish):
    default = pcm(fish, seed=4, max_frames=8)
    c = openai.OpenAI(base_url=fish + "/v1", api_key="none", max_retries=0)
    for name in ("alloy", "nova", "Echo", "shimmer"):
        got = c.audio.speech.create(model=FISH, input="Hello there, friend.", voice=name, response_format="pcm",
                                    extra_body={"seed": 4, "max_frames": 8}).content
        assert got == default, name
    error(speak(fish, voice="bogus", max_frames=3), 400, "voice", "unknown voice 'bogus'")
    card = httpx.get(fish + "/v1/models").json()["data"][0]
    assert card["voice_aliases"]["alloy"] == "default" and card["voice_aliases"]["narrator"] == "alice"


def test_openai_voice_names_and_speaker_on_qwen(qwen):
    same = {"seed": 1, "max_frames": 4}
    for name, voice in (("echo", "ethan"), ("nova", "chelsie"), ("ash", "aiden"), ("alloy", "default")):
        assert pcm(qwen, voice=name, **same) == pcm(qwen, voice=voice, **same), name
    assert pcm(qwen, speaker="chelsie", **same) == pcm(qwen, voice="chelsie", **same)  # SGLang-Omni's field
    error(speak(qwen, speaker="chelsie", voice="ethan"), 400, "speaker", "disagree")
    error(speak(qwen, voice="bogus"), 400, "voice", "unknown voice 'bogus'")
    assert httpx.get(qwen + "/v1/models").json()["data"][0]["voice_aliases"]["nova"] == "chelsie"


def test_cloning_fields_on_qwen_are_a_400_not_dropped(qwen, media):
    b64 = base64.b64encode(media[2]).decode()
    err = error(speak(qwen, ref_audio=b64, ref_text=TEXT), 400, "ref_audio", "voice cloning", "Qwen3-Omni")
    assert err["code"] == "voices_unsupported"
    error(speak(qwen, references=[{"audio_path": "ref.wav", "text": TEXT}]), 400, "references[0].audio_path",
          "voice cloning")
    error(speak(qwen, references=[{"audio": b64, "text": TEXT}]), 400, "references", "voice cloning")


def test_local_media_is_off_without_the_option(qwen, media):
    path = "file://" + str(media[1] / "ref.wav")
    body = {"messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": path}},
                                                      {"type": "text", "text": "Hi"}]}], "max_tokens": 2}
    r = httpx.post(qwen + "/v1/chat/completions", json=body, timeout=60)
    err = error(r, 400, "messages[0].content[0].audio_url.url", "--allowed-local-media-path")
    assert err["code"] == "media_path_not_allowed"
    assert httpx.get(qwen + "/health").json()["status"] == "healthy"


# ---- greedy below the limit of sampling ---------------------------------------------------------
def chat_audio(url: str, **body) -> str:
    body = {"messages": [{"role": "user", "content": "Hi"}], "modalities": ["text", "audio"],
            "audio": {"voice": "ethan", "format": "pcm16"}, "max_tokens": 3, "max_audio_frames": 4, **body}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["audio"]["data"]


def test_a_temperature_below_1e_5_is_greedy_in_every_stage(qwen, fish):
    """temperature 1e-6 (no seed) is greedy in the Thinker, the Talker and the code predictor: three
    requests give one audio, that of temperature 0 (chat and speech routes); S2 at temperature 0 or
    1e-6 is greedy in both ARs (no RAS, argmax residual codes): three requests, one audio."""
    greedy = chat_audio(qwen, temperature=0)
    assert {chat_audio(qwen, temperature=1e-6) for _ in range(3)} == {greedy}
    greedy = pcm(qwen, temperature=0, max_frames=4)
    assert {pcm(qwen, temperature=1e-6, max_frames=4) for _ in range(3)} == {greedy}
    greedy = pcm(fish, temperature=0, max_frames=8)
    assert {pcm(fish, temperature=t, max_frames=8) for t in (0, 0, 1e-6)} == {greedy}
