"""`omnivox bench`: in-process streaming-speech benchmark of any family. The family's workload
(`ServedModel.bench_workload`: its requests and its baselines) is run closed-loop at
concurrency C or open-loop with Poisson arrivals at rate R, baselines in the same run. Definitions
as in ANCHORS.md: TTFA = arrival -> first playable audio; RTF = wall time / audio seconds; a
chunk is on time if the audio received before it lasts longer than the time since the first
chunk. Audio seconds are counted at the sample rate actually produced (S2: 44.1 kHz).
"""
from __future__ import annotations

import argparse
import math

from omnivox.engine.measure import run_requests, summarize


def print_table(rows: list[dict]) -> None:
    """The side-by-side table, then each baseline compared with omnivox. A value that could not be
    measured prints as n/a, with a line under the table saying why. spec_len (the Thinker's mean
    acceptance length) is a column only when a row measured it (--speculative-config)."""
    cols = ["system", "ttfa_p50", "ttfa_p90", "rtf", "on_time", "no_stall", "audio_s_per_s", "wall"]
    cols += ["spec_len"] if any("spec_len" in r for r in rows) else []
    print("  ".join(f"{c:>14}" for c in cols))
    missing: dict[str, list[str]] = {}
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, math.nan)
            if not isinstance(v, str) and not math.isfinite(v):
                missing.setdefault(c, []).append(r["system"])
                v = "n/a"
            cells.append(f"{v:>14}" if isinstance(v, str) else f"{v:>14.3f}")
        print("  ".join(cells))
    for col, systems in missing.items():
        why = {"on_time": "every reply's audio came in one piece (not streamed): no chunk could be late",
               "rtf": "no audio was produced",
               "spec_len": "no speculative decoding (omnivox: --speculative-config)"}.get(col, "not measured")
        print(f"n/a: {col} of {', '.join(systems)}: {why}")
    base = next((r for r in rows if r["system"].startswith("omnivox")), None)
    for r in rows:
        if r is base or base is None:
            continue
        print(f"{base['system']} vs {r['system']}: TTFA p50 {_compare(base['ttfa_p50'], r['ttfa_p50'], True)}, "
              f"throughput {_compare(base['audio_s_per_s'], r['audio_s_per_s'], False)}, "
              f"RTF {_compare(base['rtf'], r['rtf'], True)}")


def _compare(mine: float, theirs: float, lower_is_better: bool) -> str:
    """"2.50x lower (better)": how `mine` stands against `theirs`, the factor always >= 1."""
    if not (math.isfinite(mine) and math.isfinite(theirs) and mine > 0 and theirs > 0):
        return "n/a"
    if mine == theirs:
        return "the same"
    factor = max(mine, theirs) / min(mine, theirs)
    lower = mine < theirs
    return f"{factor:.2f}x {'lower' if lower else 'higher'} ({'better' if lower == lower_is_better else 'worse'})"


def add_parser(sub) -> None:
    from omnivox.args import (COUNT, POSITIVE, SLOTS, add_gpu_memory_arg, add_quantization_args, first_chunk_arg, placement,
                              speculative_arg, subcommand)

    p = subcommand(sub, "bench", "streaming-speech benchmark (Qwen3-Omni: vs transformers; "
                                 "S2: vs omnivox one request at a time)")
    p.add_argument("--model", help="model folder (Qwen3-Omni or Fish S2), `fish-demo` or `qwen-demo` "
                                   "(default: the built-in Qwen3-Omni demo)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights' dtype")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    add_quantization_args(p)
    add_gpu_memory_arg(p)
    p.add_argument("--placement", type=placement, default=None, metavar="STAGE=DEVICE,...",
                   help="a device per stage (serve --help)")
    p.add_argument("--stage-loops", default="device", help="which stages step in which thread (serve --help)")
    p.add_argument("--tensor-parallel-size", type=COUNT, default=1, metavar="N", help="the Thinker over N processes")
    p.add_argument("--cpu-threads", type=COUNT, default=None,
                   help="torch intra-op threads on CPU for both systems (default: 1 for models under 100M parameters)")
    p.add_argument("--num-requests", type=COUNT, default=16, help="requests measured (after 2 warm-up requests)")
    p.add_argument("--concurrency", type=COUNT, default=8, help="closed loop: requests in flight")
    p.add_argument("--rate", type=POSITIVE, help="open loop: Poisson arrivals per second (overrides --concurrency)")
    p.add_argument("--prompt-tokens", type=COUNT, default=None,
                   help="prompt length (default 32 tokens; S2: words of text, default 12)")
    p.add_argument("--reply-tokens", type=COUNT, default=16, help="Thinker tokens per reply (Qwen3-Omni)")
    p.add_argument("--reply-frames", type=COUNT, default=25,
                   help="speech frames per reply (Qwen3-Omni: exactly, 80 ms; S2: at most, 21.5 Hz)")
    p.add_argument("--seed", type=SLOTS, default=0, help="seed of the prompts (and S2's sampling: seed + i)")
    p.add_argument("--first-chunk-frames", type=first_chunk_arg, default=None, metavar="{auto,1-25}",
                   help="codec frames in a reply's first audio chunk (default auto: see `omnivox serve --help`)")
    p.add_argument("--scheduling", choices=["slack", "fifo"], default="slack", help="the engine's policy (serve --help)")
    p.add_argument("--speculative-config", type=speculative_arg, default=None, metavar="JSON",
                   help="omnivox's Thinker speculation (serve --help); the table's spec_len is its mean acceptance "
                        "length (tokens a drafting row takes per Thinker step)")
    p.add_argument("--no-baseline", action="store_true", help="skip the baseline (transformers; S2: one at a time)")
    p.add_argument("--hf-batched-only", action="store_true",
                   help="Qwen3-Omni: only the batched transformers baseline (not one request at a time)")
    p.add_argument("--hf-experts", default="eager", help="transformers' experts implementation for the CPU "
                                                         "baseline (eager, or batched_mm / grouped_mm where it has them)")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from omnivox.engine.config import EngineConfig
    from omnivox.errors import OmnivoxError
    from omnivox.models.registry import load
    from omnivox.serving import describe_weight_bytes

    if args.first_chunk_frames is not None and not 1 <= args.first_chunk_frames <= 25:
        raise OmnivoxError("--first-chunk-frames must be within 1-25")
    cfg = EngineConfig(max_running=args.concurrency, max_queue=args.num_requests,
                       first_chunk_frames=args.first_chunk_frames, scheduling=args.scheduling,
                       stage_loops=args.stage_loops, speculative=args.speculative_config)
    model = load(args.model, dtype=args.dtype, device=args.device, engine_config=cfg, cpu_threads=args.cpu_threads,
                 progress=False, placement=args.placement, tensor_parallel_size=args.tensor_parallel_size,
                 quantization=args.quantization, fp8_compute=args.fp8_compute,
                 gpu_memory_utilization=args.gpu_memory_utilization)
    work = model.bench_workload(args)
    print(f"model {model.folder} ({model.family.label}, {args.dtype}, {args.device}, {torch.get_num_threads()} CPU "
          f"threads for every system); {args.num_requests} requests, {_mode(args)}; {work.describe()}; "
          f"{describe_weight_bytes(model.weight_bytes())}", flush=True)
    try:
        run_requests(work.submit, min(2, args.num_requests), 2, None, args.seed)  # warm-up
        res, wall = run_requests(work.submit, args.num_requests, args.concurrency, args.rate, args.seed)
        stats = model.engine.stats()
        rows = [summarize("omnivox", res, wall)]
        thinker = stats.stages.get("thinker")
        if thinker is not None and thinker.verified:
            rows[0]["spec_len"] = thinker.mean_accepted_length
        for name, run in ([] if args.no_baseline else work.baselines()):  # some baselines use the engine
            got = run()
            if got is None:
                print(f"{name}: not available (transformers is not installed)")
                continue
            rows.append(summarize(name, *got))
    finally:
        model.close()
    print_table(rows)
    audio = sum(r.audio_seconds for r in res)
    batches = ", ".join(f"{s} mean batch {stats.stages[s].mean_batch:.1f}" for s in work.stages if s in stats.stages)
    print(f"audio: {audio:.3f} s in total ({audio / max(len(res), 1):.3f} s per request); engine: {batches}, "
          f"preemptions {stats.preemptions}")
    thinker = stats.stages.get("thinker")
    if thinker is not None and thinker.draft_method:
        print(f"speculation ({thinker.draft_method}): {thinker.drafted} ids drafted, {thinker.draft_accepted} confirmed, "
              f"mean acceptance length {thinker.mean_accepted_length:.2f}")
    return 0


def _mode(args: argparse.Namespace) -> str:
    return f"Poisson {args.rate}/s" if args.rate is not None else f"closed loop, concurrency {args.concurrency}"
