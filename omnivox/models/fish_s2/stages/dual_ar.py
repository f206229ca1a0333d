"""The Dual-AR as a paged AR stage: the slow AR over paged KV under continuous batching, with
the fast AR's per-frame inner loop nested in the same step, batched over every row.

Per step (spec 8): one slow-AR forward over every scheduled row's new columns -> a semantic
token for each row whose inputs are all computed (S2's rules, batched) -> the fast AR completes
every row's frame (rows that drew <|im_end|> drop theirs) -> one read of the tokens and frames
-> each frame is kept and, unless the frame budget is spent, becomes the row's next input.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from omnivox.engine import host
from omnivox.engine.config import EngineConfig
from omnivox.engine.events import StageStats
from omnivox.engine.request import Request
from omnivox.engine.scheduler import Seq
from omnivox.errors import InputError
from omnivox.kv_cache.pool import KVPool
from omnivox.models.fish_s2.fast_ar import FastAR, decode_frame
from omnivox.models.fish_s2.slow_ar import SlowAR
from omnivox.models.fish_s2.stages.request import FishRequest
from omnivox.models.fish_s2.sampler import FishSamplingParams
from omnivox.sampling.fish_rules import FishState, FishTensors, sample_residual, sample_semantic
from omnivox.stages.admission import SeqState
from omnivox.stages.frames import SpeechARAdapter
from omnivox.stages.slots import SlotPool
from omnivox.stages.step import PagedContext, StepBatch, StepResult


PAD_SAMPLING = FishSamplingParams(mode="sglang")  # rows that pad a batch to a graph's size (greedy residuals)


def kv_blocks(slow: SlowAR, cfg: EngineConfig) -> int:
    """Pages of the slow AR's KV pool: the whole memory budget (the fast AR's cache is per step)."""
    t = slow.cfg.text
    per = KVPool.bytes_per_block(t.n_layer, cfg.block_size, t.n_local_heads, t.head_dim, slow.norm.weight.dtype)
    return max(1, int(cfg.kv_cache_mb * 2**20 // per))


@dataclass(eq=False)
class DualARState(SeqState):
    req: FishRequest
    budget: int  # frames this request may emit


@dataclass
class DualARStepInputs:
    """One slow-AR step: columns and positions, and for the sampling rows their sampling values
    and sampler-state slots (padding rows: the pool's scratch slot)."""

    ids: torch.Tensor  # [N] token ids
    codes: torch.Tensor  # [N, Nc]
    positions: torch.Tensor  # [N]
    slots: torch.Tensor  # [M] long: sampler-state slots
    sampling: FishTensors  # [M]
    ignore_eos: torch.Tensor  # [M] bool


@dataclass
class DualARStepOutputs:
    got: torch.Tensor  # [M, 1 + N] the semantic token, then the frame's codes (-1: sampling failed)


class DualARAdapter(SpeechARAdapter[DualARState]):
    def __init__(self, slow: SlowAR, fast: FastAR, cfg: EngineConfig, residual_size: int):
        self.slow, self.fast, self.cfg, self.mcfg = slow, fast, cfg, slow.cfg
        self.device = slow.norm.weight.device
        self.residual_size = residual_size
        self.fast_cache = fast.new_cache(rows=cfg.max_running)
        self.sampler_states = SlotPool(lambda n: FishState.fresh(n, self.device), cfg.max_running,
                                       on_grow=lambda: self.stage.graphs and self.stage.graphs.graphs.clear())
        self.states: dict[str, DualARState] = {}
        self.fast_stats = StageStats()
        eos = torch.zeros(self.mcfg.text.vocab_size, dtype=torch.bool, device=self.device)
        eos[self.mcfg.eos_id] = True
        self.eos_column = eos  # [V]

    # ---- admission (ARAdmission): a request's sequence and its inputs --------------------------
    def max_len(self) -> int:
        return self.mcfg.text.max_seq_len

    def start(self, req: FishRequest) -> Seq:
        return self.states[req.rid].seq

    def on_admit(self, req: FishRequest) -> None:
        """At admission: check the prompt and build its sequence; prefix keys cover whole columns
        (token id and every code row), so a reused reference voice is keyed on its codes."""
        m, T, limit = req.prompt.matrix, req.prompt.length, self.mcfg.max_prompt_len
        if m.shape[0] != self.mcfg.num_rows:
            raise InputError(f"prompt must have {self.mcfg.num_rows} rows, got {m.shape[0]}")
        if T == 0 or T > limit:
            raise InputError(f"prompt has {T} tokens; it must be 1..{limit} "
                             f"(max_seq_len {self.mcfg.text.max_seq_len} minus the output reserve)")
        st = self.states[req.rid] = DualARState(req, self.mcfg.frame_budget(T, req.opts.max_frames))
        items = [tuple(col) for col in m.T.tolist()] if self.cfg.prefix_cache else None
        # the last frame is never fed back: T + budget - 1 positions at most
        st.seq = Seq(req.rid, req.order, num_tokens=T, max_tokens=T + max(st.budget, 1) - 1, key_items=items,
                     block_size=self.cfg.block_size)

    # ---- the step (ARStep): inputs (host) -> compute (device) -> apply (host) -----------------
    def neutralize(self, inputs: DualARStepInputs) -> None:
        inputs.slots.fill_(self.sampler_states.scratch)

    def inputs(self, batch: StepBatch) -> DualARStepInputs:
        """Columns (token ids [N], codes [N, Nc]) and positions [N] of the step, and for the sampled
        rows: their sampling values and sampler-state slots (padding rows: the pool's scratch slot)."""
        pad = batch.pad
        ids, codes, pos = [], [], []
        for r in batch.rows:
            i, c = r.req.columns(r.start, r.end, self.mcfg.semantic_begin)
            ids.append(i), codes.append(c)
            pos.append(torch.arange(r.start, r.end))
        if pad:
            ids.append(torch.zeros(pad, dtype=torch.long)), pos.append(torch.zeros(pad, dtype=torch.long))
            codes.append(torch.zeros(pad, self.mcfg.num_codebooks, dtype=torch.long))
        reqs = [r.req for r in batch.sampled_rows]
        dev = self.device
        slots = self.sampler_states.slot_list([q.rid for q in reqs]) + [self.sampler_states.scratch] * pad
        return DualARStepInputs(torch.cat(ids).to(dev), torch.cat(codes).to(dev), torch.cat(pos).to(dev),
                            slots=torch.tensor(slots, dtype=torch.long, device=dev),
                            sampling=FishTensors.build([q.opts.sampling for q in reqs] + [PAD_SAMPLING] * pad,
                                                       [q.seed for q in reqs] + [0] * pad, dev),
                            ignore_eos=torch.tensor([q.opts.ignore_eos for q in reqs] + [False] * pad, device=dev))

    def compute(self, inp: DualARStepInputs, ctx: PagedContext) -> DualARStepOutputs | None:
        """The slow AR over every column, a semantic token per sampled row (S2's rules, the rows'
        sampler state gathered and scattered back in place), then the fast AR completes each frame."""
        cfg = self.mcfg
        out = self.slow(inp.ids, inp.codes, inp.positions, ctx)  # [N, ...]
        if not ctx.any_sampled():  # a prefill chunk: nothing to sample yet
            return None
        hidden = ctx.sampled(out.hidden)  # [M, dim]
        fast_in = hidden if cfg.norm_fastlayer_input else ctx.sampled(out.residual)
        logits = self.slow.logits(hidden)  # [M, V]
        logits = logits.masked_fill(inp.ignore_eos[:, None] & self.eos_column, float("-inf"))  # run to the limit
        t, slots = inp.sampling, inp.slots
        state = self.sampler_states.gather(slots)
        tokens = sample_semantic(logits, t, state, cfg)  # [M]
        c0 = (tokens - cfg.semantic_begin).clamp(0, cfg.codebook_size - 1)
        frames = decode_frame(self.fast, fast_in, c0, self.fast_cache,
                              lambda lg, p: sample_residual(lg, t, state.steps, p, self.residual_size))  # [M, N]
        self.sampler_states.scatter(slots, state)
        return DualARStepOutputs(torch.cat([tokens[:, None], frames], dim=1))

    def apply(self, batch: StepBatch, out: DualARStepOutputs | None) -> StepResult:
        if not batch.sampled:
            return StepResult.none(len(batch.rows))
        self.fast_stats.record(len(batch.sampled))
        got = host.ids(out.got)  # the step's one read of the device
        result, going = self.take_frames(batch, [(tok, frame) for tok, *frame in got], self.mcfg.eos_id)
        for _, row, frame in going:
            row.seq.num_tokens += 1  # the frame is the next input column
            row.seq.extend_keys([(frame[0] + self.mcfg.semantic_begin, *frame)])
        return result

    # ---- admission (ARAdmission): the end and stats ------------------------------------------
    def frame_budget(self, req: FishRequest) -> int:
        return self.states[req.rid].budget

    def end_frames(self, req: FishRequest, reason: str) -> None:
        self.states[req.rid].done = True
        req.finish_reason, req.text_done_time = reason, req.clock.now()
        req.frames.final = True

    def forget(self, req: Request) -> None:
        super().forget(req)
        self.sampler_states.release(req.rid)

    def stats(self) -> dict[str, StageStats]:
        return {"fast_ar": self.fast_stats}
