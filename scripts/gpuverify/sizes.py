"""What gpu_verify runs at each size: the model configurations and the workloads.

Full size: the released Qwen3-Omni configuration and S2 Pro's (copies in benchmarks/, since the
GPU machine has no ../shared), the workloads of the goals. Tiny (`--tiny`): the demo-sized Qwen
config and S2's tiny config, workloads small enough for a CPU test.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QWEN_RELEASED = ROOT / "benchmarks" / "qwen3_omni_released_config.json"
S2_RELEASED = ROOT / "benchmarks" / "fish_s2_pro_released_config.json"


@dataclass(frozen=True)
class Workloads:
    text_prompt: int = 100  # Thinker text-only request: prompt tokens ...
    text_tokens: int = 256  # ... and tokens out
    speech_prompt: int = 100  # speech request: text prompt tokens,
    speech_tokens: int = 64  # Thinker tokens,
    speech_frames: int = 200  # frames out (ignore_eos)
    single_requests: int = 2  # one stream: requests run one after another (TTFA/RTF medians)
    loop_concurrency: int = 64  # closed loop: streams in flight ...
    loop_requests: int = 128  # ... and requests in all
    s2_prompt: int = 100
    s2_frames: int = 200


@dataclass(frozen=True)
class Sizes:
    name: str  # "full" | "tiny"
    dtype: str
    qwen_config: dict = field(repr=False)
    s2_config: dict = field(repr=False)  # {"config": config.json, "codec": CodecConfig fields}
    work: Workloads = Workloads()
    kernel_batches: tuple[int, ...] = (1, 8, 64)
    kernel_context: tuple[int, int] = (1024, 4096)  # decode rows' past lengths are drawn in this range
    kernel_prefill: tuple[int, int] = (512, 1024)  # the mixed batch: prefill chunk, past of the chunked row
    parity_tokens: int = 128
    probe_copy_bytes: int = 2 << 30
    probe_matmul: int = 8192
    timing_iters: int = 20
    engine_kv_mb: float = 8192.0
    duplex_lm: dict | None = field(default=None, repr=False)  # Moshi LM keyword arguments (None: moshi_narrow())
    duplex_mimi: dict | None = field(default=None, repr=False)  # moshi's mimi config (None: the released Mimi)
    duplex_batches: tuple[int, ...] = (1, 8, 32)  # sessions stepped together
    duplex_frames: int = 12  # engine steps per batch (the first a warm-up)
    duplex_kv_mb: float = 8192.0  # the LM's KV budget: session_pages and max_sessions under it


def full() -> Sizes:
    return Sizes("full", "bfloat16", json.loads(QWEN_RELEASED.read_text()), json.loads(S2_RELEASED.read_text()))


def tiny() -> Sizes:
    from omnivox.models.fish_s2.config import codec_config_to_json
    from omnivox.models.fish_s2.tiny import TINY_CODEC, TINY_CONFIG
    from omnivox.models.moshi.demo import DEMO_LM, DEMO_MIMI
    from omnivox.models.qwen3_omni.demo import build_demo_tokenizer, demo_config_dict

    codec = {k: getattr(TINY_CODEC, k) for k in TINY_CODEC.__dataclass_fields__}
    for k in ("encoder_transformer", "pre_module", "post_module"):
        codec[k] = dict(vars(codec[k]))
    assert codec_config_to_json(TINY_CODEC)["sample_rate"] == codec["sample_rate"]
    work = Workloads(text_prompt=24, text_tokens=16, speech_prompt=24, speech_tokens=6, speech_frames=8,
                     single_requests=2, loop_concurrency=3, loop_requests=4, s2_prompt=16, s2_frames=8)
    return Sizes("tiny", "bfloat16", demo_config_dict(build_demo_tokenizer()),
                 {"config": TINY_CONFIG.to_hf(), "codec": codec}, work, kernel_batches=(1, 3),
                 kernel_context=(8, 40), kernel_prefill=(12, 20), parity_tokens=24, probe_copy_bytes=16 << 20,
                 probe_matmul=256, timing_iters=2, engine_kv_mb=64.0, duplex_lm=dict(DEMO_LM),
                 duplex_mimi=dict(DEMO_MIMI), duplex_batches=(1, 3), duplex_frames=3, duplex_kv_mb=64.0)


def moshi_narrow() -> dict:
    """Moshi's released depths and sizes (temporal 32 layers, depformer 6, dep_q 8 of n_q 16, context
    3000, text card 32000, card 2048, head dims 128 / 64) at narrow width: dim 512, depformer 256."""
    from omnivox.models.moshi.demo import DEMO_LM

    return DEMO_LM | {"dim": 512, "num_heads": 4, "num_layers": 32, "text_card": 32000, "card": 2048,
                      "context": 3000, "depformer_dim": 256, "depformer_num_heads": 4, "depformer_num_layers": 6,
                      "depformer_dim_feedforward": int(4.125 * 256)}


def narrow() -> Sizes:
    """The released depths, expert counts and layouts at tens of width (benchmarks/step_cost.py's
    checkpoint config; S2 Pro's 36 + 4 layers likewise, its tiny codec): a CPU dry run of the
    full-size structure (48 Thinker layers x 128 experts, accept layer 24, the real speakers)."""
    import copy
    import sys

    from omnivox.models.fish_s2.tiny import TINY_CODEC

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from step_cost import checkpoint_config

    s2 = copy.deepcopy(json.loads(S2_RELEASED.read_text()))
    for key in ("text_config", "audio_decoder_config"):
        s2["config"][key].update(dim=64, n_head=4, n_local_heads=2, head_dim=16, intermediate_size=128)
    s2["config"]["audio_decoder_config"]["text_dim"] = 64
    codec = {k: getattr(TINY_CODEC, k) for k in TINY_CODEC.__dataclass_fields__}
    for k in ("encoder_transformer", "pre_module", "post_module"):
        codec[k] = dict(vars(codec[k]))
    s2["codec"] = codec
    work = Workloads(text_prompt=24, text_tokens=8, speech_prompt=24, speech_tokens=4, speech_frames=4,
                     single_requests=1, loop_concurrency=2, loop_requests=2, s2_prompt=16, s2_frames=4)
    return Sizes("narrow", "bfloat16", checkpoint_config(), s2, work, kernel_batches=(1, 2), kernel_context=(8, 40),
                 kernel_prefill=(12, 20), parity_tokens=16, probe_copy_bytes=16 << 20, probe_matmul=256,
                 timing_iters=2, engine_kv_mb=64.0, duplex_batches=(1, 2), duplex_frames=3, duplex_kv_mb=1024.0)


def s2_configs(s2: dict):
    """(FishConfig, CodecConfig) from `Sizes.s2_config`."""
    from omnivox.models.fish_s2.config import CodecConfig, CodecTransformerConfig, FishConfig

    c = dict(s2["codec"])
    for k in ("encoder_transformer", "pre_module", "post_module"):
        c[k] = CodecTransformerConfig(**c[k])
    for k in ("encoder_rates", "decoder_rates", "downsample_factor"):
        c[k] = tuple(c[k])
    return FishConfig.from_hf(s2["config"]), CodecConfig(**c)
