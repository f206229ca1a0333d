"""Merged w1/w3 and q_norm/k_norm keep the official names; flattened tokens equal batched rows."""
import copy
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnivox.errors import CheckpointError
from omnivox.layers.attention import DenseKVCache
from omnivox.models.fish_s2.weights import load_llm


@pytest.mark.parametrize("prefix, name", [("text_model.model.", "layers.0.feed_forward.w3.weight"),
                                          ("text_model.model.", "layers.1.attention.k_norm.weight"),
                                          ("audio_decoder.", "layers.1.feed_forward.w1.weight")])
def test_missing_part_is_named(tiny_folder, tmp_path, prefix, name):
    drop = prefix + name
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_folder, folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = folder / index[drop]
    tensors = load_file(str(shard))
    del tensors[drop]
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=rf"{re.escape(prefix)}\*\): missing tensor\(s\) {re.escape(name)}"):
        load_llm(folder, dtype=torch.float32)


def test_merged_rows_come_from_the_parts(tiny_folder, tiny_llm):
    _, slow, fast = tiny_llm
    tensors = {k: v for f in sorted(tiny_folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    pre = "text_model.model.layers.1."
    ff = slow.layers[1].feed_forward.w13.weight
    assert torch.equal(ff, torch.cat((tensors[pre + "feed_forward.w1.weight"], tensors[pre + "feed_forward.w3.weight"])))
    norm = slow.layers[1].attention.qk_norm.weight
    h = slow.cfg.text.n_head
    assert torch.equal(norm[:h], tensors[pre + "attention.q_norm.weight"].expand(h, -1))
    assert torch.equal(norm[h:], tensors[pre + "attention.k_norm.weight"].expand(norm.shape[0] - h, -1))
    assert fast.layers[0].attention.qk_norm is None  # the fast AR has no QK norm


@torch.no_grad()
def test_slow_flat_tokens_equal_batched_rows(tiny_llm):
    cfg, slow, _ = tiny_llm
    slow = copy.deepcopy(slow).double()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, cfg.semantic_begin, (10,), generator=g)
    codes = torch.randint(0, cfg.codebook_size, (10, cfg.num_codebooks), generator=g)
    pos = torch.arange(10)
    rows = slow(ids[None], codes[None], pos[None])
    flat = slow(ids, codes, pos)
    assert torch.equal(flat.hidden, rows.hidden[0]) and torch.equal(flat.residual, rows.residual[0])
    cache = DenseKVCache()
    parts = [slow(ids[:6], codes[:6], pos[:6], cache).hidden]
    parts += [slow(ids[i:i + 1], codes[i:i + 1], pos[i:i + 1], cache).hidden for i in range(6, 10)]
    torch.testing.assert_close(torch.cat(parts), flat.hidden, rtol=0, atol=1e-12)
