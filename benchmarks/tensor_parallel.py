"""The Thinker at tensor-parallel size 1 beside 2 (or more), same workload, one run.

    python benchmarks/tensor_parallel.py                    # the built-in demo, TP 1 and 2, on CPU (gloo)
    python benchmarks/tensor_parallel.py --model narrow     # the released depth at tens of width (step_cost.py's)
    python benchmarks/tensor_parallel.py --sizes 1 2 --requests 8 --tokens 64 --prompt-tokens 256
    python benchmarks/tensor_parallel.py --model DIR --device cuda:0 --dtype bfloat16   # 2 GPUs: cuda:0, cuda:1 (NCCL)

Workload: distinct prompts of `--prompt-tokens` tokens, text replies of exactly `--tokens` tokens
(greedy, ends ignored), all submitted at once to a fresh engine (fifo) after one warm-up request.
Per size: wall seconds, ms per Thinker step (wall / the Thinker's steps), output tokens/s, and the
bytes the driver broadcast per step (the step's packed inputs and metadata, pickled).

On CPU the ranks are processes on the same 2 cores and every collective crosses a socket: slower
than one process is expected; this shows what the plumbing costs, not what several GPUs give.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(size: int, args) -> dict:
    from omnivox import Omni
    from omnivox.engine.config import EngineConfig

    omni = Omni(args.folder, dtype=args.dtype, device=args.device, progress=False, tensor_parallel_size=size,
                engine_config=EngineConfig(scheduling="fifo", max_running=64))
    vocab = omni.cfg.thinker.text.vocab_size
    try:
        def request(i: int) -> dict:
            user = [(1000 + 131 * i + 7 * k) % (vocab - 2000) + 1000 for k in range(args.prompt_tokens)]
            return dict(prompt_ids=_chat(omni, user), max_tokens=args.tokens, return_audio=False, greedy=True, ignore_eos=True)

        omni.generate([request(10_000)])  # warm-up
        before = omni.engine.stats().stages["thinker"].steps
        sent = omni.tp.sent_total if omni.tp else 0
        start = time.perf_counter()
        outs = omni.generate([request(i) for i in range(args.requests)])
        wall = time.perf_counter() - start
        steps = omni.engine.stats().stages["thinker"].steps - before
        sent = (omni.tp.sent_total - sent) if omni.tp else 0
    finally:
        omni.close()
    tokens = sum(len(o.text_ids) for o in outs)
    return {"tp": size, "wall_s": wall, "steps": steps, "ms_per_step": 1000 * wall / max(steps, 1),
            "tokens_per_s": tokens / wall, "bytes_per_step": sent / max(steps, 1)}


def _chat(omni, user: list[int]) -> list[int]:
    """A chat prompt around `user` ids (the tokenizer's turn markers)."""
    cfg = omni.cfg
    nl = omni.tokenizer.encode("\n")
    return ([cfg.im_start_token_id, cfg.user_token_id, *nl, *user, cfg.im_end_token_id, *nl,
             cfg.im_start_token_id, cfg.assistant_token_id, *nl])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder, or `narrow`: the released Thinker's depth at "
                                                 "tens of width (step_cost.py's checkpoint, built on first use; "
                                                 "default: the built-in demo)")
    p.add_argument("--device", default="cpu", help="the Thinker's device (on CUDA rank r takes the r-th next one)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    import torch
    args.folder = args.model
    if args.model == "narrow":
        from step_cost import ensure_checkpoint
        args.folder = ensure_checkpoint()
    print(f"{args.requests} requests, prompt {args.prompt_tokens} tokens, reply {args.tokens} tokens; "
          f"{torch.get_num_threads()} intra-op thread(s) in the driver")
    print(f"  {'TP':>3} {'wall s':>7} {'steps':>6} {'ms/step':>8} {'tokens/s':>9} {'bytes/step':>11}")
    rows = []
    for size in args.sizes:
        r = run(size, args)
        rows.append(r)
        print(f"  {r['tp']:3d} {r['wall_s']:7.2f} {r['steps']:6d} {r['ms_per_step']:8.2f} {r['tokens_per_s']:9.1f} "
              f"{r['bytes_per_step']:11.0f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
