"""The Dual-AR stage: the slow AR over a paged KV cache under continuous batching, with the
fast AR's per-frame inner loop nested in the same step and batched across every request that
sampled a semantic token.

Per step (spec 8): one flattened slow-AR forward over every scheduled sequence's new columns
-> semantic token for each sequence whose inputs are all computed (sampled per mode group,
each row from its own generator) -> rows that drew <|im_end|> stop, their frame dropped ->
one `decode_frame` over the others -> each frame is kept and, unless the frame budget is
spent, becomes the sequence's next input column.
"""
from __future__ import annotations

import hashlib
import time

import torch

from omnivox.engine.config import EngineConfig
from omnivox.engine.events import StageStats
from omnivox.engine.paged import PagedBatch, SeqSlice
from omnivox.engine.scheduler import ARScheduler, Seq
from omnivox.errors import InputError
from omnivox.kv_cache.block_allocator import BlockAllocator
from omnivox.kv_cache.pool import KVPool
from omnivox.models.fish_s2.fast_ar import FastAR, decode_frame
from omnivox.models.fish_s2.generate import frame_budget, max_prompt_len
from omnivox.models.fish_s2.sampler import SemanticState, make_generator, sample_residual, sample_semantic
from omnivox.models.fish_s2.slow_ar import SlowAR
from omnivox.models.fish_s2.stages.request import FishRequest


def kv_blocks(slow: SlowAR, cfg: EngineConfig) -> int:
    """Pages of the slow AR's KV pool: the whole memory budget (the fast AR's cache is per step)."""
    t = slow.cfg.text
    per = KVPool.bytes_per_block(t.n_layer, cfg.block_size, t.n_local_heads, t.head_dim, slow.norm.weight.dtype)
    return max(1, int(cfg.kv_cache_mb * 2**20 // per))


def prefix_keys(matrix: torch.Tensor, block_size: int) -> list[int]:
    """One chained key per full block of the prompt. A position's input is its whole column
    (token id and every code row), so a reference voice is keyed on its codes, not its tokens."""
    cols = matrix.T.contiguous().numpy()  # [T, rows]
    keys, parent = [], b""
    for b in range(cols.shape[0] // block_size):
        parent = hashlib.sha1(parent + cols[b * block_size:(b + 1) * block_size].tobytes()).digest()
        keys.append(int.from_bytes(parent[:8], "big"))
    return keys


class DualARStage:
    name = "slow_ar"

    def __init__(self, slow: SlowAR, fast: FastAR, cfg: EngineConfig, residual_size: int):
        self.slow, self.fast, self.cfg, self.mcfg = slow, fast, cfg, slow.cfg
        self.device = slow.norm.weight.device
        t = self.mcfg.text
        blocks = kv_blocks(slow, cfg)
        self.pool = KVPool(t.n_layer, blocks, cfg.block_size, t.n_local_heads, t.head_dim,
                           slow.norm.weight.dtype, self.device)
        self.alloc = BlockAllocator(blocks, cfg.block_size)
        self.sched = ARScheduler(self.alloc, cfg.max_running, cfg.token_budget,
                                 on_free=self.pool.poison if cfg.poison_freed_pages else None)
        self.fast_cache = fast.new_cache()
        self.residual_size = residual_size
        self.reqs: dict[str, FishRequest] = {}
        self.stats = StageStats()
        self.fast_stats = StageStats()

    # ---- admission ----------------------------------------------------------------------
    def admit(self, req: FishRequest) -> None:
        """Check the prompt, set up the request's sampler state and queue its sequence."""
        T, limit = req.prompt.length, max_prompt_len(self.mcfg)
        if req.prompt.matrix.shape[0] != self.mcfg.num_rows:
            raise InputError(f"prompt must have {self.mcfg.num_rows} rows, got {req.prompt.matrix.shape[0]}")
        if T == 0 or T > limit:
            raise InputError(f"prompt has {T} tokens; it must be 1..{limit} "
                             f"(max_seq_len {self.mcfg.text.max_seq_len} minus the output reserve)")
        p = req.opts.sampling
        req.generator = make_generator(p.seed, self.device)
        req.sem_state = SemanticState.fresh(1, p.ras_window, p.penalty_window, self.device)
        req.budget = frame_budget(self.mcfg, T, req.opts.max_frames)
        keys = prefix_keys(req.prompt.matrix, self.cfg.block_size) if self.cfg.prefix_cache else []
        # the last frame is never fed back: T + budget - 1 positions at most
        seq = Seq(req.rid, req.order, num_tokens=T, max_tokens=T + max(req.budget, 1) - 1, prefix_keys=keys)
        self.sched.add(seq)  # may raise CannotFit
        req.seq = seq
        self.reqs[req.rid] = req

    # ---- stepping -----------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.sched.has_work()

    @torch.no_grad()
    def step(self) -> list[FishRequest]:
        """One batched slow-AR forward plus the fast AR; returns requests whose AR finished."""
        batch = self.sched.schedule()
        if not batch.items:
            return []
        self.stats.record(len(batch.items))
        ids, codes, pos, slices = [], [], [], []
        for seq, n in batch.items:
            i, c = self.reqs[seq.rid].columns(seq.num_computed, seq.num_computed + n, self.mcfg.semantic_begin)
            ids.append(i), codes.append(c)
            pos.append(torch.arange(seq.num_computed, seq.num_computed + n))
            slices.append(SeqSlice(seq.block_table, seq.num_computed, n))
        ctx = PagedBatch(self.pool, slices)
        dev = self.device
        out = self.slow(torch.cat(ids)[None].to(dev), torch.cat(codes)[None].to(dev), torch.cat(pos)[None].to(dev), ctx)
        rows, reqs = [], []
        for i, (seq, n) in enumerate(batch.items):
            seq.num_computed += n
            if seq.prefix_keys:
                self.sched.register_prefix(seq)
            if seq.num_computed == seq.num_tokens:
                rows.append(ctx.cu[i + 1] - 1)
                reqs.append(self.reqs[seq.rid])
        if not rows:
            return []
        logits = self.slow.logits(out.hidden[0, rows])  # [M, V]
        no_eos = [j for j, r in enumerate(reqs) if r.opts.ignore_eos]
        if no_eos:  # benchmarks: run to the frame limit
            logits[no_eos, self.mcfg.eos_id] = float("-inf")
        tokens = self._sample_semantic(reqs, logits)
        return self._frames(reqs, tokens, self.slow.fast_input(out)[0, rows])

    def _sample_semantic(self, reqs: list[FishRequest], logits: torch.Tensor) -> list[int]:
        """One token per request; rows are grouped by sampler layout (mode and window sizes)."""
        tokens = [0] * len(reqs)
        groups: dict[tuple, list[int]] = {}
        for j, r in enumerate(reqs):
            p = r.opts.sampling
            groups.setdefault((p.mode, p.ras_window, p.penalty_window, p.sgl_ras_window), []).append(j)
        for rows in groups.values():
            sub = [reqs[j] for j in rows]
            state = SemanticState.concat([r.sem_state for r in sub]) if len(sub) > 1 else sub[0].sem_state
            got = sample_semantic(logits[rows], [r.opts.sampling for r in sub], state,
                                  [r.generator for r in sub], self.mcfg)
            for k, (j, r) in enumerate(zip(rows, sub)):
                r.sem_state = state.select([k]) if len(sub) > 1 else state
                tokens[j] = int(got[k])
        return tokens

    def _frames(self, reqs: list[FishRequest], tokens: list[int], h: torch.Tensor) -> list[FishRequest]:
        """Stop on <|im_end|> (frame dropped), else run the fast AR for all the others at once."""
        cfg, done = self.mcfg, []
        going = []
        for j, (req, t) in enumerate(zip(reqs, tokens)):
            if t == cfg.eos_id:
                self._finish(req, "stop")
                done.append(req)
            else:
                going.append(j)
        if not going:
            return done
        self.fast_stats.record(len(going))
        sub = [reqs[j] for j in going]
        c0 = (torch.tensor([tokens[j] for j in going], device=self.device) - cfg.semantic_begin)
        c0 = c0.clamp(0, cfg.codebook_size - 1)
        params, gens = [r.opts.sampling for r in sub], [r.generator for r in sub]
        frames = decode_frame(self.fast, h[going], c0, self.fast_cache,
                              lambda logits, p: sample_residual(logits, params, gens, self.residual_size))
        for req, frame in zip(sub, frames.tolist()):
            req.frames.append(frame)
            if len(req.frames) >= req.budget:
                self._finish(req, "length")
                done.append(req)
            else:
                req.seq.num_tokens += 1  # the frame is the next input column
        return done

    def _finish(self, req: FishRequest, reason: str) -> None:
        req.ar_done, req.finish_reason, req.ar_done_time = True, reason, time.monotonic()
        self.remove(req)

    def remove(self, req: FishRequest) -> None:
        if req.seq is not None:
            self.sched.remove(req.seq)
        self.reqs.pop(req.rid, None)
