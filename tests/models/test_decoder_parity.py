"""Decoder stacks (Thinker text model, Talker, code predictor) equal transformers' in fp64."""
import pytest
import torch
from safetensors.torch import load_file

from omnivox.layers.attention import DenseKVCache
from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
from omnivox.models.qwen3_omni.decoder import DecoderStack
from omnivox.models.qwen3_omni.weights import load_submodule
from qwen_tiny import VARIANT, build_reference


@pytest.fixture(scope="module", params=["base", "variant"])
def pair(request, tmp_path_factory):
    ref = build_reference(VARIANT if request.param == "variant" else None).double()
    folder = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(folder)
    import json
    cfg = Qwen3OmniConfig.from_hf(json.loads((folder / "config.json").read_text()))
    return ref, cfg, load_file(str(folder / "model.safetensors"))


def _positions(b, s):
    t = torch.arange(s).expand(b, s)
    return torch.stack([t, t // 2 + 1, (t * 3) % 7])  # distinct T/H/W rows


def _stack(dc, tensors, prefix):
    m = DecoderStack(dc).double()
    load_submodule(m, {k: v for k, v in tensors.items() if not k.endswith(("embed_tokens.weight", "codec_embedding.weight")) and ".codec_embedding." not in k}, prefix)
    return m.eval()


@torch.no_grad()
@pytest.mark.parametrize("part", ["thinker", "talker", "code_predictor"])
def test_stack_matches_reference(pair, part):
    ref, cfg, tensors = pair
    g = torch.Generator().manual_seed(1)
    if part == "thinker":
        dc, prefix, ref_mod = cfg.thinker.text, "thinker.model.", ref.thinker.model.language_model
    elif part == "talker":
        dc, prefix, ref_mod = cfg.talker.text, "talker.model.", ref.talker.model
    else:
        dc, prefix, ref_mod = cfg.talker.code_predictor, "talker.code_predictor.model.", ref.talker.code_predictor.model
    ours = _stack(dc, tensors, prefix)
    x = torch.randn(2, 11, dc.hidden_size, generator=g, dtype=torch.float64)
    if dc.mrope_section:
        pos = _positions(2, 11)
        want = ref_mod(inputs_embeds=x, position_ids=pos).last_hidden_state
    else:
        pos = torch.arange(11).expand(2, 11)
        want = ref_mod(inputs_embeds=x, position_ids=pos).last_hidden_state
    got, _, _ = ours(x, pos)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@torch.no_grad()
def test_kv_cached_decode_equals_full_forward(pair):
    _, cfg, tensors = pair
    ours = _stack(cfg.thinker.text, tensors, "thinker.model.")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 9, cfg.thinker.text.hidden_size, generator=g, dtype=torch.float64)
    pos = _positions(1, 9)
    full, _, _ = ours(x, pos)
    cache = DenseKVCache()
    parts = [ours(x[:, :5], pos[:, :, :5], cache)[0]]
    for i in range(5, 9):
        parts.append(ours(x[:, i:i + 1], pos[:, :, i:i + 1], cache)[0])
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-12)
