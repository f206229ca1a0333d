"""Image/video preprocessing parity with transformers 5.24.

Reference for images: `Qwen2VLImageProcessorPil`, the PIL back end that AutoImageProcessor picks for
a Qwen3-Omni `preprocessor_config.json` when torchvision is absent (it cannot be installed here).
Results are required to be bit-identical (stronger than allclose 1e-6).

Reference for video: none can run. transformers' `Qwen2VLVideoProcessor` (used by
`Qwen3OmniMoeProcessor`) imports torchvision at module level. The video path is checked instead
frame by frame against the reference *image* processor, called with the per-frame size bounds the
Qwen3-Omni processor passes to its video processor, plus the reference's temporal padding rule.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from omnivox.errors import CheckpointError, InputError
from omnivox.models.qwen3_omni.config import VisionEncoderConfig
from omnivox.models.qwen3_omni.image_processor import (
    OPENAI_CLIP_MEAN, VisionProcessorConfig, num_vision_tokens, preprocess_image, preprocess_video, smart_resize,
)

VISION = VisionEncoderConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
                             spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32,
                             num_position_embeddings=64, deepstack_visual_indexes=(0, 1))

# The released file merges WhisperFeatureExtractor and Qwen2VLImageProcessor fields (spec pitfall 18).
MERGED = {
    "chunk_length": 300, "dither": 0.0, "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128,
    "hop_length": 160, "n_fft": 400, "n_samples": 4800000, "nb_max_frames": 30000, "padding_side": "right",
    "padding_value": 0.0, "return_attention_mask": True, "sampling_rate": 16000,
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3OmniMoeProcessor",
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "min_pixels": 3136, "max_pixels": 12845056,
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
}


def make_image(h: int, w: int, shift: int = 0) -> Image.Image:
    """Deterministic RGB test picture: colour gradients plus two filled shapes."""
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([(x * 255 // max(w - 1, 1) + shift) % 256, y * 255 // max(h - 1, 1),
                    (3 * x + 5 * y + 7 * shift) % 256], axis=-1).astype(np.uint8)
    img = Image.fromarray(rgb)
    draw = ImageDraw.Draw(img)
    draw.ellipse((w // 5, h // 6, w // 2, h // 2), fill=(250, 20, 60))
    draw.rectangle((w // 2, h // 2, w - 3, h - 5), fill=(10, 200, 90))
    return img


def write_config(folder: Path, d: dict) -> Path:
    (folder / "preprocessor_config.json").write_text(json.dumps(d))
    return folder


def reference(folder: Path):
    from transformers import AutoImageProcessor

    proc = AutoImageProcessor.from_pretrained(folder)
    assert type(proc).__name__ == "Qwen2VLImageProcessorPil" and proc.backend == "pil"
    return proc


def ref_run(proc, img, **kw) -> tuple[torch.Tensor, tuple[int, int, int]]:
    out = proc(images=[img], return_tensors="pt", **kw)
    return out["pixel_values"], tuple(out["image_grid_thw"][0].tolist())


def assert_same(ours, ref) -> None:
    (pv, grid), (ref_pv, ref_grid) = ours, ref
    assert grid == ref_grid
    assert pv.dtype == torch.float32 and pv.shape == ref_pv.shape
    assert torch.equal(pv, ref_pv), f"max abs diff {(pv - ref_pv).abs().max().item()}"


def test_from_folder_reads_merged_file(tmp_path):
    cfg = VisionProcessorConfig.from_folder(write_config(tmp_path, MERGED), VISION)
    assert (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size) == (16, 2, 2)
    assert (cfg.min_pixels, cfg.max_pixels) == (3136, 12845056)
    assert cfg.image_mean == (0.5, 0.5, 0.5) and cfg.image_std == (0.5, 0.5, 0.5)


@pytest.mark.parametrize("size", [(123, 201), (40, 50), (17, 300)], ids=["123x201", "under-min-pixels", "wide"])
def test_image_matches_reference(tmp_path, size):
    folder = write_config(tmp_path, MERGED)
    cfg, proc = VisionProcessorConfig.from_folder(folder, VISION), reference(folder)
    img = make_image(*size)
    ref = ref_run(proc, img)
    assert_same(preprocess_image(img, cfg), ref)
    assert_same(preprocess_image(np.asarray(img), cfg), ref)
    png = io.BytesIO()
    img.save(png, format="PNG")
    assert_same(preprocess_image(png.getvalue(), cfg), ref)
    (tmp_path / "x.png").write_bytes(png.getvalue())
    assert_same(preprocess_image(tmp_path / "x.png", cfg), ref)
    if size == (40, 50):  # 40x50 rounds to 32x64 = 2048 < min_pixels: scaled up to 64x64
        assert ref[1] == (1, 4, 4)


def test_alpha_is_composited_on_white_like_reference(tmp_path):
    folder = write_config(tmp_path, MERGED)
    cfg, proc = VisionProcessorConfig.from_folder(folder, VISION), reference(folder)
    img = make_image(70, 90).convert("RGBA")
    img.putalpha(Image.fromarray((np.arange(70 * 90).reshape(70, 90) % 256).astype(np.uint8)))
    ours = preprocess_image(img, cfg)
    assert_same(ours, ref_run(proc, img))
    assert not torch.equal(ours[0], preprocess_image(img.convert("RGB"), cfg)[0])


def test_size_spelling_and_class_defaults(tmp_path):
    """`size: {shortest_edge, longest_edge}` spelling, no mean/std (-> OpenAI CLIP), max_pixels hit."""
    d = {k: v for k, v in MERGED.items() if k not in ("min_pixels", "max_pixels", "image_mean", "image_std")}
    folder = write_config(tmp_path, {**d, "size": {"shortest_edge": 2048, "longest_edge": 8192}})
    cfg, proc = VisionProcessorConfig.from_folder(folder, VISION), reference(folder)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.image_mean) == (2048, 8192, OPENAI_CLIP_MEAN)
    img = make_image(123, 201)  # 24723 pixels > 8192
    ref = ref_run(proc, img)
    assert ref[1] == (1, 4, 6)  # scaled down to 64x96
    assert_same(preprocess_image(img, cfg), ref)


def test_absent_file_uses_vision_config_and_class_defaults(tmp_path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = VisionProcessorConfig.from_folder(tmp_path, VISION)
    proc = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2)
    assert (cfg.min_pixels, cfg.max_pixels) == (proc.size["shortest_edge"], proc.size["longest_edge"])
    assert list(cfg.image_mean) == list(proc.image_mean) and list(cfg.image_std) == list(proc.image_std)
    img = make_image(123, 201)
    assert_same(preprocess_image(img, cfg), ref_run(proc, img))


def test_geometry_mismatch_with_vision_config_is_rejected(tmp_path):
    with pytest.raises(CheckpointError, match="patch"):
        VisionProcessorConfig.from_folder(write_config(tmp_path, {**MERGED, "patch_size": 14}), VISION)


def test_video_frames_match_reference_image_path(tmp_path):
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

    folder = write_config(tmp_path, MERGED)
    cfg, proc = VisionProcessorConfig.from_folder(folder, VISION), reference(folder)
    video_size = Qwen3OmniMoeProcessor.videos_kwargs["size"]
    assert (cfg.video_min_pixels, cfg.video_max_pixels) == (video_size["shortest_edge"], video_size["longest_edge"])

    frames = np.stack([np.asarray(make_image(64, 96, shift=17 * i)) for i in range(5)])  # [5, 64, 96, 3]
    pv, grid, second_per_grid = preprocess_video(frames, 2.0, cfg)
    h, w = smart_resize(64, 96, 32, cfg.video_min_pixels, cfg.video_max_pixels)
    assert grid == (3, h // 16, w // 16) and second_per_grid == 1.0  # 5 frames padded to 6
    assert num_vision_tokens(grid, 2) == 3 * (h // 32) * (w // 32)

    per_slice = grid[1] * grid[2]
    patches = pv.view(3, per_slice, 3, 2, 16, 16)  # [t, h*w, C, tp, p, p]
    for i in range(6):
        frame = frames[min(i, 4)]  # the last frame repeats
        ref_pv, ref_grid = ref_run(proc, Image.fromarray(frame), size=video_size)
        assert ref_grid == (1, grid[1], grid[2])
        assert torch.equal(patches[i // 2, :, :, i % 2], ref_pv.view(per_slice, 3, 2, 16, 16)[:, :, 0])


def test_num_vision_tokens():
    assert num_vision_tokens((1, 8, 12), 2) == 24
    assert num_vision_tokens((3, 4, 6), 2) == 18


def test_bad_inputs_raise_input_error(tmp_path):
    cfg = VisionProcessorConfig.from_folder(write_config(tmp_path, MERGED), VISION)
    with pytest.raises(InputError, match="not a readable image"):
        preprocess_image(b"\x89PNG\r\n\x1a\n this is not a picture", cfg)
    with pytest.raises(InputError, match="not a readable image"):
        preprocess_image(tmp_path / "missing.jpg", cfg)
    with pytest.raises(InputError, match="uint8"):
        preprocess_image(np.zeros((8, 8, 3), dtype=np.float32), cfg)
    with pytest.raises(InputError, match="aspect ratio"):
        preprocess_image(np.zeros((2, 500, 3), np.uint8), cfg)
    with pytest.raises(InputError, match="uint8"):
        preprocess_video(np.zeros((2, 8, 8), dtype=np.uint8), 2.0, cfg)
    err = None
    try:
        preprocess_image(b"junk", cfg)
    except InputError as e:
        err = str(e)
    assert err is not None and "\n" not in err


def test_video_config_is_not_the_image_config():
    cfg = VisionProcessorConfig(16, 2, 2, 3136, 12845056, (0.5,) * 3, (0.5,) * 3)
    # A 64x96 image keeps its size; the same frame as video is scaled up to the video minimum.
    assert preprocess_image(np.zeros((64, 96, 3), np.uint8), cfg)[1] == (1, 4, 6)
    assert preprocess_video(np.zeros((1, 64, 96, 3), np.uint8), 1.0, cfg)[1] == (1, 20, 28)
