"""One owner of the device (issue 19 item 3): only the engine thread runs the served model's code.
While a realtime turn is spoken and answered and a chat with audio input is answered (Qwen3-Omni),
and while S2 speaks with an inline reference voice and a voice is uploaded and used, every call of
the model's modules is recorded with its thread: all are the engine's. Before, a realtime turn's
AuT windows ran in the realtime workers and reference voices were codec-encoded in the voice
worker, beside the engine's steps (on a GPU: beside a CUDA graph being captured)."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import threading

import httpx
import torch
import websockets

from realtime_helpers import MEDIA, MODEL, b64, live_server, pieces, speech_pcm
from speech_helpers import FISH, reference_wav


class ModuleThreads:
    """Records the thread of every forward call of the given models' modules."""

    def __init__(self, *models: torch.nn.Module):
        self.ids = {id(m) for model in models for m in model.modules()}
        self.threads: dict[str, int] = {}
        self._lock = threading.Lock()

    def _hook(self, module, args) -> None:
        if id(module) in self.ids:
            name = threading.current_thread().name
            with self._lock:
                self.threads[name] = self.threads.get(name, 0) + 1

    def __enter__(self) -> "ModuleThreads":
        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def test_only_the_engine_thread_runs_qwen3_omni(omni):
    async def turn(url):
        async with websockets.connect(url.replace("http", "ws", 1) + f"/v1/realtime?model={MODEL}",
                                      max_size=None) as ws:
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "audio": {"input": {"turn_detection": None}}, "max_output_tokens": 3,
                "omnivox": {"max_audio_frames": 3}}}))
            for p in pieces(speech_pcm(lead_ms=100, tail_ms=100)):
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": b64(p)}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "response.create"}))
            while True:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 120))
                assert ev["type"] != "error", ev
                if ev["type"] == "response.done":
                    return ev["response"]["status"]

    wav = base64.b64encode((MEDIA / "question_24k.wav").read_bytes()).decode()
    with live_server(omni) as (url, _), ModuleThreads(omni.model) as seen:
        status = asyncio.run(turn(url))
        chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "max_tokens": 3, "modalities": ["text"], "messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
                {"type": "text", "text": "What is asked?"}]}]})
    assert status == "incomplete" and chat.status_code == 200, chat.text
    assert set(seen.threads) == {"omnivox-engine"} and seen.threads["omnivox-engine"] > 100, seen.threads


def test_only_the_engine_thread_runs_s2(tmp_path):
    from omnivox.api.voices import VoiceStore
    from omnivox import FishTTS

    torch.set_num_threads(1)
    tts = FishTTS(progress=False)
    ref = {"audio": base64.b64encode(reference_wav(seed=3)).decode(), "text": "A reference."}
    try:
        with live_server(tts, FISH, voices=VoiceStore(tmp_path)) as (url, _), \
                ModuleThreads(tts.slow, tts.fast, tts.codec) as seen:
            inline = httpx.post(url + "/v1/audio/speech", timeout=120, json={
                "model": FISH, "input": "With a reference.", "response_format": "pcm", "max_frames": 3,
                "references": [ref]})
            made = httpx.post(url + "/v1/audio/voices", timeout=120,
                              data={"name": "owner", "consent": "c", "transcript": "A sample."},
                              files={"audio_sample": ("s.wav", io.BytesIO(reference_wav(seed=4)), "audio/wav")})
            used = httpx.post(url + "/v1/audio/speech", timeout=120, json={
                "model": FISH, "input": "With a saved voice.", "voice": {"id": "owner"}, "response_format": "pcm",
                "max_frames": 3})
    finally:
        tts.close()
    assert inline.status_code == 200 and made.status_code == 200 and used.status_code == 200, \
        (inline.text, made.text, used.text)
    assert set(seen.threads) == {"omnivox-engine"} and seen.threads["omnivox-engine"] > 10, seen.threads
