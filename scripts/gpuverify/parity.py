"""Phase parity: teacher-forced omnivox vs transformers on the same weights (the twin shares them).

One forward over the same token ids (a chat prompt) for the Thinker, random input embeddings for
the Talker's decoder stack, random codes for Code2Wav; each in bf16 and in fp32 (`build.upcast`:
one module's fp32 copy at a time), for both libraries. Four pairs are compared:
  implementation  omnivox fp32 vs transformers fp32: the same function? (cosine ~1, top-1 ~1)
  ours            omnivox bf16 vs transformers fp32: what serving in bf16 costs ...
  floor           transformers bf16 vs transformers fp32: ... and what it costs transformers
  bf16            omnivox bf16 vs transformers bf16
Per-position cosine of the final hidden states (min and mean), top-1 agreement of the logits.
ok: implementation cosine >= 0.999 and top-1 >= 0.99; ours within 0.005 (cosine mean) and
0.03 (top-1) of the floor.
"""
from __future__ import annotations

import contextlib

import torch

from gpuverify.build import upcast
from gpuverify.runner import Box, Skip, State
from gpuverify.timing import rel_err

PAIRS = {"implementation": ("omnivox_fp32", "hf_fp32"), "ours": ("omnivox_bf16", "hf_fp32"),
         "floor": ("hf_bf16", "hf_fp32"), "bf16": ("omnivox_bf16", "hf_bf16")}


def parity(box: Box, st: State) -> bool:
    if st.qwen is None:
        raise Skip("no model: the build phase did not finish")
    if st.hf is None:
        raise Skip(st.hf_error or "no transformers twin")
    r = box.results
    ok = True
    for name, runs in (("thinker", _thinker), ("talker", _talker), ("code2wav", _code2wav)):
        box.check(name)
        outs, errors = {}, {}
        for lib in ("omnivox", "hf"):
            for fp32 in (False, True):
                key = f"{lib}_{'fp32' if fp32 else 'bf16'}"
                try:
                    outs[key] = _run(st, runs, lib, fp32, errors)
                except Exception as e:  # the other runs and parts still count
                    errors[key] = f"{type(e).__name__}: {e}"[:1500]
        r[name] = compare(outs)
        if errors:
            r[name]["errors"] = errors
        ok &= r[name]["ok"]
    dtypes = {str(p.dtype) for m in (st.qwen, st.hf) for p in m.parameters()}
    r["weights_after"] = sorted(dtypes)  # the fp32 runs cast only inside a module's forward
    return ok and dtypes == {"torch.bfloat16"} | ({"torch.float32"} if st.sizes.dtype == "float32" else set())


def _run(st: State, runs, lib: str, fp32: bool, errors: dict) -> dict:
    """One forward; transformers' fp32 run falls back to its eager experts loop if its grouped
    experts kernel refuses fp32 on this device (the fallback is recorded)."""
    try:
        return runs(st, lib, fp32)
    except Exception as e:
        if lib != "hf" or not fp32:
            raise
        errors["hf_fp32_grouped"] = f"{type(e).__name__}: {e}"[:1500]
        impl = getattr(st.hf.config, "_experts_implementation", None) or "grouped_mm"
        st.hf.set_experts_implementation("eager")
        try:
            return runs(st, lib, fp32)
        finally:
            st.hf.set_experts_implementation(impl)


def compare(outs: dict[str, dict[str, torch.Tensor]]) -> dict:
    res = {}
    for pair, (a, b) in PAIRS.items():
        if a not in outs or b not in outs:
            continue
        x, y = outs[a], outs[b]
        m = {"hidden_rel_err": rel_err(x["hidden"], y["hidden"])}
        if x["hidden"].dim() == 2:  # [T, H]: one cosine per position
            cos = torch.nn.functional.cosine_similarity(x["hidden"].double(), y["hidden"].double(), dim=-1)
            m.update(cos_min=float(cos.min()), cos_mean=float(cos.mean()))
        else:  # a waveform: one cosine
            m.update(cos_min=_cos(x["hidden"], y["hidden"]), cos_mean=_cos(x["hidden"], y["hidden"]))
        if "logits" in x:
            m["top1"] = float((x["logits"].argmax(-1) == y["logits"].argmax(-1)).double().mean())
        res[pair] = {k: round(v, 6) for k, v in m.items()}
    if not all(k in res for k in ("implementation", "ours", "floor")):
        res["ok"] = False
        return res
    imp, ours, floor = res["implementation"], res["ours"], res["floor"]
    ok = imp["cos_min"] >= 0.999 and ours["cos_mean"] >= floor["cos_mean"] - 0.005
    if "top1" in imp:
        ok = ok and imp["top1"] >= 0.99 and ours["top1"] >= floor["top1"] - 0.03
    res["ok"] = bool(ok)
    return res


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))


def _tokens(st: State) -> torch.Tensor:
    from omnivox.models.qwen3_omni.bench import prompts

    ids = prompts(st.qwen.cfg, 1, st.sizes.parity_tokens, seed=7)[0]
    return torch.tensor([ids], device=st.device)


def _positions(t: int, device: str) -> torch.Tensor:
    return torch.arange(t, device=device).expand(3, 1, t)  # text: three equal M-RoPE rows, [3, 1, T]


@torch.no_grad()
def _thinker(st: State, lib: str, fp32: bool) -> dict:
    ids = _tokens(st)
    th = st.qwen.thinker if lib == "omnivox" else st.hf.thinker
    with upcast(th) if fp32 else contextlib.nullcontext():
        if lib == "omnivox":
            x, _ = th.embed(ids)
            h, _, _ = th(x, _positions(ids.shape[1], st.device))
            logits = th.logits(h)
        else:
            out = th(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, output_hidden_states=True)
            h, logits = out.hidden_states[-1], out.logits
    return {"hidden": h[0].float(), "logits": logits[0].float()}


@torch.no_grad()
def _talker(st: State, lib: str, fp32: bool) -> dict:
    c = st.qwen.cfg.talker.text
    g = torch.Generator(device=st.device).manual_seed(11)
    x = torch.randn((1, st.sizes.parity_tokens, c.hidden_size), generator=g, device=st.device)
    stack = st.qwen.talker.model if lib == "omnivox" else st.hf.talker.model
    with upcast(stack) if fp32 else contextlib.nullcontext():
        x = x.to(torch.float32 if fp32 else torch.bfloat16)
        if lib == "omnivox":
            h, _, _ = stack(x, _positions(x.shape[1], st.device))
        else:
            h = stack(inputs_embeds=x, use_cache=False).last_hidden_state
    return {"hidden": h[0].float()}


@torch.no_grad()
def _code2wav(st: State, lib: str, fp32: bool) -> dict:
    c = st.qwen.cfg.code2wav
    g = torch.Generator(device=st.device).manual_seed(13)
    codes = torch.randint(0, 2048, (1, c.num_quantizers, 24), generator=g, device=st.device)
    c2w = st.qwen.code2wav if lib == "omnivox" else st.hf.code2wav
    with upcast(c2w) if fp32 else contextlib.nullcontext():
        wav = c2w(codes)
    return {"hidden": wav.reshape(-1).float()}
