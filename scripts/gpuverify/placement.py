"""Phase placement: the Thinker on the GPU and the Talker + vocoder on the CPU (the second device
this machine has), against everything on the GPU (`omnivox.engine.placement`).

Three engines over the same seeded weights (each model built straight into its placement, per
stage, as the loader does, so both builds hold the same values; fp32):
  one_device  every stage on the GPU, one loop (the engine as served on one device)
  serial      placed, `stage_loops="one"`: every stage stepped in turn by one thread
  overlapped  placed, `stage_loops="device"`: the Thinker's loop and the CPU's (Talker + vocoder)
              step at once, joined every step

Equality: the same greedy speech requests (submitted in one engine step, `ignore_eos`, so every run
computes the same rows) through each. serial and overlapped must be exactly equal (text ids, codes;
audio within 1e-4, reported). Against one_device the text ids must be equal (the Thinker computes
on the same device); the codes are reported as the share of equal frames only: the Talker computes
on another device, where a float difference may flip a greedy pick.

Overlap: one load (N speech requests at once, as many Thinker tokens as frames, so both loops
have work nearly every step) through each engine, every engine step timed, and each stage's step in
the serial run: ms/step of one_device, serial and overlapped, overlap = 1 - overlapped / serial, and
the ideal overlap of that stage balance (the smaller side over the sum). Two loops take a step more
for the same load (the Talker reads a Thinker token one step later): `load_s`, the steps' seconds in
all, is beside the ms/step. `crossing_ms_per_step`: the time the Talker spent in its hand-overs from
the Thinker's device (each frame's word-embedding rows: a lookup and a copy on the GPU's default
stream, which the Thinker's own kernels may hold up while both loops run). NOTE: the CPU side's
Python holds the GIL the GPU loop also needs for its launches: this measures, it does not promise.

Size (`model_config`): on the GPU the Thinker of the narrow configuration (`sizes.narrow`: the
released 48 layers x 128 experts at tens of width), its decode steps replaying CUDA graphs as served
(the demo-sized Thinker would be a handful of launches, nothing to overlap; the full-size one in
fp32, ~120 GB, does not fit beside the built model), and a Talker + vocoder at the same widths with
their depths cut (TALKER_DEPTH: Talker 4 layers, code predictor 1 layer, Code2Wav 2 layers; the
upsampling stack as released). Measured on the 2-core CPU VM (one thread, 8 requests, 40
frames): Talker + vocoder 43 ms a step uncut (the code predictor's 15 sequential inner steps x 5
layers dominate), 20 ms cut; the narrow Thinker's replayed step is estimated at a few ms (48 layers
of ~30 small kernels + the step's host work). Cut, both sides are the same order of time, so an
overlap can show; the results give each stage's ms/step and `ideal_overlap`, from which a GPU run
says how to retune TALKER_DEPTH.

CPU threads (`cpu_threads`): half the cores, at most 8, for the phase (restored after; set before any
engine thread starts, and every thread takes the count at its first parallel op, so the serial and
overlapped runs reduce alike): at tens of width the Talker's ops are below torch's intra-op grain
but for the vocoder's convolutions, and the other cores stay free for the Thinker loop's host thread
(launches, replays) and the request threads.

With --tiny (CPU): the demo-sized model, every stage on the CPU, and the overlapped engine splits
its loops explicitly ("thinker,talker+vocoder", two loops on one device), a small load: the same
code and the same result keys in a few seconds; the timings there mean nothing (2 cores, one GIL).
"""
from __future__ import annotations

import contextlib
import copy
import gc
import os
import threading
import time
from collections import defaultdict

import numpy as np
import torch

from gpuverify.runner import Box, State

CPU = "cpu"
AUDIO_ATOL = 1e-4  # serial vs overlapped audio: the same computations, so 0 is expected
# The Talker side's depths on the GPU run (the narrow widths kept): see the module docstring.
TALKER_DEPTH = {
    "talker_config": {"text_config": {"num_hidden_layers": 4},
                      "code_predictor_config": {"num_hidden_layers": 1, "layer_types": ["full_attention"]}},
    "code2wav_config": {"num_hidden_layers": 2},
}
# (requests, prompt tokens, Thinker tokens, frames)
WORK = {"gpu": {"equality": (4, 24, 24, 40), "load": (8, 24, 40, 40)},
        "tiny": {"equality": (3, 24, 6, 8), "load": (3, 24, 8, 8)}}
HUNG_S = 30.0  # after the deadline, how long cancelled requests may take to end


def placement(box: Box, st: State) -> bool:
    r = box.results
    gpu = st.device.startswith("cuda")
    dev = str(torch.empty(0, device=st.device).device)  # "cuda" -> "cuda:0": the devices compare equal
    other = CPU  # the second device: this machine has one GPU
    where = {"thinker": dev, "talker": other, "vocoder": other}
    one = {name: dev for name in where}
    split = "device" if gpu else "thinker,talker+vocoder"  # on CPU: two loops on the one device
    work = WORK["gpu" if gpu else "tiny"]
    config, r["model"] = model_config(st)
    before = torch.get_num_threads()
    threads = max(1, min(8, (os.cpu_count() or 2) // 2))
    r.update(dtype="float32", devices=where, stage_loops={"serial": "one", "overlapped": split},
             cpu_threads=threads, workload={k: dict(zip(("requests", "prompt", "tokens", "frames"), v))
                                            for k, v in work.items()})
    runs = r["runs"] = {}
    out: dict = {}
    torch.set_num_threads(threads)  # before any engine thread starts: each takes it at its first parallel op
    try:
        model, runs["build_placed_s"] = build_placed(config, where)
        for name, loops in (("serial", "one"), ("overlapped", split)):
            box.check(name)
            out[name] = run_engine(box, model, st, loops, work, runs.setdefault(name, {}))
        del model
        _free(st.device)
        r["equality"] = compare(out["serial"]["equality"], out["overlapped"]["equality"])
        r["overlap"] = overlap(out)
        box.check("one_device")
        model, runs["build_one_s"] = build_placed(config, one)
        out["one_device"] = run_engine(box, model, st, "one", work, runs.setdefault("one_device", {}))
        del model
        _free(st.device)
    finally:
        torch.set_num_threads(before)
    r["vs_one_device"] = against_one_device(out["one_device"]["equality"], out["serial"]["equality"])
    r["overlap"] = overlap(out)
    v = r["vs_one_device"]
    return (r["equality"]["ok"] and v["text_equal"] == v["requests"]
            # the encoder (it only feeds the Thinker) steps first in the Thinker's loop
            and runs["serial"]["loops"] == [["encoder", "thinker", "talker", "vocoder"]]
            and runs["overlapped"]["loops"] == [["encoder", "thinker"], ["talker", "vocoder"]]
            and not any(o["cut_short"] for run in out.values() for o in run.values()))


# ---- the model --------------------------------------------------------------------------------
def model_config(st: State) -> tuple[dict, str]:
    """(the Qwen3-Omni config for this phase, a line saying what it is): the narrow Thinker with
    the Talker side cut (TALKER_DEPTH) on the GPU; the run's own (demo) config with --tiny."""
    from gpuverify import sizes

    if st.sizes.name == "tiny":
        return st.sizes.qwen_config, "demo-sized (--tiny)"
    cfg = _merge(sizes.narrow().qwen_config, TALKER_DEPTH)
    th, tk = cfg["thinker_config"]["text_config"], cfg["talker_config"]
    line = (f"narrow: Thinker {th['num_hidden_layers']} layers x {th['num_experts']} experts (hidden "
            f"{th['hidden_size']}); Talker {tk['text_config']['num_hidden_layers']} layers, code predictor "
            f"{tk['code_predictor_config']['num_hidden_layers']}, Code2Wav "
            f"{cfg['code2wav_config']['num_hidden_layers']} (hidden {tk['text_config']['hidden_size']})")
    return cfg, line


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


@torch.no_grad()
def build_placed(config: dict, devices: dict[str, str], seed: int = 3):
    """-> (omnivox Qwen3OmniModel, seconds): built on the meta device, each stage's modules made on
    its device (as `weights.load_model` places them), filled by `randomize_on_device_`, whose
    generator runs on the Thinker's device: the same values whatever the Talker's device."""
    from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
    from omnivox.models.qwen3_omni.model import Qwen3OmniModel
    from omnivox.models.qwen3_omni.random_init import randomize_on_device_
    from omnivox.models.qwen3_omni.weights import reset_buffers

    t0 = time.monotonic()
    with torch.device("meta"):
        model = Qwen3OmniModel(Qwen3OmniConfig.from_hf(config))
    model = model.to(torch.float32)
    for stage, modules in model.stage_modules().items():
        for module in modules:
            module.to_empty(device=devices.get(stage, devices["thinker"]))
    assert next(model.parameters()).device == torch.device(devices["thinker"])  # the generator's device
    randomize_on_device_(model, seed)
    reset_buffers(model)
    _sync(devices["thinker"])
    return model.eval(), round(time.monotonic() - t0, 2)


# ---- an engine, its runs and its steps ------------------------------------------------------------
def run_engine(box: Box, model, st: State, loops: str, work: dict, info: dict) -> dict:
    """An engine over `model` with `loops`: CUDA graphs captured and warmed up, then the equality
    requests and the load, each submitted in one step. -> {"equality": run, "load": run}."""
    from gpuverify.workload import speech_options
    from omnivox.engine.config import EngineConfig
    from omnivox.engine.engine import Engine
    from omnivox.models.qwen3_omni.stages.graph import build

    n = max(v[0] for v in work.values())
    cfg = EngineConfig(max_running=n, kv_cache_mb=min(256.0, st.sizes.engine_kv_mb), token_budget=2048,
                       scheduling="fifo", stage_loops=loops, graph_buckets=tuple(b for b in (1, 2, 4, 8) if b <= n))
    engine = Engine(build(model, cfg), cfg)
    with contextlib.ExitStack() as stack:
        stack.callback(engine.shutdown)
        t0 = time.monotonic()
        info.update(loops=engine.stages.loops, cuda_graphs=engine.stages.warmup())
        timer = StepTimer(engine)
        stack.callback(timer.close)
        run_batch(engine, model, speech_options(model.cfg, 3, 2), 2, 8, 99, box.deadline)  # warm: kernels, handles
        info["warmup_s"] = round(time.monotonic() - t0, 2)
        info["attention_backend"] = {k: s.backend.name for k, s in engine.stages.stages.items()
                                     if hasattr(s, "backend")}
        out = {}
        for part, seed in (("equality", 1), ("load", 2)):
            box.check(f"{loops}: {part}")
            reqs, prompt, tokens, frames = work[part]
            timer.reset()
            res = run_batch(engine, model, speech_options(model.cfg, tokens, frames), reqs, prompt, seed, box.deadline)
            res.update(timer.figures())
            out[part] = res
            info[part] = {k: v for k, v in res.items() if k not in ("finished", "audio")}
        return out


def run_batch(engine, model, opts, n: int, length: int, seed: int, deadline: float) -> dict:
    """`n` speech requests submitted in one engine step (held under its lock: every run of the
    same requests computes the same rows); at `deadline` what runs is cancelled. `opts`: one
    GenerationOptions for all, or a list of one per request (tp.py mixes text and speech).
    -> {"finished": [Finished], "audio": [samples], "cut_short", "wall_s"}."""
    from gpuverify.workload import qwen_prompt, queue_request
    from omnivox.errors import OmnivoxError
    from omnivox.models.qwen3_omni.bench import prompts

    ps = prompts(model.cfg, n, length, seed=seed)
    got: list = [None] * n
    errors: list[str] = []

    def drain(i: int, handle) -> None:
        try:
            got[i] = handle.collect()
        except OmnivoxError as e:
            errors.append(str(e))
            got[i] = (None, np.zeros(0, np.float32))

    t0 = time.monotonic()
    with engine._lock:  # NOTE: held so that the engine admits all n in one step (as graphs.py does)
        per = opts if isinstance(opts, list) else [opts] * n
        handles = [queue_request(engine, qwen_prompt(p), o) for p, o in zip(ps, per)]
    threads = [threading.Thread(target=drain, args=(i, h), daemon=True) for i, h in enumerate(handles)]
    for t in threads:
        t.start()
    cut = False
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():  # out of time: cancel everything, wait for the aborts to land
            cut = True
            for h in handles:
                h.cancel()
            t.join(HUNG_S)
            if t.is_alive():
                raise RuntimeError(f"requests still in flight {HUNG_S} s after the deadline (engine hung?)")
    if errors:
        raise RuntimeError(f"request failed: {errors[0]}")
    cut = cut or any(f is None or f.finish_reason == "abort" for f, _ in got)
    return {"finished": [f for f, _ in got], "audio": [a for _, a in got], "cut_short": cut,
            "wall_s": round(time.monotonic() - t0, 3)}


class StepTimer:
    """Wall time of every `StageGraph.step` the engine thread makes, of each stage's step within it
    (a loop thread times its own stages), by wrapping the instances' methods, and of the Talker's
    crossings from the Thinker's device (`talker_prompt.hand_over`, wrapped until `close`: the
    per-frame word-embedding rows, which on a GPU queue behind the Thinker's kernels)."""

    def __init__(self, engine):
        from omnivox.models.qwen3_omni import talker_prompt

        graph = engine.stages
        self.device = {n: s.device for n, s in graph.stages.items()}
        self.reset()
        step, self._module, self._hand_over = graph.step, talker_prompt, talker_prompt.hand_over

        def timed_hand_over(produce, device, **where):
            t0 = time.perf_counter()
            out = self._hand_over(produce, device, **where)
            self.crossing_s += time.perf_counter() - t0
            self.crossings += 1
            return out
        talker_prompt.hand_over = timed_hand_over

        def timed_step():
            t0 = time.perf_counter()
            out = step()
            self.steps.append(time.perf_counter() - t0)
            return out
        graph.step = timed_step
        for name, stage in graph.stages.items():
            stage.step = self._wrap(name, stage.step)

    def _wrap(self, name: str, fn):
        def timed():
            t0 = time.perf_counter()
            out = fn()
            _sync(self.device[name])  # a stage's queued kernels count to its step
            self.stage_s[name] += time.perf_counter() - t0
            self.stage_steps[name] += 1
            return out
        return timed

    def close(self) -> None:
        self._module.hand_over = self._hand_over

    def reset(self) -> None:
        self.crossing_s, self.crossings = 0.0, 0
        self.steps: list[float] = []
        self.stage_s: dict[str, float] = defaultdict(float)
        self.stage_steps: dict[str, int] = defaultdict(int)

    def figures(self) -> dict:
        n = len(self.steps)
        return {"steps": n, "step_s": round(sum(self.steps), 4),
                "ms_per_step": round(1e3 * sum(self.steps) / n, 3) if n else None,
                "stage_ms_per_step": {k: round(1e3 * v / n, 3) for k, v in self.stage_s.items()} if n else {},
                "stage_steps": dict(self.stage_steps), "crossings": self.crossings,
                "crossing_ms_per_step": round(1e3 * self.crossing_s / n, 3) if n else None}


# ---- figures --------------------------------------------------------------------------------------
def compare(want: dict, got: dict) -> dict:
    """serial vs overlapped: exactly equal text ids and codes, audio within AUDIO_ATOL."""
    pairs = list(zip(want["finished"], got["finished"]))
    n = len(pairs)
    ok_pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    text = sum(a.text_ids == b.text_ids for a, b in ok_pairs)
    codes = sum(np.array_equal(a.codes, b.codes) for a, b in ok_pairs)
    same_len = len(ok_pairs) == n and all(x.shape == y.shape for x, y in zip(want["audio"], got["audio"]))
    audio = (max(float(np.abs(x - y).max(initial=0.0)) for x, y in zip(want["audio"], got["audio"]))
             if same_len else None)
    return {"requests": n, "text_equal": text, "codes_equal": codes, "audio_max_abs_diff": audio,
            "frames": [int(a.codes.shape[0]) for a, _ in ok_pairs],
            "ok": text == n and codes == n and audio is not None and audio <= AUDIO_ATOL}


def against_one_device(one: dict, placed: dict) -> dict:
    """Text ids equal (required); the share of equal frames (all code groups) over the frames of
    both, and the audio difference where the lengths agree (reported)."""
    pairs = [(a, b) for a, b in zip(one["finished"], placed["finished"]) if a is not None and b is not None]
    frames = sum(max(a.codes.shape[0], b.codes.shape[0]) for a, b in pairs)
    equal = sum(int((a.codes[:m] == b.codes[:m]).all(axis=1).sum())
                for a, b in pairs for m in [min(a.codes.shape[0], b.codes.shape[0])])
    lens = [x.shape == y.shape for x, y in zip(one["audio"], placed["audio"])]
    return {"requests": len(one["finished"]), "text_equal": sum(a.text_ids == b.text_ids for a, b in pairs),
            "codes_requests_equal": sum(np.array_equal(a.codes, b.codes) for a, b in pairs),
            "codes_frames_equal": round(equal / frames, 4) if frames else None,
            "audio_max_abs_diff": max((float(np.abs(x - y).max(initial=0.0)) for (x, y), s
                                       in zip(zip(one["audio"], placed["audio"]), lens) if s), default=None)}


def overlap(out: dict) -> dict:
    """The load's ms/step in each engine, overlap = 1 - overlapped / serial, and the ideal overlap
    of the serial run's stage balance: min(Thinker, Talker + vocoder) / (their sum)."""
    load = {k: v["load"] for k, v in out.items()}
    ms = {k: load[k]["ms_per_step"] if k in load else None for k in ("one_device", "serial", "overlapped")}
    stages = load["serial"]["stage_ms_per_step"]
    th, rest = stages.get("thinker", 0.0), stages.get("talker", 0.0) + stages.get("vocoder", 0.0)
    res = {"one_device_ms_per_step": ms["one_device"], "serial_ms_per_step": ms["serial"],
           "overlapped_ms_per_step": ms["overlapped"],
           "overlap": round(1 - ms["overlapped"] / ms["serial"], 4) if ms["serial"] and ms["overlapped"] else None,
           "serial_stage_ms_per_step": stages, "overlapped_stage_ms_per_step": load["overlapped"]["stage_ms_per_step"],
           "crossing_ms_per_step": {k: load[k]["crossing_ms_per_step"] for k in load},
           "ideal_overlap": round(min(th, rest) / (th + rest), 4) if th + rest else None,
           "steps": {k: load[k]["steps"] for k in load}, "load_s": {k: load[k]["step_s"] for k in load}}
    return res


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
