"""`--scheduling fifo` beside `--scheduling slack` on the built-in demo, same workload, one process.

    python benchmarks/streaming_scheduling.py                    # c = 8 16 32 64, Poisson at 1.5x, TTFA spread at c = 8
    python benchmarks/streaming_scheduling.py --concurrency 32 --no-poisson --ttfa-runs 0 --frames 25

Workload: distinct 32-token prompts, each replying exactly `--tokens` Thinker tokens and `--frames`
speech frames (80 ms each; greedy, end tokens ignored), submitted to the engine in this process
(`omnivox bench`'s workload), each policy on a fresh engine (max_running 64, a queue that holds
every request) after 2 warm-up requests. Loads: closed loop at each concurrency c with 4c requests;
Poisson arrivals at 1.5x (fifo's peak audio-s/s in this run / audio seconds per request), 256
requests. Client-side playback from each stream's first chunk (`omnivox.engine.playback`):
  gap-free   share of requests sent whose stream never stalled (refused or failed: not gap-free)
  stall s    seconds of silence per stream (all requests sent)
  TTFA       p50 / p90 from arrival to the first audio (queued requests wait: it counts)
  goodput    audio-seconds of gap-free streams per wall second
  audio-s/s  all audio per wall second
At c = 8 the two policies also run `--ttfa-runs` times interleaved: slack's TTFA p50 beside fifo's
spread (min-max of its p50s). Goals (issue 21): at c = 32 and 64 slack's gap-free share >= 95 % and
its goodput >= 70 % of fifo's audio-s/s; at c = 8 slack's TTFA p50 within fifo's spread (or below).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

POLICIES = ("fifo", "slack")


def run(policy: str, n: int, concurrency: int | None, rate: float | None, args) -> dict:
    from omnivox.engine.config import EngineConfig
    from omnivox.engine.measure import run_requests
    from omnivox.models.registry import load

    cfg = EngineConfig(max_running=64, max_queue=max(n, 256), scheduling=policy)
    model = load(None, engine_config=cfg, progress=False)
    wl = argparse.Namespace(prompt_tokens=None, num_requests=n, seed=args.seed, reply_tokens=args.tokens,
                            reply_frames=args.frames, concurrency=concurrency or n)
    work = model.bench_workload(wl)
    try:
        run_requests(work.submit, 2, 2, None, args.seed)  # warm-up
        results, wall = run_requests(work.submit, n, concurrency or n, rate, args.seed)
        waited = model.engine.stats().waiting_capacity
    finally:
        model.close()
    plays = [r.playback() for r in results]
    gap_free = [p for p in plays if p.chunks and p.gap_free]
    audio = sum(r.audio_seconds for r in results)
    ttfa = [r.ttfa for r in results]
    return {
        "policy": policy, "requests": n, "completed": len(results),
        "gap_free": len(gap_free) / n,
        "stall_s": sum(p.stall_s for p in plays) / n,
        "ttfa_p50": float(np.percentile(ttfa, 50)), "ttfa_p90": float(np.percentile(ttfa, 90)),
        "goodput": sum(p.received for p in gap_free) / wall,
        "audio_s_per_s": audio / wall, "wall": wall, "left_waiting": waited,
    }


def table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"  {'policy':8} {'gap-free':>9} {'stall s':>8} {'TTFA p50':>9} {'TTFA p90':>9} {'goodput':>8} "
          f"{'audio-s/s':>10} {'wall s':>7}")
    for r in rows:
        print(f"  {r['policy']:8} {100 * r['gap_free']:8.1f}% {r['stall_s']:8.3f} {r['ttfa_p50']:9.3f} "
              f"{r['ttfa_p90']:9.3f} {r['goodput']:8.2f} {r['audio_s_per_s']:10.2f} {r['wall']:7.1f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--frames", type=int, default=50)
    p.add_argument("--poisson-requests", type=int, default=256)
    p.add_argument("--no-poisson", action="store_true")
    p.add_argument("--ttfa-runs", type=int, default=5, help="interleaved runs of each policy at c = 8")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write every row here")
    args = p.parse_args()

    import torch
    torch.set_num_threads(1)
    out: dict = {"closed": {}, "poisson": None, "ttfa_c8": None}
    print(f"demo, {args.tokens} tokens + {args.frames} frames ({args.frames * 0.08:.2f} s of audio) per request; "
          f"{torch.get_num_threads()} CPU thread; {time.strftime('%Y-%m-%d %H:%M')}")
    for c in args.concurrency:
        rows = [run(pol, 4 * c, c, None, args) for pol in POLICIES]
        out["closed"][c] = rows
        table(f"closed loop, c = {c}, {4 * c} requests", rows)
    if not args.no_poisson and out["closed"]:
        peak = max(rows[0]["audio_s_per_s"] for rows in out["closed"].values())
        rate = 1.5 * peak / (args.frames * 0.08)
        rows = [run(pol, args.poisson_requests, None, rate, args) for pol in POLICIES]
        out["poisson"] = {"rate": rate, "rows": rows}
        table(f"Poisson, {rate:.2f} requests/s (1.5 x fifo's peak {peak:.1f} audio-s/s), "
              f"{args.poisson_requests} requests", rows)
    if args.ttfa_runs:
        p50 = {pol: [] for pol in POLICIES}
        for _ in range(args.ttfa_runs):
            for pol in POLICIES:
                p50[pol].append(run(pol, 32, 8, None, args)["ttfa_p50"])
        out["ttfa_c8"] = p50
        lo, hi = min(p50["fifo"]), max(p50["fifo"])
        med = statistics.median(p50["slack"])
        print(f"\nTTFA p50 at c = 8 over {args.ttfa_runs} interleaved runs: fifo {lo:.3f}-{hi:.3f} s, "
              f"slack median {med:.3f} s ({', '.join(f'{v:.3f}' for v in p50['slack'])}): "
              f"{'within' if lo <= med <= hi else 'below (better than)' if med < lo else 'ABOVE'} fifo's spread")
    print("\ngoals (slack): gap-free >= 95 % and goodput >= 70 % of fifo's audio-s/s at c = 32 and 64")
    for c in (32, 64):
        if c in out["closed"]:
            fifo, slack = out["closed"][c]
            ok = slack["gap_free"] >= 0.95 and slack["goodput"] >= 0.7 * fifo["audio_s_per_s"]
            print(f"  c = {c}: gap-free {100 * slack['gap_free']:.1f} % (fifo {100 * fifo['gap_free']:.1f} %), goodput "
                  f"{slack['goodput']:.2f} = {100 * slack['goodput'] / fifo['audio_s_per_s']:.0f} % of fifo's "
                  f"{fifo['audio_s_per_s']:.2f} audio-s/s: {'met' if ok else 'MISSED'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
