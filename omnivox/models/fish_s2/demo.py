"""The built-in Fish S2 demo: the tiny official-layout checkpoint (`tiny.write_tiny_checkpoint`,
seed 0) with `DEMO_CODEC`, written deterministically to the cache folder on first use (no
network). Its audio is noise.

The demo's codec has S2 Pro's time structure, so its audio seconds, RTF and first-chunk
latency mean what they do for the released model: 44.1 kHz, encoder rates 2·4·8·8 with a 2x2
quantizer downsample and decoder rates 8·8·4·2, so 2048 samples per frame (21.5 frames/s),
and the released attention windows (128 frames, 512 in the encoder). Only the widths are
narrow (decoder 128 -> 8 channels where S2 Pro has 1536 -> 96; latent 64 where it has 1024;
one layer per transformer), so one frame streams out in about 5 ms on one CPU core. The LLM
is the tiny test one (its 64-entry semantic codebook and 3 residual codebooks of 16 set the
codec's codebooks). Tests keep `tiny.TINY_CODEC` (16 samples per frame) for speed.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from omnivox.demo import NOISE_NOTE, build_lock, cache_root
from omnivox.models.fish_s2.config import CodecConfig, CodecTransformerConfig

FISH_DEMO_VERSION = 2  # 2: the released 2048-sample hop (v1 decoded 16 samples per frame)
MARKER = "OMNIVOX_DEMO"

_DEMO_TF = CodecTransformerConfig(n_layer=1, dim=64, n_head=4, head_dim=16, intermediate_size=192, window=128)
DEMO_CODEC = CodecConfig(sample_rate=44100, encoder_dim=4, encoder_rates=(2, 4, 8, 8), decoder_dim=128,
                         decoder_rates=(8, 8, 4, 2), codebook_dim=8, semantic_codebook_size=64, codebook_size=16,
                         n_residual=3, downsample_factor=(2, 2), encoder_transformer=replace(_DEMO_TF, window=512),
                         pre_module=_DEMO_TF, post_module=_DEMO_TF)


def fish_demo_path() -> Path:
    """The demo S2 folder, created on first use (atomically, safe under races; built once by
    processes started together: `omnivox.demo.build_lock`)."""
    folder = cache_root() / f"demo-fish-s2-v{FISH_DEMO_VERSION}"
    if (folder / MARKER).exists():
        return folder
    with build_lock(folder):
        return _build_fish_demo(folder)


def _build_fish_demo(folder: Path) -> Path:
    from omnivox.models.fish_s2.tiny import write_tiny_checkpoint

    if (folder / MARKER).exists():  # built while this process waited for the lock
        return folder
    tmp = Path(tempfile.mkdtemp(prefix=".demo-fish-", dir=folder.parent))
    try:
        write_tiny_checkpoint(tmp, seed=0, codec=DEMO_CODEC)
        (tmp / MARKER).write_text(NOISE_NOTE + "\n")
        try:
            os.replace(tmp, folder)
        except OSError:  # another process won the race (or a stale folder without the marker)
            if not (folder / MARKER).exists():
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
