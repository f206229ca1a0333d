"""Count eager aten ops of one decoder layer forward, per part, on the tiny configs.

Every op that reaches the dispatcher is counted (views included) with a TorchDispatchMode;
module hooks attribute each op to the innermost part of the stack's last layer it ran in
(the last, not the first: a cache may build a per-step mask at layer 0 and share it):

  attn    the layer's attention module, without the cache's `attend` (q/k/v, norms, RoPE, o_proj)
  attend  the KV-cache seam `cache.attend(...)` (storage + SDPA), reported on its own
  norms   the two pre-norms of the layer
  mlp     a dense SwiGLU (or the Talker's shared expert inside the MoE)
  moe     the routed MoE (another helper's scope; shown, not summed)
  other   residual adds and layer scales
  layer   attn + attend + norms + mlp + other (MoE excluded)

`stack` is the once-per-forward part of the whole stack (RoPE tables, final norm, ...).
The layer runs inside a full stack forward over a cache already holding PAST tokens, at 1 and
at 8 new tokens, with 3-D input [1, S, H] and (where the stack accepts it) 2-D input [S, H].

    python scripts/layer_ops.py [--dtype bfloat16|float32] [--ops]
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's omnivox

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PAST = 4
PARTS = ("attn", "attend", "norms", "mlp", "other")


class OpCounter(TorchDispatchMode):
    """Counts every dispatched aten op under the current scope (None = outside layer 0)."""

    def __init__(self):
        super().__init__()
        self.scopes: list[str] = []
        self.counts: Counter = Counter()
        self.names: dict[str, Counter] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        scope = self.scopes[-1] if self.scopes else "stack"
        self.counts[scope] += 1
        self.names.setdefault(scope, Counter())[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def scope(self, name: str):
        self.scopes.append(name)
        try:
            yield
        finally:
            self.scopes.pop()


def _hook(module: torch.nn.Module, counter: OpCounter, name: str) -> list:
    def pre(*_):
        counter.scopes.append(name)

    def post(*_):
        counter.scopes.pop()

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


def _instrument(layer: torch.nn.Module, counter: OpCounter) -> list:
    """Hooks on layer 0 and its parts; returns the handles."""
    handles = _hook(layer, counter, "other")
    for name, child in layer.named_children():
        if name in ("self_attn", "attention"):
            handles += _hook(child, counter, "attn")
        elif "norm" in name:
            handles += _hook(child, counter, "norms")
        elif name in ("mlp", "feed_forward"):
            moe = hasattr(child, "experts")
            handles += _hook(child, counter, "moe" if moe else "mlp")
            if moe and hasattr(child, "shared_expert"):
                handles += _hook(child.shared_expert, counter, "mlp")
    return handles


def _wrap_attend(cache, counter: OpCounter, layer: int):
    """Put `cache.attend` of `layer` under the `attend` scope (an instance attribute shadows the method)."""
    inner = cache.attend
    measured = layer

    def attend(layer, *args, **kwargs):
        ctx = counter.scope("attend") if layer == measured else contextlib.nullcontext()
        with ctx:
            return inner(layer, *args, **kwargs)

    cache.attend = attend
    return cache


def count(run, layers) -> dict[str, int] | None:
    """Ops per part of the last layer during `run(counter)`; None if the stack rejects the input.
    Ops of the other layers are dropped; what runs outside every layer is `stack`."""
    counter = OpCounter()
    handles = _instrument(layers[-1], counter)
    for layer in layers[:-1]:
        handles += _hook(layer, counter, "other layers")
    try:
        with torch.no_grad(), counter:
            run(counter)
    except Exception:  # e.g. 2-D input on a stack that only takes [B, S, H]
        return None
    finally:
        for h in handles:
            h.remove()
    out = {p: counter.counts.get(p, 0) for p in PARTS}
    out["layer"] = sum(out.values())
    out["moe"] = counter.counts.get("moe", 0)
    out["stack"] = counter.counts.get("stack", 0)
    out["_names"] = counter.names
    return out


# ---------------------------------------------------------------- the stacks

def qwen_stacks(dtype):
    from omnivox.layers.attention import DenseKVCache
    from omnivox.models.qwen3_omni.code2wav import Code2WavTransformer
    from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
    from omnivox.models.qwen3_omni.decoder import DecoderStack
    from omnivox.models.qwen3_omni.demo import build_demo_tokenizer, demo_config_dict
    from omnivox.models.qwen3_omni.random_init import randomize_

    cfg = Qwen3OmniConfig.from_hf(demo_config_dict(build_demo_tokenizer()))
    for name, dc in (("thinker", cfg.thinker.text), ("talker", cfg.talker.text),
                     ("code_predictor", cfg.talker.code_predictor)):
        stack = DecoderStack(dc)
        randomize_(stack.named_parameters())
        stack = stack.to(dtype).eval()
        mrope = dc.mrope_section is not None

        def run(counter, s, two_d, stack=stack, mrope=mrope, hidden=dc.hidden_size):
            with _paused(counter):
                x = torch.randn(PAST + s, hidden).to(dtype)
                t = torch.arange(PAST + s)
                pos = torch.stack([t, t, t]) if mrope else t  # [3, T] or [T]
                cache = DenseKVCache()
                if two_d:
                    stack(x[:PAST], pos[..., :PAST], cache)
                else:
                    stack(x[None, :PAST], pos[..., None, :PAST], cache)
            _wrap_attend(cache, counter, len(stack.layers) - 1)
            if two_d:
                stack(x[PAST:], pos[..., PAST:], cache)
            else:
                stack(x[None, PAST:], pos[..., None, PAST:], cache)

        yield name, stack.layers, run

    dc = cfg.code2wav.transformer
    c2w = Code2WavTransformer(dc)
    randomize_(c2w.named_parameters())
    c2w = c2w.to(dtype).eval()

    def run_c2w(counter, s, two_d):
        if two_d:
            raise ValueError("Code2Wav runs [B, n, H] per request row")
        with _paused(counter):
            state = c2w.init_state(1, "cpu", dtype)
            x = torch.randn(1, PAST + s, dc.hidden_size).to(dtype)
            c2w.step(x[:, :PAST], state)
        c2w.step(x[:, PAST:], state)

    yield "code2wav", c2w.layers, run_c2w


def fish_stacks(dtype):
    from omnivox.layers.attention import DenseKVCache
    from omnivox.models.fish_s2.tiny import TINY_CONFIG, build_tiny_llm

    slow, fast = build_tiny_llm(0, TINY_CONFIG)
    slow, fast = slow.to(dtype), fast.to(dtype)
    n = TINY_CONFIG.num_codebooks

    def run_slow(counter, s, two_d):
        with _paused(counter):
            ids = torch.randint(0, TINY_CONFIG.text.vocab_size, (PAST + s,))
            codes = torch.zeros(PAST + s, n, dtype=torch.long)
            pos = torch.arange(PAST + s)
            cache = DenseKVCache()
            if two_d:
                slow(ids[:PAST], codes[:PAST], pos[:PAST], cache)
            else:
                slow(ids[None, :PAST], codes[None, :PAST], pos[None, :PAST], cache)
        _wrap_attend(cache, counter, len(slow.layers) - 1)
        if two_d:
            slow(ids[PAST:], codes[PAST:], pos[PAST:], cache)
        else:
            slow(ids[None, PAST:], codes[None, PAST:], pos[None, PAST:], cache)

    yield "s2_slow", slow.layers, run_slow

    def run_fast(counter, s, two_d):
        # the per-frame inner loop: s request rows, one token each, at position 2 of the frame
        with _paused(counter):
            cache = fast.new_cache()
            x = torch.randn(s, 3, TINY_CONFIG.fast.dim).to(dtype)
            pos = torch.arange(3).expand(s, 3)
            fast(x[:, :2], pos[:, :2], cache)
        _wrap_attend(cache, counter, len(fast.layers) - 1)
        if two_d:  # 2-D: the token axis is the request axis
            fast(x[:, 2], pos[:, 2], cache)
        else:
            fast(x[:, 2:], pos[:, 2:], cache)

    yield "s2_fast", fast.layers, run_fast


@contextlib.contextmanager
def _paused(counter: OpCounter):
    """Run setup work without counting it."""
    with torch.utils._python_dispatch._disable_current_modes():
        yield


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float64"])
    ap.add_argument("--ops", action="store_true", help="also list the op names per part")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    rows = []
    for name, layer, run in [*qwen_stacks(dtype), *fish_stacks(dtype)]:
        for s in (1, 8):
            for two_d in (False, True):
                got = count(lambda c: run(c, s, two_d), layer)
                rows.append((name, s, "2-D" if two_d else "3-D", got))
    head = f"{'stack':15s} {'S':>2s} {'in':3s} " + " ".join(f"{p:>6s}" for p in (*PARTS, "layer", "moe", "stack"))
    print(f"aten ops, last layer of each tiny stack, {args.dtype}, {PAST} cached tokens")
    print(head)
    print("-" * len(head))
    for name, s, kind, got in rows:
        if got is None:
            print(f"{name:15s} {s:2d} {kind:3s} " + " ".join(f"{'-':>6s}" for _ in (*PARTS, 'layer', 'moe', 'stack')))
            continue
        print(f"{name:15s} {s:2d} {kind:3s} " + " ".join(f"{got[p]:6d}" for p in (*PARTS, "layer", "moe", "stack")))
    if args.ops:
        for name, s, kind, got in rows:
            if got is None:
                continue
            print(f"\n{name} S={s} {kind}")
            for part in (*PARTS, "stack"):
                ops = got["_names"].get(part)
                if ops:
                    print(f"  {part:7s} " + ", ".join(f"{k} x{v}" if v > 1 else k for k, v in sorted(ops.items())))


if __name__ == "__main__":
    main()
