"""Batch work (no listener) under `--scheduling slack` beside `fifo`, on the built-in demo, one process.

    python benchmarks/batch_scheduling.py                 # offline batch x5 alternating, then the mix at c = 32
    python benchmarks/batch_scheduling.py --runs 1 --json benchmarks/results/batch_scheduling_cpu.json

1. Offline batch: 16 greedy speaking requests in one `Omni.generate` call (distinct 32-token prompts,
   `--tokens` Thinker tokens + `--frames` frames each, end tokens ignored): audio-s/s = all audio /
   the call's wall time, the Thinker's largest batch, the stage steps the call took (the same
   count: the same schedule), and whether both policies made the same codes. The two policies'
   engines are loaded side by side and alternate `--runs` times. Goal (issue 44): slack's median
   audio-s/s within 10 % of fifo's (on a loaded machine the best run of each is the steadier figure).
2. Mix at c = 32: 16 playing streams (a listener plays each: `playing=True`) and 16 batch requests
   of the same shape, all submitted at once, each policy on a fresh engine after 2 warm-up
   requests. Playing streams: gap-free share, stall seconds per stream, TTFA p50/p90 (client-side
   playback from each stream's first chunk, as in streaming_scheduling.py); batch requests: their
   audio-s/s (their audio / the time from the first arrival to the last batch request's end), beside
   fifo's.
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
N = 16


def load(policy: str, max_running: int = 64):
    from omnivox.engine.config import EngineConfig
    from omnivox.models.registry import load as load_model

    return load_model(None, engine_config=EngineConfig(max_running=max_running, max_queue=256, scheduling=policy),
                      progress=False)


def offline(models: dict, args) -> dict:
    """`--runs` alternating runs of one generate call of N requests per policy."""
    from omnivox.models.qwen3_omni.bench import prompts

    ps = prompts(models["fifo"].cfg, N, 32, args.seed, models["fifo"].tokenizer)
    reqs = [dict(prompt_ids=p, greedy=True, ignore_eos=True, max_tokens=args.tokens, max_frames=args.frames)
            for p in ps]
    for m in models.values():  # warm-up
        m.generate(requests=reqs[:2])
    rows: dict[str, list[dict]] = {pol: [] for pol in POLICIES}
    codes: dict[str, list] = {}
    for _ in range(args.runs):
        for pol in POLICIES:
            m = models[pol]
            steps = sum(st.steps for st in m.engine.stats().stages.values())
            start = time.monotonic()
            outs = m.generate(requests=reqs)
            wall = time.monotonic() - start
            audio = sum(o.audio.shape[0] / o.sample_rate for o in outs)
            stats = m.engine.stats()
            steps = sum(st.steps for st in stats.stages.values()) - steps
            peak = stats.stages["thinker"].max_batch
            rows[pol].append({"audio_s_per_s": audio / wall, "wall": wall, "audio_s": audio, "stage_steps": steps,
                              "thinker_max_batch": peak})
            codes[pol] = [o.codes.tolist() for o in outs]
            print(f"  {pol:6} {audio / wall:7.2f} audio-s/s  wall {wall:5.2f} s  {steps} stage steps  "
                  f"thinker batch <= {peak}", flush=True)
    med = {pol: statistics.median(r["audio_s_per_s"] for r in rows[pol]) for pol in POLICIES}
    best = {pol: max(r["audio_s_per_s"] for r in rows[pol]) for pol in POLICIES}
    return {"runs": rows, "median": med, "best": best, "same_codes": codes["fifo"] == codes["slack"]}


def mix(policy: str, args) -> dict:
    """16 playing + 16 batch submitted together (c = 32) on a fresh engine."""
    from omnivox.engine.measure import run_requests

    model = load(policy)
    wl = argparse.Namespace(prompt_tokens=None, num_requests=2 * N, seed=args.seed, reply_tokens=args.tokens,
                            reply_frames=args.frames, concurrency=2 * N)
    work = model.bench_workload(wl)
    try:
        run_requests(work.submit, 2, 2, None, args.seed)  # warm-up
        # even i play, odd i are batch: the two kinds arrive interleaved
        results, wall = run_requests(lambda i: work.submit(i, playing=i % 2 == 0), 2 * N, 2 * N, None, args.seed)
        thinker = model.engine.stats().stages["thinker"].max_batch
    finally:
        model.close()
    playing, batch = results[0::2], results[1::2]
    plays = [r.playback() for r in playing]
    start = min(r.arrival for r in results)
    batch_wall = max(r.finish for r in batch) - start
    return {
        "policy": policy, "playing": len(playing), "batch": len(batch),
        "gap_free": sum(p.chunks > 0 and p.gap_free for p in plays) / len(playing),
        "stall_s": sum(p.stall_s for p in plays) / len(playing),
        "ttfa_p50": float(np.percentile([r.ttfa for r in playing], 50)),
        "ttfa_p90": float(np.percentile([r.ttfa for r in playing], 90)),
        "playing_done_s": max(r.finish for r in playing) - start,
        "batch_audio_s_per_s": sum(r.audio_seconds for r in batch) / batch_wall, "batch_wall": batch_wall,
        "all_audio_s_per_s": sum(r.audio_seconds for r in results) / wall, "wall": wall,
        "thinker_max_batch": thinker,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--frames", type=int, default=50)
    p.add_argument("--runs", type=int, default=5, help="alternating runs of the offline batch per policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write every row here")
    args = p.parse_args()

    import torch
    torch.set_num_threads(1)
    print(f"demo, {args.tokens} tokens + {args.frames} frames ({args.frames * 0.08:.2f} s of audio) per request; "
          f"{torch.get_num_threads()} CPU thread; {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"\n1. offline batch: {N} greedy speaking requests in one Omni.generate call, {args.runs} runs alternating")
    models = {pol: load(pol) for pol in POLICIES}
    try:
        off = offline(models, args)
    finally:
        for m in models.values():
            m.close()
    f, s = off["median"]["fifo"], off["median"]["slack"]
    bf, bs = off["best"]["fifo"], off["best"]["slack"]
    print(f"  median: fifo {f:.2f}, slack {s:.2f} audio-s/s = {100 * s / f:.0f} % of fifo's (best runs: {bf:.2f}, "
          f"{bs:.2f} = {100 * bs / bf:.0f} %); same codes: {off['same_codes']}; goal (slack's median within 10 % of "
          f"fifo's): {'met' if s >= 0.9 * f else 'MISSED'}")

    print(f"\n2. mix at c = {2 * N}: {N} playing streams + {N} batch requests submitted together")
    rows = [mix(pol, args) for pol in POLICIES]
    print(f"  {'policy':8} {'gap-free':>9} {'stall s':>8} {'TTFA p50':>9} {'TTFA p90':>9} {'streams done':>13} "
          f"{'batch audio-s/s':>16} {'batch done':>11} {'all audio-s/s':>14}")
    for r in rows:
        print(f"  {r['policy']:8} {100 * r['gap_free']:8.1f}% {r['stall_s']:8.3f} {r['ttfa_p50']:9.3f} "
              f"{r['ttfa_p90']:9.3f} {r['playing_done_s']:12.1f}s {r['batch_audio_s_per_s']:16.2f} "
              f"{r['batch_wall']:10.1f}s {r['all_audio_s_per_s']:14.2f}")
    fifo, slack = rows
    print(f"  slack: playing gap-free {100 * slack['gap_free']:.1f} % (fifo {100 * fifo['gap_free']:.1f} %); batch "
          f"{slack['batch_audio_s_per_s']:.2f} audio-s/s = "
          f"{100 * slack['batch_audio_s_per_s'] / fifo['batch_audio_s_per_s']:.0f} % of fifo's")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"offline": off, "mix": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
