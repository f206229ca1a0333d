"""Phase tp: the Thinker sharded over two processes on the one GPU (`Omni(tensor_parallel_size=2)`,
omnivox/parallel/) against one process, and the sharded layers' kernels at their per-rank shapes.

How two ranks share one GPU: `OMNIVOX_TP_SAME_DEVICE=1` puts every rank on the Thinker's device
(`launch.TensorParallel.start`; by default rank r takes cuda:(base + r)) and `OMNIVOX_TP_BACKEND=gloo`
makes the group gloo (NCCL refuses two ranks on one device), so every all_reduce / all_gather is
copied through host memory. The worker is started by the driver and inherits both (the driver puts
its own omnivox first on the worker's PYTHONPATH).

1. equality: one checkpoint (written to a temporary folder: random fp32 weights) served at TP 1
   and at TP 2, the same greedy requests (speech and a text-only one) submitted in one engine
   step (so both runs batch the same rows), ignore_eos: the text ids and codes must be identical
   (`text_ids_identical`, `codes_identical`), the audio's max abs difference is reported (the
   Talker reads the Thinker's hidden states, whose sums the ranks add in another order). Both runs
   are eager (`cuda_graphs="off"`): graphs are off for the sharded Thinker today (stages/ar.py:
   a mirrored stage gets no GraphRunner).
2. step: a text-only load (the Thinker alone) at each size: ms per Thinker step (wall / steps and
   the stage's own step time), bytes the driver broadcast per step (`TensorParallel.sent_total /
   steps`: the pickled inputs + metadata), and TP 1 with CUDA graphs as served, for scale.
3. per_rank_kernels: one Thinker decode step's attention block (qkv, q/k norm, RoPE, paged
   attention with the device's backend, o_proj) and MoE block (router + routed experts) built
   directly at the released configuration's per-rank shapes (TP 1: 32 q / 4 kv heads, experts
   at I = 768; TP 2: 16 / 2, 384; TP 4: 8 / 1, 192), random bf16 weights, B = 1 / 8 / 64 rows
   with 1-4k contexts: ms per layer each (no collective: what one rank computes), and the bytes
   each layer's two all_reduce would carry.

Size (`model_config`, as the placement phase): on the GPU the narrow Thinker (the released 48
layers x 128 experts at tens of width: 97 collectives a step, so the host-staged gloo path is
exercised at the released depth) with its Talker side cut; loading takes seconds. With --tiny (CPU,
gloo): the demo-sized model, a tiny workload, and the kernels at the released head counts on tens
of width (`TINY_KERNEL_SHAPE`); the same code and the same result keys in a few seconds (most of
it the worker's start). The timings on one GPU over gloo measure the plumbing, not what TP gives.

What only several GPUs can show (`several_gpus` in the results): NCCL collectives on device
memory (the real per-step cost of TP; here every collective is a host round trip), NCCL inside
CUDA graphs (the sharded Thinker runs eager today), each rank's weights on its own device (the
full-size Thinker split), and ms/step as TP grows. On a machine with 2 GPUs:
    omnivox serve --model DIR --tensor-parallel-size 2 --device cuda:0 --dtype bfloat16
    python benchmarks/tensor_parallel.py --model DIR --device cuda:0 --dtype bfloat16 --sizes 1 2
    omnivox bench --model DIR --device cuda:0 --dtype bfloat16 --tensor-parallel-size 2 --no-baseline
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import replace

import numpy as np
import torch

from gpuverify.runner import Box, State

TP_ENV = {"OMNIVOX_TP_BACKEND": "gloo", "OMNIVOX_TP_SAME_DEVICE": "1"}
# equality: (speech requests, prompt tokens, Thinker tokens, frames, text-only requests);
# load: (text requests, prompt tokens, tokens)
WORK = {"gpu": {"equality": (3, 24, 16, 24, 1), "load": (8, 64, 32)},
        "tiny": {"equality": (2, 16, 4, 6, 1), "load": (3, 16, 6)}}
KERNEL_TP = (1, 2, 4)
KERNEL_BATCHES = (1, 8, 64)
PAGE = 16
# --tiny's kernel shapes: the released head counts (so each TP size's split is the released one) at tens of width
TINY_KERNEL_SHAPE = {"hidden_size": 64, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 16,
                     "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "num_hidden_layers": 48}
SEVERAL_GPUS = {
    "shows": ["NCCL collectives on device memory (here gloo stages every all_reduce / all_gather through the host)",
              "NCCL inside CUDA graphs: graphs are off for the sharded Thinker today (a mirrored stage gets no "
              "GraphRunner, omnivox/stages/ar.py), so TP steps run eager",
              "each rank's shard on its own device (the full-size Thinker split: per-rank memory, load)",
              "ms per Thinker step as TP grows (1, 2, 4)"],
    "commands": ["omnivox serve --model DIR --tensor-parallel-size 2 --device cuda:0 --dtype bfloat16  "
                 "(ranks on cuda:0, cuda:1, NCCL)",
                 "python benchmarks/tensor_parallel.py --model DIR --device cuda:0 --dtype bfloat16 --sizes 1 2 "
                 "--requests 8 --tokens 64 --prompt-tokens 256",
                 "omnivox bench --model DIR --device cuda:0 --dtype bfloat16 --tensor-parallel-size 2 --no-baseline"],
}


def tp(box: Box, st: State) -> bool:
    from gpuverify.placement import model_config

    r = box.results
    gpu = st.device.startswith("cuda")
    dev = str(torch.empty(0, device=st.device).device)  # "cuda" -> "cuda:0"
    work = WORK["gpu" if gpu else "tiny"]
    config, r["model"] = model_config(st)
    n_speech, prompt, tokens, frames, n_text = work["equality"]
    r.update(dtype="float32", device=dev, env=TP_ENV, several_gpus=SEVERAL_GPUS,
             workload={"equality": {"speech_requests": n_speech, "text_requests": n_text, "prompt": prompt,
                                    "tokens": tokens, "frames": frames},
                       "load": dict(zip(("requests", "prompt", "tokens"), work["load"]))})
    runs = r["runs"] = {}
    out: dict = {}
    folder = tempfile.mkdtemp(prefix="omnivox-gv-tp-")
    try:
        runs["checkpoint_s"] = write_checkpoint(config, folder)
        for size in (1, 2):
            box.check(f"TP {size}")
            out[size] = run_size(box, folder, size, dev, st, work, runs.setdefault(f"tp{size}", {}))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    r["equality"] = compare(out[1]["equality"], out[2]["equality"])
    t1, t2 = runs["tp1"], runs["tp2"]
    r["step"] = {"tp1_ms_per_step": t1["load"]["ms_per_step"], "tp2_ms_per_step": t2["load"]["ms_per_step"],
                 "tp1_graphs_ms_per_step": t1["load_graphs"]["ms_per_step"],
                 "tp1_stage_ms_per_step": t1["load"]["stage_ms_per_step"],
                 "tp2_stage_ms_per_step": t2["load"]["stage_ms_per_step"],
                 "tp1_bytes_per_step": t1["load"]["bytes_per_step"], "tp2_bytes_per_step": t2["load"]["bytes_per_step"],
                 "tp2_over_tp1": round(t2["load"]["ms_per_step"] / t1["load"]["ms_per_step"], 3)
                 if t1["load"]["ms_per_step"] else None}
    box.check("per-rank kernels")
    r["per_rank_kernels"] = per_rank_kernels(box, st)
    e = r["equality"]
    return (e["text_ids_identical"] and e["codes_identical"] and not any(o["cut_short"] for o in out.values())
            and t2["rank_devices"] == [dev, dev] and t2["backend"] == "gloo" and t2["workers_left"] == 0
            and t2["load"]["bytes_per_step"] > 0 and all(c["ok"] for c in r["per_rank_kernels"]["rows"]))


# ---- the checkpoint and the engines -----------------------------------------------------------------
def write_checkpoint(config: dict, folder: str) -> float:
    """The demo tokenizer's files and seeded random weights for `config` (what the workers load)."""
    from omnivox.models.qwen3_omni.demo import write_demo_files
    from omnivox.models.qwen3_omni.random_init import save_random_checkpoint

    t0 = time.monotonic()
    write_demo_files(folder)  # tokenizer, chat template, ... (config.json is then replaced)
    save_random_checkpoint(config, folder, seed=5)
    return round(time.monotonic() - t0, 2)


@contextlib.contextmanager
def tp_env(size: int):
    """TP_ENV while an Omni of `size` starts (its workers inherit it)."""
    if size == 1:
        yield
        return
    old = {k: os.environ.get(k) for k in TP_ENV}
    os.environ.update(TP_ENV)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_size(box: Box, folder: str, size: int, dev: str, st: State, work: dict, info: dict) -> dict:
    """An Omni at tensor-parallel `size` over `folder`: warm-up, the equality batch, the text load
    (and at TP 1 the load again with CUDA graphs as served); stopped, its workers checked gone."""
    from gpuverify.workload import speech_options, text_options
    from omnivox import Omni
    from omnivox.engine.config import EngineConfig

    n_speech, prompt, tokens, frames, n_text = work["equality"]
    n_load = work["load"][0]
    n = max(n_speech + n_text, n_load)
    cfg = EngineConfig(max_running=n, kv_cache_mb=min(256.0, st.sizes.engine_kv_mb), token_budget=2048,
                       scheduling="fifo", cuda_graphs="off", graph_buckets=tuple(b for b in (1, 2, 4, 8) if b <= n))
    t0 = time.monotonic()
    with tp_env(size):
        omni = Omni(folder, dtype="float32", device=dev, progress=False, tensor_parallel_size=size, engine_config=cfg)
    out: dict = {}
    try:
        info["start_s"] = round(time.monotonic() - t0, 2)
        if omni.tp is not None:
            info["backend"] = omni.tp.group.backend
            procs = omni.tp.workers.procs  # the process launcher's (gpu_verify runs outside Ray)
            info["rank_devices"] = [str(omni.tp.device)] + [p.args[p.args.index("--device") + 1] for p in procs]
            info["worker_pids"] = [p.pid for p in procs]
        else:
            info.update(backend=None, rank_devices=[dev], worker_pids=[])
        cfg_m = omni.model.cfg
        t0 = time.monotonic()
        run(omni, [speech_options(cfg_m, 2, 2), text_options(2)], 8, 99, box)  # warm: kernels, handles, the group
        info["warmup_s"] = round(time.monotonic() - t0, 2)
        box.check(f"TP {size}: equality")
        opts = [speech_options(cfg_m, tokens, frames)] * n_speech + [text_options(tokens)] * n_text
        out["equality"] = run(omni, opts, prompt, 1, box)
        info["equality"] = {k: v for k, v in out["equality"].items() if k not in ("finished", "audio")}
        box.check(f"TP {size}: load")
        reqs, prompt_l, tokens_l = work["load"]
        out["load"] = run(omni, [text_options(tokens_l)] * reqs, prompt_l, 2, box, timed=True)
        info["load"] = {k: v for k, v in out["load"].items() if k not in ("finished", "audio")}
        if size == 1:  # as served: CUDA graphs on a GPU (none on CPU: the same eager run again)
            box.check("TP 1: load with graphs")
            restart(omni, replace(cfg, cuda_graphs="auto"))
            info["cuda_graphs"] = omni.engine.stages.warmup()
            run(omni, [text_options(2)], 8, 99, box)  # warm
            res = run(omni, [text_options(tokens_l)] * reqs, prompt_l, 2, box, timed=True)
            info["load_graphs"] = {k: v for k, v in res.items() if k not in ("finished", "audio")}
    finally:
        omni.close()
        procs = omni.tp.workers.procs if omni.tp is not None else []
        info["workers_left"] = sum(p.poll() is None for p in procs)
    out["cut_short"] = any(v["cut_short"] for v in out.values() if isinstance(v, dict))
    return out


def restart(omni, cfg) -> None:
    """A fresh engine under `cfg` (the workers stay: the next engine sends them its setup)."""
    if omni._engine is not None:
        omni._engine.shutdown()
        omni._engine = None
    omni.engine_config = cfg


def run(omni, opts: list, length: int, seed: int, box: Box, timed: bool = False) -> dict:
    """`opts` (one per request) submitted in one engine step; with `timed` the Thinker's steps,
    their ms (wall / steps, and the stage's own step time) and the bytes broadcast per step."""
    from gpuverify.placement import StepTimer, run_batch

    engine = omni.engine
    timer = StepTimer(engine) if timed else None
    try:
        steps0 = engine.stats().stages["thinker"].steps
        sent0, tp_steps0 = (omni.tp.sent_total, omni.tp.steps) if omni.tp is not None else (0, 0)
        res = run_batch(engine, omni.model, opts, len(opts), length, seed, box.deadline)
        steps = engine.stats().stages["thinker"].steps - steps0
    finally:
        if timer is not None:
            timer.close()
    if timed:
        sent, tp_steps = (omni.tp.sent_total - sent0, omni.tp.steps - tp_steps0) if omni.tp is not None else (0, 0)
        fig = timer.figures()
        res.update(thinker_steps=steps, ms_per_step=round(1e3 * res["wall_s"] / steps, 3) if steps else None,
                   stage_ms_per_step=fig["stage_ms_per_step"].get("thinker"), tp_steps=tp_steps,
                   bytes_per_step=round(sent / tp_steps) if tp_steps else 0,
                   tokens=sum(len(f.text_ids) for f in res["finished"] if f is not None))
    return res


def compare(one: dict, two: dict) -> dict:
    """TP 1 vs TP 2: identical text ids and codes (required), the audio's max abs difference (reported)."""
    pairs = list(zip(one["finished"], two["finished"]))
    ok = [(a, b) for a, b in pairs if a is not None and b is not None]
    text = sum(a.text_ids == b.text_ids for a, b in ok)
    codes = sum(np.array_equal(a.codes, b.codes) for a, b in ok)
    first = [_first_diff(a.text_ids, b.text_ids) for a, b in ok]
    frames = [_first_diff(a.codes.tolist(), b.codes.tolist()) for a, b in ok]
    same = [x.shape == y.shape for x, y in zip(one["audio"], two["audio"])]
    audio = max((float(np.abs(x - y).max(initial=0.0)) for (x, y), s in zip(zip(one["audio"], two["audio"]), same)
                 if s), default=None)
    n = len(pairs)
    return {"requests": n, "text_equal": text, "codes_equal": codes, "text_ids_identical": text == n == len(ok),
            "codes_identical": codes == n == len(ok), "audio_max_abs_diff": audio, "audio_lengths_equal": all(same),
            "first_text_diff": first, "first_frame_diff": frames, "frames": [int(a.codes.shape[0]) for a, _ in ok],
            "text_tokens": [len(a.text_ids) for a, _ in ok]}


def _first_diff(a: list, b: list) -> int | None:
    """The first index where two sequences differ (the shorter one's length if one is a prefix); None: equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---- the sharded layers at per-rank shapes ------------------------------------------------------
def kernel_shape(st: State) -> tuple[dict, str]:
    """The Thinker text config whose per-rank shapes are timed: the released one on a GPU."""
    import json

    from gpuverify.sizes import QWEN_RELEASED

    if st.device.startswith("cuda"):
        c = json.loads(QWEN_RELEASED.read_text())["thinker_config"]["text_config"]
        return c, "released"
    return {**TINY_KERNEL_SHAPE, "rms_norm_eps": 1e-6, "norm_topk_prob": True, "rope_theta": 1e6}, \
        "released head counts at tens of width (--tiny)"


def per_rank_kernels(box: Box, st: State) -> dict:
    """ms of one decode step's attention block and MoE block per layer at each TP size's per-rank
    shapes (what one rank computes; no collective), bf16 on a GPU (fp32 on CPU, one thread: at tens
    of width more threads only wait for each other on a shared machine)."""
    before = torch.get_num_threads()
    if not st.device.startswith("cuda"):
        torch.set_num_threads(1)
    try:
        return _per_rank_kernels(box, st)
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def _per_rank_kernels(box: Box, st: State) -> dict:
    import random

    from gpuverify.timing import sync, time_us
    from omnivox.attention.backends import make_backend
    from omnivox.layers.moe import experts_impl

    c, what = kernel_shape(st)
    dev = st.device
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    backend = make_backend("auto", dev)
    heads, kv, hd, hidden = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["hidden_size"]
    inter, layers = c["moe_intermediate_size"], c["num_hidden_layers"]
    theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 1e6))
    rows, base = [], {}
    lo, hi = st.sizes.kernel_context
    for n in KERNEL_TP:  # TP 1 first: the other sizes are compared with it
        box.check(f"per-rank kernels TP {n}")
        try:
            attn, moe = _attention_block(c, n, dev, dtype), _moe_block(c, n, dev, dtype)
        except Exception as e:  # noqa: BLE001 - recorded; the next size runs
            rows += [{"tp": n, "batch": b, "ok": False, "error": f"{type(e).__name__}: {e}"[:1000]}
                     for b in KERNEL_BATCHES]
            continue
        for b in KERNEL_BATCHES:
            box.check(f"per-rank kernels TP {n} B={b}")
            row = {"tp": n, "batch": b, "heads": f"{heads // n}/{kv // n}x{hd}", "moe_intermediate": inter // n}
            try:
                past = [random.Random(b).randint(lo, hi) for _ in range(b)]  # the same rows at every size
                x = torch.randn((b, hidden), generator=torch.Generator(device=dev).manual_seed(b), device=dev).to(dtype)
                attend, rope = _paged(backend, past, kv // n, hd, dev, dtype, theta)
                fa = lambda: attn(x, rope, attend, 0)  # noqa: E731
                fm = lambda: moe(x)  # noqa: E731
                ok = bool(torch.isfinite(fa()).all()) and bool(torch.isfinite(fm()).all())
                sync(dev)
                a_ms = time_us(fa, dev, st.sizes.timing_iters) / 1e3
                m_ms = time_us(fm, dev, st.sizes.timing_iters) / 1e3
                row.update(attention_ms=round(a_ms, 4), moe_ms=round(m_ms, 4), layer_ms=round(a_ms + m_ms, 4),
                           step_ms_all_layers=round(layers * (a_ms + m_ms), 3),
                           experts_impl=experts_impl(x, inter // n),
                           all_reduce_bytes_per_layer=2 * b * hidden * x.element_size() if n > 1 else 0, ok=ok)
                if n == 1:
                    base[b] = a_ms + m_ms
                row["vs_tp1"] = round((a_ms + m_ms) / base[b], 3) if base.get(b) else None
                del attend
            except Exception as e:  # noqa: BLE001 - recorded; the next case runs
                row.update(ok=False, error=f"{type(e).__name__}: {e}"[:1000])
            rows.append(row)
        del attn, moe
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    return {"shapes": what, "dtype": str(dtype), "attention_backend": backend.name, "layers": layers,
            "context": [lo, hi], "rows": rows}


def _init_(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    for _, p in sorted(module.named_parameters()):
        p.data.normal_(generator=g).mul_(p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1).add_(0 if p.dim() > 1 else 1)


def _attention_block(c: dict, n: int, dev: str, dtype):
    from omnivox.layers.attention import DecoderAttention

    with torch.device(dev):
        attn = DecoderAttention(c["hidden_size"], c["num_attention_heads"] // n, c["num_key_value_heads"] // n,
                                c["head_dim"], c.get("rms_norm_eps", 1e-6))
    attn = attn.to(dtype).eval()
    _init_(attn, 11)
    return attn


def _moe_block(c: dict, n: int, dev: str, dtype):
    from omnivox.layers.moe import SparseMoE

    with torch.device(dev):
        moe = SparseMoE(c["hidden_size"], c["num_experts"], c["moe_intermediate_size"] // n, c["num_experts_per_tok"],
                        c.get("norm_topk_prob", True), (c.get("shared_expert_intermediate_size") or 0) // n)
    moe = moe.to(dtype).eval()
    _init_(moe, 12)
    return moe


class _Attend:
    """The engine's attention seam (`PagedContext.attend`) over one layer's pages."""

    def __init__(self, backend, k_cache, v_cache, meta):
        self.backend, self.k, self.v, self.meta = backend, k_cache, v_cache, meta

    def attend(self, layer: int, q, k, v):
        return self.backend.forward(q, k, v, self.k, self.v, self.meta)


def _paged(backend, past: list[int], kv: int, hd: int, dev: str, dtype, theta):
    """A decode step of len(past) rows over shuffled pages holding random K/V, and its RoPE."""
    from omnivox.attention.metadata import build_metadata
    from omnivox.layers.rotary import inv_freq, rotate_half_rope

    need = [-(-(p + 1) // PAGE) for p in past]
    blocks = sum(need)
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(blocks)).tolist()
    tables, at = [], 0
    for k in need:
        tables.append(order[at:at + k])
        at += k
    meta = build_metadata(tables, past, [1] * len(past), block_size=PAGE, dummy_slot=blocks * PAGE, device=dev)
    g = torch.Generator(device=dev).manual_seed(len(past))
    k_cache, v_cache = (torch.randn(((blocks + 1) * PAGE, kv, hd), generator=g, device=dev).to(dtype) for _ in range(2))
    pos = torch.tensor(past, device=dev)
    return _Attend(backend, k_cache, v_cache, meta), rotate_half_rope(pos, inv_freq(hd, theta, device=dev), dtype)
