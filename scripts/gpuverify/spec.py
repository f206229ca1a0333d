"""Phase spec: DFlash and EAGLE-3 verify steps against a plain decode step, on the real-depth narrow
Thinker (`sizes.narrow`; `--tiny`: the tiny one) with random drafts of matching shapes (DFlash: 2
layers, block 8; EAGLE-3: SGLang's layout, one layer, a 32k draft vocabulary where the Thinker's
is larger; both on target layers [1, N // 2, N - 3] clipped to the Thinker): ms per Thinker step
(the draft's propose included) at B = 1, 8, 32 for text-only greedy decoding with speculation
off and on (every row verifying 7 drafts; a random draft is rarely right, so this is the verify
step's cost, not a speed-up). Outputs are checked equal. Timings synchronize the device around
each step."""
from __future__ import annotations

import json
import time

import torch

from gpuverify.runner import Box, State

BATCHES, TOKENS, BLOCK = (1, 8, 32), 24, 8


def _layer_ids(model) -> list[int]:
    n = model.cfg.thinker.text.num_hidden_layers
    return sorted({min(max(i, 0), n - 1) for i in (1, n // 2, n - 3)})


def _save(module, d: dict, folder) -> str:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(d))
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(folder / "model.safetensors"))
    return str(folder)


def _dflash_folder(model, st: State) -> str:
    from omnivox.speculative.dflash.config import DFlashConfig
    from omnivox.speculative.dflash.model import DFlashDraft

    th, ids = model.cfg.thinker.text, _layer_ids(model)
    n = th.num_hidden_layers
    d = {"architectures": ["DFlashDraftModel"], "hidden_size": th.hidden_size, "intermediate_size": 2 * th.hidden_size,
         "num_hidden_layers": 2, "num_attention_heads": th.num_attention_heads,
         "num_key_value_heads": th.num_key_value_heads, "head_dim": th.head_dim, "vocab_size": th.vocab_size,
         "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_target_layers": n, "block_size": BLOCK,
         "dflash_config": {"mask_token_id": 0, "target_layer_ids": ids}}
    torch.manual_seed(0)
    return _save(DFlashDraft(DFlashConfig.from_hf(d)), d, st.out / "spec_dflash")


def _eagle3_folder(model, st: State) -> str:
    from omnivox.speculative.eagle3.config import Eagle3Config
    from omnivox.speculative.eagle3.model import Eagle3Head

    th, ids = model.cfg.thinker.text, _layer_ids(model)
    d = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": th.hidden_size,
         "intermediate_size": 2 * th.hidden_size, "num_hidden_layers": 1, "num_attention_heads": th.num_attention_heads,
         "num_key_value_heads": th.num_key_value_heads, "head_dim": th.head_dim, "vocab_size": th.vocab_size,
         "draft_vocab_size": min(th.vocab_size, 32000), "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}}
    torch.manual_seed(0)
    return _save(Eagle3Head(Eagle3Config.from_hf(d), len(ids)), d, st.out / "spec_eagle3")


def _timed(engine, device: str, reqs, submit) -> tuple[list, float, int]:
    """Run `reqs`; (outputs, seconds in Thinker steps, Thinker steps)."""
    stage = engine.stages.stages["thinker"]
    inner, clock = stage.step, {"s": 0.0, "n": 0}

    def step():
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = inner()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        clock["s"] += time.perf_counter() - t
        clock["n"] += 1
        return out
    stage.step = step
    try:
        outs = submit(reqs)
    finally:
        stage.step = inner
    return outs, clock["s"], clock["n"]


def text_prompts(vocab: int, n: int) -> list:
    """n distinct 16-token text prompts."""
    from omnivox.models.qwen3_omni.types import PreparedPrompt

    return [PreparedPrompt(ids=[(17 * i + 5 * k) % (vocab - 64) + 32 for k in range(16)]) for i in range(n)]


def decode_run(model, st: State, reqs: list, tokens: int, **config) -> tuple[list, float, int, object]:
    """`reqs` as greedy text-only requests of `tokens` tokens (ignore_eos) on a fresh engine over
    `model` (EngineConfig `config`), after one warm-up request: (outputs, ms per Thinker step,
    Thinker steps, the engine's stats)."""
    from gpuverify.workload import queue_request
    from omnivox.engine.config import EngineConfig
    from omnivox.engine.engine import Engine
    from omnivox.models.qwen3_omni.stages.graph import build
    from omnivox.models.qwen3_omni.types import GenerationOptions

    opts = GenerationOptions(max_tokens=tokens, ignore_eos=True, return_audio=False)
    cfg = EngineConfig(max_running=len(reqs), kv_cache_mb=min(512.0, st.sizes.engine_kv_mb), cuda_graphs="off",
                       **config)
    engine = Engine(build(model, cfg), cfg)
    try:
        def run(rs):
            return [h.collect()[0] for h in [queue_request(engine, p, opts) for p in rs]]
        run(reqs[:1])  # warm-up
        outs, secs, steps = _timed(engine, st.device, reqs, run)
        return outs, round(1e3 * secs / max(steps, 1), 3), steps, engine.stats()
    finally:
        engine.shutdown()


def spec(box: Box, st: State) -> bool:
    from gpuverify import sizes
    from gpuverify.build import build_qwen
    from omnivox.engine.config import SpeculativeConfig

    r = box.results
    config = sizes.narrow().qwen_config if st.sizes.name == "full" else st.sizes.qwen_config
    dtype = torch.bfloat16 if st.device.startswith("cuda") else torch.float32
    model, _ = build_qwen(config, dtype, st.device, seed=2)
    folders = {"dflash": _dflash_folder(model, st), "eagle3": _eagle3_folder(model, st)}
    r["draft"] = {"dflash": {"layers": 2, "block_size": BLOCK}, "eagle3": {"layers": 1, "chain": BLOCK - 1},
                  "target_layer_ids": _layer_ids(model), "thinker_layers": model.cfg.thinker.text.num_hidden_layers}
    batches = [b for b in BATCHES if b <= st.sizes.work.loop_concurrency] or [1]
    vocab = model.cfg.thinker.text.vocab_size
    ok = True
    for b in batches:
        box.check(f"B={b}")
        reqs = text_prompts(vocab, b)
        row = {}
        for name in ("plain", *folders):
            spec_cfg = None if name == "plain" else SpeculativeConfig(
                method=name, model=folders[name], num_speculative_tokens=BLOCK - 1, disable_by_batch_size=1 << 30)
            outs, ms, steps, stats = decode_run(model, st, reqs, TOKENS, speculative=spec_cfg)
            th = stats.stages["thinker"]
            row[name] = {"ms_per_step": ms, "steps": steps, "tokens_per_step": round(b * TOKENS / max(steps, 1), 3),
                         "mean_accepted_length": round(th.mean_accepted_length, 3), "ids": [o.text_ids for o in outs]}
        plain = row["plain"].pop("ids")
        for name in folders:
            row[name]["same_output"] = row[name].pop("ids") == plain
            row[name]["verify_vs_plain_step"] = round(row[name]["ms_per_step"] / max(row["plain"]["ms_per_step"], 1e-9),
                                                      3)
            ok &= row[name]["same_output"]
        r[f"B={b}"] = row
    return ok
