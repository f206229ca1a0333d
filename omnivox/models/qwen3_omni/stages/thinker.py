"""The Thinker as a paged AR stage: media encoded when a request starts, prefix keys over its
whole sequence (prompt with media digests, then the generated ids), text streamed to the client
and into the voiced stream the Talker reads."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omnivox.engine import host
from omnivox.engine.config import EngineConfig
from omnivox.engine.events import StageStats
from omnivox.engine.placement import hand_over
from omnivox.engine.prompt import Segment
from omnivox.engine.scheduler import Seq
from omnivox.errors import InputError
from omnivox.kv_cache.prefix import content_digest
from omnivox.models.qwen3_omni.media import encode_media, id_mask, positions
from omnivox.models.qwen3_omni.model import Qwen3OmniModel
from omnivox.models.qwen3_omni.processor import placeholder_runs
from omnivox.models.qwen3_omni.stages.media_rows import MediaRows
from omnivox.models.qwen3_omni.stages.request import QwenRequest
from omnivox.sampling import noise
from omnivox.sampling.batched import PAD_PARAMS, SamplingError, SamplingTensors, sample, seen_mask
from omnivox.models.qwen3_omni.stages.drafting import ThinkerDrafting
from omnivox.speculative.drafter import Drafter
from omnivox.stages.ar import ARAdapter
from omnivox.stages.step import PagedContext, Row, StepBatch, StepResult
from omnivox.stages.streamed_prompt import StreamedPromptAdmission, StreamedState
from omnivox.stages.text_stream import HookError, TextStream


def _digest(t: torch.Tensor, *facts) -> bytes:
    """A media item's content digest for its prefix-cache keys: its tensor's shape and float32
    values, and the `facts` that change what the model reads from the same values.
    NOTE: the values alone do not identify an item: a uniform image and its transpose have equal
    patches (the grid tells them apart, and so do their positions), and a video's frames at 1 and
    2 fps are the same patches at other temporal positions (`second_per_grid`)."""
    data = t.detach().float().cpu().contiguous().numpy()
    return content_digest(repr((tuple(data.shape), *facts)).encode() + data.tobytes())


def _media_digests(p) -> dict[str, list[bytes]]:
    """Each media item's prefix-key digest, by kind, in prompt order: audio by its features and the
    AuT window they are encoded with; images and videos by their patches, grid (t, h, w) and
    seconds per temporal grid step (videos)."""
    return {"audio": [_digest(f, "audio", p.audio_window_chunks) for f in p.audio_features],
            "visual": [_digest(v.pixel_values, v.kind, tuple(v.grid), float(v.second_per_grid)) for v in p.visual]}


@dataclass(eq=False)
class ThinkerState(StreamedState):
    """What the Thinker keeps per request: the prompt's input rows and positions, its text stream."""

    req: QwenRequest
    embeds: torch.Tensor  # [P, H] prompt embeddings, media scattered in
    visual_rows: np.ndarray  # [P] row of each prompt position in the deepstack features, -1 if not visual
    deepstack: list[torch.Tensor]  # per level [N_visual, H]
    positions: np.ndarray  # [3, P] float32 M-RoPE positions
    delta: float  # decode positions continue at P + delta
    text: TextStream | None = None
    restored: bool = False  # accept-layer rows of a prefix-cache hit copied back


@dataclass
class ThinkerStepInputs:
    """One Thinker step: ids (a decode step) or input rows, M-RoPE positions, and for the sampling
    rows their sampling values."""

    positions: torch.Tensor  # [3, N] float32
    ids: torch.Tensor | None = None  # [N] a decode step's generated ids
    x: torch.Tensor | None = None  # [N, H] input rows (prompt slices, generated ids), else None
    deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # flat visual rows [K], features per level
    capture: int | None = None  # the layer whose hidden states the Talker's prefill reads
    tap_positions: torch.Tensor | None = None  # [N] long: each token's index in its sequence (the drafter reads taps)
    sampling: SamplingTensors | None = None  # [M] (None: no row samples)
    seen: torch.Tensor | None = None  # [M, V] bool: ids each row drew (the repetition penalty)


@dataclass
class ThinkerStepOutputs:
    hk: torch.Tensor | None  # [N, H] the capture layer's hidden states
    ids: torch.Tensor | None  # [M] sampled ids (-1: sampling failed)


class ThinkerAdapter(ThinkerDrafting, StreamedPromptAdmission[ThinkerState], ARAdapter[ThinkerState]):
    def __init__(self, model: Qwen3OmniModel, cfg: EngineConfig, tokenizer=None, suppressed_ids: list[int] = (),
                 drafter: Drafter | None = None):
        """`drafter`: the speculative method (`speculative.make_drafter`), None without speculation
        (and on a tensor-parallel worker: rank 0 drafts)."""
        self.model, self.cfg, self.mcfg, self.tokenizer = model, cfg, model.cfg, tokenizer
        w = model.thinker.lm_head.weight
        self.device, self.dtype = w.device, w.dtype
        self.suppress = id_mask(suppressed_ids, self.mcfg.thinker.text.vocab_size, self.device)  # [V]: never sampled
        th = self.mcfg.thinker
        self.media_ids = {th.audio_token_id, th.image_token_id, th.video_token_id}
        self.undraftable = set(suppressed_ids) | self.media_ids  # ids a draft never holds
        self.drafter = drafter
        self.taps = drafter.taps if drafter is not None else ()
        self.accept = self.mcfg.talker.accept_hidden_layer if self.mcfg.has_audio_output else None
        self.levels = len(th.vision.deepstack_visual_indexes)
        self.context = th.text.max_position_embeddings
        self.states: dict[str, ThinkerState] = {}
        self.media_rows = MediaRows(cfg.block_size, self.media_ids)  # of the prefix cache's media blocks
        self.encode_stats = StageStats()

    # ---- admission (ARAdmission): a request's sequence and its inputs --------------------------
    def max_len(self) -> int:
        return self.context or super().max_len()

    def start(self, req: QwenRequest) -> Seq:
        return self.states[req.rid].seq

    @torch.no_grad()
    def on_admit(self, req: QwenRequest) -> None:
        """At admission: encode the request's media (its own encoder calls), build its prompt rows,
        positions and prefix keys."""
        p = req.prompt
        audio, vis, deepstack = encode_media(self.model, p)
        self.encode_stats.record(1)
        x, vmask = self.model.thinker.embed(torch.tensor([p.ids], device=self.device), audio, vis)
        mask = np.array([t in (self.mcfg.thinker.image_token_id, self.mcfg.thinker.video_token_id) for t in p.ids])
        rows = np.where(mask, np.cumsum(mask) - 1, -1)
        pos, delta = positions(self.mcfg, p.ids, p)
        st = ThinkerState(req, x[0], rows, list(deepstack), pos.to(torch.float32).cpu().numpy(), float(delta))
        st.text = TextStream(
            req, stops=req.opts.thinker_stops(self.mcfg.im_end_token_id), max_tokens=req.opts.max_tokens,
            context=self.context, decoder=self.tokenizer.incremental_decoder() if self.tokenizer is not None else None,
            voiced=req.voiced if req.speaks else None, hook=req.hook, end_id=self.mcfg.im_end_token_id,
            encode=lambda text: self.tokenizer.encode_pieces([(text, True)]))  # its special-token strings stay text
        if req.speaks:
            req.voiced.hidden = torch.zeros(len(p.ids), self.mcfg.thinker.text.hidden_size, device=self.device,
                                            dtype=self.dtype)
        P = len(p.ids)
        st.seq = Seq(req.rid, req.order, num_tokens=P, max_tokens=P + req.opts.max_tokens,
                     key_items=self._key_items(p) if self.cfg.prefix_cache else None, block_size=self.cfg.block_size)
        self.states[req.rid] = st
        if req.stream is not None:
            st.closed = False
            self.absorb(st)

    # ---- admission (StreamedPromptAdmission): a streamed prompt's rows, sequential positions ----
    def check_segment(self, seg: Segment) -> None:
        # ids without rows are tokens, read as the model read them when it generated them (a realtime
        # reply re-enters the conversation as its ids, placeholder ids included)
        th = self.mcfg.thinker
        if seg.embeds is not None and any(t in (th.image_token_id, th.video_token_id) for t in seg.ids):
            raise InputError("a streamed prompt's embedding rows are audio only (images and videos need 3-D "
                             "positions)")

    @torch.no_grad()
    def absorb_rows(self, st: ThinkerState, seg: Segment) -> None:
        req, th = st.req, self.mcfg.thinker
        n, P = len(seg.ids), len(req.prompt.ids)
        if seg.embeds is None:
            rows = self.model.thinker.model.embed_tokens(torch.tensor(seg.ids, device=self.device))
        elif isinstance(seg.embeds, np.ndarray):  # rows kept on the host (a re-rendered turn's, `HostRows`)
            rows = torch.from_numpy(seg.embeds).to(self.device, self.dtype)
        else:
            rows = hand_over(lambda: seg.embeds, self.device).to(self.dtype)  # the AuT's rows (encoder stage)
        st.embeds = torch.cat([st.embeds, rows])
        start = P + st.delta
        st.positions = np.concatenate([st.positions, np.broadcast_to(start + np.arange(n, dtype=np.float32),
                                                                     (3, n))], axis=1)
        st.visual_rows = np.concatenate([st.visual_rows, np.full(n, -1)])
        if req.speaks:
            req.voiced.hidden = torch.cat([req.voiced.hidden, req.voiced.hidden.new_zeros(n, rows.shape[1])])
        if th.audio_token_id in seg.ids:  # the audio blocks' sizes, for the Talker's positions
            req.prompt.audio_token_counts = placeholder_runs(req.prompt.ids + seg.ids, th.audio_token_id)

    def _key_items(self, p) -> list:
        """Each prompt token's identity for the prefix cache: its id, with the media content digest."""
        th = self.mcfg.thinker
        digests = _media_digests(p)
        kinds = {th.audio_token_id: "audio", th.image_token_id: "visual", th.video_token_id: "visual"}
        item = {"audio": -1, "visual": -1}
        out = []
        for i, t in enumerate(p.ids):
            k = kinds.get(t)
            if k is None:
                out.append(t)
                continue
            if i == 0 or p.ids[i - 1] != t:
                item[k] += 1
            out.append((t, digests[k][item[k]]))
        return out

    # ---- the step (ARStep): inputs (host) -> compute (device) -> apply (host) -----------------
    def samples(self, row: Row) -> bool:
        return self.states[row.req.rid].closed  # a prompt that may still grow answers nothing yet

    def inputs(self, batch: StepBatch) -> ThinkerStepInputs:
        """Ids (a decode step) or input rows [N, H] (prompt slices and generated ids), positions
        [3, N] (built host-side, one copy), deepstack rows, and the sampled rows' sampling values."""
        rows, pad = batch.rows, batch.pad
        decode = all(r.n == 1 + len(r.draft) and r.start >= r.req.prompt_tokens for r in rows)
        pos = [self._positions(r) for r in rows] + [np.zeros((3, pad), np.float32)]
        inp = ThinkerStepInputs(torch.from_numpy(np.concatenate(pos, axis=1).astype(np.float32)).to(self.device))
        if self.taps:
            index = [np.arange(r.start, r.end) for r in rows] + [np.zeros(pad, np.int64)]
            inp.tap_positions = torch.from_numpy(np.concatenate(index)).to(self.device)
        if decode:
            ids = [t for r in rows for t in [r.req.text_ids[r.start - r.req.prompt_tokens], *r.draft]] + [0] * pad
            inp.ids = torch.tensor(ids, device=self.device)
        else:
            inp.x, inp.deepstack = self._rows(rows)
            inp.capture = self.accept if any(r.req.speaks for r in rows) else None
        if not batch.sampled and not pad:
            return inp
        # one sampling row per sampled position: a row's j-th draws its output position
        # len(text_ids) + j with the noise step the sequential path uses there, its drafts before
        # it counted as drawn (they are, wherever that draw counts)
        params, seeds, steps, seen = [], [], [], []
        for r in batch.sampled_rows:
            q = r.req
            for j in range(1 + len(r.draft)):
                params.append(q.opts.thinker)
                seeds.append(q.seed)
                steps.append(len(q.text_ids) + j)
                seen.append(q.text_ids + r.draft[:j])
        t = SamplingTensors.build(params + [PAD_PARAMS] * pad, seeds + [0] * pad, steps + [0] * pad, self.device,
                                  graph=pad > 0)
        vocab = self.mcfg.thinker.text.vocab_size
        inp.seen = seen_mask(seen + [[]] * pad, vocab, self.device) if t.any_penalty else None
        inp.sampling = t
        return inp

    def _positions(self, r: Row) -> np.ndarray:
        st, P = self.states[r.req.rid], r.req.prompt_tokens
        parts = []
        if r.start < P:
            parts.append(st.positions[:, r.start:min(r.end, P)])
        if r.end > P:
            s = max(r.start, P)
            parts.append(np.broadcast_to(P + st.delta + (s - P) + np.arange(r.end - s, dtype=np.float32), (3, r.end - s)))
        return np.concatenate(parts, axis=1)

    def _rows(self, rows: list[Row]):
        """Input rows [N, H] (prompt slices; one embedding call for each run of generated ids) and
        deepstack (flat indices of the visual rows, their features per level)."""
        pieces: list = []  # a prompt slice (tensor) or a list of generated ids
        vis_idx, vis_rows = [], [[] for _ in range(self.levels)]
        n = 0
        for r in rows:
            st, P = self.states[r.req.rid], r.req.prompt_tokens
            if r.start < P:
                e = min(r.end, P)
                pieces.append(st.embeds[r.start:e])
                v = st.visual_rows[r.start:e]
                hit = np.nonzero(v >= 0)[0]
                if hit.size and st.deepstack:
                    vis_idx.extend((n + hit).tolist())
                    sel = torch.from_numpy(v[hit]).to(self.device)
                    for lvl, feats in zip(vis_rows, st.deepstack):
                        lvl.append(feats.index_select(0, sel))
            if r.end > P:
                ids = r.req.text_ids[max(r.start, P) - P:r.end - P - len(r.draft)] + r.draft
                if pieces and isinstance(pieces[-1], list):
                    pieces[-1].extend(ids)
                else:
                    pieces.append(list(ids))
            n += r.n
        embed = self.model.thinker.model.embed_tokens
        x = torch.cat([embed(torch.tensor(p, device=self.device)) if isinstance(p, list) else p for p in pieces])
        vis = (torch.tensor(vis_idx, device=self.device), [torch.cat(lvl) for lvl in vis_rows]) if vis_idx else None
        return x, vis

    def compute(self, inp: ThinkerStepInputs, ctx: PagedContext) -> ThinkerStepOutputs:
        x = self.model.thinker.model.embed_tokens(inp.ids) if inp.x is None else inp.x
        h, hk, feats = self.model.thinker(x, inp.positions, ctx, capture=inp.capture, deepstack=inp.deepstack,
                                          taps=self.taps)
        if feats is not None:  # the drafter's context, from this step's target features (no host copy)
            self.drafter.absorb(feats, inp.tap_positions, ctx.meta.write_slots)
        out = ThinkerStepOutputs(hk, None)
        if inp.sampling is not None:
            logits = self.model.thinker.logits(ctx.sampled(h)).float()  # [M, V]
            out.ids = sample(logits, inp.sampling, noise.THINKER, seen=inp.seen, suppress=self.suppress)
        return out

    def apply(self, batch: StepBatch, out: ThinkerStepOutputs) -> StepResult:
        rows = batch.rows
        if out.hk is not None:
            self._keep_hidden(rows, out.hk)
        self._register_hidden(rows)
        result = StepResult.none(len(rows))
        if not batch.sampled:
            return result
        ids = host.ids(out.ids)  # the step's one read of the device
        at = 0
        for i, c in zip(batch.sampled, batch.sample_counts):
            result.accepted[i] = self._take(rows[i], ids[at:at + c], result)
            at += c
        return result

    def _take(self, r: Row, drawn: list[int], result: StepResult) -> int:
        """Accept a row's draws in order: the first, then each next one while the draw before it
        equals the draft it verifies (the draws after a wrong draft saw a wrong input). Returns
        the number accepted; a failed draw or hook fails the request there."""
        for j, tok in enumerate(drawn):
            if tok < 0:
                result.failures.append((r.req, SamplingError("sampling failed: the Thinker's logits hold no valid "
                                                             "distribution for these sampling values")))
                return j
            try:
                done = self._accept(r.req, r.seq, tok)
            except HookError as e:
                result.failures.append((r.req, e))
                return j
            if done:
                result.finished.append(r.req)
                return j + 1
            if j == len(r.draft) or tok != r.draft[j]:
                return j + 1
        return len(drawn)

    def _keep_hidden(self, rows: list[Row], hk: torch.Tensor) -> None:
        """Accept-layer hidden states of prompt positions, for the Talker's prefill."""
        n = 0
        for r in rows:
            req, P = r.req, r.req.prompt_tokens
            if req.speaks:
                st = self.states[req.rid]
                if not st.restored and r.seq.prefix_hit and r.start == r.seq.prefix_hit:
                    self.media_rows.restore(req.prompt.ids, r.seq.prefix_keys, r.seq.prefix_hit, req.voiced.hidden)
                    req.voiced.hidden_done = max(req.voiced.hidden_done, r.seq.prefix_hit)
                    st.restored = True
                if r.start < P:
                    e = min(r.end, P)
                    req.voiced.hidden[r.start:e] = hk[n:n + e - r.start]
                    req.voiced.hidden_done = max(req.voiced.hidden_done, e)
            n += r.n

    # ---- the prefix cache's media rows (stages/media_rows.py) --------------------------------
    def bind(self, stage) -> None:
        super().bind(stage)
        stage.alloc.watch(self.media_rows)  # the rows follow the cache: kept while it holds their block

    def forget(self, req: QwenRequest) -> None:
        super().forget(req)
        self.media_rows.release(req.rid)

    def prefix_limit(self, seq: Seq, blocks: int) -> int:
        """A cached block with media is usable only if its accept-layer rows were kept (Talker input)."""
        st = self.states.get(seq.rid)
        if st is None or not st.req.speaks:
            return blocks
        return self.media_rows.usable(st.req.prompt.ids, seq.prefix_keys, blocks)

    def _register_hidden(self, rows: list[Row]) -> None:
        """Keep the accept-layer rows of media blocks computed so far (a block the prompt's end cuts
        once the whole prompt is computed). Runs in `apply`, before the stage offers this step's
        blocks to the prefix cache, which then reports them cached."""
        bs = self.cfg.block_size
        for r in rows:
            req = r.req
            if not (req.speaks and r.seq.prefix_keys):
                continue
            v, P = req.voiced, len(req.prompt.ids)
            known = -(-P // bs) if v.hidden_done >= P else v.hidden_done // bs
            self.media_rows.keep(req.rid, req.prompt.ids, r.seq.prefix_keys, v.hidden,
                                 min(known, len(r.seq.prefix_keys)))

    # ---- the step (ARStep): what a sampled token does ----------------------------------------
    def _accept(self, req: QwenRequest, seq: Seq, tok: int) -> bool:
        """Record and stream one token (its text stream); True when the Thinker is done with the request."""
        st = self.states[req.rid]
        if st.text.push(tok):
            st.done = True
            return True
        seq.num_tokens += 1
        seq.extend_keys([tok])
        return False

    # ---- admission (ARAdmission): the end and stats ------------------------------------------
    def stats(self) -> dict[str, StageStats]:
        return {"encode": self.encode_stats}
