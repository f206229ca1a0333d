"""The browser playground (`GET /playground`) in a real headless Chromium (Debian's `chromium`,
driven by Playwright), its microphone a fake device playing the committed speech: it connects to
/v1/realtime, the server hears a turn, and the page shows the reply's transcript and schedules
its audio for playback (counted by the page's own JavaScript).

Skipped when no Chromium is installed, except under CI=true (.ci/run installs it): there a
missing browser fails the test instead of hiding it."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from omnivox.audio.io import load_audio
from realtime_helpers import MEDIA, live_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and os.environ.get("CI") != "true":
    pytest.skip("no chromium here (apt-get install -y chromium); CI installs it", allow_module_level=True)


def fake_microphone(folder: Path) -> Path:
    """What the fake capture device plays (in a loop): silence, the committed speech, silence."""
    speech = load_audio(MEDIA / "speech_16k.wav")
    # 20 s of silence after the speech: the reply ends before the loop speaks again (which would barge
    # in), even when a loaded machine leaves the server's audio input seconds behind the microphone
    x = np.concatenate([np.zeros(8000, np.float32), speech, np.zeros(320000, np.float32)])
    x = x + (1e-3 * np.random.default_rng(0).standard_normal(len(x))).astype(np.float32)
    path = folder / "microphone.wav"
    sf.write(path, x, 16000, subtype="PCM_16")
    return path


def test_playground_talks_and_plays_in_chromium(omni):
    from playwright.sync_api import sync_playwright

    assert CHROMIUM is not None, "CI=true but no chromium: .ci/run must install it"
    folder = Path(tempfile.mkdtemp(prefix="omnivox-playground-"))
    args = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={fake_microphone(folder)}",
            "--autoplay-policy=no-user-gesture-required", "--no-sandbox"]
    try:
        with live_server(omni) as (url, app), sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
            page = browser.new_page()
            page.goto(url + "/playground")
            page.fill("#settings", '{"max_output_tokens": 6, "omnivox": {"max_audio_frames": 10}}')
            page.click("#start")
            page.wait_for_function("() => window.omnivox.stats.responses >= 1", timeout=90_000)
            stats = page.evaluate("window.omnivox.stats")
            shown = page.inner_text("#transcript")
            turns = page.inner_text("#turns")
            browser.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert stats["connected"] and stats["sessionId"].startswith("sess_")
    assert stats["appendsSent"] > 10 and stats["samplesSent"] > 24000
    assert stats["audioDeltas"] > 0 and stats["scheduledSamples"] > 0
    turn = stats["turns"][0]
    assert turn["status"] in ("completed", "incomplete")
    assert stats["scheduledSamples"] // 24 >= turn["audioMs"] > 0  # every delta of the reply was scheduled
    assert turn["ttfaServerMs"] is not None and turn["ttfaServerMs"] > 0
    assert stats["transcript"] and stats["transcript"].strip()[:3] in shown
    assert "you: (speech)" in shown and "ms" in turns
    assert not stats["errors"]
