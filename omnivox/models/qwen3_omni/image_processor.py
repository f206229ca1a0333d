"""Image and video preprocessing for Qwen3-Omni's vision encoder (spec sections 3.5 and 6.1).

Reproduces transformers 5.24's `Qwen2VLImageProcessorPil` (the back end AutoImageProcessor picks for
`qwen3_omni_moe` when torchvision is absent), step for step:

1. convert to RGB;
2. `smart_resize` to multiples of patch_size * merge_size within [min_pixels, max_pixels], resampled
   by PIL bicubic on the uint8 image;
3. rescale: uint8 -> float64 * (1/255) -> float32;
4. normalise in float32: (x - mean) / std;
5. cut into patches of (channel, time, y, x) = C * temporal_patch_size * p * p values, listed in
   2x2 merge-block order (t, h/m, w/m, m, m). A still image is repeated over the temporal patch.

Video uses the same rules frame by frame (transformers' own video processor needs torchvision), with
the frame count padded to a multiple of temporal_patch_size by repeating the last frame, and the
per-frame pixel bounds that `Qwen3OmniMoeProcessor` passes to its video processor.
"""
from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Union

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from omnivox.errors import CheckpointError, InputError
from omnivox.media_budget import DecodeBudget
from omnivox.models.qwen3_omni.config import VisionEncoderConfig

ImageInput = Union[Image.Image, np.ndarray, str, Path, bytes]

# Qwen2-VL image processor class defaults (used only when preprocessor_config.json is absent).
QWEN2VL_MIN_PIXELS = 56 * 56
QWEN2VL_MAX_PIXELS = 28 * 28 * 1280
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# `Qwen3OmniMoeProcessor.videos_kwargs["size"]` in transformers 5.24: passed on every call, so it
# overrides whatever the video processor's own config says.
VIDEO_MIN_PIXELS = 128 * 32 * 32
VIDEO_MAX_PIXELS = 768 * 32 * 32
MAX_ASPECT_RATIO = 200
# NOTE: bytes per pixel of a full-size picture while it is decoded: PIL's decode (RGBX), the
# orientation copy and the RGB conversion
IMAGE_BYTES_PER_PIXEL = 12


@dataclass(frozen=True)
class VisionProcessorConfig:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    rescale_factor: float = 1 / 255
    video_min_pixels: int = VIDEO_MIN_PIXELS
    video_max_pixels: int = VIDEO_MAX_PIXELS

    @classmethod
    def from_folder(cls, folder: Path, vision_cfg: VisionEncoderConfig) -> "VisionProcessorConfig":
        """Read `folder/preprocessor_config.json`.

        The released file merges the Whisper feature-extractor and Qwen2-VL image-processor fields
        (spec pitfall 18); only the image fields are read here. Pixel bounds may be spelt as
        top-level `min_pixels`/`max_pixels` (these win, as in transformers) or as
        `size: {shortest_edge, longest_edge}`. Fields the file lacks take the Qwen2-VL class
        defaults (mean/std: OpenAI CLIP; 3136..1003520 pixels), except the patch geometry, which
        comes from the vision config. When the file is absent, everything takes those defaults.
        The video pixel bounds are not read: the reference processor always overrides them.
        """
        path = Path(folder) / "preprocessor_config.json"
        d = {}
        if path.is_file():
            try:
                d = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{path}: not readable JSON ({e})") from None
        _check_supported(d, path)
        size = d.get("size") or {}
        cfg = cls(
            patch_size=int(d.get("patch_size", vision_cfg.patch_size)),
            temporal_patch_size=int(d.get("temporal_patch_size", vision_cfg.temporal_patch_size)),
            merge_size=int(d.get("merge_size", vision_cfg.spatial_merge_size)),
            min_pixels=int(_first(d.get("min_pixels"), size.get("shortest_edge"), size.get("min_pixels"),
                                  QWEN2VL_MIN_PIXELS)),
            max_pixels=int(_first(d.get("max_pixels"), size.get("longest_edge"), size.get("max_pixels"),
                                  QWEN2VL_MAX_PIXELS)),
            image_mean=_triple(d.get("image_mean", OPENAI_CLIP_MEAN), "image_mean", path),
            image_std=_triple(d.get("image_std", OPENAI_CLIP_STD), "image_std", path),
            rescale_factor=float(d.get("rescale_factor", 1 / 255)),
        )
        geometry = (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size)
        expected = (vision_cfg.patch_size, vision_cfg.temporal_patch_size, vision_cfg.spatial_merge_size)
        if geometry != expected:
            raise CheckpointError(f"{path}: patch/temporal/merge sizes {geometry} differ from the vision "
                                  f"config's {expected}")
        return cfg


def _first(*values):
    return next(v for v in values if v is not None)


def _triple(v, name: str, path: Path) -> tuple[float, float, float]:
    vals = [v] * 3 if isinstance(v, (int, float)) else list(v)
    if len(vals) != 3:
        raise CheckpointError(f"{path}: {name} must have 3 values, got {v!r}")
    return tuple(float(x) for x in vals)


def _check_supported(d: dict, path: Path) -> None:
    """Fail loudly on settings this module does not implement instead of silently differing."""
    for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if d.get(flag) is False:
            raise CheckpointError(f"{path}: {flag}=false is not supported")
    if d.get("resample", 3) != 3:
        raise CheckpointError(f"{path}: only bicubic resampling (resample=3) is supported")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, pixel count within [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InputError(f"image aspect ratio {height}x{width} exceeds {MAX_ASPECT_RATIO}:1; crop or pad it")
    # NOTE: Python's round() (half to even), as the reference.
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def load_rgb(image: ImageInput, budget: DecodeBudget | None = None,
             cfg: VisionProcessorConfig | None = None) -> Image.Image:
    """An RGB PIL image from a PIL image, an [H, W, 3] uint8 array, a file path or encoded bytes.

    Paths and bytes follow transformers' `load_image` (EXIF orientation applied, alpha dropped);
    PIL images follow the processor's `convert_to_rgb` (alpha composited onto white). With a
    `budget` (and the `cfg` that prices it), encoded input is reserved from it before decoding.
    """
    if isinstance(image, Image.Image):
        return _pil_to_rgb(image)
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
            raise InputError(f"image array must be [H, W, 3] uint8, got {list(image.shape)} {image.dtype}")
        return Image.fromarray(image)
    if isinstance(image, (str, Path, bytes, bytearray)):
        source = io.BytesIO(image) if isinstance(image, (bytes, bytearray)) else image
        what = "image bytes" if isinstance(image, (bytes, bytearray)) else f"image file {image}"
        try:
            with Image.open(source) as img:
                if budget is not None:
                    _reserve_image(img, what, budget, cfg)
                return ImageOps.exif_transpose(img).convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
            raise InputError(f"{what} is not a readable image ({type(e).__name__})") from None
    raise InputError(f"unsupported image type {type(image).__name__}; pass a PIL image, array, path or bytes")


def _pil_to_rgb(image: Image.Image) -> Image.Image:
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _resize_normalize(image: Image.Image, size: tuple[int, int], cfg: VisionProcessorConfig) -> torch.Tensor:
    """[C, H, W] float32: bicubic resize of the uint8 image, rescale in float64, normalise in float32."""
    h, w = size
    resized = np.asarray(image.resize((w, h), resample=Image.Resampling.BICUBIC))  # [H, W, C] uint8
    x = torch.from_numpy(resized.copy()).permute(2, 0, 1)  # [C, H, W]
    x = (x.to(torch.float64) * cfg.rescale_factor).to(torch.float32)
    mean = torch.tensor(cfg.image_mean, dtype=torch.float32)[:, None, None]
    std = torch.tensor(cfg.image_std, dtype=torch.float32)[:, None, None]
    return (x - mean) / std


def _patchify(frames: torch.Tensor, cfg: VisionProcessorConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """frames [T, C, H, W] with T % temporal_patch_size == 0 -> [t*h*w, C*tp*p*p] in merge-block order."""
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    n, c, height, width = frames.shape
    gt, gh, gw = n // tp, height // p, width // p
    x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [gt, gh/m, gw/m, m, m, C, tp, p, p]
    return x.reshape(gt * gh * gw, c * tp * p * p).contiguous(), (gt, gh, gw)


def preprocess_image(image: ImageInput, cfg: VisionProcessorConfig, budget: DecodeBudget | None = None
                     ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """pixel_values [N, C*tp*p*p] float32 and grid (1, h, w) in patch units (N = h*w).

    Its tokens and the bytes of decoding and preprocessing it are reserved from `budget` (None: a
    fresh one of the defaults); for an encoded image (bytes or a path) from its header, before
    it is decoded."""
    budget = budget if budget is not None else DecodeBudget()
    if isinstance(image, (str, Path, bytes, bytearray)):
        rgb = load_rgb(image, budget, cfg)
    else:
        rgb = load_rgb(image)
        _reserve_image(rgb, "image", budget, cfg)
    size = smart_resize(rgb.height, rgb.width, cfg.patch_size * cfg.merge_size, cfg.min_pixels, cfg.max_pixels)
    x = _resize_normalize(rgb, size, cfg)  # [C, H, W]
    frames = x.unsqueeze(0).expand(cfg.temporal_patch_size, -1, -1, -1)  # still image: repeat over time
    return _patchify(frames, cfg)


def _reserve_image(img: Image.Image, what: str, budget: DecodeBudget, cfg: VisionProcessorConfig) -> None:
    """Reserve an image's tokens and decode bytes from its size (for an encoded image, the header's)."""
    width, height = img.size
    if width <= 0 or height <= 0:
        raise InputError(f"{what} declares no size")
    size = smart_resize(height, width, cfg.patch_size * cfg.merge_size, cfg.min_pixels, cfg.max_pixels)
    grid = (1, size[0] // cfg.patch_size, size[1] // cfg.patch_size)
    budget.reserve(f"{what} of {width}x{height}", kept=patch_bytes(grid, cfg),
                   transient=width * height * IMAGE_BYTES_PER_PIXEL + work_bytes(size, cfg),
                   tokens=num_vision_tokens(grid, cfg.merge_size))


def video_size(height: int, width: int, cfg: VisionProcessorConfig) -> tuple[int, int]:
    """The (height, width) every frame of a video of this size is resized to."""
    return smart_resize(height, width, cfg.patch_size * cfg.merge_size, cfg.video_min_pixels, cfg.video_max_pixels)


def video_grid(count: int, size: tuple[int, int], cfg: VisionProcessorConfig) -> tuple[int, int, int]:
    """(t, h, w) in patch units of `count` frames resized to `size` (t: count padded to the temporal patch)."""
    return -(-count // cfg.temporal_patch_size), size[0] // cfg.patch_size, size[1] // cfg.patch_size


def patch_bytes(grid: tuple[int, int, int], cfg: VisionProcessorConfig) -> int:
    """Bytes of the float32 pixel_values of `grid`: what preprocessing keeps."""
    t, h, w = grid
    return t * h * w * 3 * cfg.temporal_patch_size * cfg.patch_size ** 2 * 4


def work_bytes(size: tuple[int, int], cfg: VisionProcessorConfig) -> int:
    """Bytes briefly held while one temporal group of frames of `size` is preprocessed: the
    float32 group and its patch-ordered copy, and one frame's resize (uint8), float64 and float32."""
    return size[0] * size[1] * 3 * (2 * 4 * cfg.temporal_patch_size + 2 + 8 + 8)


def preprocess_video(frames: np.ndarray, fps: float, cfg: VisionProcessorConfig
                     ) -> tuple[torch.Tensor, tuple[int, int, int], float]:
    """frames [T, H, W, 3] uint8 -> (pixel_values [t*h*w, C*tp*p*p] float32, grid (t, h, w), second_per_grid).

    Every frame is resized like an image but within the video pixel bounds; T is padded up to a
    multiple of temporal_patch_size by repeating the last frame. second_per_grid = tp / fps.
    """
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        shape = list(getattr(frames, "shape", []))
        raise InputError(f"video frames must be a [T, H, W, 3] uint8 array, got {shape} {getattr(frames, 'dtype', '')}")
    if frames.shape[0] == 0:
        raise InputError("video has no frames")
    if not fps > 0:
        raise InputError(f"video fps must be positive, got {fps}")
    count, height, width, _ = frames.shape
    size = video_size(height, width, cfg)
    return patch_frames(iter(frames), count, size, cfg), video_grid(count, size, cfg), cfg.temporal_patch_size / fps


def patch_frames(frames: Iterator[np.ndarray], count: int, size: tuple[int, int], cfg: VisionProcessorConfig
                 ) -> torch.Tensor:
    """`count` RGB frames [H, W, 3] uint8 (taken one at a time from `frames`), each resized to
    `size` -> pixel_values [t*h*w, C*tp*p*p] float32, written one temporal group at a time (the
    last frame repeats to fill the last group): only one group of float32 frames is ever held."""
    tp = cfg.temporal_patch_size
    t, h, w = video_grid(count, size, cfg)
    out = torch.empty(t * h * w, 3 * tp * cfg.patch_size ** 2, dtype=torch.float32)  # [t*h*w, C*tp*p*p]
    group = torch.empty(tp, 3, *size, dtype=torch.float32)  # [tp, C, H, W]
    for i in range(t * tp):
        if i < count:
            group[i % tp] = _resize_normalize(Image.fromarray(next(frames)), size, cfg)
        else:
            group[i % tp] = group[(i - 1) % tp]
        if i % tp == tp - 1:
            out[i // tp * h * w:(i // tp + 1) * h * w] = _patchify(group, cfg)[0]
    return out


def num_vision_tokens(grid: tuple[int, int, int], merge_size: int) -> int:
    """Merged tokens (= <|image_pad|> / <|video_pad|> count) for one image or video."""
    t, h, w = grid
    return t * h * w // (merge_size * merge_size)
