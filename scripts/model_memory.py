"""Weight memory of the released Qwen3-Omni per stage in bf16 and in block FP8, and the KV tokens and
streams that fit beside it on an 80 GB (H100) and a 141 GB (H200) GPU. Built on the meta device from
benchmarks/qwen3_omni_released_config.json: no weights, no GPU, a few seconds.

    python scripts/model_memory.py [--config FILE] [--gpu-memory-utilization 0.9] [--reserve-gib 4]

FP8 is what `--quantization fp8` (or a block-FP8 checkpoint) holds: the AR stages' decoder linears
and experts in float8 with float32 128x128 block scales (omnivox/layers/fp8.py); embeddings, heads,
router gates, norms, encoders and Code2Wav stay bf16. KV: bf16 keys and values of every layer, the
Thinker's and the Talker's (the code predictor's per-frame cache is transient). A stream is one
conversation of `--stream-tokens` Thinker tokens (its spoken reply's Talker frames count alike).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from omnivox.layers.fp8 import FP8Config, convert
from omnivox.models.qwen3_omni.config import DecoderConfig, Qwen3OmniConfig
from omnivox.models.qwen3_omni.model import Qwen3OmniModel
from omnivox.models.qwen3_omni.weights import FP8_KEEP, FP8_LAYERS

ROOT = Path(__file__).resolve().parents[1]
GPUS = {"80 GB (H100)": 80e9, "141 GB (H200)": 141e9}


def stage_bytes(model: Qwen3OmniModel) -> dict[str, int]:
    """Bytes per stage of the meta model's parameters and buffers (dtype x numel)."""
    return {stage: sum(t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers()))
            for stage, modules in model.stage_modules().items()}


def kv_bytes_per_token(d: DecoderConfig) -> int:
    return d.num_hidden_layers * 2 * d.num_key_value_heads * d.head_dim * 2  # K and V, bf16


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "benchmarks" / "qwen3_omni_released_config.json")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--reserve-gib", type=float, default=4.0, help="activations, CUDA graphs and allocator slack")
    p.add_argument("--stream-tokens", type=int, default=8192, help="Thinker context of one stream")
    args = p.parse_args(argv)
    cfg = Qwen3OmniConfig.from_hf(json.loads(args.config.read_text()))
    with torch.device("meta"):
        model = Qwen3OmniModel(cfg).to(torch.bfloat16)
    bf16 = stage_bytes(model)
    convert(model, FP8_LAYERS, FP8Config(), keep=FP8_KEEP)
    fp8 = stage_bytes(model)
    gib = 2**30
    print(f"Qwen3-Omni ({args.config.name}), weights in GiB per stage")
    print(f"{'stage':>10} {'bf16':>8} {'fp8':>8}")
    for stage in bf16:
        print(f"{stage:>10} {bf16[stage] / gib:8.2f} {fp8[stage] / gib:8.2f}")
    print(f"{'total':>10} {sum(bf16.values()) / gib:8.2f} {sum(fp8.values()) / gib:8.2f}")
    per_token = kv_bytes_per_token(cfg.thinker.text) + (kv_bytes_per_token(cfg.talker.text) if cfg.talker else 0)
    print(f"\nKV per token (Thinker + Talker, bf16): {per_token / 1024:.0f} KiB; a stream: {args.stream_tokens} tokens "
          f"({args.stream_tokens * per_token / gib:.2f} GiB); budget = {args.gpu_memory_utilization:g} x GPU - weights "
          f"- {args.reserve_gib:g} GiB reserve")
    print(f"{'GPU':>14} {'weights':>8} {'KV GiB':>8} {'KV tokens':>10} {'streams':>8}")
    for name, total in GPUS.items():
        for label, weights in (("bf16", bf16), ("fp8", fp8)):
            kv = args.gpu_memory_utilization * total - sum(weights.values()) - args.reserve_gib * gib
            tokens = max(0, math.floor(kv / per_token))
            print(f"{name:>14} {label:>8} {max(kv, 0) / gib:8.1f} {tokens:>10} {tokens // args.stream_tokens:>8}")


if __name__ == "__main__":
    main()
