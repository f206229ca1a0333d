"""One streaming step of Mimi's windowed transformer at its released size (8 layers, 512 wide, a
250-step window, 2 steps per 80 ms frame; Moshi's encoder and decoder each run one per frame),
random weights, fp32 CPU, at B sessions: this checkout beside an older commit (`--baseline-ref`),
each in its own process on the same machine, rounds alternating (the machine's load varies).

    python benchmarks/window_step.py [--baseline-ref REF] [--batches 1 8 32] [--steps 30] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(batches: list[int], steps: int) -> dict[int, float]:
    """ms per step at each batch size (after 5 warm-up steps, which also fill part of the window)."""
    import torch
    from omnivox.models.moshi.mimi import MimiTransformer
    from omnivox.models.moshi.mimi_config import TransformerConfig
    torch.set_num_threads(1)
    torch.manual_seed(0)
    t = MimiTransformer(TransformerConfig(), 2).eval()
    out = {}
    with torch.no_grad():
        for b in batches:
            state, x = t.init_state(b, "cpu", torch.float32), torch.randn(b, 2, 512)
            for _ in range(5):
                t.step(x, state)
            start = time.perf_counter()
            for _ in range(steps):
                t.step(x, state)
            out[b] = (time.perf_counter() - start) / steps * 1000
    return out


def run_in(tree: Path, batches: list[int], steps: int) -> dict[int, float]:
    code = (f"import json, sys; sys.path.insert(0, {str(tree)!r}); sys.path.insert(1, {str(ROOT / 'benchmarks')!r}); "
            f"import omnivox; assert omnivox.__file__.startswith({str(tree)!r}), omnivox.__file__; "
            f"from window_step import measure; print(json.dumps(measure({batches!r}, {steps})))")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline-ref", default="3ce0667", help="the older commit (default: before the views)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="omnivox-window-baseline-") as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", a.baseline_ref, "omnivox"], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        runs = {"baseline": [], "this": []}
        for _ in range(a.rounds):
            runs["baseline"].append(run_in(Path(tmp), a.batches, a.steps))
            runs["this"].append(run_in(ROOT, a.batches, a.steps))
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    print(f"Mimi's window transformer, released size, one step of 2 positions, fp32 CPU, 1 thread, best of "
          f"{a.rounds} rounds x {a.steps} steps; {a.baseline_ref} -> {head} (working tree)")
    print(f"{'B':>4} {'baseline ms':>12} {'this ms':>9} {'change':>8}")
    for b in a.batches:
        old, new = min(r[b] for r in runs["baseline"]), min(r[b] for r in runs["this"])
        print(f"{b:>4} {old:>12.2f} {new:>9.2f} {100 * (new - old) / old:>+7.1f}%")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
