"""One streaming step of a windowed transformer at its released size, random weights, fp32 CPU, at B
sessions: this checkout beside an older commit (`--baseline-ref`), each in its own process on the
same machine, rounds alternating (the machine's load varies).

- `--model mimi` (default): Mimi's (8 layers, 512 wide, a 250-step window, 2 steps per 80 ms frame;
  Moshi's encoder and decoder each run one per frame);
- `--model code2wav`: Qwen3-Omni Code2Wav's (8 layers, 1024 wide, a 72-frame window, one frame per
  step), its state gathered from a slot pool and scattered back each step as the vocoder stage does.

    python benchmarks/window_step.py [--model mimi|code2wav] [--baseline-ref REF] [--batches 1 8 32]
                                     [--steps 30] [--rounds 2]
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


def measure(batches: list[int], steps: int, model: str = "mimi") -> dict[int, float]:
    """ms per step at each batch size (after warm-up steps that also fill part of the window)."""
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if model == "mimi":
        from omnivox.models.moshi.mimi import MimiTransformer
        from omnivox.models.moshi.mimi_config import TransformerConfig
        t, width, n, warm = MimiTransformer(TransformerConfig(), 2).eval(), 512, 2, 5
    else:
        from omnivox.models.qwen3_omni.code2wav import Code2WavTransformer
        from omnivox.models.qwen3_omni.config import Code2WavConfig
        cfg = Code2WavConfig.from_hf(json.loads((ROOT / "benchmarks" / "qwen3_omni_released_config.json")
                                                .read_text())["code2wav_config"]).transformer
        t, width, n, warm = Code2WavTransformer(cfg).eval(), cfg.hidden_size, 1, 80  # the window fills at 72
    out = {}
    with torch.no_grad():
        for b in batches:
            x, rows = torch.randn(b, n, width), torch.arange(b)
            pool = t.init_state(b if model == "mimi" else b + 2, "cpu", torch.float32)

            def step() -> None:
                if model == "mimi":  # one state, stepped in place
                    return t.step(x, pool)
                state = pool.select(rows)  # the pooled rows, as the vocoder stage's slot pool holds them
                t.step(x, state)
                pool.assign(rows, state)
            for _ in range(warm):
                step()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            out[b] = (time.perf_counter() - start) / steps * 1000
    return out


def run_in(tree: Path, batches: list[int], steps: int, model: str) -> dict[int, float]:
    code = (f"import json, sys; sys.path.insert(0, {str(tree)!r}); sys.path.insert(1, {str(ROOT / 'benchmarks')!r}); "
            f"import omnivox; assert omnivox.__file__.startswith({str(tree)!r}), omnivox.__file__; "
            f"from window_step import measure; print(json.dumps(measure({batches!r}, {steps}, {model!r})))")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["mimi", "code2wav"], default="mimi")
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
            runs["baseline"].append(run_in(Path(tmp), a.batches, a.steps, a.model))
            runs["this"].append(run_in(ROOT, a.batches, a.steps, a.model))
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    what = ("Mimi's window transformer, released size, one step of 2 positions" if a.model == "mimi" else
            "Code2Wav's window transformer, released size, one frame per step, rows gathered from and scattered "
            "to a slot pool")
    print(f"{what}, fp32 CPU, 1 thread, best of "
          f"{a.rounds} rounds x {a.steps} steps; {a.baseline_ref} -> {head} (working tree)")
    print(f"{'B':>4} {'baseline ms':>12} {'this ms':>9} {'change':>8}")
    for b in a.batches:
        old, new = min(r[b] for r in runs["baseline"]), min(r[b] for r in runs["this"])
        print(f"{b:>4} {old:>12.2f} {new:>9.2f} {100 * (new - old) / old:>+7.1f}%")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
