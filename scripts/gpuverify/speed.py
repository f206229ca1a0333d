"""Phases qwen_speed and s2_speed: the engine on the goal workloads, with the models built in memory.

The engine is what `Omni(...).engine` / `FishTTS(...).engine` build (the family's stage graph
around the model, `omnivox.engine.engine.Engine`), constructed directly around the in-memory
models; requests are `PreparedPrompt` ids / S2 prompt matrices made here (no tokenizer needed).

Figures: tokens/s of a text request (decode: tokens after the first over their time span;
overall: all tokens over arrival to last token), TTFA and RTF at one stream (requests run one
after another), RTF per stream and audio-s/s in a closed loop, and achieved GB/s = the weight
bytes one step reads (active experts only) x steps / time, against ~4.3 TB/s. A phase that runs
out of time cancels what is in flight and reports what finished.
"""
from __future__ import annotations

import contextlib
import gc
import io
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field, replace

import torch

from gpuverify.runner import Box, Skip, State
from gpuverify.workload import qwen_prompt, queue_request, speech_options, text_options

PEAK_TB_S = 4.3  # H200 device-to-device copy measured on this workplace's machines (KINDS.md)
HUNG_S = 30.0  # after a deadline, how long cancelled requests may take to end


# ---- requests and the closed loop ---------------------------------------------------------
@dataclass
class Outcome:
    arrival: float
    finish: float
    reason: str
    token_times: list[float] = field(default_factory=list)
    chunks: list[tuple[float, float]] = field(default_factory=list)  # (time, audio seconds)
    text_ids: list[int] = field(default_factory=list)

    @property
    def audio_s(self) -> float:
        return sum(s for _, s in self.chunks)


def consume(handle) -> Outcome:
    from omnivox.engine.events import AudioChunk, Failed, Finished, TextDelta

    t0, out = time.monotonic(), None
    times, chunks = [], []
    for ev in handle:
        if isinstance(ev, TextDelta) and ev.token_ids:
            times.append(ev.time)
        elif isinstance(ev, AudioChunk):
            chunks.append((ev.time, ev.samples.shape[0] / ev.sample_rate))
        elif isinstance(ev, Finished):
            out = Outcome(ev.arrival, ev.time, ev.finish_reason, times, chunks, list(ev.text_ids))
        elif isinstance(ev, Failed):
            raise RuntimeError(f"request failed: {ev.message}")
    return out or Outcome(t0, time.monotonic(), "lost", times, chunks)


def closed_loop(submit, n: int, concurrency: int, deadline: float) -> tuple[list[Outcome], float, bool]:
    """Run `submit(i)` for i < n with at most `concurrency` in flight; at `deadline` cancel what
    runs and submit nothing more. -> (outcomes, wall seconds, cut short)."""
    outcomes: list[Outcome] = []
    live: dict[int, object] = {}
    errors: list[BaseException] = []
    lock, free = threading.Lock(), threading.Semaphore(concurrency)

    def one(i: int, handle) -> None:
        try:
            o = consume(handle)
            with lock:
                outcomes.append(o)
        except BaseException as e:  # noqa: BLE001 - raised again below, in the caller's thread
            errors.append(e)
        finally:
            with lock:
                live.pop(i, None)
            free.release()

    start, threads, i = time.monotonic(), [], 0
    while i < n and time.monotonic() < deadline:
        if not free.acquire(timeout=0.05):
            continue
        handle = submit(i)
        with lock:
            live[i] = handle
        threads.append(threading.Thread(target=one, args=(i, handle), daemon=True))
        threads[-1].start()
        i += 1
    cut = i < n
    while any(t.is_alive() for t in threads):
        now = time.monotonic()
        if now > deadline:  # NOTE: cancel is idempotent; the engine aborts within a step
            cut = True
            with lock:
                for handle in live.values():
                    handle.cancel()
        if now > deadline + HUNG_S:  # the engine answers no more: give up on it (daemon threads)
            raise RuntimeError(f"{len(live)} requests still in flight {HUNG_S} s after the deadline (engine hung?)")
        time.sleep(0.02)
    if errors:
        raise errors[0]
    return outcomes, time.monotonic() - start, cut


def speech_stats(outcomes: list[Outcome], wall: float, cut: bool) -> dict:
    done = [o for o in outcomes if o.reason != "abort" and o.audio_s > 0]
    heard = [o for o in outcomes if o.chunks]
    audio = sum(o.audio_s for o in outcomes)
    out = {"requests_done": len(done), "requests_seen": len(outcomes), "cut_short": cut, "wall_s": round(wall, 3),
           "audio_s": round(audio, 3), "audio_s_per_s": round(audio / wall, 3) if wall else None}
    if heard:
        ttfa = sorted(o.chunks[0][0] - o.arrival for o in heard)
        out.update(ttfa_ms_p50=round(1e3 * statistics.median(ttfa), 1), ttfa_ms_max=round(1e3 * ttfa[-1], 1))
    if done:
        rtf = [(o.finish - o.arrival) / o.audio_s for o in done]
        out.update(rtf_mean=round(statistics.mean(rtf), 4), rtf_max=round(max(rtf), 4))
    elif heard:  # nothing finished in time: wall time so far over audio so far, per stream
        out["rtf_partial"] = round(statistics.mean((o.finish - o.arrival) / o.audio_s for o in heard if o.audio_s), 4)
    return out


def text_stats(o: Outcome) -> dict:
    t = o.token_times
    out = {"tokens": len(t), "reason": o.reason}
    if t:
        out["ttft_ms"] = round(1e3 * (t[0] - o.arrival), 1)
        out["tokens_per_s_overall"] = round(len(t) / (t[-1] - o.arrival), 1)
    if len(t) > 1:
        out["decode_ms_per_token"] = round(1e3 * (t[-1] - t[0]) / (len(t) - 1), 3)
        out["tokens_per_s"] = round((len(t) - 1) / (t[-1] - t[0]), 1)
    return out


# ---- weight bytes per step ------------------------------------------------------------------
def _bytes(m: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def expected_hit(experts: int, top_k: int, rows: float) -> float:
    """Distinct experts a layer reads for `rows` tokens, routing taken as uniform."""
    return experts * (1 - (1 - top_k / experts) ** max(rows, 1))


def moe_stack_bytes(stack, rows: float) -> float:
    """One step of a decoder stack: every layer's dense weights + the experts it hits."""
    total = 0.0
    for layer in stack.layers:
        ex = getattr(layer.mlp, "experts", None)
        if ex is None:
            total += _bytes(layer)
            continue
        e = ex.gate_up_proj.shape[0]
        per = _bytes(ex) / e
        total += _bytes(layer) - _bytes(ex) + per * expected_hit(e, layer.mlp.gate.top_k, rows)
    return total + _bytes(stack.norm)


def thinker_step_bytes(model, rows: float) -> float:
    th = model.thinker
    return moe_stack_bytes(th.model, rows) + _bytes(th.lm_head)


def frame_step_bytes(model, rows: float) -> float:
    """One speech step: the Talker, its head, the code predictor's 15 inner steps, one vocoder chunk."""
    tk = model.talker
    cp = tk.code_predictor
    inner = sum(_bytes(layer) for layer in cp.model.layers) + _bytes(cp.model.norm) + _bytes(cp.lm_head[0])
    return moe_stack_bytes(tk.model, rows) + _bytes(tk.codec_head) + len(cp.lm_head) * inner + _bytes(model.code2wav)


def gb_s(nbytes: float, seconds: float) -> dict:
    rate = nbytes / seconds / 1e9
    return {"weight_gb_per_step": round(nbytes / 1e9, 3), "gb_s": round(rate, 1),
            "of_peak": round(rate / (PEAK_TB_S * 1e3), 3)}


# ---- the engine under test ------------------------------------------------------------------
ATTEMPTS = (("auto", "auto"), ("auto", "off"), ("torch_ref", "off"))  # (attention backend, CUDA graphs)


def start_engine(r: dict, make, warm, stage: str):
    """`make(attention_backend, cuda_graphs)` -> Engine with its CUDA graphs captured
    (`StageGraph.warmup`, before any request as `serve` does) and warmed up by `warm(engine)`
    (kernels compile, handles get made). The checkout's defaults first; if that fails, its error
    and the engine's log go into `r["fallbacks"]` and the next of ATTEMPTS is tried."""
    for backend, graphs in ATTEMPTS:
        engine = make(backend, graphs)
        log = io.StringIO()
        t0 = time.monotonic()
        try:
            with contextlib.redirect_stderr(log):  # the engine thread prints a failed step's traceback
                r["cuda_graphs"] = engine.stages.warmup()
                warm(engine)
        except Exception as e:
            engine.shutdown()
            r.setdefault("fallbacks", []).append({"backend": backend, "cuda_graphs": graphs, "log": log.getvalue()[-3000:],
                                                  "error": f"{type(e).__name__}: {e}"[:2000]})
            if (backend, graphs) == ATTEMPTS[-1]:
                raise
            continue
        sys.stderr.write(log.getvalue())
        r.update(attention_backend=engine.stages.stages[stage].backend.name, cuda_graphs_mode=graphs,
                 warmup_s=round(time.monotonic() - t0, 2))
        return engine
    raise AssertionError("unreachable")


def loop_stats(engine, stage: str, submit, n: int, concurrency: int, deadline: float, step_bytes) -> dict:
    """A closed loop's figures, with the stage's steps during it and GB/s at its mean batch."""
    s0 = engine.stats().stages.get(stage)
    steps0, rows0 = (s0.steps, s0.total_batched) if s0 else (0, 0)
    res, wall, cut = closed_loop(submit, n, concurrency, deadline)
    out = speech_stats(res, wall, cut)
    s = engine.stats().stages[stage]
    steps = s.steps - steps0
    if steps:
        batch = (s.total_batched - rows0) / steps
        out.update(steps=steps, mean_batch=round(batch, 2), **gb_s(step_bytes(batch), wall / steps))
    return out


# ---- Qwen3-Omni -----------------------------------------------------------------------------
class _HostStandIn:
    """--tiny on the CPU: engine/memory.py's DeviceMemory with made-up figures (a 64 MiB device
    holding the weights, no peak), so the dry run takes every step of the budget's path."""

    def __init__(self, weights: int):
        self.weights = weights

    def measures(self, device) -> bool:
        return True

    def info(self, device) -> tuple[int, int]:
        return 2**26, self.weights

    def begin(self, device) -> None:
        pass

    def end(self, device) -> int:
        return 0


def kv_budget_check(model, cfg) -> dict:
    """`--kv-cache-mb` left out: the budget after the profiling run (engine/memory.py) at 0.9, then
    its KV allocated and every stage's worst-case step (max_running rows, a token_budget chunk) run
    again beside it: no OOM, and the reserved peak within 0.9 of the device."""
    from types import SimpleNamespace

    from omnivox.engine.memory import CUDA, budget_after_warmup
    from omnivox.models.qwen3_omni.family import FAMILY

    served = SimpleNamespace(model=model, tokenizer=None, suppressed_ids=[], tp=None, engine_config=cfg,
                             default_kv_mb=lambda: 256.0)
    dev = model.thinker.lm_head.weight.device
    memory = CUDA if dev.type == "cuda" else _HostStandIn(sum(p.numel() * p.element_size() for p in model.parameters()))
    t0 = time.monotonic()
    budget = budget_after_warmup(FAMILY, served, {"thinker": dev, "talker": dev}, 0.9, memory)
    out = {"line": budget.describe(), "stage_mb": budget.stage_mb, "profile_s": round(time.monotonic() - t0, 2)}
    cfg = replace(cfg, kv_cache_mb=sum(budget.stage_mb.values()), kv_stage_mb=tuple(budget.stage_mb.items()),
                  cuda_graphs="off")
    graph = FAMILY.stage_graph(served, cfg)
    try:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        for stage in graph.stages.values():
            for kind, run in stage.profile_steps().items():
                if dev.type == "cuda" or kind == "decode":  # --tiny: one step a stage shows the path
                    run()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            total = torch.cuda.mem_get_info(dev)[1]
            out.update(peak_reserved_gib=round(torch.cuda.max_memory_reserved(dev) / 2**30, 2),
                       total_gib=round(total / 2**30, 2),
                       within=torch.cuda.max_memory_reserved(dev) <= 0.9 * total)
        out["ok"] = all(mb > 0 for mb in budget.stage_mb.values()) and out.get("within", True)
        out["check_s"] = round(time.monotonic() - t0, 2)
    finally:
        graph.close()
        del graph
        if dev.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
    return out


def qwen_speed(box: Box, st: State) -> bool:
    from omnivox.engine.config import EngineConfig
    from omnivox.engine.engine import Engine
    from omnivox.models.qwen3_omni.bench import prompts
    from omnivox.models.qwen3_omni.stages.graph import build

    if st.qwen is None:
        raise Skip("no model: the build phase did not finish")
    w, r, model = st.sizes.work, box.results, st.qwen

    def make(backend: str, graphs: str, scheduling: str = "fifo"):  # fifo: the closed loop's throughput
        cfg = EngineConfig(max_running=w.loop_concurrency, max_queue=max(256, w.loop_requests),
                           kv_cache_mb=st.sizes.engine_kv_mb, token_budget=2048, attention_backend=backend,
                           cuda_graphs=graphs, scheduling=scheduling)
        return Engine(build(model, cfg), cfg)

    box.check("kv budget")
    r["kv_budget"] = kv_budget_check(model, EngineConfig(max_running=w.loop_concurrency,  # the speed runs' worst cases
                                                         token_budget=2048 if st.device.startswith("cuda") else 16))
    text_p = prompts(model.cfg, 1, w.text_prompt, seed=1)[0]
    speech_p = prompts(model.cfg, w.loop_requests + w.single_requests + 2, w.speech_prompt, seed=2)
    st.extra["text_prompt"] = text_p

    def warm(engine) -> None:  # prefill and decode steps of both routes
        closed_loop(lambda i: queue_request(engine, qwen_prompt(speech_p[-1 - i]), speech_options(model.cfg, 2, 3)),
                    2, 2, box.deadline)
        closed_loop(lambda i: queue_request(engine, qwen_prompt(text_p), text_options(3)), 1, 1, box.deadline)

    engine = start_engine(r, make, warm, "thinker")
    try:
        box.check("text")
        res, _, _ = closed_loop(lambda i: queue_request(engine, qwen_prompt(text_p), text_options(w.text_tokens)), 1, 1,
                                box.deadline)
        o = res[0]
        st.extra["omnivox_text_ids"] = o.text_ids
        r["text"] = text_stats(o)
        if "decode_ms_per_token" in r["text"]:
            r["text"].update(gb_s(thinker_step_bytes(model, 1), r["text"]["decode_ms_per_token"] / 1e3))
        opts = speech_options(model.cfg, w.speech_tokens, w.speech_frames)
        step_bytes = lambda b: frame_step_bytes(model, b)  # noqa: E731
        box.check("speech, one stream")
        r["speech_1"] = loop_stats(engine, "talker", lambda i: queue_request(engine, qwen_prompt(speech_p[i]), opts),
                                   w.single_requests, 1, box.deadline, step_bytes)
        box.check("speech, closed loop")
        k = w.single_requests
        r["speech_loop"] = loop_stats(engine, "talker",
                                      lambda i: queue_request(engine, qwen_prompt(speech_p[k + i]), opts),
                                      w.loop_requests, w.loop_concurrency, box.deadline, step_bytes)
        backend, graphs = r["attention_backend"], r["cuda_graphs_mode"]
    finally:
        engine.shutdown()
    box.check("scheduling, fifo vs slack")
    r["scheduling"] = scheduling_compare(lambda pol: make(backend, graphs, pol), warm, speech_p, opts,
                                         r["speech_loop"].get("audio_s_per_s"), w.speech_frames * 0.08,
                                         w.loop_requests, box.deadline)
    return not r["speech_loop"]["cut_short"] and r["speech_loop"]["requests_done"] > 0


def scheduling_compare(make, warm, prompts_, opts, capacity: float | None, audio_s: float, n: int,
                       deadline: float) -> dict:
    """Issue 21's comparison in the engine: Poisson arrivals at 1.5x the closed loop's audio-s/s
    (over the audio of one request), `n` requests, under fifo and then slack, each on a fresh engine
    and in half the time left; per policy the gap-free share (of requests sent), stall seconds per
    stream, TTFA p50/p90, goodput and audio-s/s."""
    import random

    from omnivox.engine.playback import PlaybackClock

    if not capacity:
        return {"skipped": "no closed-loop audio-s/s to scale the arrival rate from"}
    rate = 1.5 * capacity / audio_s
    out: dict = {"rate_per_s": round(rate, 3), "requests": n}
    for i, policy in enumerate(("fifo", "slack")):
        engine = make(policy)
        try:
            engine.stages.warmup()
            warm(engine)
            rng = random.Random(7)

            def submit(j: int):
                time.sleep(rng.expovariate(rate))
                return queue_request(engine, qwen_prompt(prompts_[j % len(prompts_)]), opts)
            until = time.monotonic() + (deadline - time.monotonic()) / (2 - i)
            res, wall, cut = closed_loop(submit, n, n, until)
        finally:
            engine.shutdown()
        plays = [PlaybackClock.replay(o.chunks) for o in res]
        gap_free = [p for p in plays if p.chunks and p.gap_free]
        ttfa = sorted(o.chunks[0][0] - o.arrival for o in res if o.chunks)
        out[policy] = {
            "gap_free": round(len(gap_free) / n, 4), "stall_s_per_stream": round(sum(p.stall_s for p in plays) / n, 4),
            "ttfa_ms_p50": round(1e3 * statistics.median(ttfa), 1) if ttfa else None,
            "ttfa_ms_p90": round(1e3 * ttfa[int(0.9 * (len(ttfa) - 1))], 1) if ttfa else None,
            "goodput": round(sum(p.received for p in gap_free) / wall, 3),
            "audio_s_per_s": round(sum(o.audio_s for o in res) / wall, 3), "cut_short": cut}
    return out


# ---- S2 Pro -----------------------------------------------------------------------------------
def s2_speed(box: Box, st: State) -> bool:
    from gpuverify.build import DTYPES, build_s2
    from omnivox.engine.config import EngineConfig
    from omnivox.engine.engine import Engine
    from omnivox.models.fish_s2.stages.graph import build

    st.qwen = st.hf = None  # the last phase that needs them is done: room for S2
    gc.collect()
    if st.device.startswith("cuda"):
        torch.cuda.empty_cache()
    w, r = st.sizes.work, box.results
    fcfg, slow, fast, codec, r["build"] = build_s2(st.sizes.s2_config, DTYPES[st.sizes.dtype], st.device)
    box.check("engine")

    def make(backend: str, graphs: str):
        cfg = EngineConfig(max_running=w.loop_concurrency, max_queue=max(256, w.loop_requests),
                           kv_cache_mb=st.sizes.engine_kv_mb, token_budget=2048, attention_backend=backend,
                           cuda_graphs=graphs, scheduling="fifo")  # the closed loop's throughput, every stream at once
        return Engine(build(slow, fast, codec, cfg), cfg)

    prompts = [s2_prompt(fcfg, w.s2_prompt, seed=i) for i in range(w.loop_requests + w.single_requests + 2)]
    engine = start_engine(r, make, lambda e: closed_loop(lambda i: queue_request(e, prompts[-1 - i], s2_options(3, i)),
                                                         2, 2, box.deadline), "slow_ar")
    per_step = _bytes(slow) + fcfg.num_codebooks * _bytes(fast) + codec_decode_bytes(codec)
    try:
        box.check("speech, one stream")
        r["speech_1"] = loop_stats(engine, "slow_ar",
                                   lambda i: queue_request(engine, prompts[i], s2_options(w.s2_frames, i)),
                                   w.single_requests, 1, box.deadline, lambda b: per_step)
        box.check("speech, closed loop")
        k = w.single_requests
        r["speech_loop"] = loop_stats(engine, "slow_ar",
                                      lambda i: queue_request(engine, prompts[k + i], s2_options(w.s2_frames, k + i)),
                                      w.loop_requests, w.loop_concurrency, box.deadline, lambda b: per_step)
    finally:
        engine.shutdown()
    return not r["speech_loop"]["cut_short"] and r["speech_loop"]["requests_done"] > 0


def codec_decode_bytes(codec) -> int:
    """The codec weights one decode chunk reads (the encoder side left out)."""
    q = codec.quantizer
    return _bytes(codec.decoder) + _bytes(q.post_module) + _bytes(q.upsample)


def s2_prompt(cfg, length: int, seed: int):
    """An S2 text prompt of `length` columns in the chat layout's shape: ordinary ids below the
    special range, the voice header last; no reference codes."""
    from omnivox.models.fish_s2.stages.request import SpeechPrompt

    g = torch.Generator().manual_seed(seed)
    body = torch.randint(0, min(cfg.semantic_begin, cfg.eos_id), (length,), generator=g)
    matrix = torch.zeros(cfg.num_rows, length, dtype=torch.long)
    matrix[0] = body
    return SpeechPrompt(f"(synthetic prompt {seed})", matrix)


def s2_options(frames: int, seed: int):
    from omnivox.models.fish_s2.sampler import FishSamplingParams
    from omnivox.models.fish_s2.stages.request import TTSOptions
    return TTSOptions(FishSamplingParams(seed=seed), frames, ignore_eos=True)
