"""Train one of the built-in demo model's learned drafts on CPU (seeded, bounded): a DFlash draft or
an EAGLE-3 head, by distillation from the demo Thinker's greedy continuations, written to
omnivox/speculative/{dflash,eagle3}/demo_draft/ with the demo's version and a hash of the demo
Thinker (`speculative/demo.py` refuses any other). Both methods: the same data, the same steps,
batch, optimiser and seeds.

1. Prompts: seeded word salads from the demo corpus (`PROMPT_SEED`; the benchmark's held-out
   prompts use another seed), chat-templated; the demo Thinker's greedy continuations (the
   engine, `ignore_eos`).
2. Target features: the Thinker's layers `TARGET_IDS` over each whole sequence (one dense forward).
3. DFlash: anchors at random generated positions a (the block [token a, mask x 7] at positions
   a..a+7, its context the features of positions [0, a)); loss: cross-entropy of the draft's
   logits (the Thinker's frozen LM head) against the Thinker's own next tokens a+1..a+7, later
   positions weighted less. The draft's forward is the engine's (`DFlashLayer.project`, its
   attention over context then block, no causal mask) on dense tensors.
4. EAGLE-3 (SGLang's layout, `fc` over the two demo layers): a draft vocabulary of the
   `DRAFT_VOCAB` ids most frequent in the continuations (`d2t`/`t2d`); the "training-time test":
   the head unrolled `TTT` steps at every position at once (step 0 on the target features, step t
   on step t - 1's hidden state and the true token, attending to the target entries up to its
   index and to its own earlier steps there, as the engine's chain does), cross-entropy against
   the Thinker's next tokens (where they are in the draft vocabulary) at generated positions,
   later steps weighted less. The head's pieces are the engine's (`Eagle3Head.project` / `finish`
   / `logits`).

    python scripts/train_demo_draft.py --method dflash|eagle3 [--steps 2400] [--prompts 1024] [--batch 8]
        [--anchors 16] [--out DIR]
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
DRAFT_VOCAB, TTT = 512, 4
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
        ids = omni.build_prompt(m).ids
        seqs.append((list(ids) + o.text_ids, len(ids)))
    return seqs


def dflash_config(thinker, mask_id: int) -> dict:
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


def block_logits(draft, embed, head, feats, ids, anchors, mask_id) -> torch.Tensor:
    """The DFlash draft's logits [A, BLOCK - 1, V] for its blocks at `anchors` [A] of one sequence
    `ids` [S] (block position j + 1 proposes the id at anchor + 1 + j)."""
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
    return head(draft.norm(x[:, 1:]))  # [A, B-1, V]


def block_loss(draft, embed, head, feats, ids, anchors, mask_id, weights) -> torch.Tensor:
    """Mean weighted CE of the draft's blocks at `anchors` [A] of one sequence `ids` [S]."""
    S, A = ids.shape[0], anchors.shape[0]
    logits = block_logits(draft, embed, head, feats, ids, anchors, mask_id)
    target_pos = anchors[:, None] + torch.arange(1, BLOCK)
    labels = torch.where(target_pos < S, ids[target_pos.clamp(max=S - 1)], -100)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(A, BLOCK - 1)
    w = weights[None] * (labels >= 0)
    return (ce * w).sum() / w.sum()


def dflash_model(model, mask_id: int):
    """(config dict, a fresh DFlash draft, loss(draft, feats, ids, P, rng) for one sequence)."""
    from omnivox.speculative.dflash.config import DFlashConfig
    from omnivox.speculative.dflash.model import DFlashDraft

    cfg = dflash_config(model.cfg.thinker.text, mask_id)
    draft = DFlashDraft(DFlashConfig.from_hf(cfg))
    embed, head = model.thinker.model.embed_tokens, model.thinker.lm_head
    weights = torch.exp(-torch.arange(BLOCK - 1, dtype=torch.float32) / 4)

    def loss(feats, ids, P, rng, anchors):
        picked = torch.from_numpy(np.sort(rng.choice(np.arange(P, len(ids) - 1), size=anchors, replace=False)))
        return block_loss(draft, embed, head, feats, ids, picked, mask_id, weights)
    return cfg, draft, loss


def eagle3_config(thinker, draft_vocab: int) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": thinker.hidden_size,
            "intermediate_size": INTERMEDIATE, "num_hidden_layers": 1,
            "num_attention_heads": thinker.num_attention_heads, "num_key_value_heads": thinker.num_key_value_heads,
            "head_dim": thinker.head_dim, "vocab_size": thinker.vocab_size, "draft_vocab_size": draft_vocab,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "max_position_embeddings": 4096,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "norm_before_residual": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": TARGET_IDS, "use_aux_hidden_state": True},
            "torch_dtype": "float32"}


def draft_vocabulary(seqs, vocab: int, size: int) -> torch.Tensor:
    """The `size` ids most frequent in the continuations (ties: lower id), sorted [size]."""
    counts = np.zeros(vocab, dtype=np.int64)
    for ids, P in seqs:
        np.add.at(counts, np.asarray(ids[P:]), 1)
    return torch.from_numpy(np.sort(np.argsort(-counts, kind="stable")[:size]))


def chain_logits(head, embed, feats, ids, steps: int):
    """The EAGLE-3 head unrolled `steps` at every index p of one sequence `ids` [S] at once: yields
    each step's draft-vocabulary logits [S - 1, Vd] (step t at index p proposes the id at p + 2 +
    t; index p reads the token at p + 1 and the feature of p, later steps the true tokens)."""
    from omnivox.layers.attention import additive_mask, masked_attention
    n = ids.shape[0] - 1
    p = torch.arange(n)
    hidden, token = head.fuse(feats[:n]), ids[1:]
    keys, vals, blocks = [], [], [p[None] <= p[:, None]]
    for t in range(steps):
        x = embed(token)
        q, k, v, residual = head.project(x, hidden, p + t)
        keys.append(k)
        vals.append(v)
        if t:  # step t also sees its index's earlier steps (the chain's own entries)
            blocks.append(torch.eye(n, dtype=torch.bool))
        mask = additive_mask(torch.cat(blocks, dim=1), x.dtype)
        out = masked_attention(q[None], torch.cat(keys)[None], torch.cat(vals)[None], mask)[0]
        hidden = head.finish(out, residual)
        yield head.logits(hidden)
        token = torch.cat([ids[2 + t:], ids.new_zeros(1 + t)])  # teacher forcing: the true next tokens


def chain_loss(head, embed, feats, ids, P, weights, labels) -> torch.Tensor:
    """Mean weighted CE of the head unrolled TTT steps over one sequence `ids` [S] at its generated
    positions; `labels` [V] maps a Thinker id to its draft id (-100: outside the draft vocabulary)."""
    S = ids.shape[0]
    p = torch.arange(S - 1)
    total, wsum = 0.0, 0.0
    for t, logits in enumerate(chain_logits(head, embed, feats, ids, TTT)):
        target = p + 2 + t
        label = torch.where((target < S) & (p >= P - 1), labels[ids[target.clamp(max=S - 1)]], -100)
        total = total + weights[t] * F.cross_entropy(logits, label, ignore_index=-100, reduction="sum")
        wsum = wsum + weights[t] * (label >= 0).sum()
    return total / max(float(wsum), 1.0)


def eagle3_model(model, seqs):
    """(config dict, a fresh EAGLE-3 head with its d2t/t2d, loss(feats, ids, P, rng, anchors))."""
    from omnivox.speculative.eagle3.config import Eagle3Config
    from omnivox.speculative.eagle3.model import Eagle3Head

    th = model.cfg.thinker.text
    keep = draft_vocabulary(seqs, th.vocab_size, DRAFT_VOCAB)
    cfg = eagle3_config(th, len(keep))
    head = Eagle3Head(Eagle3Config.from_hf(cfg), len(TARGET_IDS))
    head.d2t.copy_(keep - torch.arange(len(keep)))
    head.t2d.zero_()
    head.t2d[keep] = True
    labels = torch.full((th.vocab_size,), -100, dtype=torch.long)
    labels[keep] = torch.arange(len(keep))
    embed = model.thinker.model.embed_tokens
    weights = torch.exp(-torch.arange(TTT, dtype=torch.float32) / 4)
    return cfg, head, lambda feats, ids, P, rng, anchors: chain_loss(head, embed, feats, ids, P, weights, labels)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=("dflash", "eagle3"), required=True)
    p.add_argument("--steps", type=int, default=2400)
    p.add_argument("--prompts", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--anchors", type=int, default=16, help="DFlash: blocks per sequence and step (random generated "
                   "positions; EAGLE-3 trains at every position)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from omnivox import Omni
    from omnivox.models.qwen3_omni.demo import DEMO_VERSION
    from omnivox.speculative.demo import FOLDERS, thinker_hash
    from safetensors.torch import save_file

    out = a.out or FOLDERS[a.method]
    omni = Omni(progress=False)
    model = omni.model
    mask_id = omni.tokenizer.encode("<|endoftext|>")[0]
    t0 = time.time()
    seqs = continuations(omni, word_prompts(a.prompts, PROMPT_SEED), CONTINUATION)
    feats = features(model, seqs)
    print(f"{len(seqs)} sequences, {sum(len(s) for s, _ in seqs)} tokens in {time.time() - t0:.1f} s", flush=True)
    torch.manual_seed(TRAIN_SEED)
    cfg_dict, draft, loss_of = dflash_model(model, mask_id) if a.method == "dflash" else eagle3_model(model, seqs)
    with torch.no_grad():
        for name, w in draft.named_parameters():
            if not name.endswith("norm.weight"):
                w.normal_(0, 0.02)
    for prm in model.parameters():
        prm.requires_grad_(False)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=a.steps, pct_start=0.05)
    rng = np.random.default_rng(TRAIN_SEED)
    t0, run = time.time(), None
    for step in range(a.steps):
        loss = 0.0
        for i in rng.choice(len(seqs), size=a.batch, replace=False):
            ids, P = seqs[i]
            loss = loss + loss_of(feats[i], torch.tensor(ids), P, rng, a.anchors)
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
    meta = {"demo_version": DEMO_VERSION, "thinker_sha256": thinker_hash(model),
            "script": f"scripts/train_demo_draft.py --method {a.method}", "steps": a.steps, "prompts": a.prompts,
            "batch": a.batch, "anchors": a.anchors, "prompt_seed": PROMPT_SEED, "train_seed": TRAIN_SEED,
            "final_loss": round(run, 4), "train_seconds": round(time.time() - t0)}
    (out / "omnivox_demo.json").write_text(json.dumps(meta, indent=2) + "\n")
    omni.close()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
