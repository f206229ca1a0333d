"""The Thinker stage: media encoding at admission, then continuous batching over a paged
KV cache with prefix caching and chunked prefill. Emits text and feeds the voiced stream."""
from __future__ import annotations

import hashlib

import torch

from omnivox.engine.config import EngineConfig
from omnivox.engine.events import StageStats
from omnivox.engine.paged import PagedBatch, SeqSlice
from omnivox.engine.scheduler import ARScheduler, Seq
from omnivox.kv_cache.block_allocator import BlockAllocator
from omnivox.kv_cache.pool import KVPool
from omnivox.models.qwen3_omni.model import Qwen3OmniModel
from omnivox.models.qwen3_omni.pipeline import OfflineGenerator
from omnivox.models.qwen3_omni.positions import decode_positions
from omnivox.models.qwen3_omni.stages.request import QwenRequest
from omnivox.sampling.sampler import choose


class HookError(Exception):
    """A request's text hook raised or returned garbage."""


def _digest(t: torch.Tensor) -> int:
    return int.from_bytes(hashlib.sha1(t.detach().float().cpu().contiguous().numpy().tobytes()).digest()[:8], "big")


class ThinkerStage:
    name = "thinker"

    def __init__(self, model: Qwen3OmniModel, cfg: EngineConfig, num_blocks: int, tokenizer=None):
        self.model, self.cfg, self.mcfg = model, cfg, model.cfg
        tc = self.mcfg.thinker.text
        dev, dtype = model.thinker.lm_head.weight.device, model.thinker.lm_head.weight.dtype
        self.device, self.dtype = dev, dtype
        self.pool = KVPool(tc.num_hidden_layers, num_blocks, cfg.block_size, tc.num_key_value_heads, tc.head_dim,
                           dtype, dev)
        self.alloc = BlockAllocator(num_blocks, cfg.block_size)
        self.sched = ARScheduler(self.alloc, cfg.max_running, cfg.token_budget,
                                 on_free=self.pool.poison if cfg.poison_freed_pages else None,
                                 prefix_limit=self._prefix_limit)
        self.reqs: dict[str, QwenRequest] = {}
        self.hidden_store: dict[int, torch.Tensor] = {}  # prefix key -> hk rows of a block holding media
        self.media_ids = {self.mcfg.thinker.audio_token_id, self.mcfg.thinker.image_token_id,
                          self.mcfg.thinker.video_token_id}
        self.offline = OfflineGenerator(model)  # media encoding and positions
        self.tokenizer = tokenizer
        self.stats = StageStats()
        self.encode_stats = StageStats()
        self.failed: list[tuple[QwenRequest, str]] = []  # requests to fail after this step
        self.accept = self.mcfg.talker.accept_hidden_layer if self.mcfg.has_audio_output else None

    # ---- admission ----------------------------------------------------------------------
    @torch.no_grad()
    def admit(self, req: QwenRequest) -> None:
        """Encode the request's media (its own encoder calls: the reference's encoder output
        depends on what else is in the call) and queue it."""
        p = req.prompt
        if req.opts.speech_ids:
            self._admit_speech(req)
            return
        audio, vis, deepstack = self.offline.encode_media(p)
        self.encode_stats.record(1)
        ids = torch.tensor([p.ids], device=self.device)
        x, vmask = self.model.thinker.embed(ids, audio, vis)
        req.embeds, req.visual_mask = x[0], vmask[0]
        req.deepstack = list(deepstack)
        req.visual_index = torch.cumsum(vmask[0].long(), 0) - 1
        pos, req.delta = self.offline.positions(p.ids, p)
        req.positions = pos.to(torch.float32)
        if req.want_audio:
            req.hk = torch.zeros(len(p.ids), self.mcfg.thinker.text.hidden_size, device=self.device, dtype=self.dtype)
        seq = Seq(req.rid, req.order, num_tokens=len(p.ids), max_tokens=len(p.ids) + req.opts.max_tokens,
                  prefix_keys=self._prefix_keys(p) if self.cfg.prefix_cache else [])
        self.sched.add(seq)  # may raise CannotFit
        req.thinker_seq = seq
        self.reqs[req.rid] = req

    def _admit_speech(self, req: QwenRequest) -> None:
        """Text to speech: the given ids are the assistant's text; the Thinker decodes nothing.
        The prompt holds no media, so the Talker needs no Thinker hidden states."""
        th = self.mcfg.thinker
        if any(t in self.media_ids for t in req.prompt.ids):
            raise ValueError("text-to-speech prompts carry no media")
        req.hk = torch.zeros(len(req.prompt.ids), th.text.hidden_size, device=self.device, dtype=self.dtype)
        req.hk_done = len(req.prompt.ids)
        req.text_ids = list(req.opts.speech_ids)
        req.voiced = list(req.opts.speech_ids) + [self.mcfg.im_end_token_id]
        req.voiced_final = True
        req.finish_reason = "stop"
        req.thinker_done = True

    def _prefix_keys(self, p) -> list[int]:
        """One key per full prompt block, chained, with media content in the key."""
        th = self.mcfg.thinker
        digests = {"audio": [_digest(f) for f in p.audio_features],
                   "visual": [_digest(v.pixel_values) for v in p.visual]}
        kinds = {th.audio_token_id: "audio", th.image_token_id: "visual", th.video_token_id: "visual"}
        item = {"audio": -1, "visual": -1}
        token_keys = []
        for i, t in enumerate(p.ids):
            k = kinds.get(t)
            if k is not None:
                if i == 0 or p.ids[i - 1] != t:
                    item[k] += 1
                token_keys.append((t, digests[k][item[k]]))
            else:
                token_keys.append(t)
        keys, parent, bs = [], 0, self.cfg.block_size
        for b in range(len(token_keys) // bs):
            parent = hash((parent, tuple(token_keys[b * bs:(b + 1) * bs])))
            keys.append(parent)
        return keys

    def _block_has_media(self, req: QwenRequest, b: int) -> bool:
        bs = self.cfg.block_size
        return any(t in self.media_ids for t in req.prompt.ids[b * bs:(b + 1) * bs])

    def _prefix_limit(self, seq: Seq, n: int) -> int:
        """A cached block with media is usable only if its accept-layer hidden rows were kept."""
        req = self.reqs[seq.rid]
        if not req.want_audio:
            return n
        for b in range(n):
            if self._block_has_media(req, b) and seq.prefix_keys[b] not in self.hidden_store:
                return b
        return n

    # ---- stepping -----------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.sched.has_work()

    def _inputs(self, req: QwenRequest, a: int, b: int):
        """Embeddings [n, H], positions [3, n], visual mask [n] and deepstack rows for tokens [a, b)."""
        P = len(req.prompt.ids)
        rows, pos, mask = [], [], []
        if a < P:
            e = min(b, P)
            rows.append(req.embeds[a:e])
            pos.append(req.positions[:, a:e])
            mask.append(req.visual_mask[a:e])
        if b > P:
            s = max(a, P)
            ids = torch.tensor(req.text_ids[s - P:b - P], device=self.device)
            rows.append(self.model.thinker.model.embed_tokens(ids))
            pos.append(decode_positions(P + req.delta + (s - P), b - s).to(torch.float32))
            mask.append(torch.zeros(b - s, dtype=torch.bool, device=self.device))
        m = torch.cat(mask)
        ds = []
        if req.deepstack and a < P:
            idx = req.visual_index[a:min(b, P)][req.visual_mask[a:min(b, P)]]
            ds = [lvl[idx] for lvl in req.deepstack]
        return torch.cat(rows), torch.cat(pos, dim=1).to(self.device), m, ds

    @torch.no_grad()
    def step(self) -> list[QwenRequest]:
        """One batched forward; returns the requests whose Thinker finished in this step."""
        batch = self.sched.schedule()
        if not batch.items:
            return []
        self.stats.record(len(batch.items))
        xs, ps, ms, slices = [], [], [], []
        levels: list[list[torch.Tensor]] = [[] for _ in range(len(self.model.cfg.thinker.vision.deepstack_visual_indexes))]
        for seq, n in batch.items:
            req = self.reqs[seq.rid]
            if seq.prefix_hit and seq.num_computed == seq.prefix_hit:
                self._restore_hidden(req, seq)
            x, p, m, ds = self._inputs(req, seq.num_computed, seq.num_computed + n)
            xs.append(x), ps.append(p), ms.append(m)
            for lvl, rows in zip(levels, ds):
                lvl.append(rows)
            slices.append(SeqSlice(seq.block_table, seq.num_computed, n))
        ctx = PagedBatch(self.pool, slices)
        rows = torch.cat(ms).nonzero().squeeze(1)  # the visual tokens' rows in the flat batch
        deep = (rows, [torch.cat(l) for l in levels]) if rows.numel() and levels and levels[0] else None
        capture = self.accept if any(self.reqs[s.rid].want_audio for s, _ in batch.items) else None
        h, hk = self.model.thinker(torch.cat(xs)[None], torch.cat(ps, dim=1)[:, None, :], ctx,
                                   capture=capture, deepstack=deep)
        sample_rows, sample_reqs = [], []
        for i, (seq, n) in enumerate(batch.items):
            req = self.reqs[seq.rid]
            a, P = seq.num_computed, len(req.prompt.ids)
            if req.want_audio and a < P and hk is not None:
                e = min(a + n, P)
                req.hk[a:e] = hk[0, ctx.cu[i]:ctx.cu[i] + e - a]
                req.hk_done = max(req.hk_done, e)
            seq.num_computed += n
            if seq.prefix_keys:
                self._register(req, seq)
            if seq.num_computed == seq.num_tokens:
                sample_rows.append(ctx.cu[i + 1] - 1)
                sample_reqs.append(req)
        finished = []
        if sample_rows:
            logits = self.model.thinker.logits(h[0, sample_rows]).float()  # [M, V]
            for j, req in enumerate(sample_reqs):
                try:
                    if self._accept_token(req, logits[j]):
                        finished.append(req)
                except HookError as e:
                    self.failed.append((req, str(e)))
        return finished

    def _restore_hidden(self, req: QwenRequest, seq: Seq) -> None:
        bs = self.cfg.block_size
        if req.want_audio:
            for b in range(seq.prefix_hit // bs):
                if self._block_has_media(req, b):
                    req.hk[b * bs:(b + 1) * bs] = self.hidden_store[seq.prefix_keys[b]]
            req.hk_done = max(req.hk_done, seq.prefix_hit)

    def _register(self, req: QwenRequest, seq: Seq) -> None:
        self.sched.register_prefix(seq)
        if req.want_audio:
            bs = self.cfg.block_size
            for b in range(min(req.hk_done // bs, len(seq.prefix_keys))):
                key = seq.prefix_keys[b]
                if key not in self.hidden_store and self._block_has_media(req, b):
                    self.hidden_store[key] = req.hk[b * bs:(b + 1) * bs].clone()
            if len(self.hidden_store) > 2 * self.alloc.num_blocks:  # drop rows of evicted blocks
                self.hidden_store = {k: v for k, v in self.hidden_store.items() if k in self.alloc.by_hash}

    def _accept_token(self, req: QwenRequest, logits: torch.Tensor) -> bool:
        """Sample, record and stream one token; True when the Thinker is done with the request."""
        o = req.opts
        seen = None
        if o.thinker.repetition_penalty != 1.0:  # the default: no per-token history tensor
            seen = torch.tensor(sorted(set(req.text_ids)), dtype=torch.long, device=self.device)
        tok = choose(logits, o.thinker, req.gen_thinker, seen=seen)
        req.text_ids.append(tok)
        delta = req.decoder.push(tok) if req.decoder is not None else ""
        req.text += delta
        req.emit_text(delta, [tok])
        stops = o.thinker_stops(self.mcfg.im_end_token_id)
        limit = self.mcfg.thinker.text.max_position_embeddings
        total = len(req.prompt.ids) + len(req.text_ids)
        done = tok in stops or len(req.text_ids) >= o.max_tokens or (limit and total >= limit)
        if done:
            req.finish_reason = "stop" if tok in stops else "length"
            rest = req.decoder.flush() if req.decoder is not None else ""
            if rest:
                req.text += rest
                req.emit_text(rest, [])
            delta += rest
        self._voice(req, tok, delta, done)
        if done:
            self.remove(req)
            req.thinker_done = True
        else:
            req.thinker_seq.num_tokens += 1
        return done

    def _voice(self, req: QwenRequest, tok: int, delta: str, done: bool) -> None:
        """Extend the voiced stream: the Thinker's ids, or what the hook releases (re-tokenized)."""
        if not req.want_audio:
            return
        if req.hook is None:
            req.voiced.append(tok)
        else:
            try:
                released = req.hook(delta, done) or ""
            except Exception as e:  # a broken hook fails its own request only
                raise HookError(f"text hook failed: {type(e).__name__}: {e}") from None
            if not isinstance(released, str):
                raise HookError(f"text hook must return a string or None, got {type(released).__name__}")
            if released:
                req.voiced.extend(self.tokenizer.encode(released))
            if done:
                req.voiced.append(self.mcfg.im_end_token_id)  # the end marker the Talker drops for tts_eos
        req.voiced_final = done

    def remove(self, req: QwenRequest) -> None:
        if req.thinker_seq is not None:
            self.sched.remove(req.thinker_seq)
        self.reqs.pop(req.rid, None)
