"""Prompt-lookup speculative decoding of the Thinker, on and off: Thinker tokens per step and aten
ops (and CPU ms) per accepted token, on the demo model and the real-depth narrow one
(`step_cost.ensure_checkpoint`), for a repetitive prompt ("repeat this paragraph") and a
non-repetitive one; then the same at larger batches, where speculation should stop paying
(`disable_by_batch_size` is set out of reach here so every batch drafts). Both models have random
weights and copy nothing, so prompt lookup rarely hits; the "oracle" columns draft what the model
will say (the run with speculation off), the ceiling a model that repeats its input approaches.

Text only, greedy, `ignore_eos`, eager fp32 on one CPU thread; the Thinker stage's `step` is
wrapped: ops counted by a TorchDispatchMode on one run, CPU time (`time.thread_time`) on another.
Outputs are checked equal on and off. Not a test: prints one table.

    python benchmarks/speculative.py [--tokens 48] [--batches 1 4 16] [--models demo narrow]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PARAGRAPH = ("The quick brown fox jumps over the lazy dog near the river bank, while the old farmer "
             "watches the sun go down behind the hills and counts his sheep one by one.")
PROMPTS = {"repetitive": f"Repeat this paragraph word for word: {PARAGRAPH} {PARAGRAPH}",
           "plain": "Tell me something new about the weather in a city you have never seen."}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
        "disable_by_batch_size": 1 << 30}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _meter(omni, count: bool) -> dict:
    """Wrap the Thinker stage's step: steps, ops (count) or CPU seconds (time)."""
    stage = omni.engine.stages.stages["thinker"]
    inner, m = stage.step, {"steps": 0, "ops": 0, "cpu": 0.0}

    def step():
        m["steps"] += 1
        if count:
            with _Ops() as c:
                out = inner()
            m["ops"] += c.n
            return out
        t = time.thread_time()
        out = inner()
        m["cpu"] += time.thread_time() - t
        return out
    stage.step = step
    return m


def run(folder, spec, prompt: str, batch: int, tokens: int, oracle: list[int] | None = None) -> dict:
    from omnivox import Omni
    reqs = [dict(messages=[{"role": "user", "content": prompt}], greedy=True, max_tokens=tokens, ignore_eos=True,
                 return_audio=False) for _ in range(batch)]
    row = {}
    for count in (True, False):
        omni = Omni(model=folder, progress=False, speculative_config=spec)
        try:
            omni.generate(reqs[:1] if batch == 1 else reqs)  # warm-up (also the prefix cache: both sides)
            if oracle is not None:  # every row says `oracle` (same prompt, greedy): draft it
                P = len(omni.prepare([{"role": "user", "content": prompt}]).ids)
                omni.engine.stages.stages["thinker"].adapter.drafter.lookup = lambda ids, k: oracle[len(ids) - P:][:k]
            m = _meter(omni, count)
            outs = omni.generate(reqs)
            st = omni.engine.stats().stages["thinker"]
        finally:
            omni.close()
        n = sum(len(o.text_ids) for o in outs)
        row.update(ids=[o.text_ids for o in outs], tokens=n, steps=m["steps"])
        if count:
            row["ops_per_token"] = m["ops"] / n
        else:
            row["ms_per_token"] = 1e3 * m["cpu"] / n
        row["mean_len"] = st.mean_accepted_length
    row["tokens_per_step"] = row["tokens"] / row["steps"]  # per Thinker step, over the batch
    return row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--models", nargs="+", default=["demo", "narrow"], choices=["demo", "narrow"])
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from omnivox.models.qwen3_omni.demo import demo_model_path
    from step_cost import ensure_checkpoint
    folders = {"demo": lambda: demo_model_path(), "narrow": lambda: ensure_checkpoint()}
    print(f"{'model':7} {'prompt':10} {'B':>3} | {'tok/step off':>12} {'on':>6} | {'ops/tok off':>11} {'on':>7} | "
          f"{'cpu ms/tok off':>14} {'on':>7} | mean len | oracle: tok/step ops/tok ms/tok | same ids", flush=True)
    for name in a.models:
        folder = folders[name]()
        for kind, prompt in PROMPTS.items():
            for b in a.batches if kind == "repetitive" else a.batches[:1]:
                off, on = run(folder, None, prompt, b, a.tokens), run(folder, SPEC, prompt, b, a.tokens)
                orc = run(folder, SPEC, prompt, b, a.tokens, oracle=off["ids"][0])
                same = off["ids"] == on["ids"] == orc["ids"]
                print(f"{name:7} {kind:10} {b:>3} | {off['tokens_per_step'] / b:>12.2f} {on['tokens_per_step'] / b:>6.2f} | "
                      f"{off['ops_per_token']:>11.0f} {on['ops_per_token']:>7.0f} | {off['ms_per_token']:>14.2f} "
                      f"{on['ms_per_token']:>7.2f} | {on['mean_len']:>8.2f} | {orc['tokens_per_step'] / b:>15.2f} "
                      f"{orc['ops_per_token']:>7.0f} {orc['ms_per_token']:>6.2f} | {same}", flush=True)


if __name__ == "__main__":
    main()
