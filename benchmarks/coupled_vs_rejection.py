"""Would rejection sampling accept more than coupled drafting? For the demo's learned drafts
(DFlash, EAGLE-3), at every generated position of the benchmark's held-out requests
(`benchmarks/speculative.py`: the same prompts, seeds and temperatures), the first draft
position's acceptance rate under both rules, computed from the two distributions:

- coupled (omnivox): the draft draws with the noise the Thinker's draw will use (Gumbel-max,
  same temperature and suppression): P[argmax(log q + g) = argmax(log p + g)], over `--draws`
  noise draws per position;
- rejection sampling (vLLM's rule, what `"acceptance": "rejection"` would do): accept x ~ q with
  min(1, p(x) / q(x)), i.e. sum_x min(p(x), q(x)) = 1 - TV(p, q);
- the Thinker's probability mass on ids the draft can propose at all (EAGLE-3: its draft
  vocabulary), a bound on both.

p: the demo Thinker's distribution after the position's token (dense forward, temperature 0.7),
q: the draft's first proposal there (the engine's modules, dense: `scripts/train_demo_draft.py`'s
`block_logits` / `chain_logits`). Not a test; prints one table and writes
benchmarks/results/coupled_vs_rejection_cpu.txt.

    python benchmarks/coupled_vs_rejection.py [--tokens 64] [--draws 256]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts"), str(ROOT / "benchmarks")]


def draft_logits(method: str, model, feats, ids, anchors, mask_id) -> torch.Tensor:
    """The draft's first-proposal logits over the Thinker's vocabulary [A, V] at `anchors` (the
    pending token's positions) of one sequence."""
    from omnivox.speculative.demo import demo_draft_folder
    from train_demo_draft import block_logits, chain_logits
    th = model.thinker
    folder = demo_draft_folder(method)
    if method == "dflash":
        from omnivox.speculative.dflash.drafter import load_draft
        draft = load_draft(folder, model.cfg.thinker.text, torch.float32, "cpu")
        return block_logits(draft, th.model.embed_tokens, th.lm_head, feats, ids, anchors, mask_id)[:, 0].float()
    from omnivox.speculative.eagle3.drafter import load_head
    head, _ = load_head(folder, model.cfg.thinker.text, torch.float32, "cpu")
    step0 = next(chain_logits(head, th.model.embed_tokens, feats, ids, 1))  # index p proposes the id at p + 2
    return head.to_target(step0[anchors - 1])


@torch.no_grad()
def measure(omni, prompts, temperature: float, tokens: int, draws: int) -> list[tuple]:
    from speculative import in_loop
    from train_demo_draft import TARGET_IDS
    model = omni.model
    th = model.thinker
    mask_id = omni.tokenizer.encode("<|endoftext|>")[0]
    suppress = omni.engine.stages.stages["thinker"].adapter.suppress.cpu()
    sampling = dict(greedy=True) if temperature == 0 else dict(temperature=temperature)
    outs = omni.generate([dict(messages=[{"role": "user", "content": p}], max_tokens=tokens, ignore_eos=True,
                               return_audio=False, seed=1000 + i, **sampling) for i, p in enumerate(prompts)])
    g = torch.Generator().manual_seed(0)
    acc = {m: [] for m in ("dflash", "eagle3")}
    for p_text, out in zip(prompts, outs):
        prompt = list(omni.build_prompt([{"role": "user", "content": p_text}]).ids)
        ids = torch.tensor(prompt + out.text_ids)
        P, S = len(prompt), len(ids)
        x = th.model.embed_tokens(ids[None])
        pos = torch.arange(S, dtype=torch.float32).expand(3, 1, -1)
        hidden, _, feats = th(x, pos, taps=tuple(TARGET_IDS))
        anchors = torch.arange(P, S - 1)  # pending token at a; the Thinker's next id is ids[a + 1]
        free = torch.tensor([not in_loop(ids[:a + 1].tolist()) for a in anchors.tolist()])
        lp = th.lm_head(hidden[0, anchors]).float().masked_fill(suppress, float("-inf"))  # [A, V]
        for method in acc:
            lq = draft_logits(method, model, feats[0], ids, anchors, mask_id).masked_fill(suppress, float("-inf"))
            if temperature == 0:
                coupled = (lq.argmax(-1) == lp.argmax(-1)).float()
                rejection, reach = coupled, torch.ones_like(coupled)
            else:
                p, q = (lp / temperature).softmax(-1), (lq / temperature).softmax(-1)
                gumbel = -torch.log(-torch.log(torch.rand(draws, *lp.shape, generator=g).clamp_min(1e-20)))
                coupled = ((lq / temperature + gumbel).argmax(-1) == (lp / temperature + gumbel).argmax(-1)).float().mean(0)
                rejection = torch.minimum(p, q).sum(-1)
                reach = p.masked_fill(~torch.isfinite(lq), 0).sum(-1)
            acc[method].append(torch.stack([coupled, rejection, reach, free.float()], dim=1))
    rows = []
    for method, parts in acc.items():
        a = torch.cat(parts)
        outside = a[a[:, 3] > 0]
        rows.append((method, temperature, len(a), *a[:, :3].mean(0).tolist(), *outside[:, :3].mean(0).tolist()))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--draws", type=int, default=256, help="noise draws per position for the coupled rate")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "coupled_vs_rejection_cpu.txt")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from omnivox import Omni
    from speculative import held_out_prompts
    omni = Omni(progress=False)
    prompts = held_out_prompts()
    lines = [f"# python benchmarks/coupled_vs_rejection.py --tokens {a.tokens} --draws {a.draws}: demo model, "
             f"held-out prompts, CPU, {time.strftime('%Y-%m-%d')}; first draft position's acceptance rate",
             f"{'method':8} {'temp':>4} {'positions':>9} | {'coupled':>7} {'rejection':>9} {'reach':>6} | outside loops: "
             f"{'coupled':>7} {'rejection':>9} {'reach':>6}"]
    print("\n".join(lines), flush=True)
    try:
        for temperature in (0.0, 0.7):
            for r in measure(omni, prompts, temperature, a.tokens, a.draws):
                line = (f"{r[0]:8} {r[1]:>4} {r[2]:>9} | {r[3]:>7.3f} {r[4]:>9.3f} {r[5]:>6.3f} | {'':15}"
                        f"{r[6]:>7.3f} {r[7]:>9.3f} {r[8]:>6.3f}")
                lines.append(line)
                print(line, flush=True)
    finally:
        omni.close()
    a.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
