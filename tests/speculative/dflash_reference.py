"""Test helpers around the reference DFlash (PyPI `dflash` 0.1.0, z-lab): a random draft built with
its `DFlashDraftModel`, saved in z-lab's layout."""
from __future__ import annotations

from pathlib import Path

import torch


def build_reference_draft(folder: Path, *, hidden=32, heads=4, kv_heads=2, head_dim=16, vocab=64, layers=2,
                          target_layers=2, target_ids=(0, 1), block=4, mask_id=5, seed=0, extra: dict | None = None):
    """A `DFlashDraftModel` with seeded weights large enough that every block matters, saved to
    `folder` (config.json + model.safetensors). Returns the model."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
                      rms_norm_eps=1e-6, max_position_embeddings=4096,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg.architectures = ["DFlashDraftModel"]
    cfg.num_target_layers = target_layers
    cfg.block_size = block
    cfg.dflash_config = {"mask_token_id": mask_id, "target_layer_ids": list(target_ids), **(extra or {})}
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    return model
