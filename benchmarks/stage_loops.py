"""`--stage-loops one` beside the stages in separate loops, on the built-in demo, same workload, one process.

    python benchmarks/stage_loops.py                       # c = 8 32, loops: one | thinker,talker+vocoder
    python benchmarks/stage_loops.py --concurrency 16 --loops one thinker,talker,vocoder

Workload: `omnivox bench`'s (distinct 32-token prompts, `--tokens` Thinker tokens and `--frames`
frames per reply, greedy, ends ignored), closed loop with 4c requests at each concurrency c, each
layout on a fresh engine (fifo, max_running 64) over the same weights after 2 warm-up requests.
Prints wall seconds, audio-s/s, the Thinker's steps and the wall time per Thinker step per layout.

On CPU both loops run Python on one interpreter (the GIL) over 2 cores: this measures what the
threads cost or give here, it is not an overlap claim; the GPU phase `placement` of
scripts/gpu_verify.py measures overlap on a Thinker that computes on a GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(model, loops: str, concurrency: int, args) -> dict:
    from omnivox.engine.measure import run_requests

    model.close()
    model.engine_config = replace(model.engine_config, stage_loops=loops)
    n = 4 * concurrency
    wl = argparse.Namespace(prompt_tokens=None, num_requests=n, seed=args.seed, reply_tokens=args.tokens,
                            reply_frames=args.frames, concurrency=concurrency)
    work = model.bench_workload(wl)
    try:
        run_requests(work.submit, 2, 2, None, args.seed)  # warm-up
        steps_before = _steps(model)
        start = time.perf_counter()
        results, wall = run_requests(work.submit, n, concurrency, None, args.seed)
        busy = time.perf_counter() - start
        steps = _steps(model) - steps_before
        layout = model.engine.stages.loops
    finally:
        model.close()
    audio = sum(r.audio_seconds for r in results)
    return {"loops": loops, "layout": layout, "concurrency": concurrency, "requests": len(results), "wall": wall,
            "audio_s_per_s": audio / wall, "steps": steps, "ms_per_step": 1000 * busy / max(steps, 1)}


def _steps(model) -> int:
    """Steps of the graph so far: the Thinker's step count (every engine step with text work)."""
    return model.engine.stats().stages["thinker"].steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--loops", nargs="+", default=["one", "thinker,talker+vocoder"])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--frames", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()

    from omnivox.engine.config import EngineConfig
    from omnivox.models.registry import load

    import torch
    model = load(None, engine_config=EngineConfig(max_running=64, max_queue=1024, scheduling="fifo"), progress=False)
    print(f"demo model, {torch.get_num_threads()} intra-op thread(s); tokens {args.tokens}, frames {args.frames}")
    rows = []
    for c in args.concurrency:
        print(f"\nconcurrency {c} ({4 * c} requests)")
        print(f"  {'loops':26} {'wall s':>7} {'audio-s/s':>10} {'thinker steps':>14} {'ms/step':>8}")
        for loops in args.loops:
            r = run(model, loops, c, args)
            rows.append(r)
            print(f"  {loops:26} {r['wall']:7.2f} {r['audio_s_per_s']:10.2f} {r['steps']:14d} {r['ms_per_step']:8.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
