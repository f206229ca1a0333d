"""Moshi LM frame step time (greedy): omnivox's LM stage (paged KV, one step of the stage graph
per frame, `tests/models/moshi/lm_stage.py`) beside moshi 0.2.13's
`LMGen.step` (the baseline) on the tiny test model, B sessions per step; and the temporal
transformer's KV bytes per session at the released config (benchmarks/moshi_released_config.json).

    python benchmarks/moshi_lm_step.py [--frames 30] [--batches 1 8] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "models" / "moshi"))

from omnivox.models.moshi.config import MoshiConfig  # noqa: E402
from omnivox.models.moshi.lm_weights import load_lm  # noqa: E402


def _time_ours(model, codes: torch.Tensor) -> float:
    from lm_stage import LMStage
    stage = LMStage(model, block_size=16, pages=codes.shape[0] * 14)  # each session may hold 200 frames
    reqs = [stage.open() for _ in range(codes.shape[0])]
    total = 0.0
    for t in range(codes.shape[1]):
        for b, req in enumerate(reqs):
            stage.push(req, codes[b, t])
        start = time.perf_counter()
        stage.step()
        total += (time.perf_counter() - start) if t else 0.0  # the first frame untimed
    return total * 1000 / (codes.shape[1] - 1)


def _time_moshi(lm, codes: torch.Tensor) -> float:
    from moshi.models.lm import LMGen
    from moshi.utils.compile import no_compile
    gen = LMGen(lm, use_sampling=False)
    with no_compile(), gen.streaming(codes.shape[0]):
        gen.step(codes[:, 0, :, None])
        start = time.perf_counter()
        for t in range(1, codes.shape[1]):
            gen.step(codes[:, t, :, None])
    return (time.perf_counter() - start) * 1000 / (codes.shape[1] - 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=30)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tiny_lm import build_reference, save_checkpoint, user_codes
    lm = build_reference(seed=0)
    with tempfile.TemporaryDirectory() as d:
        ours = load_lm(save_checkpoint(Path(d), lm), dtype=torch.float32)
    print(f"tiny test LM (tests/models/moshi/tiny_lm.py), fp32 CPU, {args.threads} intra-op thread(s), "
          f"{args.frames} frames (first one untimed)")
    print(f"  {'B':>3}  {'omnivox ms/frame':>17}  {'moshi LMGen ms/frame':>21}")
    for b in args.batches:
        codes = user_codes(args.frames, b, seed=b)
        print(f"  {b:>3}  {_time_ours(ours, codes):>17.2f}  {_time_moshi(lm, codes):>21.2f}")
    cfg = MoshiConfig.from_json(json.loads((ROOT / "benchmarks" / "moshi_released_config.json").read_text()))
    t = cfg.transformer
    per_step = cfg.kv_bytes_per_step(2)
    print(f"released config: {t.num_layers} layers, {t.kv_heads} kv heads x {t.head_dim}, context {t.context} frames")
    print(f"  temporal KV per session: {per_step / 2**10:.0f} KiB per frame (bf16), "
          f"{per_step * t.context / 2**30:.2f} GiB for the full window ({t.context} frames = "
          f"{t.context * 0.08:.0f} s); fp32 doubles it")


if __name__ == "__main__":
    main()
