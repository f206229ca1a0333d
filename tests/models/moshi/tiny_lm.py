"""A tiny random Moshi LM built with moshi's own classes (the reference), saved in Kyutai's
layout, and moshi's `LMGen` loop over user code streams: the oracle of tests/models/moshi."""
from __future__ import annotations

import json
from pathlib import Path

import torch

# the released config's shape (loaders._lm_kwargs), shrunk; context 5 so a test crosses the ring
TINY_LM = {
    "dim": 32, "text_card": 48, "existing_text_padding_id": 3, "n_q": 16, "dep_q": 8, "card": 40,
    "num_heads": 4, "num_layers": 2, "hidden_scale": 4.125, "causal": True, "layer_scale": None,
    "context": 5, "max_period": 10000, "gating": "silu", "norm": "rms_norm_f32",
    "positional_embedding": "rope", "depformer_dim": 16, "depformer_dim_feedforward": 66,
    "depformer_num_heads": 2, "depformer_num_layers": 2, "depformer_layer_scale": None,
    "depformer_multi_linear": True, "depformer_context": 8, "depformer_max_period": 10000,
    "depformer_gating": "silu", "depformer_pos_emb": "none", "depformer_weights_per_step": True,
    "delays": [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
}
FILES = {"moshi_name": "model.safetensors", "mimi_name": "mimi.safetensors", "tokenizer_name": "tokenizer.model"}


def build_reference(seed: int = 0, **overrides):
    """moshi's LMModel with random weights (fp32, CPU, eval). Weights are scaled up from moshi's
    small init so greedy tokens vary from frame to frame (a parity test that can fail)."""
    from moshi.models.lm import LMModel
    torch.manual_seed(seed)
    lm = LMModel(**(TINY_LM | overrides), device="cpu", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if p.dim() == 2 and "emb" not in name:
                p.mul_(2.0)
    return lm


def save_checkpoint(folder: Path, lm, fused: bool = False, **overrides) -> Path:
    """config.json (LM kwargs + file names) and the LM safetensors under moshi's keys; `fused`:
    the attention projections stacked as Kyutai's releases store them (`in_proj_weight`)."""
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in lm.state_dict().items()}
    if fused:
        for kind, fused_name in (("in_projs", "in_proj_weight"), ("out_projs", "out_proj.weight")):
            groups: dict[str, list] = {}
            for k in sorted(k for k in state if f".self_attn.{kind}." in k):
                groups.setdefault(k.split(f"{kind}.")[0], []).append(k)
            for prefix, keys in groups.items():
                keys.sort(key=lambda k: int(k.split(f"{kind}.")[1].split(".")[0]))
                state[prefix + fused_name] = torch.cat([state.pop(k) for k in keys])
    save_file(state, str(folder / FILES["moshi_name"]))
    (folder / "config.json").write_text(json.dumps(TINY_LM | overrides | FILES))
    return folder


def user_codes(frames: int, batch: int = 1, seed: int = 1, card: int = 40) -> torch.Tensor:
    """[batch, frames, 8] random user codes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, card, (batch, frames, 8), generator=g)


def reference_tokens(lm, codes: torch.Tensor) -> list[torch.Tensor | None]:
    """moshi's plain loop: LMGen(lm, use_sampling=False).step per frame; codes [B, T, 8] ->
    per frame None or [B, 1 + dep_q]."""
    from moshi.models.lm import LMGen
    from moshi.utils.compile import no_compile
    gen = LMGen(lm, use_sampling=False)
    out = []
    with no_compile(), gen.streaming(codes.shape[0]):
        for t in range(codes.shape[1]):
            step = gen.step(codes[:, t, :, None])
            out.append(None if step is None else step[..., 0].clone())
    return out
