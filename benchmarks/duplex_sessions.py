"""Concurrent full-duplex sessions on the moshi-demo checkpoint, `--scheduling fifo` beside `slack`
in the same process: more sessions are offered than the machine can step in real time, and each
policy's engine (its own MoshiServed, the same offered load) serves them.

Each session opens at its own time (`--stagger` s after the previous, so they arrive staggered),
then pushes one 80 ms frame of speech (the committed espeak-ng clip, looped from the session's
own offset) every 80 ms at its own phase, in real time, for `--seconds`, and closes. A session
`open_duplex` refuses (Overloaded: /api/chat and /v1/realtime close it with 1013) is counted as
refused. Per output frame, from the engine's own events: latency = `AudioChunk.time` - the input
frame's arrival (`due` - one frame), lateness = `time - due`; a session is in time when none of
its frames was late. Reported per policy: sessions offered / admitted / refused, the share of
sessions in time (of those admitted and of those offered), frame latency p50 / p99 and the late
frames' share, lateness p99 / max.

    python benchmarks/duplex_sessions.py [--sessions 80] [--stagger 0.1] [--seconds 8] [--rounds 2] [--threads 1]

(the defaults offer up to 80 sessions at once; the 2-core CPU holds about 20-25 in time)

The machine's load varies (other jobs share it): the policies alternate, `--rounds` times, and
every round is printed beside their sums.
"""
from __future__ import annotations

import argparse
import asyncio
import heapq
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omnivox.audio.io import load_audio  # noqa: E402
from omnivox.engine.config import EngineConfig  # noqa: E402
from omnivox.engine.events import AudioChunk, Failed, Finished  # noqa: E402
from omnivox.errors import Overloaded  # noqa: E402
from omnivox.models.moshi.served import MoshiServed  # noqa: E402
from omnivox.serving_duplex import DuplexParams  # noqa: E402

SPEECH = ROOT / "tests" / "media" / "speech_16k.wav"


@dataclass
class Session:
    index: int
    opens: float  # when it opens (seconds from the run's start)
    handle: object = None
    audio_in: object = None
    refused: bool = False
    latency: list[float] = field(default_factory=list)  # per output frame
    late: list[float] = field(default_factory=list)  # per output frame: time - due
    end: str = ""

    async def read(self) -> None:
        async for ev in self.handle:
            if isinstance(ev, AudioChunk):
                self.latency.append(ev.time - (ev.due - ev.samples.shape[0] / ev.sample_rate))
                self.late.append(ev.time - ev.due)
            elif isinstance(ev, Finished):
                self.end = ev.finish_reason
            elif isinstance(ev, Failed):
                self.end = f"failed: {ev.message}"


def run(policy: str, args, speech: np.ndarray) -> dict:
    cfg = EngineConfig(max_running=args.sessions, kv_cache_mb=args.kv_mb, scheduling=policy)
    served = MoshiServed(engine_config=cfg)
    assert served.max_sessions >= args.sessions, f"the KV holds {served.max_sessions} sessions: raise --kv-mb"
    frame, frame_s = served.frame_size, served.frame_size / served.sample_rate
    frames = round(args.seconds / frame_s)
    warm, warm_in = served.open_duplex(DuplexParams(greedy=True))  # the first steps (lazy setup) off the clock
    warm_in.push(speech[:4 * frame])
    warm_in.close()
    warm.collect()
    sessions = [Session(i, i * args.stagger) for i in range(args.sessions)]
    # one feeder thread: (when, session, frame index) in time order; frame -1 opens the session
    start = time.monotonic() + 0.2
    events = [(start + s.opens, s.index, -1) for s in sessions]
    heapq.heapify(events)
    loop = asyncio.new_event_loop()  # the sessions' events reach one event loop, as a server's do
    looper = threading.Thread(target=loop.run_forever, daemon=True)
    looper.start()
    readers = []
    load = os.getloadavg()
    while events:
        when, i, k = heapq.heappop(events)
        time.sleep(max(0.0, when - time.monotonic()))
        s = sessions[i]
        if k < 0:
            try:
                s.handle, s.audio_in = served.open_duplex(DuplexParams(greedy=True), loop=loop)
            except Overloaded:
                s.refused = True
                continue
            readers.append(asyncio.run_coroutine_threadsafe(s.read(), loop))
            heapq.heappush(events, (when + frame_s, i, 0))  # its own phase: a frame every 80 ms from its opening
        elif k < frames:
            at = (i * 7919 * frame + k * frame) % (speech.size - frame)  # its own place in the clip
            s.audio_in.push(speech[at:at + frame])
            heapq.heappush(events, (when + frame_s, i, k + 1))
        else:
            s.audio_in.close()
    for f in readers:
        f.result(timeout=120)
    loop.call_soon_threadsafe(loop.stop)
    looper.join()
    served.close()
    load = (load, os.getloadavg())
    admitted = [s for s in sessions if not s.refused]
    in_time = [s for s in admitted if s.late and max(s.late) <= 0 and s.end == "stop"]
    lat = np.concatenate([s.latency for s in admitted]) if admitted else np.zeros(0)
    late = np.concatenate([s.late for s in admitted]) if admitted else np.zeros(0)
    return dict(policy=policy, offered=len(sessions), admitted=len(admitted), refused=len(sessions) - len(admitted),
                in_time=len(in_time), frames=lat.size, lat=lat, late=late, ended=sorted({s.end for s in admitted}),
                load=load)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=80, help="sessions offered")
    ap.add_argument("--stagger", type=float, default=0.1, help="seconds between two sessions' openings")
    ap.add_argument("--seconds", type=float, default=8.0, help="seconds of audio each session sends")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--kv-mb", type=float, default=512.0)
    ap.add_argument("--rounds", type=int, default=2, help="fifo then slack, this many times (the machine's load varies)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    speech = load_audio(SPEECH, target_sr=24000).astype(np.float32)
    results = [run(policy, args, speech) for _ in range(args.rounds) for policy in ("fifo", "slack")]
    for policy in ("fifo", "slack"):  # every round's sessions together
        rs = [r for r in results if r["policy"] == policy]
        results.append(dict(policy=f"{policy} all", **{k: sum(r[k] for r in rs) for k in ("offered", "admitted", "refused",
                                                                                          "in_time", "frames")},
                            lat=np.concatenate([r["lat"] for r in rs]), late=np.concatenate([r["late"] for r in rs])))
    print(f"moshi-demo, fp32 CPU, {args.threads} intra-op thread(s): {args.sessions} duplex sessions offered, one "
          f"every {args.stagger:g} s, each sending {args.seconds:g} s of speech in real time (a frame every 80 ms)")
    print(f"  {'policy':>9} {'offered':>7} {'admitted':>8} {'refused':>7} {'in time/admitted':>16} "
          f"{'in time/offered':>15} {'frames':>6} {'lat p50 ms':>10} {'lat p99 ms':>10} {'late frames':>11} "
          f"{'late p99 ms':>11} {'late max ms':>11}")
    for r in results:
        lat, late = r["lat"] * 1000, r["late"] * 1000
        pct = (lambda a, q: float(np.percentile(a, q)) if a.size else float("nan"))
        share = (lambda n, d: f"{n}/{d} {100 * n / d:5.1f}%" if d else "-")
        print(f"  {r['policy']:>9} {r['offered']:>7} {r['admitted']:>8} {r['refused']:>7} "
              f"{share(r['in_time'], r['admitted']):>16} {share(r['in_time'], r['offered']):>15} {r['frames']:>6} "
              f"{pct(lat, 50):>10.1f} {pct(lat, 99):>10.1f} {100 * float((late > 0).mean()) if late.size else 0:>10.1f}% "
              f"{max(0.0, pct(late, 99)):>11.1f} {max(0.0, float(late.max()) if late.size else 0.0):>11.1f}")
    for r in results[:-2]:
        (a1, a5, a15), (b1, b5, b15) = r["load"]
        print(f"  {r['policy']}: sessions ended {r['ended']}; load average {a1:.2f} {a5:.2f} {a15:.2f} before, "
              f"{b1:.2f} {b5:.2f} {b15:.2f} after")
    print(f"machine: {os.cpu_count()}-core CPU, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}; at most "
          f"{args.seconds / args.stagger:.0f} sessions at once are offered")


if __name__ == "__main__":
    main()
