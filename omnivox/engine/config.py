"""Engine configuration."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 32  # requests running at once (per AR stage)
    max_queue: int = 256  # requests waiting beyond max_running; more are refused (Overloaded)
    kv_cache_mb: float = 256.0  # KV memory budget of the model's AR stages (Qwen3-Omni: half Thinker, half Talker)
    block_size: int = 16  # tokens per KV page
    token_budget: int = 512  # tokens per stage step (longer prefills are chunked)
    prefix_cache: bool = True
    first_chunk_frames: int | None = None  # at least this many frames in a reply's first audio chunk; None: auto
    vocoder_chunk_frames: int = 1  # frames per decode after the first (which is 1 frame)
    poison_freed_pages: bool = False  # tests: fill freed KV pages with NaN
    attention_backend: str = "auto"  # "torch_ref" | "per_sequence" (the oracle) | "triton_paged" | "auto": the device's
    cuda_graphs: str = "auto"  # "auto": decode steps replay CUDA graphs on a GPU | "off" (--enforce-eager) | "fake" (tests)
    graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)  # batch sizes with a graph (<= max_running)
