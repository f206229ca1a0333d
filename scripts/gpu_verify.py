"""The one prepared check for a lent GPU: build the full-size models on the device and verify them.

    python scripts/gpu_verify.py --out DIR [--tiny] [--phases a,b] [--budget-s 480] [--device cuda]

For a machine with no network and no ../shared (everything it reads is in the repo), at most
~8 minutes (`--budget-s`), every phase in its own time box (the budget left, shared in
proportion to the phases left). DIR/gpu_verify.json is rewritten atomically after every phase as
{"meta": ..., "phases": [{"name", "ok", "seconds", "results"}, ...], "summary": ...}, so a run
killed at its limit still returns what it measured. Phases (`scripts/gpuverify/<module>.py`):

  probe        versions, the APIs omnivox needs, a 2 GiB copy and an 8192^3 bf16 matmul (ceilings)
  build        full-size Qwen3-Omni from benchmarks/qwen3_omni_released_config.json, random bf16
               weights drawn on the device (scaled so every block matters), no disk; transformers'
               model over the same tensors (views by checkpoint name; copies reported)
  kernels      triton_paged vs torch_ref at the Thinker/Talker/S2 attention shapes, page 16,
               decode B = 1/8/64 with 1-4k contexts and one mixed prefill batch; MoE experts per layer
  graphs       CUDA-graph replay vs eager per bucket: the same seeded speech requests with and without
               graphs, every stage replayed; exactly equal in fp32 (released structure at tens of
               width), and at full size in bf16 the equal counts and eager vs graph ms/step
  parity       teacher-forced omnivox vs transformers, bf16 and fp32 (transformers bf16 vs fp32: the floor)
  qwen_speed   the engine: text request (100 + 256 tokens) tokens/s and GB/s; speech requests
               (100-token prompt, 64 tokens, 200 frames, ignore_eos): TTFA and RTF at one stream,
               RTF per stream in a closed loop of 64 (128 requests); then --scheduling fifo vs
               slack, Poisson arrivals at 1.5x that loop's audio-s/s (gap-free share, goodput)
  placement    the Thinker on the GPU, the Talker + vocoder on the CPU (narrow Thinker, Talker side
               cut in depth): the same greedy speech requests all on the GPU, placed with one loop
               (stage_loops="one") and placed with a loop per device ("device"): placed loops equal
               one loop exactly, text ids equal to all-on-GPU (codes: share of equal frames);
               ms/step of each on one load and the overlap 1 - two loops / one loop
  tp           the Thinker over 2 processes on the one GPU (both on cuda:0: OMNIVOX_TP_SAME_DEVICE=1,
               gloo through the host: OMNIVOX_TP_BACKEND=gloo) vs 1, narrow Thinker, fp32: the same greedy
               text + speech requests give identical text ids and codes (audio diff reported); ms per
               Thinker step and bytes broadcast per step at TP 1 vs 2; attention and MoE per layer at the
               released per-rank shapes (TP 1/2/4, bf16, B = 1/8/64). NCCL (and NCCL in CUDA graphs)
               need several GPUs: the commands for them are in its results (`several_gpus`)
  hf_generate  transformers' generate on the same prompts (text tokens/s; speech TTFA = RTF call)
  s2_speed     S2 Pro at full size (built on the device) on the speech workloads
  fp8          the block-FP8 Triton kernels at the Thinker's shapes (q/k/v projection, one MoE layer's
               experts in one launch each) against bf16 on the dequantized weights: error, µs, B = 1/8/32;
               torch's block-scaled _scaled_mm beside them where it runs
  duplex       Moshi at its released depths, narrow width (released Mimi), loaded from a written checkpoint:
               ms per engine frame step (Mimi encode + LM + depformer + Mimi decode, B sessions one frame
               each, median after a warm-up) at B = 1/8/32 against the 80 ms frame; session_pages and
               max_sessions under the phase's KV budget
  summary      the table printed at the end (also in the JSON)

--tiny runs the same phases on CPU with the demo-sized configs and small workloads (the kernels
phase needs TRITON_INTERPRET=1 there; transformers' parts are skipped if it is missing; placement
puts every stage on the CPU and splits the loops as "thinker,talker+vocoder"; tp runs its two ranks on
the CPU over gloo, the demo model); --narrow
likewise with the released depths and expert counts at tens of width.
The script and the omnivox code it imports need only torch, triton, transformers, numpy,
safetensors, tokenizers, jinja2, tqdm and scipy (no soundfile, fastapi, uvicorn, pydantic).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]  # this checkout's omnivox, and the gpuverify package beside this file

PHASES = {  # name -> (module, weight: a phase's box is the budget left x its share of the weights left)
    "probe": ("probe", 20), "build": ("build", 60), "kernels": ("kernels", 45), "graphs": ("graphs", 55),
    "parity": ("parity", 40), "qwen_speed": ("speed", 135), "placement": ("placement", 45), "tp": ("tp", 90),
    "hf_generate": ("baseline", 60),
    "s2_speed": ("speed", 75), "spec": ("spec", 55), "fp8": ("fp8", 30), "duplex": ("duplex", 30),
}


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    import importlib

    import torch

    from gpuverify import sizes, summary
    from gpuverify.runner import State, run_phase, write_json

    start = time.monotonic()
    device = a.device or ("cpu" if a.tiny or a.narrow or not torch.cuda.is_available() else "cuda")
    size = sizes.tiny() if a.tiny else sizes.narrow() if a.narrow else sizes.full()
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "gpu_verify.json"
    doc = {"meta": {"argv": sys.argv[1:] if argv is None else argv, "sizes": size.name, "device": device,
                    "budget_s": a.budget_s, "commit": _commit(), "started": time.strftime("%Y-%m-%d %H:%M:%S")},
           "phases": []}
    st = State(size, device, a.out)
    chosen = [p for p in PHASES if p in a.phases]
    for i, name in enumerate(chosen):
        left = a.budget_s - (time.monotonic() - start)
        weights = [PHASES[p][1] for p in chosen[i:]]
        box = left * weights[0] / sum(weights)
        if left < 2:
            doc["phases"].append({"name": name, "ok": False, "seconds": 0.0,
                                  "results": {"skipped": "the run's budget is spent"}})
        else:
            fn = getattr(importlib.import_module(f"gpuverify.{PHASES[name][0]}"), name)
            doc["phases"].append(run_phase(name, fn, st, box))
        p = doc["phases"][-1]
        print(f"[{name}] {'ok' if p['ok'] else 'NOT ok'} in {p['seconds']:.1f} s (box {box:.0f} s)"
              + (f": {_why(p['results'])}" if not p["ok"] else ""), flush=True)
        write_json(path, doc)
    t0 = time.monotonic()
    rows = summary.rows(doc["phases"], full=size.name == "full")
    text = summary.table(rows)
    total = round(time.monotonic() - start, 1)
    doc["phases"].append({"name": "summary", "ok": True, "seconds": round(time.monotonic() - t0, 2),
                          "results": {"rows": rows, "table": text, "total_s": total}})
    write_json(path, doc)
    print(f"\nomnivox GPU verification ({size.name} size, {device}, {total} s); JSON: {path}\n{text}", flush=True)
    return 0


def _why(results: dict) -> str:
    for key in ("skipped", "out_of_time", "error"):
        if key in results:
            return f"{key}: {results[key]}"
    return "a check failed (see the JSON)"


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_verify.json")
    p.add_argument("--tiny", action="store_true", help="demo-sized models on CPU (a dry run of every phase)")
    p.add_argument("--narrow", action="store_true", help="the released depths at tens of width on CPU (a slower "
                                                         "dry run of the full-size structure, ~2-4 min)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of: {', '.join(PHASES)}")
    p.add_argument("--budget-s", type=float, default=480.0, help="seconds for the whole run (default 480)")
    p.add_argument("--device", help="default: cuda if available (cpu with --tiny)")
    a = p.parse_args(argv)
    a.phases = [x.strip() for x in a.phases.split(",") if x.strip()]
    unknown = [x for x in a.phases if x not in PHASES and x != "summary"]
    if unknown:
        p.error(f"unknown phase(s) {', '.join(unknown)}; choose from {', '.join(PHASES)}")
    return a


if __name__ == "__main__":
    sys.exit(main())
