"""Speculative decoding of the Thinker on the demo model, by method: none, repeat-last (the last id
k times: the floor any drafter should beat), n-gram (prompt lookup), DFlash and EAGLE-3 (the demo's
trained draft and head, one script, the same data and steps), at batch sizes 1, 4 and 16 and
temperatures 0 and 0.7 (seeded), on held-out prompts (`scripts/train_demo_draft.py` word prompts
of another seed than its training ones).

Per run: the mean acceptance length (tokens a decoding row takes per Thinker step: 1 + confirmed
drafts, 1 where it drafted nothing) over all decode steps and over the steps outside loops (a step
whose sequence's last 8 tokens have a period <= 4 is in a loop: the random demo falls into loops,
where any drafter scores), the confirmation rate per draft position (outside loops), Thinker tokens
per step per row, and CPU ms per token (`time.thread_time` around the Thinker stage's step; one
CPU thread). Outputs are checked equal to speculation off. Not a test: prints one table and
writes it to benchmarks/results/speculative_demo_cpu.{txt,json}.

    python benchmarks/speculative.py [--tokens 64] [--batches 1 4 16] [--k 7]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

HELD_OUT_SEED = 1
METHODS = ("none", "repeat-last", "ngram", "dflash", "eagle3")


def held_out_prompts(n: int = 16) -> list[str]:
    """The benchmarks' prompts: the training script's word salads, of a seed it never trains on."""
    from train_demo_draft import word_prompts
    return word_prompts(n, HELD_OUT_SEED)


def in_loop(ids: list[int], span: int = 8, period: int = 4) -> bool:
    """Do the last `span` ids repeat with a period of at most `period`?"""
    tail = ids[-span:]
    return len(tail) == span and any(all(tail[i] == tail[i - p] for i in range(p, span)) for p in range(1, period + 1))


def _spec(method: str, k: int) -> dict | None:
    base = {"num_speculative_tokens": k, "disable_by_batch_size": 1 << 30}
    if method == "none":
        return None
    if method in ("dflash", "eagle3"):
        return {"method": method, "model": "demo", **base}
    return {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4, **base}


def _record(omni, steps: list) -> None:
    """Wrap the Thinker adapter's `apply`: per decoding row and step (in loop, drafted, taken)."""
    adapter = omni.engine.stages.stages["thinker"].adapter
    inner = adapter.apply

    def apply(batch, out):
        rows = [(batch.rows[i], in_loop(list(batch.rows[i].req.prompt.ids) + batch.rows[i].req.text_ids))
                for i in batch.sampled]
        result = inner(batch, out)
        for (r, loop), i in zip(rows, batch.sampled):
            if r.req.text_ids and r.start >= r.req.prompt_tokens:
                steps.append((loop, len(r.draft), result.accepted[i]))
        return result
    adapter.apply = apply


def run(method: str, prompts: list[str], batch: int, temperature: float, tokens: int, k: int) -> dict:
    from omnivox import Omni
    omni = Omni(progress=False, speculative_config=_spec(method, k))
    try:
        if method == "repeat-last":
            omni.engine.stages.stages["thinker"].adapter.drafter.lookup = lambda ids, n: [ids[-1]] * n
        sampling = dict(greedy=True) if temperature == 0 else dict(temperature=temperature)
        reqs = [dict(messages=[{"role": "user", "content": p}], max_tokens=tokens, ignore_eos=True, return_audio=False,
                     seed=1000 + i, **sampling) for i, p in enumerate(prompts)]
        omni.generate(reqs[:1])  # warm-up
        steps: list = []
        _record(omni, steps)
        stage = omni.engine.stages.stages["thinker"]
        inner, clock = stage.step, {"cpu": 0.0, "steps": 0}

        def step():
            t = time.thread_time()
            out = inner()
            clock["cpu"] += time.thread_time() - t
            clock["steps"] += 1
            return out
        stage.step = step
        outs = [o for i in range(0, len(reqs), batch) for o in omni.generate(reqs[i:i + batch])]
    finally:
        omni.close()
    n = sum(len(o.text_ids) for o in outs)
    free = [s for s in steps if not s[0]]
    width = max([d for _, d, _ in steps] + [0])
    per_pos = [np.mean([t - 1 > j for _, d, t in free if d > j]) if any(d > j for _, d, _ in free) else float("nan")
               for j in range(width)]
    return {"method": method, "batch": batch, "temperature": temperature, "ids": [o.text_ids for o in outs],
            "mean_len": float(np.mean([t for _, _, t in steps])), "mean_len_outside_loops": float(np.mean([t for _, _, t in free])),
            "outside_share": len(free) / len(steps), "per_position": [round(float(p), 3) for p in per_pos],
            "tokens_per_step": n / clock["steps"] / batch, "ms_per_token": 1e3 * clock["cpu"] / n}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--k", type=int, default=7, help="ids drafted per step (DFlash: at most block_size - 1 = 7)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "speculative_demo_cpu")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    prompts = held_out_prompts()
    lines = [f"# python benchmarks/speculative.py --tokens {a.tokens} --k {a.k}: demo model, held-out prompts, CPU, "
             f"{time.strftime('%Y-%m-%d')}",
             f"{'method':12} {'B':>3} {'temp':>4} | {'mean len':>8} {'outside loops':>13} {'(share)':>7} | "
             f"{'tok/step':>8} {'cpu ms/tok':>10} | same ids | confirmed per draft position (outside loops)"]
    print("\n".join(lines), flush=True)
    results = []
    for temperature in (0.0, 0.7):
        for b in a.batches:
            chosen = prompts[:max(b, 4)]  # B = 1: four prompts one after another
            base = None
            for method in METHODS:
                r = run(method, chosen, b, temperature, a.tokens, a.k)
                base = base or r["ids"]
                r["same_ids"] = r.pop("ids") == base
                results.append(r)
                line = (f"{method:12} {b:>3} {temperature:>4} | {r['mean_len']:>8.2f} {r['mean_len_outside_loops']:>13.2f} "
                        f"{r['outside_share']:>7.2f} | {r['tokens_per_step']:>8.2f} {r['ms_per_token']:>10.2f} | "
                        f"{str(r['same_ids']):>8} | {' '.join(f'{x:.2f}' for x in r['per_position'])}")
                lines.append(line)
                print(line, flush=True)
    a.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    a.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
