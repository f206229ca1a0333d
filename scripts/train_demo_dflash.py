"""Train the built-in demo model's DFlash draft on CPU (seeded, bounded): distillation from the
demo Thinker's greedy continuations, written to omnivox/speculative/dflash/demo_draft/ with the
demo's version and a hash of the demo Thinker (`speculative/dflash/demo.py` refuses any other).

1. Prompts: seeded word salads from the demo corpus (`PROMPT_SEED`; the benchmark's held-out
   prompts use another seed), chat-templated; the demo Thinker's greedy continuations (the
   engine, `ignore_eos`).
2. Target features: the Thinker's layers `TARGET_IDS` over each whole sequence (one dense forward).
3. Training examples: anchors at random generated positions a (the block [token a, mask x 7] at
   positions a..a+7, its context the features of positions [0, a)); loss: cross-entropy of the
   draft's logits (the Thinker's frozen LM head) against the Thinker's own next tokens a+1..a+7,
   later positions weighted less. The draft's forward here is the engine's (`DFlashLayer.project`,
   its attention over context then block, no causal mask) on dense tensors.

    python scripts/train_demo_dflash.py [--steps 2400] [--prompts 1024] [--batch 8] [--anchors 16] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT_SEED, TRAIN_SEED = 0, 0
BLOCK, TARGET_IDS, LAYERS, INTERMEDIATE = 8, [0, 1], 2, 256
CONTINUATION = 64


def word_prompts(n: int, seed: int) -> list[str]:
    """`n` seeded prompts of 3-12 words drawn from the demo corpus."""
    from omnivox.models.qwen3_omni.demo import DEMO_CORPUS
    words = sorted(set(DEMO_CORPUS.split()))
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, size=int(rng.integers(3, 13)))) for _ in range(n)]


def continuations(omni, prompts: list[str], tokens: int) -> list[tuple[list[int], int]]:
    """(prompt ids + greedy continuation, prompt length) per prompt."""
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    reqs = [dict(messages=m, greedy=True, max_tokens=tokens, ignore_eos=True, return_audio=False) for m in msgs]
    outs = [o for i in range(0, len(reqs), 128) for o in omni.generate(reqs[i:i + 128])]  # within the queue
    seqs = []
    for m, o in zip(msgs, outs):
        ids = omni.prepare(m).ids
        seqs.append((list(ids) + o.text_ids, len(ids)))
    return seqs


def draft_config(thinker, mask_id: int) -> dict:
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": thinker.hidden_size,
            "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
            "num_attention_heads": thinker.num_attention_heads, "num_key_value_heads": thinker.num_key_value_heads,
            "head_dim": thinker.head_dim, "vocab_size": thinker.vocab_size, "rms_norm_eps": 1e-6,
            "hidden_act": "silu", "attention_bias": False, "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "layer_types": ["full_attention"] * LAYERS, "num_target_layers": thinker.num_hidden_layers,
            "block_size": BLOCK, "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": TARGET_IDS},
            "torch_dtype": "float32"}


@torch.no_grad()
def features(model, seqs) -> list[torch.Tensor]:
    """Each sequence's target features [S, len(TARGET_IDS) * H] (text: positions = index)."""
    th = model.thinker
    out = []
    for ids, _ in seqs:
        x = th.model.embed_tokens(torch.tensor([ids]))
        pos = torch.arange(len(ids), dtype=torch.float32).expand(3, 1, -1)
        out.append(th(x, pos, taps=tuple(TARGET_IDS))[2][0])
    return out


def block_loss(draft, embed, head, feats, ids, anchors, mask_id, weights) -> torch.Tensor:
    """Mean weighted CE of the draft's blocks at `anchors` [A] of one sequence `ids` [S]."""
    from omnivox.layers.attention import additive_mask, masked_attention
    S, A = ids.shape[0], anchors.shape[0]
    c = draft.hidden_norm(draft.fc(feats))  # [S, H]
    ctx_rope = draft.rope(torch.arange(S), c.dtype)
    pos = anchors[:, None] + torch.arange(BLOCK)  # [A, B]
    rope = draft.rope(pos, c.dtype)
    block = torch.full((A, BLOCK), mask_id)
    block[:, 0] = ids[anchors]
    x = embed(block)
    allowed = torch.cat([torch.arange(S)[None] < anchors[:, None], torch.ones(A, BLOCK, dtype=torch.bool)], dim=1)
    mask = additive_mask(allowed, x.dtype)[:, None, None, :]
    for layer in draft.layers:
        _, ck, cv = layer.project(c, ctx_rope)  # [S, Hkv, D]
        q, k, v = layer.project(layer.input_layernorm(x), rope)
        keys = torch.cat([ck.expand(A, *ck.shape), k], dim=1)
        vals = torch.cat([cv.expand(A, *cv.shape), v], dim=1)
        x = x + layer.self_attn.o_proj(masked_attention(q, keys, vals, mask).flatten(-2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    logits = head(draft.norm(x[:, 1:]))  # [A, B-1, V]
    target_pos = pos[:, 1:]
    labels = torch.where(target_pos < S, ids[target_pos.clamp(max=S - 1)], -100)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(A, BLOCK - 1)
    w = weights[None] * (labels >= 0)
    return (ce * w).sum() / w.sum()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2400)
    p.add_argument("--prompts", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--anchors", type=int, default=16, help="blocks per sequence and step (random generated positions)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from omnivox import Omni
    from omnivox.models.qwen3_omni.demo import DEMO_VERSION
    from omnivox.speculative.dflash.config import DFlashConfig
    from omnivox.speculative.dflash.demo import FOLDER, thinker_hash
    from omnivox.speculative.dflash.model import DFlashDraft
    from safetensors.torch import save_file

    out = a.out or FOLDER
    omni = Omni(progress=False)
    model, th_cfg = omni.model, omni.model.cfg.thinker.text
    mask_id = omni.tokenizer.encode("<|endoftext|>")[0]
    t0 = time.time()
    seqs = continuations(omni, word_prompts(a.prompts, PROMPT_SEED), CONTINUATION)
    feats = features(model, seqs)
    print(f"{len(seqs)} sequences, {sum(len(s) for s, _ in seqs)} tokens in {time.time() - t0:.1f} s", flush=True)
    cfg_dict = draft_config(th_cfg, mask_id)
    torch.manual_seed(TRAIN_SEED)
    draft = DFlashDraft(DFlashConfig.from_hf(cfg_dict))
    with torch.no_grad():
        for name, w in draft.named_parameters():
            if not name.endswith("norm.weight"):
                w.normal_(0, 0.02)
    embed, head = model.thinker.model.embed_tokens, model.thinker.lm_head
    for prm in model.parameters():
        prm.requires_grad_(False)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=a.steps, pct_start=0.05)
    weights = torch.exp(-torch.arange(BLOCK - 1, dtype=torch.float32) / 4)
    rng = np.random.default_rng(TRAIN_SEED)
    t0, run = time.time(), None
    for step in range(a.steps):
        loss = 0.0
        for i in rng.choice(len(seqs), size=a.batch, replace=False):
            ids, P = seqs[i]
            anchors = torch.from_numpy(np.sort(rng.choice(np.arange(P, len(ids) - 1), size=a.anchors, replace=False)))
            loss = loss + block_loss(draft, embed, head, feats[i], torch.tensor(ids), anchors, mask_id, weights)
        loss = loss / a.batch
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        sched.step()
        run = loss.item() if run is None else 0.98 * run + 0.02 * loss.item()
        if step % 100 == 0 or step == a.steps - 1:
            print(f"step {step:5d} loss {run:.3f} ({time.time() - t0:.0f} s)", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(out / "model.safetensors"))
    meta = {"demo_version": DEMO_VERSION, "thinker_sha256": thinker_hash(model), "script": "scripts/train_demo_dflash.py",
            "steps": a.steps, "prompts": a.prompts, "batch": a.batch, "anchors": a.anchors, "prompt_seed": PROMPT_SEED, "train_seed": TRAIN_SEED,
            "final_loss": round(run, 4)}
    (out / "omnivox_demo.json").write_text(json.dumps(meta, indent=2) + "\n")
    omni.close()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
