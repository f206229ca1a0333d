"""Vision encoder parity with transformers 5.24 (`model.thinker.model.visual`), in float64.

Weights travel through `save_pretrained` and are loaded by their on-disk names
(`thinker.visual.*`, strict). An image grid (1, 4, 6) and a video grid (2, 4, 4) go through one
call; the merged tokens and every deepstack output must match to 1e-10. A wrong fp32 island
(interpolation weights or rotary) shows up as ~1e-7, letting video frames attend to each other as ~1.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from omnivox.models.qwen3_omni.config import Qwen3OmniConfig, VisionEncoderConfig
from omnivox.models.qwen3_omni.image_processor import VisionProcessorConfig, preprocess_image
from omnivox.models.qwen3_omni.vision_encoder import VisionEncoder
from qwen_tiny import VARIANT, build_reference, save_reference

IMAGE, VIDEO = (1, 4, 6), (2, 4, 4)
PREFIX = "thinker.visual."


def load_pair(variant, folder):
    """(transformers visual tower in fp64, our encoder in fp64 loaded from the saved checkpoint)."""
    import json

    model = build_reference(variant)
    save_reference(model, folder)
    cfg = Qwen3OmniConfig.from_hf(json.loads((folder / "config.json").read_text()))
    tensors = load_file(folder / "model.safetensors")
    weights = {k[len(PREFIX):]: v for k, v in tensors.items() if k.startswith(PREFIX)}
    ours = VisionEncoder(cfg.thinker.vision)
    ours.load_state_dict(weights, strict=True)
    return model.thinker.model.visual.double().eval(), ours.double().eval(), cfg.thinker.vision


def inputs(vision_cfg) -> torch.Tensor:
    """A real preprocessed 64x96 picture (grid 1x4x6) followed by a random 2x4x4 video."""
    y, x = np.mgrid[0:64, 0:96]
    picture = np.stack([x * 2, y * 3, (x + y) % 256], axis=-1).astype(np.uint8)
    pcfg = VisionProcessorConfig(vision_cfg.patch_size, vision_cfg.temporal_patch_size, vision_cfg.spatial_merge_size,
                                 3136, 12845056, (0.5,) * 3, (0.5,) * 3)
    image_pv, grid = preprocess_image(picture, pcfg)
    assert grid == IMAGE
    video_pv = torch.randn(2 * 4 * 4, image_pv.shape[1], generator=torch.Generator().manual_seed(3))
    return torch.cat([image_pv, video_pv]).double()  # [56, 1536]


@pytest.mark.parametrize("variant", [None, VARIANT], ids=["base", "variant"])
def test_vision_encoder_matches_reference(tmp_path, variant):
    ref, ours, vcfg = load_pair(variant, tmp_path)
    pixel_values = inputs(vcfg)
    with torch.no_grad():
        expected = ref(pixel_values, grid_thw=torch.tensor([IMAGE, VIDEO]))
        merged, deepstack = ours(pixel_values, [IMAGE, VIDEO])
    n_tokens = (24 + 32) // 4
    assert merged.shape == (n_tokens, vcfg.out_hidden_size) and merged.dtype == torch.float64
    assert merged.std() > 0.1  # the tower moves the signal: parity is not vacuous
    torch.testing.assert_close(merged, expected.pooler_output, atol=1e-10, rtol=0)
    assert len(deepstack) == len(vcfg.deepstack_visual_indexes) == len(expected.deepstack_features) == 2
    for ours_level, ref_level in zip(deepstack, expected.deepstack_features):
        assert ours_level.shape == (n_tokens, vcfg.out_hidden_size)
        torch.testing.assert_close(ours_level, ref_level, atol=1e-10, rtol=0)

    # One mixed call equals separate calls per item (what the thinker's image/video paths do).
    with torch.no_grad():
        image_only, image_ds = ours(pixel_values[:24], [IMAGE])
        video_only, video_ds = ours(pixel_values[24:], [VIDEO])
    torch.testing.assert_close(torch.cat([image_only, video_only]), merged, atol=1e-12, rtol=0)
    for level, a, b in zip(deepstack, image_ds, video_ds):
        torch.testing.assert_close(torch.cat([a, b]), level, atol=1e-12, rtol=0)


def test_vision_encoder_rejects_inconsistent_grids():
    ours = VisionEncoder(VisionEncoderConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                             in_channels=3, patch_size=16, spatial_merge_size=2,
                                             temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=64,
                                             deepstack_visual_indexes=(0,))).double()
    with pytest.raises(ValueError, match="cover"):
        ours(torch.zeros(10, 1536, dtype=torch.float64), [IMAGE])
    with pytest.raises(ValueError, match="multiples"):
        ours(torch.zeros(15, 1536, dtype=torch.float64), [(1, 3, 5)])
