"""The vocoder stage: streams every request's frames through the S2 codec decoder with its own
carried state (`CodecStreamState`: conv tails, transposed-conv inputs, the post-module's window
KV and absolute position), so the streamed audio equals the one-shot decode: no overlap
re-decoding, no crossfade. The first chunk is one frame; later chunks take
`vocoder_chunk_frames` frames (or what is left once the AR is done). Requests with the same
chunk length are decoded in one call, their states concatenated and split again."""
from __future__ import annotations

from collections import defaultdict

import torch

from omnivox.engine.config import EngineConfig
from omnivox.engine.events import StageStats
from omnivox.models.fish_s2.codec import CodecStreamState, FishCodec
from omnivox.models.fish_s2.stages.request import FishRequest


class VocoderStage:
    name = "vocoder"

    def __init__(self, codec: FishCodec, cfg: EngineConfig):
        self.codec, self.cfg = codec, cfg
        p = next(codec.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.reqs: dict[str, FishRequest] = {}
        self.stats = StageStats()

    def track(self, req: FishRequest) -> None:
        self.reqs[req.rid] = req

    def _chunk(self, req: FishRequest) -> int:
        pending = len(req.frames) - req.vocoded
        if pending <= 0:
            return 0
        if req.vocoded == 0:
            return 1
        n = max(1, self.cfg.vocoder_chunk_frames)
        if pending >= n:
            return n
        return pending if req.ar_done else 0

    def has_work(self) -> bool:
        return any(self._chunk(r) for r in self.reqs.values())

    @torch.no_grad()
    def step(self) -> list[FishRequest]:
        groups: dict[int, list[FishRequest]] = defaultdict(list)
        for req in self.reqs.values():
            n = self._chunk(req)
            if n:
                groups[n].append(req)
        touched = []
        for n, reqs in groups.items():
            self.stats.record(len(reqs))
            states = [r.voc_state if r.voc_state is not None else self.codec.init_stream(1, self.device, self.dtype)
                      for r in reqs]
            state = CodecStreamState.concat(states) if len(states) > 1 else states[0]
            codes = torch.tensor([r.frames[r.vocoded:r.vocoded + n] for r in reqs], device=self.device)  # [B, n, N]
            wav = self.codec.decode_step(codes.transpose(1, 2), state)[:, 0].float().cpu().numpy()  # [B, hop * n]
            for b, req in enumerate(reqs):
                req.voc_state = state.select([b]) if len(reqs) > 1 else state
                req.vocoded += n
                req.emit_audio(wav[b], n)
                touched.append(req)
        return touched

    def remove(self, req: FishRequest) -> None:
        self.reqs.pop(req.rid, None)
        req.voc_state = None
