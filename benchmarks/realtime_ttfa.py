"""Time to first audio of a spoken turn: incremental realtime input vs the same utterance as one
HTTP request vs a text-only request, for utterances of about 2, 6 and 12 s.

A real `omnivox serve` (the built-in demo model unless --model) runs in a child process. Speech is
made with espeak-ng (its rate set so each utterance lasts the target) into a temporary folder.
Every run uses distinct inputs (a different seeded noise floor per repetition, a numbered text),
so no path is helped by the prefix cache. The clock starts when the last speech sample is sent:

  incremental  /v1/realtime (a plain WebSocket client), manual turns: the utterance is appended in
               40 ms pieces paced in real time (the server resamples, featurises, encodes and
               prefills it meanwhile), then `input_audio_buffer.commit` + `response.create` right
               after the last piece; TTFA = the first `response.output_audio.delta`.
  one-shot     POST /v1/chat/completions (stream, pcm16) with the whole utterance as a wav
               `input_audio` part, sent when the last sample has been spoken; TTFA = the first
               SSE chunk carrying audio.
  text-only    the same request with a short text instead of the audio: what answering costs
               without any audio to take in.

Each response is cancelled (realtime) or closed (HTTP) after its first audio, the next measurement
waits for the server to be idle, and all paths use the same generation settings. The goal: (incremental - text-only) <= 0.25 x (one-shot - text-only)
at 6 s and 12 s: the audio left to take in once the user stops is at most a quarter of the
whole utterance's cost.

    python benchmarks/realtime_ttfa.py [--reps 5] [--model PATH] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omnivox.audio.io import resample  # noqa: E402

TEXT = ("The realtime route listens while you speak, so that when you stop talking only the last moment of "
        "your voice is left to take in before the answer can begin. Speech recognition turns spoken words into "
        "text, and this sentence keeps going for a while longer so that the longest utterance has enough words "
        "to last about twelve seconds.")
TARGETS = (2.0, 6.0, 12.0)
RATE = 24000
PIECE_MS = 40


def speech(folder: Path, seconds: float) -> np.ndarray:
    """espeak-ng speech of about `seconds` (24 kHz float32): words cut to fit, then the rate tuned."""
    words = TEXT.split()[:max(4, int(seconds * 2.6))]
    text = " ".join(words)

    def say(wpm: int) -> np.ndarray:
        out = folder / f"u{seconds:g}_{wpm}.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-s", str(wpm), "-w", str(out), text], check=True)
        wave, rate = sf.read(out, dtype="float32")
        return resample(wave, rate, RATE)

    wave = say(175)
    wpm = int(np.clip(175 * (len(wave) / RATE) / seconds, 80, 450))
    return say(wpm)


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).round().astype("<i2").tobytes()


def wav_bytes(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def with_noise(x: np.ndarray, seed: int) -> np.ndarray:
    return x + (2e-4 * np.random.default_rng(seed).standard_normal(len(x))).astype(np.float32)


# ---- the server ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "omnivox.cli", "serve", "--port", str(port)]
    if args.model:
        cmd += ["--model", args.model, "--dtype", args.dtype, "--device", args.device]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = tempfile.NamedTemporaryFile("w+", prefix="omnivox-ttfa-server-", suffix=".log", delete=False)
    print(f"server log: {log.name}", flush=True)  # a file: a pipe nobody reads would stall the server
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{Path(log.name).read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health/ready", timeout=2).status_code == 200:  # 503 while loading
                name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
                return proc, url, name
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit("the server did not start")


def settle(url: str) -> None:
    """Wait until the previous measurement's request has ended (it is cancelled at its first audio)."""
    deadline = time.monotonic() + 30
    while httpx.get(url + "/health").json()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)


# ---- the three paths -----------------------------------------------------------------------------
async def incremental(url: str, model: str, x: np.ndarray, gen: dict) -> float:
    """A plain WebSocket client (json in, json out), as minimal as the HTTP paths' httpx client."""
    import websockets
    data = pcm16(x)
    step = PIECE_MS * RATE // 1000 * 2
    uri = url.replace("http", "ws", 1) + f"/v1/realtime?model={model}"
    async with websockets.connect(uri, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "realtime", "audio": {"input": {"turn_detection": None}}, "max_output_tokens": gen["max_tokens"],
            "omnivox": {"max_audio_frames": gen["max_frames"]}}}))
        t0 = time.monotonic()
        for k, i in enumerate(range(0, len(data), step)):  # real time: piece k leaves at k * 40 ms
            await asyncio.sleep(max(0.0, t0 + k * PIECE_MS / 1000 - time.monotonic()))
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(data[i:i + step]).decode()}))
        last = time.monotonic()
        await ws.send('{"type": "input_audio_buffer.commit"}')
        await ws.send('{"type": "response.create"}')
        async for message in ws:
            kind = json.loads(message)["type"]
            if kind == "response.output_audio.delta":
                ttfa = time.monotonic() - last
                await ws.send('{"type": "response.cancel"}')
                return ttfa
            if kind in ("error", "response.done"):
                raise RuntimeError(f"no audio: {message[:300]}")
    raise RuntimeError("the session ended without audio")


async def chat(url: str, model: str, content, gen: dict) -> float:
    body = {"model": model, "stream": True, "modalities": ["text", "audio"],
            "audio": {"voice": "ethan", "format": "pcm16"}, "max_tokens": gen["max_tokens"],
            "max_audio_frames": gen["max_frames"], "messages": [{"role": "user", "content": content}]}
    async with httpx.AsyncClient(timeout=120) as client:
        t0 = time.monotonic()
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"audio"' in line and '"data"' in line:
                    return time.monotonic() - t0
    raise RuntimeError("no audio in the reply")


def one_shot(url, model, x, gen):
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav_bytes(x)).decode(), "format": "wav"}}
    return chat(url, model, [part], gen)


def text_only(url, model, rep, gen):
    return chat(url, model, f"Answer briefly, question number {rep}: what is the capital of France?", gen)


# ---- the run --------------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="runs per path and length (the median is reported)")
    p.add_argument("--model", help="a checkpoint folder (default: the built-in demo model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-frames", type=int, default=25)
    p.add_argument("--json", type=Path, help="write every measurement here")
    args = p.parse_args()
    if shutil.which("espeak-ng") is None:
        raise SystemExit("espeak-ng is needed to make the utterances (apt-get install -y espeak-ng)")
    gen = {"max_tokens": args.max_tokens, "max_frames": args.max_frames}
    folder = Path(tempfile.mkdtemp(prefix="omnivox-ttfa-"))
    utterances = {t: speech(folder, t) for t in TARGETS}
    proc, url, model = start_server(args)
    results: dict[str, dict[float, list[float]]] = {k: {t: [] for t in TARGETS} for k in
                                                    ("incremental", "one-shot", "text-only")}
    try:
        for t, x in utterances.items():  # warm-up: first calls of every path and shape
            asyncio.run(incremental(url, model, x[:RATE], gen))
            asyncio.run(one_shot(url, model, x, gen))
        asyncio.run(text_only(url, model, -1, gen))
        for rep in range(args.reps):
            for t, x in utterances.items():
                y = with_noise(x, seed=1000 * rep + int(t))
                runs = (("incremental", lambda: incremental(url, model, y, gen)),
                        ("one-shot", lambda: one_shot(url, model, with_noise(x, 7 + rep), gen)),
                        ("text-only", lambda: text_only(url, model, rep * 10 + int(t), gen)))
                for name, measure in runs:
                    settle(url)
                    results[name][t].append(asyncio.run(measure()))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
        shutil.rmtree(folder, ignore_errors=True)
    report(results, utterances, args, gen)
    return 0


def report(results, utterances, args, gen) -> None:
    med = {k: {t: statistics.median(v) for t, v in by.items()} for k, by in results.items()}
    what = args.model or "the built-in demo model"
    print(f"TTFA after the last speech sample, median of {args.reps} ({what}, {args.device}; "
          f"{gen['max_tokens']} tokens / {gen['max_frames']} frames at most; 24 kHz pcm16)")
    print("| utterance | incremental (realtime) | one-shot (chat completion) | text-only | "
          "(inc - text) / (one-shot - text) | goal <= 0.25 |")
    print("|---|---|---|---|---|---|")
    met = True
    for t, x in utterances.items():
        inc, one, txt = med["incremental"][t], med["one-shot"][t], med["text-only"][t]
        ratio = (inc - txt) / (one - txt) if one > txt else float("inf")
        ok = ratio <= 0.25
        if t >= 6:
            met &= ok
        print(f"| {len(x) / RATE:.1f} s | {inc * 1000:.0f} ms | {one * 1000:.0f} ms | {txt * 1000:.0f} ms | "
              f"{ratio:.2f} | {'met' if ok else 'not met'}{'' if t >= 6 else ' (not part of the goal)'} |")
    print(f"goal ((incremental - text-only) <= 0.25 x (one-shot - text-only) at 6 s and 12 s): "
          f"{'MET' if met else 'NOT MET'}")
    if args.json:
        args.json.write_text(json.dumps({k: {str(t): v for t, v in by.items()} for k, by in results.items()},
                                        indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
