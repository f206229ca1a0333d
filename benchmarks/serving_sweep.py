"""`omnivox bench` on the built-in demo at several concurrencies, medians of repeated runs, this
checkout beside an older commit and beside transformers batched in the same run.

    python benchmarks/serving_sweep.py                       # c = 8, 16, 32, 64; 3 runs each; old = 06ea32f
    python benchmarks/serving_sweep.py --concurrency 8 16 --runs 1 --no-old

Each run is one `omnivox bench` process (16 Thinker tokens + 25 frames per request, greedy,
`ignore_eos`, `--num-requests` = 4 x c, one CPU thread for every system). The transformers row
is transformers' own generate in batches of c, with the experts implementation given by
`--hf-experts` (default: the fastest on this CPU among those transformers offers, measured first).
The older commit's `omnivox/` is extracted with `git archive` and run with its own bench
(`--no-baseline`). Printed: audio-seconds per second and the share of chunks on time, the
median over the runs, with the ratios the engine-core issue asks for.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a cell is a number, or `nan`/`inf` (older trees) or `n/a` (not measured)
_CELL = r"([\d.]+|nan|inf|n/a)"
ROW = re.compile(rf"^\s*(omnivox|hf batch=\d+)\s+{_CELL}\s+{_CELL}\s+{_CELL}\s+{_CELL}\s+{_CELL}\s+{_CELL}")


def _num(cell: str) -> float:
    return float("nan") if cell == "n/a" else float(cell)


def bench(tree: Path, c: int, requests: int, baseline: bool, hf_experts: str, cache: str) -> dict[str, dict]:
    """One `omnivox bench` run in `tree`; {system: {ttfa_p50, rtf, on_time, audio_s_per_s}}."""
    args = [sys.executable, "-m", "omnivox.cli", "bench", "--num-requests", str(requests), "--concurrency", str(c),
            "--reply-tokens", "16", "--reply-frames", "25"]
    if tree == ROOT:  # throughput with every request running, as the older trees (before --scheduling) did
        args += ["--scheduling", "fifo"]
    if baseline:
        args += ["--hf-experts", hf_experts, "--hf-batched-only"]
    else:
        args += ["--no-baseline"]
    env = dict(os.environ, PYTHONPATH=str(tree), OMNIVOX_CACHE=cache)
    out = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"bench failed in {tree}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    rows = {}
    for line in out.stdout.splitlines():
        m = ROW.match(line)
        if m:
            name = "transformers" if m.group(1).startswith("hf") else "omnivox"
            rows[name] = {"ttfa_p50": _num(m.group(2)), "rtf": _num(m.group(4)), "on_time": _num(m.group(5)),
                          "audio_s_per_s": _num(m.group(7))}
    return rows


def fastest_experts(cache: str) -> str:
    """The transformers experts implementation with the shortest generate on the demo, on this CPU."""
    code = r"""
import json, sys, time, torch
from transformers import Qwen3OmniMoeForConditionalGeneration
from omnivox.models.qwen3_omni.demo import demo_model_path
from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
from omnivox.models.qwen3_omni.bench import prompts
torch.set_num_threads(1)
folder = demo_model_path()
m = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder).eval()
ids = torch.tensor(prompts(Qwen3OmniConfig.from_hf(json.loads((folder / "config.json").read_text())), 8, 32, 0))
def run():
    m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), thinker_max_new_tokens=8,
               thinker_do_sample=False, talker_do_sample=False, talker_max_new_tokens=10)
with torch.no_grad():
    run()  # warm-up: the first call pays one-time costs
for impl in sys.argv[1:]:
    try:
        m.set_experts_implementation(impl)
        with torch.no_grad():
            run()
            t = time.monotonic()
            run()
        print(impl, time.monotonic() - t, flush=True)
    except Exception as e:
        print(impl, "failed", type(e).__name__, str(e)[:200], flush=True)
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMNIVOX_CACHE=cache)
    run = subprocess.run([sys.executable, "-c", code, "eager", "batched_mm", "grouped_mm"], env=env,
                         capture_output=True, text=True, timeout=1800)
    times = {}
    for line in run.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            times[parts[0]] = float(parts[1])
        elif line.strip():
            print("  transformers:", line, flush=True)
    if not times:
        print(run.stderr[-2000:], flush=True)
    print("transformers experts on this CPU (s for one batch of 8):", times, flush=True)
    return min(times, key=times.get) if times else "eager"


def median(runs: list[dict], system: str, key: str) -> float:
    vals = [r[system][key] for r in runs if system in r]
    return statistics.median(vals) if vals else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--old-ref", default="06ea32f")
    p.add_argument("--no-old", action="store_true")
    p.add_argument("--hf-experts", default=None)
    args = p.parse_args()
    cache = tempfile.mkdtemp(prefix="omnivox-sweep-")
    old = None
    if not args.no_old:
        old = Path(tempfile.mkdtemp(prefix="omnivox-old-"))
        archive = subprocess.run(["git", "archive", args.old_ref, "omnivox"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    experts = args.hf_experts or fastest_experts(cache)
    table = []
    for c in args.concurrency:
        new_runs = [bench(ROOT, c, 4 * c, True, experts, cache) for _ in range(args.runs)]
        old_runs = [bench(old, c, 4 * c, False, experts, cache) for _ in range(args.runs)] if old else []
        row = {"c": c, "new": median(new_runs, "omnivox", "audio_s_per_s"),
               "new_on_time": median(new_runs, "omnivox", "on_time"), "new_ttfa": median(new_runs, "omnivox", "ttfa_p50"),
               "hf": median(new_runs, "transformers", "audio_s_per_s"),
               "old": median(old_runs, "omnivox", "audio_s_per_s") if old_runs else float("nan"),
               "old_on_time": median(old_runs, "omnivox", "on_time") if old_runs else float("nan")}
        table.append(row)
        print(f"c={c}: {row}", flush=True)
    print(f"\nomnivox bench on the demo, 16 tokens + 25 frames per request, --num-requests = 4c, median of "
          f"{args.runs} runs; transformers batched (experts: {experts}) in the same runs")
    print(f"{'c':>4} | {'old audio-s/s':>13} | {'new audio-s/s':>13} | {'hf batch=c':>10} | {'new/hf':>6} | "
          f"{'old on time':>11} | {'new on time':>11} | {'new TTFA p50':>12}")
    for r in table:
        print(f"{r['c']:>4} | {r['old']:>13.2f} | {r['new']:>13.2f} | {r['hf']:>10.2f} | {r['new'] / r['hf']:>6.2f} | "
              f"{r['old_on_time']:>11.0%} | {r['new_on_time']:>11.0%} | {r['new_ttfa']:>11.3f}s")
    by_c = {r["c"]: r for r in table}
    if 8 in by_c:
        print(f"goal: 100% of chunks on time at c=8: {by_c[8]['new_on_time']:.0%} "
              f"({'met' if by_c[8]['new_on_time'] >= 1.0 else 'NOT met'})")
    if 16 in by_c:
        ratio = by_c[16]["new"] / by_c[16]["hf"]
        print(f"goal: at c=16 >= 2x transformers batch=16: {ratio:.2f}x ({'met' if ratio >= 2 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
