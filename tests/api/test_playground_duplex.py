"""The playground's full-duplex mode in a real headless Chromium, its microphone a fake device
playing the committed speech, against `omnivox serve --model moshi-demo` (/v1/realtime's duplex
mapping, docs/realtime.md): the page enters the mode from `session.created`, streams the
microphone without anything turn-based, and the server's frames come back (/metrics); its settings
box sends sampling values (session.update) when edited; the page schedules the response's audio deltas for playback and shows its transcript, exactly as the socket
carried them (Playwright reads the frames beside the page); Stop closes the socket, releases the
microphone and ends the server's session.

Skipped when no Chromium is installed, except under CI=true (.ci/run installs it)."""
from __future__ import annotations

import base64
import json
import os
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from api_helpers import metric, metric_sum, running_server, wait_for
from omnivox.audio.io import load_audio
from realtime_helpers import MEDIA

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and os.environ.get("CI") != "true":
    pytest.skip("no chromium here (apt-get install -y chromium); CI installs it", allow_module_level=True)

WAIT_MS = 90_000
DELTAS = 12  # audio deltas (80 ms frames) the page must schedule before Stop


def fake_microphone(folder: Path) -> Path:
    """What the fake capture device plays (in a loop): a little silence, then the committed speech."""
    speech = load_audio(MEDIA / "speech_16k.wav")
    x = np.concatenate([np.zeros(4000, np.float32), speech])
    x = x + (1e-3 * np.random.default_rng(0).standard_normal(len(x))).astype(np.float32)
    path = folder / "microphone.wav"
    sf.write(path, x, 16000, subtype="PCM_16")
    return path


def prefix_states(received: list[dict]) -> list[tuple[int, int, str]]:
    """(audio deltas, their samples, transcript) after each prefix of the server's events: the page
    saw one prefix (it drops what still arrives once it has closed the socket)."""
    deltas, samples, text, out = 0, 0, "", [(0, 0, "")]
    for ev in received:
        if ev["type"] == "response.output_audio.delta":
            deltas, samples = deltas + 1, samples + len(base64.b64decode(ev["delta"])) // 2
        elif ev["type"] == "response.output_audio_transcript.delta":
            text += ev["delta"]
        out.append((deltas, samples, text))
    return out


def test_duplex_mode_streams_the_microphone_and_plays_the_reply(tmp_path):
    from playwright.sync_api import sync_playwright

    assert CHROMIUM is not None, "CI=true but no chromium: .ci/run must install it"
    args = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={fake_microphone(tmp_path)}",
            "--autoplay-policy=no-user-gesture-required", "--no-sandbox"]
    received, sent = [], []
    with running_server(Path(os.environ["OMNIVOX_CACHE"]), "--model", "moshi-demo") as (url, _, _), \
            sync_playwright() as pw:
        before = httpx.get(url + "/metrics").text
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        page = browser.new_page()
        sockets = []

        def watch(socket):  # on the page's socket's first event: no frame missed
            sockets.append(socket)
            socket.on("framereceived", lambda payload: received.append(json.loads(payload)))
            socket.on("framesent", lambda payload: sent.append(json.loads(payload)))
        page.on("websocket", watch)
        page.goto(url + "/playground")
        page.click("#start")
        page.wait_for_function(f"() => (window.omnivox.stats.audioDeltas >= {DELTAS} && "
                               "window.omnivox.stats.transcript.trim()) || window.omnivox.stats.closeCode !== null",
                               timeout=WAIT_MS)
        closed = page.evaluate("[window.omnivox.stats.closeCode, window.omnivox.stats.closeReason]")
        assert closed[0] is None, f"the server closed the session: {closed}"
        assert page.inner_text("#status") == "full duplex" and page.is_hidden("#turns-box")
        shown_sampling = json.loads(page.input_value("#settings"))["omnivox"]  # the values in effect
        page.fill("#settings", json.dumps({"omnivox": {**shown_sampling, "temperature": 0.5, "text_top_k": 7}}))
        page.press("#settings", "Tab")  # leaving the box sends it
        page.wait_for_function("() => window.omnivox.stats.updates >= 1", timeout=WAIT_MS)
        # the microphone reached the server: the frames it answered (one per input frame) are in /metrics
        wait_for(lambda: metric(httpx.get(url + "/metrics").text, "omnivox_duplex_frames_total") >= DELTAS,
                 what="the frames counted")
        # while connected, its own late frames (a gauge per session), and what slack measured the engine holds
        live = httpx.get(url + "/metrics").text
        session_id = page.evaluate("window.omnivox.stats.sessionId")
        assert metric(live, "omnivox_duplex_session_frames_late", session=session_id) >= 0
        wait_for(lambda: "\nomnivox_live_sessions_capacity " in httpx.get(url + "/metrics").text,
                 what="the measured capacity of live sessions")

        page.click("#stop")
        page.wait_for_function("() => window.omnivox.stats.closeCode !== null", timeout=WAIT_MS)
        deadline = time.monotonic() + 30
        while not sockets[0].is_closed() and time.monotonic() < deadline:  # Playwright's last frames
            page.wait_for_timeout(20)
        stats = page.evaluate("window.omnivox.stats")
        shown = page.eval_on_selector("#transcript .assistant", "d => d.textContent")
        status = page.inner_text("#status")
        browser.close()
        # the server's session ended with the socket
        wait_for(lambda: metric_sum(httpx.get(url + "/metrics").text, "omnivox_duplex_sessions_ended_total")
                 == metric_sum(before, "omnivox_duplex_sessions_ended_total") + 1, what="the session's end")

    assert received[0]["type"] == "session.created" and received[0]["session"]["omnivox"]["duplex"] is True
    assert stats["duplex"] and stats["sessionId"] == received[0]["session"]["id"]
    assert metric(before, "omnivox_duplex_frames_total") == 0 and stats["samplesSent"] >= DELTAS * 1920
    # nothing turn-based was sent: audio appends and the sampling values, no commit or response.create
    assert {e["type"] for e in sent} == {"input_audio_buffer.append", "session.update"}
    updates = [e for e in sent if e["type"] == "session.update"]
    assert len(updates) == 1 and updates[0]["session"]["omnivox"]["temperature"] == 0.5
    assert stats["sampling"]["temperature"] == 0.5 and stats["sampling"]["text_top_k"] == 7  # session.updated
    assert set(shown_sampling) == {"temperature", "top_k", "text_temperature", "text_top_k", "seed", "greedy"}
    assert sum(e["type"] == "input_audio_buffer.append" for e in sent) == stats["appendsSent"]
    # every audio delta the page got was scheduled, and its text is the server's text
    assert (stats["audioDeltas"], stats["scheduledSamples"], stats["transcript"]) in prefix_states(received)
    assert stats["audioDeltas"] >= DELTAS and stats["scheduledSamples"] == stats["audioDeltas"] * 1920
    assert shown == stats["transcript"] and shown.strip()
    assert not stats["errors"] and not [e for e in received if e["type"] == "error"]
    # Stop: the socket closed normally, the microphone released
    assert stats["closeCode"] == 1000 and not stats["micOpen"] and status == "disconnected"
