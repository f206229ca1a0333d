"""Full-duplex frame step time on the moshi-demo checkpoint: one engine step of omnivox's Moshi
stage graph (Mimi's encoder stage -> the paged LM stage -> Mimi's vocoder stage, B sessions each
pushed one frame before the step, as `open_duplex` feeds them) beside moshi 0.2.13's plain
streaming loop over the same folder (the baseline, loaded by moshi's own `CheckpointInfo`),
greedy, fp32 CPU, in the same process.

    python benchmarks/duplex_step.py [--frames 20] [--batches 1 8 32] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from omnivox.engine.config import EngineConfig  # noqa: E402
from omnivox.models.moshi.demo import moshi_demo_path  # noqa: E402
from omnivox.models.moshi.served import MoshiServed  # noqa: E402
from omnivox.models.moshi.step_timing import frame_step_seconds  # noqa: E402

F = 1920


def _time_moshi(lm, mimi, pcm: torch.Tensor) -> float:
    from moshi.models.lm import LMGen
    from moshi.utils.compile import no_compile
    gen, b = LMGen(lm, use_sampling=False), pcm.shape[0]
    with no_compile(), torch.no_grad(), mimi.streaming(b), gen.streaming(b):
        start = None
        for t in range(pcm.shape[1]):
            if t == 1:
                start = time.perf_counter()
            out = gen.step(mimi.encode(pcm[:, t, None]))
            if out is not None:
                mimi.decode(out[:, 1:])
    return (time.perf_counter() - start) * 1000 / (pcm.shape[1] - 1)


def _moshi_reference(folder: Path):
    from moshi.models import loaders
    here = os.getcwd()
    os.chdir(folder)  # hf_repo None: moshi reads mimi_config_name relative to the working directory
    try:
        info = loaders.CheckpointInfo.from_hf_repo(None, moshi_weights=folder / "model.safetensors",
                                                   mimi_weights=folder / "mimi.safetensors",
                                                   tokenizer=folder / "tokenizer.model",
                                                   config_path=folder / "config.json")
        return info.get_moshi(device="cpu", dtype=torch.float32), info.get_mimi(device="cpu")
    finally:
        os.chdir(here)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=20)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = moshi_demo_path()
    served = MoshiServed(folder, engine_config=EngineConfig(max_running=max(args.batches), kv_cache_mb=64))
    lm, mimi = _moshi_reference(folder)
    print(f"moshi-demo ({folder.name}), fp32 CPU, {args.threads} intra-op thread(s), {args.frames} frames "
          f"(first one untimed); a frame is 80 ms of audio")
    print(f"  {'B':>3}  {'omnivox ms/frame':>17}  {'moshi loop ms/frame':>20}  {'omnivox ms/session-frame':>25}")
    for b in args.batches:
        g = torch.Generator().manual_seed(b)
        pcm = 0.1 * torch.randn(b, args.frames, F, generator=g)
        steps = frame_step_seconds(served, pcm)
        ours = sum(steps) * 1000 / len(steps)
        print(f"  {b:>3}  {ours:>17.2f}  {_time_moshi(lm, mimi, pcm):>20.2f}  {ours / b:>25.3f}")


if __name__ == "__main__":
    main()
