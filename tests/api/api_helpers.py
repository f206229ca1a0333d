"""Helpers of the API tests: a real `omnivox serve` process, decoding what it sends, /metrics."""
from __future__ import annotations

import base64
import contextlib
import io
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
MODEL = "omnivox-demo-qwen3-omni"
SPEECH = ROOT / "tests" / "media" / "speech_16k.wav"
SAMPLE_RATE = 24000
SEAM = 555  # the vocoder's look-ahead: n frames of speech are n * 1920 - 555 samples


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(cache: Path, *args: str, timeout: float = 90.0, ready: bool = True, port: int | None = None):
    """Start `python -m omnivox.cli serve` with `args` on `port` (default: a free one); yield
    (base_url, process, log path) once it is ready (`ready=False`: once it answers /health/live,
    maybe still loading)."""
    port = port or free_port()
    log = Path(tempfile.mkstemp(prefix="omnivox-serve-", suffix=".log")[1])
    env = dict(os.environ, OMNIVOX_CACHE=str(cache), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "api"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "omnivox.cli", "serve", "--port", str(port), *args],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, log, timeout, "/health/ready" if ready else "/health/live")
        yield url, proc, log
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.unlink(missing_ok=True)


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float, probe: str) -> None:
    """Until `probe` answers 200: /health/live at once (liveness), /health/ready once the model serves."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + probe, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"server not ready after {timeout} s:\n{log.read_text()[-3000:]}")


# ---- decoding what the server sends ------------------------------------------------------------
def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.int32)


def read_pcm16(data: bytes) -> tuple[np.ndarray, int]:
    """(int16 samples as int32, sample rate) of a whole wav or flac file."""
    import soundfile as sf
    samples, rate = sf.read(io.BytesIO(data), dtype="int16")
    return samples.astype(np.int32), rate


def expected_samples(frames: int) -> int:
    """Audio of `frames` 80 ms codec frames as omnivox streams it: frames * 1920 - 555 samples."""
    return frames * 1920 - SEAM if frames else 0


def reference_pcm(out) -> np.ndarray:
    from omnivox.audio.io import encode_pcm16
    return pcm16(encode_pcm16(out.audio))


def b64_file(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from a Prometheus text exposition (labels must match exactly)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else "") + r" (\S+)$"
    for line in text.splitlines():
        m = re.match(pattern, line)
        if m:
            return float(m.group(1))
    raise KeyError(f"{name}{{{want}}} not in /metrics")


def metric_sum(text: str, name: str) -> float:
    """The sum of a metric's samples over all its label sets."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll `predicate` until it holds; fail after `timeout` s. For state a test asserts that the
    server reaches asynchronously (a session dropped, a request aborted, a counter bumped): a
    fixed sleep would be too short on a loaded machine and a waste on a quiet one."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def serving_app(app, **config):
    """Serve an app built in this process (`create_app` on a model a test controls) with uvicorn on
    127.0.0.1 in a background thread: real HTTP, for tests that must reach into the model."""
    import threading

    import uvicorn
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="error", **config))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the in-process server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
