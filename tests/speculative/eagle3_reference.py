"""Test helpers: a random EAGLE-3 checkpoint written tensor by tensor (either layout), and the
head's draft chain computed from those weights as SGLang's `LlamaForCausalLMEagle3` describes it
(and `speculators`' `Eagle3DraftModel` for its layout: a Qwen3 first layer, q/k norms), dense,
with plain torch ops: nothing from omnivox."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

H, HEADS, KV, D, INTER, VOCAB, DRAFT_VOCAB = 32, 4, 2, 8, 48, 64, 40


def write_head(folder: Path, layout: str = "sglang", taps: int = 2, seed: int = 0, **extra) -> dict:
    """A random head saved to `folder` (config.json + model.safetensors). Returns its tensors by
    their own-layout names (`midlayer.*` for SGLang's, `layers.0.*` for speculators')."""
    g = torch.Generator().manual_seed(seed)
    layer = "midlayer." if layout == "sglang" else "layers.0."
    shapes = {"fc.weight": (H, taps * H), "norm.weight": (H,), "lm_head.weight": (DRAFT_VOCAB, H),
              f"{layer}self_attn.q_proj.weight": (HEADS * D, 2 * H), f"{layer}self_attn.k_proj.weight": (KV * D, 2 * H),
              f"{layer}self_attn.v_proj.weight": (KV * D, 2 * H), f"{layer}self_attn.o_proj.weight": (H, HEADS * D),
              f"{layer}mlp.gate_proj.weight": (INTER, H), f"{layer}mlp.up_proj.weight": (INTER, H),
              f"{layer}mlp.down_proj.weight": (H, INTER), f"{layer}input_layernorm.weight": (H,),
              f"{layer}hidden_norm.weight": (H,), f"{layer}post_attention_layernorm.weight": (H,)}
    if layout == "speculators":
        shapes.update({f"{layer}self_attn.q_norm.weight": (D,), f"{layer}self_attn.k_norm.weight": (D,)})
    w = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            w[name] = 1 + 0.2 * torch.randn(shape, generator=g)
        else:
            w[name] = torch.randn(shape, generator=g) / shape[-1] ** 0.5
    keep = torch.sort(torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB]).values  # the draft vocabulary
    w["d2t"] = keep - torch.arange(DRAFT_VOCAB)
    w["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, keep, True)
    base = {"hidden_size": H, "intermediate_size": INTER, "num_hidden_layers": 1, "num_attention_heads": HEADS,
            "num_key_value_heads": KV, "head_dim": D, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "hidden_act": "silu"}
    if layout == "sglang":
        cfg = {"architectures": ["LlamaForCausalLMEagle3"], **base, "draft_vocab_size": DRAFT_VOCAB,
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1][:taps]}}
    else:
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "transformer_layer_config": {"model_type": "qwen3", **base}, "draft_vocab_size": DRAFT_VOCAB,
               "norm_before_residual": True, "eagle_aux_hidden_state_layer_ids": [1, 2][:taps]}
    cfg.update(extra)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(folder / "model.safetensors"))
    return w


def _rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, pos):  # x [S, heads, D], Llama's rotate-half
    inv = 1.0 / 10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * cos + rot * sin


def reference_chain(w: dict, features: torch.Tensor, tokens: list[int], k: int, embed: torch.Tensor,
                    layout: str = "sglang") -> list[torch.Tensor]:
    """The greedy chain's draft-vocabulary logits (k of [DRAFT_VOCAB]) for one sequence whose
    first n = len(tokens) - 1 positions have target `features` [n, F] and whose pending token is
    tokens[n]: entry p reads (embedding of tokens[p + 1], fc(features[p])) at RoPE position p;
    step j (position n - 1 + j) reads the chain's own token and hidden state from j > 0."""
    L = "midlayer." if layout == "sglang" else "layers.0."
    qk_norm, before_residual = layout == "speculators", layout == "speculators"
    n = len(tokens) - 1
    fused = features @ w["fc.weight"].T

    def entry(tok, hidden, pos):
        e = _rms(embed[tok], w[L + "input_layernorm.weight"])
        hn = _rms(hidden, w[L + "hidden_norm.weight"])
        x = torch.cat([e, hn], -1)
        q = (x @ w[L + "self_attn.q_proj.weight"].T).view(-1, HEADS, D)
        kk = (x @ w[L + "self_attn.k_proj.weight"].T).view(-1, KV, D)
        v = (x @ w[L + "self_attn.v_proj.weight"].T).view(-1, KV, D)
        if qk_norm:
            q, kk = _rms(q, w[L + "self_attn.q_norm.weight"]), _rms(kk, w[L + "self_attn.k_norm.weight"])
        return _rope(q, pos), _rope(kk, pos), v, hn if before_residual else hidden

    toks = torch.tensor(tokens)
    _, ks, vs, _ = entry(toks[1:n], fused[:n - 1], torch.arange(n - 1))  # the context: entries 0..n-2
    tok, hidden, out = toks[n:n + 1], fused[n - 1:n], []
    for j in range(k):
        q, kk, v, residual = entry(tok, hidden, torch.tensor([n - 1 + j]))
        ks, vs = torch.cat([ks, kk]), torch.cat([vs, v])
        rep = HEADS // KV
        scores = torch.einsum("hd,khd->hk", q[0], ks.repeat_interleave(rep, 1)) / D ** 0.5
        att = torch.einsum("hk,khd->hd", scores.softmax(-1), vs.repeat_interleave(rep, 1))
        r = residual + att.reshape(1, -1) @ w[L + "self_attn.o_proj.weight"].T
        m = _rms(r, w[L + "post_attention_layernorm.weight"])
        m = (torch.nn.functional.silu(m @ w[L + "mlp.gate_proj.weight"].T) * (m @ w[L + "mlp.up_proj.weight"].T))
        hidden = r + m @ w[L + "mlp.down_proj.weight"].T
        logits = _rms(hidden, w["norm.weight"]) @ w["lm_head.weight"].T
        out.append(logits[0])
        best = int(logits[0].argmax())
        tok = torch.tensor([best + int(w["d2t"][best])])
    return out
