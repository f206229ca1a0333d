"""The Thinker adapter's speculative-decoding half (`ARStep.draft` / `settle`): which decoding rows
draft and how many ids each may propose, one `Drafter.propose` call for all of them (with the
sampling each drafted position will be verified with, for a drafter that draws the same way), and
the settling of their draft state."""
from __future__ import annotations

from omnivox.engine.scheduler import Seq
from omnivox.sampling import noise
from omnivox.sampling.batched import SamplingTensors, seen_mask
from omnivox.speculative.drafter import DraftRow, DraftSampling


class ThinkerDrafting:
    """Mixed into `ThinkerAdapter`: reads its `states`, `cfg`, `context`, `drafter`, `undraftable`,
    `suppress`, `device` and `mcfg`."""

    def draft(self, seqs: list[Seq]) -> list[list[int]]:
        """One drafter call for the decoding rows that may draft: proposals never longer than what a
        row may still generate after the id it surely draws, cut before a suppressed or media id."""
        rows = [r for r in (self._draft_row(s) for s in seqs) if r is not None]
        if not rows:
            return [[] for _ in seqs]
        sampling = self._draft_sampling(rows) if self.drafter.wants_sampling() else None
        drafts = dict(zip((r.rid for r in rows), self.drafter.propose(rows, sampling).host()))
        out = []
        for s in seqs:
            ids = drafts.get(s.rid, [])
            out.append(ids[:next((j for j, t in enumerate(ids) if t < 0 or t in self.undraftable), len(ids))])
        return out

    def _draft_row(self, seq: Seq) -> DraftRow | None:
        st = self.states[seq.rid]
        req = st.req
        if not st.closed or st.done or not req.text_ids or not req.opts.speculative:
            return None
        room = min(self.cfg.speculative.num_speculative_tokens, req.opts.max_tokens - len(req.text_ids) - 1)
        if self.context:
            room = min(room, self.context - req.prompt_tokens - len(req.text_ids) - 1)
        if room <= 0:
            return None
        return DraftRow(seq.rid, req.prompt.ids + req.text_ids, seq.num_computed, seq.block_table, room)

    def _draft_sampling(self, rows: list[DraftRow]) -> DraftSampling:
        """Each proposal position sampled as the Thinker's draw there will be (its noise step)."""
        width = max(r.k for r in rows)
        params, seeds, steps, seen = [], [], [], []
        for r in rows:
            q = self.states[r.rid].req
            for j in range(width):
                params.append(q.opts.thinker)
                seeds.append(q.seed)
                steps.append(len(q.text_ids) + j)
            seen.append(q.text_ids)
        t = SamplingTensors.build(params, seeds, steps, self.device)
        mask = seen_mask(seen, self.mcfg.thinker.text.vocab_size, self.device) if t.any_penalty else None
        return DraftSampling(t, width, mask, self.suppress, noise.THINKER)

    def settle(self, kept: dict[str, int]) -> None:
        if self.drafter is not None:
            self.drafter.settle(kept)
