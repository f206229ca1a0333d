"""The Thinker: multimodal embedding scatter + the MoE text decoder + lm_head."""
from __future__ import annotations


import torch
from torch import nn

from omnivox.layers.attention import DenseKVCache
from omnivox.layers.collectives import Collectives
from omnivox.models.qwen3_omni.audio_encoder import AudioEncoder
from omnivox.models.qwen3_omni.config import ThinkerConfig
from omnivox.models.qwen3_omni.decoder import DecoderStack
from omnivox.models.qwen3_omni.vision_encoder import VisionEncoder



class ThinkerTextModel(DecoderStack):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


class Thinker(nn.Module):
    """Checkpoint prefix `thinker.`: model (text decoder), lm_head, audio_tower, visual.

    Tensor parallel (`parallel/shard.py`): the text decoder's layers are sharded, `lm_head`
    holds this rank's ceil(V/N) vocab rows (zero rows pad the last rank) and `tp` gathers the
    logits; embed_tokens and the encoders stay whole.
    """

    def __init__(self, cfg: ThinkerConfig):
        super().__init__()
        self.cfg = cfg
        self.model = ThinkerTextModel(cfg.text)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)
        self.audio_tower = AudioEncoder(cfg.audio)
        self.visual = VisionEncoder(cfg.vision)
        self.tp: Collectives | None = None

    def embed(self, ids: torch.Tensor, audio_feats: torch.Tensor | None = None,
              visual_feats: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, S] -> (embeddings [B, S, H] with media scattered in, visual mask [B, S]).

        audio_feats fill the audio pads in order; visual_feats fill image and video pads in
        sequence order (the caller orders image and video tokens as they appear).
        """
        x = self.model.embed_tokens(ids)
        audio_mask = ids == self.cfg.audio_token_id
        visual_mask = (ids == self.cfg.image_token_id) | (ids == self.cfg.video_token_id)
        for mask, feats, what in ((audio_mask, audio_feats, "audio"), (visual_mask, visual_feats, "image/video")):
            n = int(mask.sum())
            got = 0 if feats is None else feats.shape[0]
            if n != got:
                raise ValueError(f"{what}: prompt has {n} placeholder tokens but the media give {got} features")
            if n:
                x = x.clone()
                x[mask] = feats.to(x.dtype)
        return x, visual_mask

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: DenseKVCache | None = None,
                capture: int | None = None, deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None,
                taps: tuple[int, ...] = ()):
        """x [N, H] with positions [3, N], or x [B, S, H] with positions [3, B, S] ->
        (final-normed hidden like x, hidden_states[capture], target features of layers `taps`).

        deepstack = (rows [M] long: the visual tokens' indices in the flattened x, one feature
        tensor [M, H] per level), added after layers 0, 1, ...; a tapped layer's rows are taken
        after that addition (`DecoderStack.forward`). With tensor parallelism every rank's layer
        outputs are whole (their partial sums are reduced inside the layer), so are the taps.
        """
        inject = None
        if deepstack is not None and deepstack[0].numel():
            rows, levels = deepstack
            inject = {i: (rows, feats) for i, feats in enumerate(levels)}
        return self.model(x, positions, cache, capture=capture, inject=inject, taps=taps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> [..., V]; with `tp` every rank returns the same full logits."""
        logits = self.lm_head(hidden)  # [..., V] (tp: [..., ceil(V/N)], this rank's vocab rows)
        if self.tp is None:
            return logits
        return self.tp.all_gather(logits, dim=-1)[..., :self.cfg.text.vocab_size]
