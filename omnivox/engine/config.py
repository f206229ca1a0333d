"""Engine configuration."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

# how FP8 layers compute (`layers/fp8.py`, --fp8-compute); here so the CLI's parser imports no torch
FP8_COMPUTE_PATHS = ("auto", "dequant", "triton")


MAX_PROMPT_LOOKUP = 16  # the longest n-gram a draft matches (the proposer's work grows with it)
MAX_SPECULATIVE_TOKENS = 64  # ids drafted per row and step


SPECULATIVE_METHODS = ("ngram", "dflash", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding of the Thinker, in vLLM's keys. Each decode step a row drafts up to
    `num_speculative_tokens` ids, by prompt lookup (`method` "ngram": matching its last n tokens,
    n from `prompt_lookup_max` down to `prompt_lookup_min`, earlier in its own prompt and output)
    or by a learned draft (`model`: its checkpoint folder, or "demo": the built-in demo model's): a
    DFlash block drafter (`method` "dflash", at most its block_size - 1 ids) or an EAGLE-3 head
    (`method` "eagle3", a chain of that many draft steps); one forward verifies them. Above
    `disable_by_batch_size` decoding rows a step drafts nothing (on
    MoE each extra verified token reads more experts: at a large batch the step is already
    bandwidth-bound and drafts stop paying). Bounded: `prompt_lookup_max` <= MAX_PROMPT_LOOKUP and
    `num_speculative_tokens` <= MAX_SPECULATIVE_TOKENS (the proposer's host work grows with both)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 8
    model: str | None = None  # dflash, eagle3: the draft's folder, or "demo"

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(map(repr, SPECULATIVE_METHODS))}, "
                             f"got {self.method!r}")
        if (self.model is None) != (self.method == "ngram") or not isinstance(self.model, (str, type(None))):
            raise ValueError("speculative model (a folder, or \"demo\") is needed by methods 'dflash' and 'eagle3' "
                             "and only by them, "
                             f"got {self.model!r} for {self.method!r}")
        for f in fields(self)[1:-1]:
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative {f.name} must be a positive integer, got {v!r}")
        for name, most in (("num_speculative_tokens", MAX_SPECULATIVE_TOKENS), ("prompt_lookup_max", MAX_PROMPT_LOOKUP)):
            if getattr(self, name) > most:
                raise ValueError(f"speculative {name} must be at most {most}, got {getattr(self, name)}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                             f"({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, spec: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """A JSON object (text) or a dict of vLLM's keys -> the config; None stays None. Raises
        ValueError naming the bad JSON, key or value."""
        if spec is None or isinstance(spec, SpeculativeConfig):
            return spec
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(spec, dict):
            raise ValueError(f"speculative config must be a JSON object, got {type(spec).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"unknown speculative config key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "method" not in spec:
            raise ValueError(f"speculative config needs a method ({', '.join(map(repr, SPECULATIVE_METHODS))})")
        return cls(**spec)


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 32  # requests running at once (per AR stage)
    max_queue: int = 256  # requests waiting beyond max_running; more are refused (Overloaded)
    kv_cache_mb: float = 256.0  # KV memory budget of the model's AR stages (Qwen3-Omni: half Thinker, half Talker)
    kv_stage_mb: tuple[tuple[str, float], ...] = ()  # (stage, MB) per KV-caching stage, in place of the split
    block_size: int = 16  # tokens per KV page
    token_budget: int = 512  # tokens per stage step (longer prefills are chunked)
    prefix_cache: bool = True
    first_chunk_frames: int | None = None  # at least this many frames in a reply's first audio chunk; None: auto
    vocoder_chunk_frames: int = 1  # frames per decode after the first (which is 1 frame)
    poison_freed_pages: bool = False  # tests: fill freed KV pages with NaN
    attention_backend: str = "auto"  # "torch_ref" | "per_sequence" (the oracle) | "triton_paged" | "auto": the device's
    cuda_graphs: str = "auto"  # "auto": decode steps replay CUDA graphs on a GPU | "off" (--enforce-eager) | "fake" (tests)
    graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)  # batch sizes with a graph (<= max_running)
    speculative: SpeculativeConfig | None = None  # Thinker drafts (off: None)
    # streaming-aware scheduling (engine/slack.py): "slack" | "fifo" (arrival order, no capacity gate)
    scheduling: str = "slack"
    stream_lead_s: float = 1.0  # slack: a stream this far ahead of its listener yields its steps
    ttfa_target_s: float = 1.0  # slack: a stream's urgency before its first audio counts against this
    # which stages step in which thread (engine/placement.py): "device" | "one" | "thinker,talker+vocoder"
    stage_loops: str = "device"

    def __post_init__(self) -> None:
        if self.scheduling not in ("fifo", "slack"):
            raise ValueError(f"scheduling must be 'fifo' or 'slack', got {self.scheduling!r}")
        for name in ("stream_lead_s", "ttfa_target_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
