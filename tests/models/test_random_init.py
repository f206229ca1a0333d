"""Random weights drawn on the model's device (the full-size model of scripts/gpu_verify.py):
every parameter is drawn, merged parameters are consistent with their checkpoint parts (the
loader takes them back exactly), and each block's values have the intended scale."""
import json

import torch
from safetensors.torch import save_file

from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
from omnivox.models.qwen3_omni.model import Qwen3OmniModel
from omnivox.models.qwen3_omni.random_init import randomize_on_device_
from omnivox.models.qwen3_omni.weights import load_model, reset_buffers, to_disk_layout
from qwen_tiny import BASE


def _filled(seed=0):
    with torch.device("meta"):
        model = Qwen3OmniModel(Qwen3OmniConfig.from_hf(BASE))
    model = model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.fill_(float("nan"))  # anything not drawn stays NaN
    n = randomize_on_device_(model, seed)
    reset_buffers(model)
    return model, n


def test_every_parameter_is_drawn_and_the_loader_reads_them_back(tmp_path):
    model, n = _filled()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    buffers = dict(model.named_buffers())
    state = {k: v for k, v in model.state_dict().items() if k not in buffers}
    assert n == len(state)  # one draw per checkpoint tensor
    save_file(to_disk_layout(state), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    loaded = load_model(tmp_path, progress=False)
    for (name, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name  # merged q/k/v, gate/up and broadcast q/k norms included


def test_seeded_and_scaled():
    a, _ = _filled(seed=3)
    b, _ = _filled(seed=3)
    c, _ = _filled(seed=4)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["thinker.lm_head.weight"], pc["thinker.lm_head.weight"])
    qkv = pa["thinker.model.layers.0.self_attn.qkv_proj.weight"]  # fan-in scaling: std ~ 1/sqrt(hidden)
    assert abs(qkv.std().item() * qkv.shape[1] ** 0.5 - 1) < 0.15
    norm = pa["thinker.model.layers.0.input_layernorm.weight"]  # norm gains near 1, not near 0
    assert abs(norm.mean().item() - 1) < 0.1 and norm.std().item() > 0.05
