"""What one engine step costs: aten ops, host reads and CPU time per `engine.stages.step()`.

A real-depth, narrow-width Qwen3-Omni (the released configuration's layers and experts, every
width cut to tens) is built with transformers, randomised so no block is near-identity, and
cached. Then B = 1, 8, 32 requests of one workload run through `Omni(...).engine`, all submitted
at once: a 24-token user turn in the chat layout, greedy, `ignore_eos`, 12 Thinker tokens, 24
speech frames, speaker `ethan`, eager fp32 on one CPU thread.

Each step runs twice, never measured together:
  count pass  a TorchDispatchMode counts every dispatched aten op (views included) and patched
              Tensor methods count host reads (tolist, item, bool/int/float/index, numpy, cpu);
              the vocoder's audio `.cpu()`/`.numpy()` are audio copies, every other read counts
              as ids. Ops and reads are charged to the stage whose `step` ran them; `graph` is
              what the stage graph itself ran between stages.
  time pass   `time.thread_time()` of the engine thread around the same calls (no counting).
Every figure is a mean over all steps of the run (prefill steps included); a stage's figure is
its total over the run divided by the run's steps, so the stages sum to the step.

The same measurement runs on an older commit (`--baseline-ref`, default 06ea32f, the code
before the engine-core rework): its `omnivox/` is extracted with `git archive` into a temporary
folder and this file runs there in a child process (`--child`), on the same checkpoint.

    python benchmarks/step_cost.py [--quick] [--no-baseline] [--baseline-ref REF] [--json PATH]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import weakref
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RELEASED_CONFIG = HERE / "qwen3_omni_released_config.json"
CHECKPOINT_VERSION = 1  # bump when the checkpoint recipe changes (the cache key includes it)
DEFAULT_BASELINE = "06ea32f"
STAGES = ("thinker", "talker", "vocoder", "graph")
READ_METHODS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")

_ROPE_M = {"interleaved": True, "mrope_section": [4, 2, 2]}  # head_dim 16: the sections sum to 8
# Every width of the released configuration cut to tens; depths, expert counts, code groups,
# windows and the upsampling stack stay as released. Token ids come from the demo tokenizer.
WIDTHS = {
    "thinker_config": {
        "audio_config": {"d_model": 32, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
                         "downsample_hidden_size": 8, "output_dim": 32},
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32},
        "text_config": {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                        "rope_parameters": _ROPE_M},
    },
    "talker_config": {
        "thinker_hidden_size": 32,
        "text_config": {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
                        "shared_expert_intermediate_size": 32, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 16, "rope_parameters": _ROPE_M},
        "code_predictor_config": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "head_dim": 16},
    },
    "code2wav_config": {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                        "num_key_value_heads": 2, "decoder_dim": 32},
}

# A shallow variant for the smoke test (seconds, not minutes): same widths, few layers and experts.
SMALL_DEPTH = {
    "thinker_config": {
        "audio_config": {"encoder_layers": 1},
        "vision_config": {"depth": 2, "deepstack_visual_indexes": [0, 1]},
        "text_config": {"num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2},
    },
    "talker_config": {
        "accept_hidden_layer": 1,
        "text_config": {"num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
        "code_predictor_config": {"num_hidden_layers": 1, "layer_types": ["full_attention"]},
    },
    "code2wav_config": {"num_hidden_layers": 1},
}


# ---- the checkpoint -------------------------------------------------------------------------
def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def checkpoint_config(depth: dict | None = None) -> dict:
    """The released configuration at tens of width (and `depth` overrides), demo tokenizer ids."""
    from omnivox.models.qwen3_omni.demo import build_demo_tokenizer, demo_config_dict

    demo = demo_config_dict(build_demo_tokenizer())
    ids = {k: v for k, v in demo.items() if k.endswith("_token_id")}
    ids["thinker_config"] = {k: v for k, v in demo["thinker_config"].items() if k.endswith("_token_id")}
    ids["thinker_config"]["text_config"] = {"vocab_size": demo["thinker_config"]["text_config"]["vocab_size"]}
    ids["talker_config"] = {k: v for k, v in demo["talker_config"].items() if k.endswith("_token_id")}
    released = json.loads(RELEASED_CONFIG.read_text())
    return merge(merge(merge(released, WIDTHS), depth or {}), ids)


def ensure_checkpoint(depth: dict | None = None, root: Path | None = None, seed: int = 0) -> Path:
    """The cached checkpoint folder for `depth`, built on first use (atomically)."""
    cfg = checkpoint_config(depth)
    key = hashlib.sha256(json.dumps([CHECKPOINT_VERSION, cfg, seed], sort_keys=True).encode()).hexdigest()[:12]
    root = Path(root or os.environ.get("OMNIVOX_CACHE") or tempfile.gettempdir())
    folder = root / f"omnivox-step-cost-{key}"
    if (folder / "STEP_COST_COMPLETE").exists():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".step-cost-", dir=root))
    _build_checkpoint(cfg, tmp, seed)
    (tmp / "STEP_COST_COMPLETE").write_text(json.dumps(cfg) + "\n")
    try:
        os.replace(tmp, folder)
    except OSError:  # another process built it first
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _build_checkpoint(cfg: dict, folder: Path, seed: int) -> None:
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from omnivox.models.qwen3_omni.demo import write_demo_files
    from omnivox.models.qwen3_omni.random_init import randomize_

    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(**cfg)).eval()
    randomize_(model.named_parameters(), seed)
    model.save_pretrained(folder)
    config_json = (folder / "config.json").read_text()
    write_demo_files(folder)  # tokenizer, chat template, generation and preprocessor configs ...
    (folder / "config.json").write_text(config_json)  # ... but transformers' config.json


def describe(folder: Path) -> str:
    cfg = json.loads((folder / "config.json").read_text())
    th, tk = cfg["thinker_config"]["text_config"], cfg["talker_config"]["text_config"]
    cp, cw = cfg["talker_config"]["code_predictor_config"], cfg["code2wav_config"]
    experts = tk.get("num_experts", tk.get("num_local_experts"))
    return (f"Thinker {th['num_hidden_layers']} layers x {th['num_experts']} experts top-{th['num_experts_per_tok']}, "
            f"Talker {tk['num_hidden_layers']} x {experts} top-{tk['num_experts_per_tok']}, code predictor "
            f"{cp['num_hidden_layers']} layers x {cp['num_code_groups']} groups, Code2Wav {cw['num_hidden_layers']} "
            f"layers; hidden {th['hidden_size']}/{tk['hidden_size']}/{cp['hidden_size']}/{cw['hidden_size']}")


# ---- the workload ---------------------------------------------------------------------------
def chat_prompts(omni, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` distinct user turns of `length` ordinary tokens in the chat layout (distinct, so no
    request hits another's prefix cache)."""
    tok = omni.tokenizer
    head = tok.encode("<|im_start|>user\n")
    tail = tok.encode("<|im_end|>\n<|im_start|>assistant\n")
    words = [i for i in range(tok.vocab_size) if _ordinary(tok, i)]
    rng = random.Random(seed)
    return [list(head) + rng.sample(words, length) + list(tail) for _ in range(n)]


def _ordinary(tok, i: int) -> bool:
    text = tok.decode([i], skip_special_tokens=False)
    return bool(text.strip()) and "<|" not in text and "\ufffd" not in text


# ---- the meter ------------------------------------------------------------------------------
class Step:
    """What one `stages.step()` cost, per stage label."""

    def __init__(self):
        self.ops, self.ids, self.audio, self.cpu = Counter(), Counter(), Counter(), Counter()


class _OpCount(TorchDispatchMode):
    def __init__(self, meter: "Meter"):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.meter.current.ops[self.meter.label] += 1
        return func(*args, **(kwargs or {}))


_tls = threading.local()  # .meter: the Meter counting reads in this thread, else None


class Meter:
    """Wraps a stage graph's `step` and every stage's `step` (instance attributes); while
    `pass_` is "count" or "time", each graph step appends one `Step` to `steps`."""

    def __init__(self, graph):
        self.graph, self.stages = graph, stage_objects(graph)
        self.pass_: str | None = None
        self.steps: list[Step] = []
        self.sites: Counter = Counter()
        self.label = "graph"
        self.current = Step()
        self._in_step = False
        self._busy = threading.Lock()
        self._last_cpu = None  # weakref to the last counted .cpu() result (its .numpy() is the same copy)
        self._wrapped: list[tuple[object, str]] = []
        self._wrap(graph, "step", self._graph_step)
        for name, stage in self.stages.items():
            for method in ("step", "try_admit", "feed_text"):  # the old Talker admits inside the graph step
                if callable(getattr(stage, method, None)) and (method == "step" or name == "talker"):
                    self._wrap(stage, method, self._stage_call(name))

    def _wrap(self, obj, method: str, wrapper) -> None:
        inner = getattr(obj, method)
        setattr(obj, method, lambda *a, **k: wrapper(inner, *a, **k))
        self._wrapped.append((obj, method))

    def close(self) -> None:
        for obj, method in self._wrapped:
            delattr(obj, method)  # the class's method shows again

    @contextlib.contextmanager
    def measuring(self, pass_: str):
        with self._busy:
            self.pass_, self.steps, self.sites = pass_, [], Counter()
        try:
            yield self
        finally:
            with self._busy:  # an engine step in flight ends first
                self.pass_ = None

    def _graph_step(self, inner, *a, **k):
        with self._busy:
            if self.pass_ is None:
                return inner(*a, **k)
            self.current, self.label, self._in_step = Step(), "graph", True
            t0 = time.thread_time()
            try:
                if self.pass_ == "count":
                    _tls.meter = self
                    with _OpCount(self):
                        out = inner(*a, **k)
                else:
                    out = inner(*a, **k)
            finally:
                _tls.meter, self._in_step = None, False
            self.current.cpu["graph"] += time.thread_time() - t0 - sum(self.current.cpu.values())
            self.steps.append(self.current)
            return out

    def _stage_call(self, name: str):
        def call(inner, *a, **k):
            if not self._in_step:
                return inner(*a, **k)
            outer, self.label = self.label, name
            t0 = time.thread_time()
            try:
                return inner(*a, **k)
            finally:
                self.current.cpu[name] += time.thread_time() - t0
                self.label = outer
        return call

    def read(self, method: str, tensor, out) -> None:
        """A host read of `tensor` by `method` (called by the patched Tensor methods)."""
        last = self._last_cpu() if self._last_cpu is not None else None
        if method == "cpu":
            self._last_cpu = weakref.ref(out)
        elif last is tensor:
            return  # .cpu().numpy() / .cpu().tolist(): one copy, counted at .cpu()
        audio = self.label == "vocoder" and method in ("cpu", "numpy")
        (self.current.audio if audio else self.current.ids)[self.label] += 1
        frame = sys._getframe(2)  # the caller of the patched method
        path = frame.f_code.co_filename
        at = path.rfind("omnivox/")
        self.sites[(self.label, method, f"{path[at + 8:] if at >= 0 else Path(path).name}:{frame.f_lineno}")] += 1


def stage_objects(graph) -> dict:
    """name -> stage: `graph.stages` (a dict, today's StageGraph) or the old QwenStages attributes."""
    stages = getattr(graph, "stages", None)
    if isinstance(stages, dict):
        return dict(stages)
    return {n: getattr(graph, n) for n in ("thinker", "talker", "vocoder") if getattr(graph, n, None) is not None}


@contextlib.contextmanager
def counting_reads():
    """Patch the Tensor methods that read a tensor on the host; a read counts when the calling
    thread's meter is active (the engine thread inside a count-pass step)."""
    saved = {m: torch.Tensor.__dict__.get(m) for m in READ_METHODS}

    def patched(method: str, inner):
        def read(t, *a, **k):
            out = inner(t, *a, **k)
            meter = getattr(_tls, "meter", None)
            if meter is not None:
                meter.read(method, t, out)
            return out
        return read

    for m in READ_METHODS:
        setattr(torch.Tensor, m, patched(m, getattr(torch.Tensor, m)))
    try:
        yield
    finally:
        for m, orig in saved.items():
            if orig is None:
                delattr(torch.Tensor, m)
            else:
                setattr(torch.Tensor, m, orig)


# ---- one measurement --------------------------------------------------------------------------
def run_batch(omni, prompts: list[list[int]], max_tokens: int, max_frames: int) -> list[tuple[int, int]]:
    """Submit every prompt at once (the engine admits them in one step); wait for all.
    -> (text tokens, frames) per request."""
    engine = omni.engine
    lock = getattr(engine, "_lock", None) or contextlib.nullcontext()  # held: no step starts mid-submit
    with lock:
        handles = [omni.submit(prompt_ids=p, greedy=True, ignore_eos=True, max_tokens=max_tokens,
                               max_frames=max_frames, speaker="ethan") for p in prompts]
    out = []
    for h in handles:
        last = None
        for last in h:
            pass
        if type(last).__name__ != "Finished":
            raise RuntimeError(f"request failed: {last}")
        out.append((len(last.text_ids), len(last.codes)))
    return out


def summarize(count: list[Step], timed: list[Step]) -> dict:
    n, m = len(count), len(timed)
    per = {s: {"ops": sum(x.ops[s] for x in count) / n,
               "reads_ids": sum(x.ids[s] for x in count) / n,
               "reads_audio": sum(x.audio[s] for x in count) / n,
               "cpu_ms": 1e3 * sum(x.cpu[s] for x in timed) / m} for s in STAGES}
    total = {k: sum(p[k] for p in per.values()) for k in ("ops", "reads_ids", "reads_audio", "cpu_ms")}
    spread = {"ops_per_step": [sum(x.ops.values()) for x in count],
              "stage_ops_per_step": {s: [x.ops[s] for x in count] for s in STAGES},
              "reads_ids_per_step": [sum(x.ids.values()) for x in count],
              "cpu_ms_per_step": [round(1e3 * sum(x.cpu.values()), 2) for x in timed]}
    return {"steps": n, "steps_timed": m, **total, "stages": per, "each_step": spread}


def measure(folder: Path, batches=(1, 8, 32), max_tokens: int = 12, max_frames: int = 24,
            prompt_len: int = 24, log=print) -> dict:
    """The step cost of the omnivox imported here on `folder`, for each batch size."""
    import omnivox
    from omnivox import Omni

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    from dataclasses import fields

    from omnivox.engine.config import EngineConfig
    # every request of a batch runs at once (fifo); an older tree has only that policy
    fifo = {"scheduling": "fifo"} if "scheduling" in {f.name for f in fields(EngineConfig)} else {}
    omni = Omni(model=folder, progress=False, engine_config=EngineConfig(**fifo))
    meter = Meter(omni.engine.stages)
    runs = {}
    try:
        with counting_reads():
            run_batch(omni, chat_prompts(omni, 1, prompt_len, seed=-1), 2, 2)  # warm-up, not measured
            for b in batches:
                with meter.measuring("count"):
                    produced = run_batch(omni, chat_prompts(omni, b, prompt_len, seed=2 * b), max_tokens, max_frames)
                count, sites = meter.steps, meter.sites
                with meter.measuring("time"):
                    run_batch(omni, chat_prompts(omni, b, prompt_len, seed=2 * b + 1), max_tokens, max_frames)
                runs[str(b)] = {**summarize(count, meter.steps), "tokens": sorted({t for t, _ in produced}),
                                "frames": sorted({f for _, f in produced}),
                                "read_sites": [{"stage": s, "method": m, "where": w, "per_step": c / len(count)}
                                               for (s, m, w), c in sites.most_common(10)]}
                log(f"  B={b}: {runs[str(b)]['steps']} steps, {runs[str(b)]['ops']:,.0f} ops/step, "
                    f"{runs[str(b)]['cpu_ms']:.1f} CPU ms/step")
    finally:
        meter.close()
        omni.close()
        torch.set_num_threads(threads)
    return {"omnivox": str(Path(omnivox.__file__).parent), "runs": runs,
            "workload": {"prompt_len": prompt_len, "max_tokens": max_tokens, "max_frames": max_frames}}


# ---- the baseline -----------------------------------------------------------------------------
def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def checkout_label() -> str:
    try:
        dirty = bool(git("status", "--porcelain", "--untracked-files=no", "omnivox"))
        return git("rev-parse", "--short=10", "HEAD") + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        return "unknown"


def run_baseline(ref: str, folder: Path, batches, max_tokens: int, max_frames: int, prompt_len: int) -> dict:
    """This script on `ref`'s omnivox (extracted with git archive), in a child process."""
    sha = git("rev-parse", "--verify", f"{ref}^{{commit}}")
    with tempfile.TemporaryDirectory(prefix="omnivox-baseline-") as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", sha, "omnivox"],
                                 check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        out = Path(tmp) / "result.json"
        env = {**os.environ, "PYTHONPATH": tmp}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--tree", tmp, "--model", str(folder),
               "--json", str(out), "--batches", ",".join(map(str, batches)), "--max-tokens", str(max_tokens),
               "--max-frames", str(max_frames), "--prompt-len", str(prompt_len)]
        subprocess.run(cmd, check=True, env=env)
        result = json.loads(out.read_text())
        if Path(result["omnivox"]).parent != Path(tmp):  # e.g. an installed omnivox shadowed the old tree
            raise RuntimeError(f"the baseline imported {result['omnivox']}, not {tmp}/omnivox")
    result["ref"], result["commit"] = ref, sha[:10]
    return result


# ---- the report -------------------------------------------------------------------------------
def goals(new: dict) -> list[tuple[str, str, bool]]:
    runs, out = new["runs"], []
    if "1" in runs and "32" in runs:
        r = runs["32"]["ops"] / runs["1"]["ops"]
        out.append(("ops/step at B=32 <= 1.3x B=1", f"{r:.2f}x", r <= 1.3))
    worst = max(runs, key=lambda b: runs[b]["reads_ids"])
    each = runs[worst]["each_step"]["reads_ids_per_step"]
    over = sum(n > 2 for n in each)
    out.append((f"<= 2 host reads of ids per step (mean, B={worst})", f"{runs[worst]['reads_ids']:.2f}",
                runs[worst]["reads_ids"] <= 2))
    out.append((f"  steps with > 2 at B={worst} (most: {max(each)})", f"{over}/{len(each)}", over == 0))
    if "1" in runs:
        ops = runs["1"]["ops"]
        out.append(("ops/step at B=1 <= 13,000", f"{ops:,.0f}", ops <= 13000))
        out.append(("  stretch: <= 10,000", f"{ops:,.0f}", ops <= 10000))
    return out


def _pair(old: dict | None, new: dict, key: str, fmt: str, stage: str | None = None) -> str:
    def get(r):
        return (r["stages"][stage] if stage else r)[key]
    return (f"{fmt.format(get(old))} -> " if old else "") + fmt.format(get(new))


def report(new: dict, old: dict | None) -> str:
    b_all = list(new["runs"])
    lines = [f"Step cost: {new['model']}", f"workload: {new['workload']}; eager fp32 CPU, 1 thread; means over all steps",
             f"code: {(old['ref'] + ' (' + old['commit'] + ') -> ') if old else ''}{new['ref']} ({new['commit']})", ""]
    head = f"{'B':>3} | {'steps':>9} | {'ops/step':>17} | {'reads ids/step':>14} | {'audio/step':>11} | {'CPU ms/step':>15}"
    lines += [head, "-" * len(head)]
    for b in b_all:
        n, o = new["runs"][b], old["runs"].get(b) if old else None
        steps = f"{o['steps']} -> {n['steps']}" if o else str(n["steps"])
        lines.append(f"{b:>3} | {steps:>9} | {_pair(o, n, 'ops', '{:,.0f}'):>17} | "
                     f"{_pair(o, n, 'reads_ids', '{:.1f}'):>14} | {_pair(o, n, 'reads_audio', '{:.1f}'):>11} | "
                     f"{_pair(o, n, 'cpu_ms', '{:.1f}'):>15}")
    for key, title, fmt in (("ops", "ops/step", "{:,.0f}"), ("cpu_ms", "CPU ms/step", "{:.1f}"),
                            ("reads_ids", "host reads of ids/step", "{:.1f}")):
        lines += ["", f"per stage, {title}" + (" (old -> new)" if old else "")]
        lines.append(f"{'B':>3} | " + " | ".join(f"{s:>17}" for s in STAGES))
        for b in b_all:
            n, o = new["runs"][b], old["runs"].get(b) if old else None
            lines.append(f"{b:>3} | " + " | ".join(f"{_pair(o, n, key, fmt, s):>17}" for s in STAGES))
    lines += ["", "goals (new code):"]
    lines += [f"  {name:<44} {value:>10}  {'met' if ok else 'NOT met'}" for name, value, ok in goals(new)]
    return "\n".join(lines)


# ---- command line -----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="B=1 and 8 only, 4 tokens, 6 frames (a smoke run)")
    p.add_argument("--no-baseline", action="store_true", help="measure this checkout only")
    p.add_argument("--baseline-ref", default=DEFAULT_BASELINE, help=f"the older commit (default {DEFAULT_BASELINE})")
    p.add_argument("--json", type=Path, help="write every number here")
    p.add_argument("--batches", help="comma-separated batch sizes (default 1,8,32)")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--max-frames", type=int)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--model", type=Path, help="an existing checkpoint folder (default: build/cached)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)  # the folder holding the omnivox/ to measure
    a = p.parse_args(argv)
    sys.path.insert(0, a.tree or str(ROOT))
    batches = [int(b) for b in a.batches.split(",")] if a.batches else ([1, 8] if a.quick else [1, 8, 32])
    max_tokens = a.max_tokens or (4 if a.quick else 12)
    max_frames = a.max_frames or (6 if a.quick else 24)
    if a.child:
        print(f"baseline ({a.tree}):", flush=True)
        a.json.write_text(json.dumps(measure(a.model, batches, max_tokens, max_frames, a.prompt_len)))
        return
    t0 = time.monotonic()
    folder = a.model or ensure_checkpoint()
    print(f"checkpoint: {folder} ({time.monotonic() - t0:.0f} s)", flush=True)
    old = None
    if not a.no_baseline:
        old = run_baseline(a.baseline_ref, folder, batches, max_tokens, max_frames, a.prompt_len)
    print("this checkout:", flush=True)
    new = measure(folder, batches, max_tokens, max_frames, a.prompt_len)
    new.update(ref="HEAD", commit=checkout_label(), model=describe(folder))
    text = report(new, old)
    print("\n" + text + f"\n\n(total {time.monotonic() - t0:.0f} s)")
    if a.json:
        a.json.write_text(json.dumps({"new": new, "old": old, "goals": goals(new), "table": text}, indent=1))


if __name__ == "__main__":
    main()
