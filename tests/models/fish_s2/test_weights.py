"""Invariant 2.2.1: official-layout loading, weight-norm folding, fused qkv, tied head, errors."""
import json

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.utils import parametrizations, weight_norm

from omnivox.errors import CheckpointError
from omnivox.models.fish_s2.codec import FishCodec
from omnivox.models.fish_s2.tiny import TINY_CODEC, TINY_CONFIG, build_tiny_llm, write_tiny_checkpoint
from omnivox.models.fish_s2.weights import (fold_weight_norm, load_codec, load_llm, read_codec_state,
                                            read_llm_tensors)


def test_llm_every_tensor_used_and_head_tied(tiny_folder, tiny_llm):
    cfg, slow, fast = tiny_llm
    assert cfg == TINY_CONFIG
    tensors = read_llm_tensors(tiny_folder)
    assert not any("lm_head" in k or k.endswith("model.output.weight") for k in tensors)
    index = json.loads((tiny_folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 2 and set(index) == set(tensors)
    n_used = len(slow.state_dict()) + len(fast.state_dict())
    assert n_used == len(tensors)
    assert slow.cfg.text.tie_word_embeddings and not hasattr(slow, "output")
    h = torch.randn(3, cfg.text.dim)
    torch.testing.assert_close(slow.logits(h), h @ slow.embeddings.weight.T, rtol=0, atol=0)
    for k, t in tensors.items():
        mod, name = (slow, k[len("text_model.model."):]) if k.startswith("text_model.") else (
            (slow, k[len("audio_decoder."):]) if "codebook_embeddings" in k else (fast, k[len("audio_decoder."):]))
        assert torch.equal(mod.state_dict()[name], t), k


def test_wqkv_split_order(tiny_llm):
    cfg, slow, _ = tiny_llm
    t = cfg.text
    attn = slow.layers[0].attention
    x = torch.randn(1, 3, t.dim)
    w = attn.wqkv.weight
    q_rows, kv_rows = t.n_head * t.head_dim, t.n_local_heads * t.head_dim
    q, k, v = attn.wqkv(x).split((q_rows, kv_rows, kv_rows), dim=-1)
    torch.testing.assert_close(q, x @ w[:q_rows].T)
    torch.testing.assert_close(k, x @ w[q_rows:q_rows + kv_rows].T)
    torch.testing.assert_close(v, x @ w[q_rows + kv_rows:].T)


def test_codec_fold_and_consumption(tiny_folder, tiny_codec):
    raw = read_codec_state(tiny_folder / "codec.pth")
    new = [k for k in raw if k.endswith("parametrizations.weight.original0")]
    old = [k for k in raw if k.endswith(".weight_g")]
    assert len(new) > 0 and len(old) == 2 * TINY_CODEC.num_codebooks
    folded, ignored = fold_weight_norm(raw)
    assert sorted(ignored) == sorted(k for k in raw if k.endswith(("freqs_cis", "causal_mask")))
    assert len(ignored) == 6
    assert set(folded) == set(tiny_codec.state_dict())  # every weight consumed, nothing extra
    for g_key in new + old:
        base = g_key.rsplit(".parametrizations", 1)[0] if "parametrizations" in g_key else g_key[:-len(".weight_g")]
        v_key = g_key[:-1] + "1" if "parametrizations" in g_key else base + ".weight_v"
        g, v = raw[g_key].double(), raw[v_key].double()
        expect = g * v / v.flatten(1).norm(dim=1).view(-1, *([1] * (v.dim() - 1)))
        got = tiny_codec.state_dict()[base + ".weight"].double()
        assert ((got - expect).abs().max() / expect.abs().max()) < 1e-6
        assert not torch.allclose(got, v.to(got.dtype))  # the fold matters


def test_folded_codec_equals_torch_weight_norm(tiny_folder):
    """A codec keeping torch's weight-norm modules, loaded from the raw keys, gives the same output
    as one built from our folded weights (fp64, so only the fold itself is compared)."""
    raw = {k: (v.double() if v.is_floating_point() else v) for k, v in read_codec_state(tiny_folder / "codec.pth").items()}
    folded, _ = fold_weight_norm(raw)
    ours = FishCodec(TINY_CODEC).double()
    ours.load_state_dict(folded, strict=True)
    ours.eval()
    ref = FishCodec(TINY_CODEC)
    for name, m in list(ref.named_modules()):
        if name.startswith(("encoder.", "decoder.")) and any(k.startswith(name + ".parametrizations.")
                                                             for k in raw if name.endswith(".conv")):
            parametrizations.weight_norm(m)
        if name.endswith(("in_proj", "out_proj")):
            weight_norm(m)
    keep = {k: v for k, v in raw.items() if not k.endswith(("freqs_cis", "causal_mask"))}
    ref.double().load_state_dict(keep, strict=True)
    ref.eval()
    codes = torch.randint(0, 16, (2, 4, 12))
    with torch.no_grad():
        torch.testing.assert_close(ref.decode(codes), ours.decode(codes), rtol=1e-10, atol=1e-12)
        audio = torch.randn(1, 1, 200, dtype=torch.float64) * 0.3
        assert torch.equal(ref.encode(audio), ours.encode(audio))


@pytest.mark.parametrize("wrap", ["state_dict", "generator"])
def test_codec_wrapped_variants(tmp_path, tiny_codec, wrap):
    folder = write_tiny_checkpoint(tmp_path, seed=0, codec_wrap=wrap)
    codec = load_codec(folder / "codec.pth")
    for k, t in tiny_codec.state_dict().items():
        assert torch.equal(codec.state_dict()[k], t), k


def test_checkpoint_errors(tmp_path, tiny_folder):
    folder = write_tiny_checkpoint(tmp_path / "c", seed=0)
    (folder / "codec.pth").unlink()
    with pytest.raises(CheckpointError, match="codec.pth not found"):
        load_codec(folder / "codec.pth")
    (folder / "codec.pth").write_bytes(b"not a pickle at all")
    with pytest.raises(CheckpointError, match="not a readable torch state dict") as e:
        load_codec(folder / "codec.pth")
    assert "\n" not in str(e.value)
    torch.save([1, 2, 3], str(folder / "codec.pth"))
    with pytest.raises(CheckpointError, match="dict of tensors"):
        load_codec(folder / "codec.pth")
    raw = read_codec_state(tiny_folder / "codec.pth")
    raw.pop(next(k for k in raw if k.endswith(".weight_g")))
    torch.save(raw, str(folder / "codec.pth"))
    with pytest.raises(CheckpointError, match="no matching gain"):
        load_codec(folder / "codec.pth")
    raw = read_codec_state(tiny_folder / "codec.pth")
    raw.pop("decoder.model.0.conv.bias")
    torch.save(raw, str(folder / "codec.pth"))
    with pytest.raises(CheckpointError, match="missing tensor"):
        load_codec(folder / "codec.pth")
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_llm(folder)


def test_legacy_separate_qkv(tmp_path):
    from safetensors.torch import save_file
    folder = write_tiny_checkpoint(tmp_path, seed=0)
    shard = folder / "model-00002-of-00002.safetensors"
    t = load_file(str(shard))
    cfg = TINY_CONFIG.fast
    key = "audio_decoder.layers.0.attention.wqkv.weight"
    q, k, v = t.pop(key).split((cfg.n_head * cfg.head_dim, cfg.n_local_heads * cfg.head_dim,
                                cfg.n_local_heads * cfg.head_dim))
    for n, part in zip(("wq", "wk", "wv"), (q, k, v)):
        t[f"audio_decoder.layers.0.attention.{n}.weight"] = part.contiguous()
    save_file(t, str(shard))
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {**{k2: shard.name for k2 in t}, **{k2: v2 for k2, v2 in index["weight_map"].items()
                                                             if k2.startswith("text_model.")}}
    index_path.write_text(json.dumps(index))
    _, _, fast = load_llm(folder, dtype=torch.float32)
    _, ref_fast = build_tiny_llm(0)
    assert torch.equal(fast.layers[0].attention.wqkv.weight, ref_fast.layers[0].attention.wqkv.weight)
