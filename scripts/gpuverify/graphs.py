"""Phase graphs: CUDA-graph replay equals eager, for every batch-size bucket (`omnivox.stages.graphs`).

For each bucket B the same B speech requests (seeded, `ignore_eos`, all submitted in one engine
step, so both runs schedule identical steps with no padding) run through an engine with CUDA graphs
(`cuda_graphs="auto"`, every bucket captured first by `StageGraph.warmup`) and one without ("off");
text ids, codec codes and audio must be equal. The Thinker, Talker + code predictor and vocoder
decode steps all replay; the replay counts prove it. Wall time per step of each run gives
eager vs graph ms/step. On CPU (`--tiny`) the runner's `FakeGraph` stands in for the capture.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from gpuverify.runner import Box, Skip, State

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def graphs(box: Box, st: State) -> bool:
    try:
        from omnivox.stages.graphs import GraphRunner  # noqa: F401
    except ImportError:
        raise Skip("no graph runner in this checkout") from None
    if st.qwen is None:
        raise Skip("no model: the build phase did not finish")
    from omnivox.engine.config import EngineConfig

    w, r = st.sizes.work, box.results
    buckets = [b for b in BUCKETS if b <= w.loop_concurrency] or [1]
    mode = "auto" if st.device.startswith("cuda") else "fake"

    def make(graphs_mode: str):
        cfg = EngineConfig(max_running=max(buckets), kv_cache_mb=st.sizes.engine_kv_mb, token_budget=4096,
                           cuda_graphs=graphs_mode, graph_buckets=tuple(buckets))
        from omnivox.engine.engine import Engine
        from omnivox.models.qwen3_omni.stages.graph import build
        return Engine(build(st.qwen, cfg), cfg)

    eager, graphed = make("off"), make(mode)
    ok = True
    try:
        t0 = time.monotonic()
        r["capture"] = graphed.stages.warmup()
        r["capture_s"] = round(time.monotonic() - t0, 2)
        for b in buckets:
            box.check(f"bucket {b}")
            want, t_eager, steps = _run(eager, st, b)
            got, t_graph, steps_g = _run(graphed, st, b)
            case = _compare(want, got)
            case.update(eager_ms_per_step=round(1e3 * t_eager / max(steps, 1), 2),
                        graph_ms_per_step=round(1e3 * t_graph / max(steps_g, 1), 2), steps=steps)
            r[f"B={b}"] = case
            ok &= case["ok"]
        replays = {n: s.graphs.replays for n, s in graphed.stages.stages.items() if getattr(s, "graphs", None)}
        r["replays"] = replays
        ok &= bool(replays) and all(replays.values())
    finally:
        eager.shutdown()
        graphed.shutdown()
    return ok


def _run(engine, st: State, b: int):
    """b speech requests submitted in one step -> (Finished events with audio, wall s, talker steps)."""
    from gpuverify.speed import _prompt, speech_options
    from omnivox.engine.events import AudioChunk, Finished
    from omnivox.models.qwen3_omni.bench import prompts

    ps = prompts(st.qwen.cfg, b, 24, seed=100 + b)
    opts = speech_options(st.qwen.cfg, 6, 6)
    before = engine.stats().stages.get("talker")
    steps0 = before.steps if before else 0
    t0 = time.monotonic()
    with engine._lock:  # NOTE: held so that the engine admits all b in one step, in both runs
        handles = [engine.submit(_prompt(p), opts) for p in ps]
    outs = []
    for h in handles:
        audio, fin = [], None
        for ev in h:
            if isinstance(ev, AudioChunk):
                audio.append(ev.samples)
            elif isinstance(ev, Finished):
                fin = ev
        outs.append((fin, np.concatenate(audio) if audio else np.zeros(0, np.float32)))
    wall = time.monotonic() - t0
    if st.device.startswith("cuda"):
        torch.cuda.synchronize()
    return outs, wall, engine.stats().stages["talker"].steps - steps0


def _compare(want, got) -> dict:
    text = sum(a.text_ids == b.text_ids for (a, _), (b, _) in zip(want, got))
    codes = sum(np.array_equal(a.codes, b.codes) for (a, _), (b, _) in zip(want, got))
    audio = max((float(np.abs(wa - wb).max()) if wa.shape == wb.shape and wa.size else
                 (0.0 if wa.shape == wb.shape else float("inf"))) for (_, wa), (_, wb) in zip(want, got))
    n = len(want)
    return {"requests": n, "text_equal": text, "codes_equal": codes, "audio_max_abs_diff": audio,
            "frames": int(want[0][0].codes.shape[0]), "ok": text == n and codes == n and audio <= 1e-3}
