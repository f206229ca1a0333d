"""Argument types and the help layout shared by the `omnivox` subcommands (cli.py, serve.py,
bench.py): a bad value is a usage error at parse time (exit 2), before anything loads."""
from __future__ import annotations

import argparse
import math


def ranged(kind: type, lo: float | None = None, hi: float | None = None, *, positive: bool = False,
           note: str = ""):
    """An argparse type: a finite `kind` (int or float) within [lo, hi], or > 0 with `positive`. A bad
    value is a usage error at parse time (exit 2), before anything loads."""
    noun = "an integer" if kind is int else "a number"
    if positive:
        want = "a positive number" + (f" up to {hi}" if hi is not None else "")
    else:
        want = f"{noun} >= {lo}" if hi is None else f"{noun} within {lo}-{hi}"
    want += f" ({note})" if note else ""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if (value is None or not math.isfinite(value) or (positive and value <= 0)
                or (lo is not None and value < lo) or (hi is not None and value > hi)):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return value
    return parse


PORT = ranged(int, 0, 65535, note="0: any free port")
COUNT = ranged(int, 1)  # threads, workers, requests
SLOTS = ranged(int, 0)  # queue lengths, limits where 0 means none
POSITIVE = ranged(float, positive=True)  # sizes in MB, seconds, rates


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, except where there is none to show (None, False, an empty
    list) or its help already words it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        d = action.default
        if d is None or d is False or (isinstance(d, (list, str)) and not d) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def subcommand(sub, name: str, help: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".",
                          formatter_class=HelpFormatter)


def first_chunk_arg(value: str) -> int | None:
    """--first-chunk-frames: "auto" (None) or a frame count."""
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number of frames, got {value!r}") from None


def add_quantization_args(p) -> None:
    """--quantization / --fp8-compute, shared by generate, serve and bench."""
    from omnivox.engine.config import FP8_COMPUTE_PATHS as COMPUTE_PATHS

    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: quantize the AR stages' linears and experts to block FP8 (128x128, e4m3) at load; a "
                        "checkpoint whose config.json has an FP8 quantization_config loads FP8 without it")
    p.add_argument("--fp8-compute", choices=list(COMPUTE_PATHS), default="auto",
                   help="how FP8 layers compute: triton (block-FP8 Triton kernels: FP8 tensor cores, activations "
                        "quantized per token and group of 128), dequant (each layer's weights dequantized at every "
                        "call; exact to the dequantized checkpoint), auto (triton on a CUDA device with sm89+, else "
                        "dequant; the start-up line says which)")


def add_gpu_memory_arg(p) -> None:
    """--gpu-memory-utilization, shared by serve and bench (engine/memory.py)."""
    p.add_argument("--gpu-memory-utilization", type=ranged(float, 0, 1, positive=True), default=0.9,
                   metavar="FRACTION",
                   help="without --kv-cache-mb: the share of each CUDA device this process may use; what is left "
                        "of it after loading and a profiling run of each stage's worst-case step is the KV of the "
                        "stages there (two servers on one GPU: 0.45 each)")


def speculative_arg(value: str):
    """--speculative-config: a JSON object of vLLM's keys -> a frozen `SpeculativeConfig`; bad JSON, an
    unknown method or key, or a bad value is a usage error (exit 2)."""
    from omnivox.engine.config import SpeculativeConfig
    try:
        return SpeculativeConfig.parse(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def kv_budget(text: str):
    """`--kv-cache-mb`: a positive number of MB (the total), or `stage=MB,...` (each KV-caching
    stage's; the stage names are checked once the model's family is known)."""
    try:
        return ranged(float, hi=2**24, positive=True)(text)
    except argparse.ArgumentTypeError:
        if "=" not in text:
            raise
    from omnivox.engine.placement import PlacementError, parse_kv_budget
    try:
        parse_kv_budget(text, None)
    except PlacementError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def placement(text: str):
    """`--placement stage=device,...`: the devices are checked here, the stage names at load."""
    from omnivox.engine.placement import Placement, PlacementError
    try:
        Placement.parse(text)
    except PlacementError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
