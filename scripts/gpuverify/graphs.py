"""Phase graphs: CUDA-graph replay equals eager, for every batch-size bucket (`omnivox.stages.graphs`).

For each bucket B the same B speech requests (seeded, `ignore_eos`, all submitted in one engine
step, so both runs schedule identical steps with no padding rows) run through an engine with CUDA
graphs (`cuda_graphs="auto"`, every bucket captured first by `StageGraph.warmup`) and one without
("off"); text ids, codec codes and audio are compared, and the replay counts show that the
Thinker, Talker + code predictor and vocoder decode steps all replayed.

  fp32_exact  a model of the released structure at tens of width (`sizes.narrow`; `--tiny`: the
              tiny one), fp32, on the device: replay must equal eager exactly, every bucket
  bf16        the built full-size model in bf16: equal counts, the first frame that differs, and
              eager vs graph ms/step. NOTE: not required to be equal: a captured step attends over
              its block table's fixed width (`build_metadata(width=...)`), which can round
              differently in bf16 (torch_ref does: one ulp flips a near-tie and greedy runs part)
On CPU (`--tiny`) the runner's `FakeGraph` stands in for the capture.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from gpuverify.runner import Box, State

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def graphs(box: Box, st: State) -> bool:
    from gpuverify import sizes
    from gpuverify.build import build_qwen

    r = box.results
    buckets = [b for b in BUCKETS if b <= st.sizes.work.loop_concurrency] or [1]
    config = sizes.narrow().qwen_config if st.sizes.name == "full" else st.sizes.qwen_config
    small, _ = build_qwen(config, torch.float32, st.device, seed=1)
    r["fp32_exact"] = compare_buckets(box, small, st, buckets, kv_mb=256.0)
    del small
    ok = all(c["ok"] for c in r["fp32_exact"]["buckets"].values()) and r["fp32_exact"]["all_replayed"]
    if st.qwen is not None:
        box.check("bf16, the built model")
        r["bf16"] = compare_buckets(box, st.qwen, st, buckets, kv_mb=4096.0)
        ok &= r["bf16"]["all_replayed"]
    return ok


def compare_buckets(box: Box, model, st: State, buckets: list[int], kv_mb: float) -> dict:
    from omnivox.engine.config import EngineConfig
    from omnivox.engine.engine import Engine
    from omnivox.models.qwen3_omni.stages.graph import build

    def make(graphs_mode: str):
        cfg = EngineConfig(max_running=max(buckets), kv_cache_mb=min(kv_mb, st.sizes.engine_kv_mb), token_budget=4096,
                           cuda_graphs=graphs_mode, graph_buckets=tuple(buckets))
        return Engine(build(model, cfg), cfg)

    eager, graphed = make("off"), make("auto" if st.device.startswith("cuda") else "fake")
    out: dict = {"buckets": {}}
    try:
        t0 = time.monotonic()
        out["capture"] = graphed.stages.warmup()
        out["capture_s"] = round(time.monotonic() - t0, 2)
        for b in buckets:
            box.check(f"bucket {b}")
            want, t_eager, steps = _run(eager, model, st.device, b)
            got, t_graph, _ = _run(graphed, model, st.device, b)
            case = _compare(want, got)
            case.update(steps=steps, eager_ms_per_step=round(1e3 * t_eager / max(steps, 1), 2),
                        graph_ms_per_step=round(1e3 * t_graph / max(steps, 1), 2))
            out["buckets"][f"B={b}"] = case
        out["replays"] = {n: s.graphs.replays for n, s in graphed.stages.stages.items() if getattr(s, "graphs", None)}
        out["all_replayed"] = bool(out["replays"]) and all(out["replays"].values())
    finally:
        eager.shutdown()
        graphed.shutdown()
    return out


def _run(engine, model, device: str, b: int):
    """b speech requests submitted in one step -> ([(Finished, audio)], wall s, Talker steps)."""
    from gpuverify.workload import qwen_prompt, queue_request, speech_options
    from omnivox.engine.events import AudioChunk, Finished
    from omnivox.models.qwen3_omni.bench import prompts

    ps = prompts(model.cfg, b, 24, seed=100 + b)
    opts = speech_options(model.cfg, 6, 6)
    before = engine.stats().stages.get("talker")
    steps0 = before.steps if before else 0
    t0 = time.monotonic()
    with engine._lock:  # NOTE: held so that the engine admits all b in one step, in both runs
        handles = [queue_request(engine, qwen_prompt(p), opts) for p in ps]
    outs = []
    for h in handles:
        audio, fin = [], None
        for ev in h:
            if isinstance(ev, AudioChunk):
                audio.append(ev.samples)
            elif isinstance(ev, Finished):
                fin = ev
        outs.append((fin, np.concatenate(audio) if audio else np.zeros(0, np.float32)))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return outs, time.monotonic() - t0, engine.stats().stages["talker"].steps - steps0


def _compare(want, got) -> dict:
    text = sum(a.text_ids == b.text_ids for (a, _), (b, _) in zip(want, got))
    codes = sum(np.array_equal(a.codes, b.codes) for (a, _), (b, _) in zip(want, got))
    first = [_first_difference(a.codes, b.codes) for (a, _), (b, _) in zip(want, got)]
    same_len = all(wa.shape == wb.shape for (_, wa), (_, wb) in zip(want, got))
    audio = max(float(np.abs(wa - wb).max(initial=0.0)) for (_, wa), (_, wb) in zip(want, got)) if same_len else None
    n = len(want)
    return {"requests": n, "text_equal": text, "codes_equal": codes, "first_frame_differing": min(first),
            "frames": int(want[0][0].codes.shape[0]), "audio_max_abs_diff": audio,
            "ok": text == n and codes == n and audio is not None and audio <= 1e-4}


def _first_difference(a: np.ndarray, b: np.ndarray) -> int:
    """First frame index where the codes differ (the frame count when none does)."""
    n = min(len(a), len(b))
    rows = np.nonzero((a[:n] != b[:n]).any(axis=1))[0]
    return int(rows[0]) if rows.size else (n if len(a) == len(b) else n)
