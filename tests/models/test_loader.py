"""Checkpoint loading: both config spellings, shards + index, dtypes, clear errors, a placement, one stage only."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnivox.engine.placement import Placement, PlacementError
from omnivox.errors import CheckpointError
from omnivox.models.qwen3_omni.random_init import save_random_checkpoint
from omnivox.models.qwen3_omni.weights import load_model, shard_files
from qwen_tiny import BASE


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("ckpt")
    save_random_checkpoint(BASE, f, seed=3)
    return f


def _copy(folder, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(folder, dst)
    return dst


def _released_spelling(cfg: dict) -> dict:
    """Rewrite a v5 config the way the released file spells it: rope_scaling + rope_theta,
    num_local_experts for the talker."""
    def conv(d):
        rp = d.pop("rope_parameters")
        d["rope_theta"] = rp["rope_theta"]
        if "mrope_section" in rp:
            d["rope_scaling"] = {"mrope_section": rp["mrope_section"], "interleaved": True, "type": "default"}
    cfg = json.loads(json.dumps(cfg))
    conv(cfg["thinker_config"]["text_config"])
    conv(cfg["talker_config"]["text_config"])
    conv(cfg["talker_config"]["code_predictor_config"])
    conv(cfg["code2wav_config"])
    tt = cfg["talker_config"]["text_config"]
    tt["num_local_experts"] = tt.pop("num_experts")
    return cfg


@torch.no_grad()
def test_released_config_spelling_loads_identically(folder, tmp_path):
    a = load_model(folder, progress=False)
    other = _copy(folder, tmp_path)
    (other / "config.json").write_text(json.dumps(_released_spelling(BASE)))
    b = load_model(other, progress=False)
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), n
    x = torch.randn(1, 5, 32)
    pos = torch.arange(5).expand(3, 1, 5)
    torch.testing.assert_close(a.talker(x, pos), b.talker(x, pos), rtol=0, atol=0)


def test_sharded_with_index_equals_single_file(folder, tmp_path):
    tensors = load_file(str(folder / "model.safetensors"))
    dst = tmp_path / "sharded"
    dst.mkdir()
    shutil.copy(folder / "config.json", dst)
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(dst / fname))
        weight_map.update({k: fname for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert len(shard_files(dst)) == 2
    a, b = load_model(folder, progress=False), load_model(dst, progress=False)
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), n
    # the per-expert on-disk tensors were fused into [E, 2I, H]
    g = tensors["thinker.model.layers.1.mlp.experts.3.up_proj.weight"]
    assert torch.equal(b.thinker.model.layers[1].mlp.experts.gate_up_proj[3, 16:], g)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtypes(folder, dtype):
    m = load_model(folder, dtype=dtype, progress=False)
    assert {p.dtype for p in m.parameters()} == {getattr(torch, dtype)}
    assert m.thinker.model.inv_freq.dtype == torch.float32  # tables recomputed in fp32


def test_errors_are_clear(folder, tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_model(tmp_path / "nope")
    m = _copy(folder, tmp_path)
    (m / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(m)
    shutil.rmtree(m)
    m = _copy(folder, tmp_path)
    (m / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="cannot read"):
        load_model(m)
    shutil.rmtree(m)
    m = _copy(folder, tmp_path)
    t = load_file(str(m / "model.safetensors"))
    del t["talker.codec_head.weight"]
    save_file(t, str(m / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lacks 1 tensor"):
        load_model(m)
    shutil.rmtree(m)
    m = _copy(folder, tmp_path)
    bad = json.loads((m / "config.json").read_text())
    bad["talker_config"]["accept_hidden_layer"] = 9
    (m / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="accept_hidden_layer"):
        load_model(m)
    del bad["talker_config"]["spatial_merge_size"]
    (m / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="spatial_merge_size"):
        load_model(m)


def test_only_some_stages_and_a_placement(folder):
    """A tensor-parallel worker loads the Thinker only (the rest stays on meta, unread); a placement
    puts each stage's modules on its device (all `cpu` here: the split itself)."""
    full = load_model(folder, progress=False)
    thinker = load_model(folder, progress=False, only=("thinker",))
    assert {stage: thinker.device_of(stage).type for stage in ("thinker", "encoder", "talker", "vocoder")} == \
        {"thinker": "cpu", "encoder": "meta", "talker": "meta", "vocoder": "meta"}
    for (name, a), (_, b) in zip(full.thinker.model.named_parameters(), thinker.thinker.model.named_parameters()):
        assert torch.equal(a, b), name
    placed = load_model(folder, progress=False, placement=Placement.parse("talker=cpu,vocoder=cpu"))
    for (name, a), (_, b) in zip(full.state_dict().items(), placed.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(PlacementError, match="tlker"):
        load_model(folder, progress=False, placement=Placement.parse("tlker=cpu"))
