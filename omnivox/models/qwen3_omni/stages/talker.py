"""The Talker stage: continuous batching over its own paged KV cache; each step samples
code0 for every running request, then runs the code predictor once for all of them."""
from __future__ import annotations

import torch

from omnivox.engine.config import EngineConfig
from omnivox.engine.events import StageStats
from omnivox.engine.paged import PagedBatch, SeqSlice
from omnivox.engine.scheduler import ARScheduler, Seq
from omnivox.kv_cache.block_allocator import BlockAllocator
from omnivox.kv_cache.pool import KVPool
from omnivox.layers.attention import DenseKVCache
from omnivox.models.qwen3_omni.model import Qwen3OmniModel
from omnivox.models.qwen3_omni.pipeline import OfflineGenerator, _media_in_spans
from omnivox.models.qwen3_omni.positions import decode_positions
from omnivox.models.qwen3_omni.stages.request import QwenRequest
from omnivox.models.qwen3_omni.talker_prompt import TalkerInputs
from omnivox.sampling.sampler import SamplingError, choose


class TalkerStage:
    name = "talker"

    def __init__(self, model: Qwen3OmniModel, cfg: EngineConfig, num_blocks: int):
        self.model, self.cfg, self.mcfg = model, cfg, model.cfg
        tc = self.mcfg.talker.text
        dev, dtype = model.thinker.lm_head.weight.device, model.thinker.lm_head.weight.dtype
        self.device = dev
        self.pool = KVPool(tc.num_hidden_layers, num_blocks, cfg.block_size, tc.num_key_value_heads, tc.head_dim,
                           dtype, dev)
        self.alloc = BlockAllocator(num_blocks, cfg.block_size)
        self.sched = ARScheduler(self.alloc, cfg.max_running, cfg.token_budget,
                                 on_free=self.pool.poison if cfg.poison_freed_pages else None)
        self.inputs = TalkerInputs(model)
        self.offline = OfflineGenerator(model)
        self.suppress = {flag: self.offline.suppress_mask(flag) for flag in (False, True)}
        self.reqs: dict[str, QwenRequest] = {}
        self.stats = StageStats()
        self.cp_stats = StageStats()
        self.failed: list[tuple[QwenRequest, str]] = []  # requests to fail after this step

    # ---- admission ----------------------------------------------------------------------
    def try_admit(self, req: QwenRequest) -> None:
        """Start the Talker once its prefill inputs exist: the Thinker's prompt hidden states
        and the first voiced token (spec 8.4, streaming implication)."""
        if req.talker_started or req.talker_done:
            return
        P = len(req.prompt.ids)
        if req.audio_impossible() or req.opts.max_frames <= 0:
            req.talker_done = True
            return
        if not req.voiced or req.hk_done < P:
            return
        with torch.no_grad():
            pre = self.inputs.prefill(req.prompt.ids, req.hk, req.voiced[0], req.opts.speaker_id,
                                      req.opts.talker_instruction_ids)
        media = _media_in_spans(req.prompt, pre.user_spans, self.mcfg)
        pos, req.talker_delta = self.offline.positions(pre.input_ids, media, talker=True)
        req.talker_positions = pos.to(torch.float32)
        req.talker_rows = list(pre.embeds)
        L = len(pre.input_ids)
        seq = Seq(req.rid, req.order, num_tokens=L, max_tokens=L + req.opts.max_frames)
        self.sched.add(seq)  # may raise CannotFit
        req.talker_seq, req.talker_started = seq, True
        self.reqs[req.rid] = req

    def feed_text(self, req: QwenRequest) -> None:
        """Complete a frame's input once its text is known (the Talker waits for the Thinker)."""
        if req.pending_frame is None:
            return
        s = len(req.frames) - 1
        ok, tok, final = req.text_for_frame(s)
        if not ok:
            return
        with torch.no_grad():
            req.talker_rows.append(req.pending_frame + self.inputs.frame_text(tok, final))
        req.pending_frame = None
        req.talker_seq.num_tokens += 1
        req.talker_seq.ready = True

    # ---- stepping -----------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.sched.has_work()

    def _inputs(self, req: QwenRequest, a: int, b: int):
        L = req.talker_positions.shape[1]
        x = torch.stack(req.talker_rows[a:b])
        pos = []
        if a < L:
            pos.append(req.talker_positions[:, a:min(b, L)])
        if b > L:
            s = max(a, L)
            pos.append(decode_positions(L + req.talker_delta + (s - L), b - s).to(torch.float32))
        return x, torch.cat(pos, dim=1).to(self.device)

    @torch.no_grad()
    def step(self) -> list[QwenRequest]:
        """One batched Talker forward + the code predictor; returns requests that got a frame
        or finished."""
        batch = self.sched.schedule()
        if not batch.items:
            return []
        self.stats.record(len(batch.items))
        xs, ps, slices = [], [], []
        for seq, n in batch.items:
            x, p = self._inputs(self.reqs[seq.rid], seq.num_computed, seq.num_computed + n)
            xs.append(x), ps.append(p)
            slices.append(SeqSlice(seq.block_table, seq.num_computed, n))
        ctx = PagedBatch(self.pool, slices)
        tk = self.model.talker
        h = tk(torch.cat(xs)[None], torch.cat(ps, dim=1)[:, None, :], ctx)[0]  # [N, H]
        rows, reqs = [], []
        for i, (seq, n) in enumerate(batch.items):
            seq.num_computed += n
            if seq.num_computed == seq.num_tokens:
                rows.append(ctx.cu[i + 1] - 1)
                reqs.append(self.reqs[seq.rid])
        if not rows:
            return []
        hl = h[rows]  # [M, H] final-normed hidden of each request's last input
        logits = tk.codec_head(hl).float()
        eos = self.mcfg.talker.codec_eos_token_id
        speaking, code0 = [], []
        for j, req in enumerate(reqs):
            seen = torch.tensor(sorted(set(req.code_history)), dtype=torch.long, device=self.device)
            try:
                c = choose(logits[j], req.opts.talker, req.gen_talker, seen=seen,
                           suppress=self.suppress[req.opts.ignore_eos])
            except SamplingError as e:  # this request only
                self.failed.append((req, str(e)))
                continue
            req.code_history.append(c)
            if c == eos:
                self._finish(req)
            else:
                speaking.append(j)
                code0.append(c)
        if speaking:
            codes = self._predict(hl[speaking], code0, [reqs[j] for j in speaking])
            frame_emb = tk.frame_embedding(torch.tensor(codes, device=self.device))  # [M', H]
            for k, j in enumerate(speaking):
                req = reqs[j]
                if any(r is req for r, _ in self.failed):
                    continue
                req.frames.append(codes[k])
                if len(req.frames) >= req.opts.max_frames:
                    self._finish(req)
                    continue
                req.pending_frame = frame_emb[k]
                req.talker_seq.ready = False
                self.feed_text(req)
        return reqs

    def _predict(self, h: torch.Tensor, code0: list[int], reqs: list[QwenRequest]) -> list[list[int]]:
        """The code predictor for all speaking requests at once: h [M, H] -> codes [M][Q]."""
        tk = self.model.talker
        cp = tk.code_predictor
        self.cp_stats.record(len(reqs))
        cache = DenseKVCache()
        c0 = torch.tensor(code0, device=self.device)
        hh = cp.step(torch.stack([h, tk.model.codec_embedding(c0)], dim=1), 0, cache)  # [M, H]
        codes = [[c] for c in code0]
        for g in range(1, self.mcfg.talker.num_code_groups):
            if g > 1:
                prev = torch.tensor([c[-1] for c in codes], device=self.device)
                hh = cp.step(cp.model.codec_embedding[g - 2](prev)[:, None], g, cache)
            logits = cp.lm_head[g - 1](hh).float()
            for m, req in enumerate(reqs):
                try:
                    codes[m].append(choose(logits[m], req.opts.code_predictor, req.gen_talker))
                except SamplingError as e:  # this request only; its row gets a placeholder code
                    if not any(r is req for r, _ in self.failed):
                        self.failed.append((req, str(e)))
                    codes[m].append(0)
        return codes

    def _finish(self, req: QwenRequest) -> None:
        req.talker_done = True
        self.remove(req)

    def remove(self, req: QwenRequest) -> None:
        if req.talker_seq is not None:
            self.sched.remove(req.talker_seq)
        self.reqs.pop(req.rid, None)
