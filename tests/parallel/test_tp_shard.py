"""Tensor parallelism for the Thinker over gloo: two real processes on loopback load the tiny
checkpoint as their shards and run it against the whole model (tp_worker.py does the work).

The tiny Thinker has 4 q / 2 kv heads, 4 experts of intermediate 16 and vocab 152064: TP 2 divides
every cut. A copy with vocab 152061 makes the last rank's lm_head hold a padding row; a block-FP8
copy (8x8 blocks: every rank's piece whole blocks) takes its scales along.
"""
from __future__ import annotations

import json
import multiprocessing
import queue
import socket
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tp_worker
from fp8_checkpoints import qwen_rule, write_fp8
from omnivox.errors import OmnivoxError
from omnivox.layers.fp8 import FP8Config, convert
from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
from omnivox.models.qwen3_omni.model import Qwen3OmniModel
from omnivox.models.qwen3_omni.sharding import shard_thinker
from omnivox.models.qwen3_omni.weights import FP8_LAYERS
from omnivox.parallel.group import TPGroup

SIZE = 2
ODD_VOCAB = 152061
TIMEOUT_S = 90


@pytest.fixture(scope="module")
def ranks(tiny_reference, tmp_path_factory) -> list[dict]:
    _, folder = tiny_reference
    odd = odd_vocab_copy(Path(folder), tmp_path_factory.mktemp("tp-odd-vocab"))
    fp8 = write_fp8(Path(folder), tmp_path_factory.mktemp("tp-fp8") / "fp8", (8, 8), qwen_rule)
    return run_ranks([str(folder), str(odd), str(fp8)])


def odd_vocab_copy(folder: Path, out: Path) -> Path:
    """The checkpoint with the Thinker's vocab cut to ODD_VOCAB rows (embed_tokens and lm_head)."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg["thinker_config"]["text_config"]["vocab_size"] = ODD_VOCAB
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(folder / "model.safetensors")
    for name in ("thinker.model.embed_tokens.weight", "thinker.lm_head.weight"):
        tensors[name] = tensors[name][:ODD_VOCAB].clone()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def run_ranks(folders: list[str]) -> list[dict]:
    """Spawn SIZE ranks over gloo; every one is joined or killed before this returns."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=tp_worker.run, args=(rank, SIZE, port, folders, results),
                         daemon=True) for rank in range(SIZE)]
    found: dict[int, dict] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + TIMEOUT_S
        while len(found) < SIZE:
            try:
                rank, got = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"ranks {sorted(set(range(SIZE)) - set(found))} gave no result in {TIMEOUT_S} s")
            if isinstance(got, str):
                pytest.fail(f"rank {rank} failed:\n{got}")
            found[rank] = got
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return [found[rank] for rank in range(SIZE)]


def checkpoints(ranks: list[dict]):
    """(rank, checkpoint name, findings) for every rank and both checkpoints."""
    return [(r, name, got) for r, res in enumerate(ranks) for name, got in res.items() if name != "mlp"]


def test_each_rank_loads_exactly_its_pieces(ranks):
    for rank, name, got in checkpoints(ranks):
        where = f"rank {rank}, {name}"
        # per layer q/k/v/o and 4 experts' gate/up/down (and their scales in FP8), then lm_head
        assert got["cut_tensors"] == 2 * (4 + 4 * 3) * (2 if name == "fp8" else 1) + 1, where
        assert got["slice_mismatches"] == [], where
        assert got["load_vs_shard"] == [], where
        assert got["kv_heads"] == (1, 1, 2), where  # loaded, sharded after loading, whole
        rows, vocab = got["lm_head_rows"]
        assert rows == -(-vocab // SIZE), where  # ODD_VOCAB: rank 1's last row is padding


def test_sharded_forward_equals_whole(ranks):
    """Prefill + 4 greedy decode steps: the same ids, logits within fp32 rounding, every rank alike."""
    for rank, name, got in checkpoints(ranks):
        sharded_ids, whole_ids = got["ids"]
        assert sharded_ids == whole_ids, f"rank {rank}, {name}"
        assert got["logit_scale"] > 1
        assert got["max_logit_diff"] < 1e-5, f"rank {rank}, {name}: {got['max_logit_diff']}"
        print(f"rank {rank} {name}: max logit difference {got['max_logit_diff']:.2e} "
              f"(logits up to {got['logit_scale']:.1f}), ids {sharded_ids}")
    for name in ranks[0]:
        if name != "mlp":
            assert ranks[0][name]["logits_sha"] == ranks[1][name]["logits_sha"], f"{name}: ranks' logits differ"


def test_two_all_reduce_per_layer_and_one_all_gather(ranks):
    for rank, name, got in checkpoints(ranks):
        per_forward = {"all_reduce": 2 * got["layers"], "all_gather": 1}
        assert got["collectives"] == [per_forward] * len(got["collectives"]), f"rank {rank}, {name}"


def test_dense_mlp_and_shared_expert_shards(ranks):
    for rank, res in enumerate(ranks):
        for kind, (diff, collectives) in res["mlp"].items():
            assert diff < 1e-5, f"rank {rank}, {kind}: {diff}"
            assert collectives == {"all_reduce": 1}, f"rank {rank}, {kind}"


def test_indivisible_sizes_are_named(tiny_reference):
    _, folder = tiny_reference
    cfg = Qwen3OmniConfig.from_hf(json.loads((Path(folder) / "config.json").read_text()))
    with torch.device("meta"):
        model = Qwen3OmniModel(cfg)
    with pytest.raises(OmnivoxError, match=r"size 3 does not divide .*attention heads \(4\), kv heads \(2\), "
                                           r"expert intermediate size \(16\)"):
        shard_thinker(model, TPGroup(rank=0, size=3, group=None))


def test_a_cut_through_fp8_blocks_is_refused(tiny_reference):
    _, folder = tiny_reference
    cfg = Qwen3OmniConfig.from_hf(json.loads((Path(folder) / "config.json").read_text()))
    with torch.device("meta"):
        model = Qwen3OmniModel(cfg)
    convert(model, FP8_LAYERS, FP8Config(block=(16, 16)))
    with pytest.raises(OmnivoxError, match=r"^tensor parallel size 2 would cut the FP8 blocks of the experts' gate/up: a rank's 8 of 16 "
                                           r"is not a multiple of the block size 16$"):
        shard_thinker(model, TPGroup(rank=0, size=2, group=None))
