"""The playground (`GET /playground`) in headless Chromium where it used to be rough: on a
text-to-speech (S2) server it takes typed text and reports no error (its session does not listen,
so the microphone is not streamed); on a key-protected server it says why the voices are missing
and why the connection was refused, then works once the key is typed, preselecting the model's
default voice.

Skipped when no Chromium is installed, except under CI=true (.ci/run installs it)."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import soundfile as sf
import torch

from realtime_helpers import live_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and os.environ.get("CI") != "true":
    pytest.skip("no chromium here (apt-get install -y chromium); CI installs it", allow_module_level=True)

KEY = "sk-playground-test"
FISH = "omnivox-demo-fish-s2"
WAIT_MS = 90_000


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Chromium whose fake microphone plays silence."""
    from playwright.sync_api import sync_playwright

    assert CHROMIUM is not None, "CI=true but no chromium: .ci/run must install it"
    silence = tmp_path_factory.mktemp("playground") / "silence.wav"
    sf.write(silence, np.zeros(16000, np.float32), 16000, subtype="PCM_16")
    args = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={silence}", "--autoplay-policy=no-user-gesture-required",
            "--no-sandbox"]
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        yield b
        b.close()


@pytest.fixture(scope="module")
def tts():
    from omnivox import FishTTS
    torch.set_num_threads(1)
    t = FishTTS(progress=False)
    yield t
    t.close()


def stats(page) -> dict:
    return page.evaluate("window.omnivox.stats")


def test_s2_playground_speaks_typed_text_without_errors(browser, tts):
    with live_server(tts, FISH) as (url, app):
        page = browser.new_page()
        page.goto(url + "/playground")
        page.fill("#settings", '{"omnivox": {"max_audio_frames": 20, "seed": 3}}')
        page.click("#start")
        page.wait_for_function("() => window.omnivox.stats.connected", timeout=WAIT_MS)
        page.fill("#text", "Hello from the playground.")
        page.press("#text", "Enter")
        page.wait_for_function("() => window.omnivox.stats.responses >= 1", timeout=WAIT_MS)
        got, shown = stats(page), page.inner_text("#transcript")
        page.close()
    assert got["listens"] is False and got["appendsSent"] == 0  # the microphone is not streamed to S2
    assert got["textsSent"] == 1 and got["turns"][0]["status"] in ("completed", "incomplete")
    assert got["audioDeltas"] > 0 and got["scheduledSamples"] > 0
    assert "you: Hello from the playground." in shown
    assert got["errors"] == [], got["errors"]


def test_keyed_server_says_why_then_works_with_the_key(browser, omni):
    with live_server(omni, api_key=KEY) as (url, app):
        page = browser.new_page()
        page.goto(url + "/playground")
        page.wait_for_selector("#notice:not([hidden])", timeout=WAIT_MS)
        assert "needs an API key" in page.inner_text("#notice")  # the voices' 401, in words
        page.click("#start")  # no key: refused, with the server's reason
        page.wait_for_function("() => window.omnivox.stats.closeCode !== null", timeout=WAIT_MS)
        refused = stats(page)
        assert refused["closeCode"] == 4401 and "needs its API key" in refused["closeReason"]
        assert page.inner_text("#status") == "refused"
        assert refused["closeReason"] in page.inner_text("#notice")

        page.fill("#key", KEY)
        page.press("#key", "Tab")  # leaving the field loads the voices with the key
        page.wait_for_function("() => document.getElementById('voice').options.length > 1", timeout=WAIT_MS)
        assert page.is_hidden("#notice")
        page.click("#start")
        page.wait_for_function("() => window.omnivox.stats.voice !== null", timeout=WAIT_MS)  # session.updated
        got = stats(page)
        label = page.eval_on_selector("#voice", "s => s.options[s.selectedIndex].textContent")
        page.close()
    assert got["connected"] and got["errors"] == []
    assert got["voice"] == "ethan" and label == "model default (ethan)"  # the model's default, not the first name
