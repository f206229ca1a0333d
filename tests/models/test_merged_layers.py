"""Merged projections keep the checkpoint names; flattened 2-D tokens equal batched rows; the
attention seam's caches agree; one decoder layer stays within its op budget."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from omnivox.attention.backends import make_backend
from omnivox.attention.metadata import build_metadata
from omnivox.stages.ar import PagedContext
from omnivox.errors import CheckpointError
from omnivox.kv_cache.pool import KVPool
from omnivox.layers.attention import DecoderAttention, DenseKVCache
from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
from omnivox.models.qwen3_omni.decoder import DecoderStack
from omnivox.models.qwen3_omni.random_init import randomize_
from omnivox.models.qwen3_omni.random_init import save_random_checkpoint
from omnivox.models.qwen3_omni.weights import load_model
from qwen_tiny import BASE


def _stack(part: str, dtype=torch.float64) -> DecoderStack:
    cfg = Qwen3OmniConfig.from_hf(BASE)
    dc = {"thinker": cfg.thinker.text, "talker": cfg.talker.text, "code_predictor": cfg.talker.code_predictor}[part]
    stack = DecoderStack(dc)
    randomize_(stack.named_parameters(), seed=4)
    return stack.to(dtype).eval()


def _positions(dc, n: int) -> torch.Tensor:
    t = torch.arange(n)
    return torch.stack([t, t // 2 + 1, (t * 3) % 7]) if dc.mrope_section else t  # [3, N] or [N]


def test_state_dict_shows_checkpoint_parts_and_loads_them():
    attn = DecoderAttention(hidden=32, heads=4, kv_heads=2, head_dim=8, eps=1e-6)
    sd = attn.state_dict()
    assert list(sd) == [f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    assert [tuple(t.shape) for t in sd.values()] == [(32, 32), (16, 32), (16, 32), (32, 32), (8,), (8,)]
    g = torch.Generator().manual_seed(0)
    parts = {k: torch.randn(t.shape, generator=g) for k, t in sd.items()}
    attn.load_state_dict(parts)
    w = attn.qkv_proj.weight
    assert torch.equal(w[:32], parts["q_proj.weight"]) and torch.equal(w[48:], parts["v_proj.weight"])
    assert torch.equal(attn.qk_norm.weight[:4], parts["q_norm.weight"].expand(4, 8))
    assert torch.equal(attn.qk_norm.weight[4:], parts["k_norm.weight"].expand(2, 8))
    assert all(torch.equal(attn.state_dict()[k], t) for k, t in parts.items())
    del parts["k_proj.weight"]
    with pytest.raises(RuntimeError, match="k_proj.weight"):
        attn.load_state_dict(parts)


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("merged")
    save_random_checkpoint(BASE, folder, seed=5)
    return folder


@pytest.mark.parametrize("drop", ["thinker.model.layers.1.self_attn.k_proj.weight",
                                  "talker.model.layers.0.self_attn.q_norm.weight",
                                  "talker.model.layers.0.mlp.shared_expert.up_proj.weight",
                                  "talker.code_predictor.model.layers.1.mlp.gate_proj.weight",
                                  "code2wav.pre_transformer.layers.0.self_attn.v_proj.weight"])
def test_missing_part_is_named(qwen_folder, tmp_path, drop):
    tensors = load_file(str(qwen_folder / "model.safetensors"))
    assert drop in tensors
    del tensors[drop]
    (tmp_path / "config.json").write_text((qwen_folder / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"lacks 1 tensor.*{drop}"):
        load_model(tmp_path, progress=False)


def test_loaded_parts_fill_the_merged_rows(qwen_folder):
    tensors = load_file(str(qwen_folder / "model.safetensors"))
    m = load_model(qwen_folder, progress=False)
    attn = m.thinker.model.layers[0].self_attn
    pre = "thinker.model.layers.0.self_attn."
    q, k, v = (tensors[pre + n + ".weight"] for n in ("q_proj", "k_proj", "v_proj"))
    assert torch.equal(attn.qkv_proj.weight, torch.cat((q, k, v)))
    assert torch.equal(attn.qk_norm.weight[-1], tensors[pre + "k_norm.weight"])
    mlp = m.talker.code_predictor.model.layers[0].mlp
    pre = "talker.code_predictor.model.layers.0.mlp."
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat((tensors[pre + "gate_proj.weight"], tensors[pre + "up_proj.weight"])))
    assert set(m.state_dict()) - {k for k in m.state_dict() if ".experts." in k} == {
        k for k in tensors if ".experts." not in k}


@torch.no_grad()
@pytest.mark.parametrize("part", ["thinker", "code_predictor"])
def test_flat_tokens_equal_batched_rows(part):
    stack = _stack(part)
    dc = stack.cfg
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, dc.hidden_size, generator=g, dtype=torch.float64)
    pos = _positions(dc, 9)
    flat, flat_cap, _ = stack(x, pos, capture=1)
    rows, rows_cap, _ = stack(x[None], pos[..., None, :], capture=1)
    assert torch.equal(flat, rows[0]) and torch.equal(flat_cap, rows_cap[0])
    cache = DenseKVCache()
    parts = [stack(x[:4], pos[..., :4], cache)[0]] + [stack(x[i:i + 1], pos[..., i:i + 1], cache)[0] for i in range(4, 9)]
    assert cache.length == 9
    torch.testing.assert_close(torch.cat(parts), flat, rtol=0, atol=1e-12)
    rows_ = torch.arange(2, 6)  # deepstack rows of the flattened tokens
    feats = torch.randn(4, dc.hidden_size, generator=g, dtype=torch.float64)
    a, _, _ = stack(x, pos, inject={0: (rows_, feats)})
    b, _, _ = stack(x[None], pos[..., None, :], inject={0: (rows_, feats)})
    assert torch.equal(a, b[0]) and not torch.equal(a, flat)


@torch.no_grad()
def test_paged_context_over_flat_tokens_equals_each_sequence_alone():
    stack = _stack("talker")
    dc = stack.cfg
    g = torch.Generator().manual_seed(2)
    lens = (5, 3)
    xs = [torch.randn(n, dc.hidden_size, generator=g, dtype=torch.float64) for n in lens]
    ps = [_positions(dc, n) for n in lens]
    want = [stack(x, p)[0] for x, p in zip(xs, ps)]
    for backend in ("torch_ref", "per_sequence"):
        pool = KVPool(dc.num_hidden_layers, 4, 4, dc.num_key_value_heads, dc.head_dim, torch.float64, "cpu")
        meta = build_metadata([[0, 1], [2]], [0, 0], list(lens), block_size=4, dummy_slot=pool.dummy_slot, device="cpu")
        ctx = PagedContext(pool, meta, make_backend(backend, "cpu"))
        h = stack(torch.cat(xs), torch.cat(ps, dim=-1), ctx)[0]
        torch.testing.assert_close(h, torch.cat(want), rtol=0, atol=1e-12)


class _LayerOps(TorchDispatchMode):
    """Records the ops dispatched while `on`."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []
        self.on = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def test_decoder_layer_op_budget():
    """The last Thinker layer at one flattened token (fp32), without its MoE and the cache's own
    work: 2 projections x 2 ops, one q/k norm, one rotation, a few views, no transposes (the
    seam's job) and no RoPE tables (built once per forward)."""
    stack = _stack("thinker", torch.float32)
    last = len(stack.layers) - 1
    layer, ops = stack.layers[last], _LayerOps()
    for module, on_enter in ((layer, True), (layer.mlp, False)):
        module.register_forward_pre_hook(lambda *_, v=on_enter: setattr(ops, "on", v))
        module.register_forward_hook(lambda *_, v=on_enter: setattr(ops, "on", not v))
    cache = DenseKVCache()
    inner = cache.attend

    def attend(i, q, k, v):
        was, ops.on = ops.on, ops.on and i != last
        try:
            return inner(i, q, k, v)
        finally:
            ops.on = was

    cache.attend = attend
    x, pos = torch.randn(5, stack.cfg.hidden_size), _positions(stack.cfg, 5)
    stack(x[:4], pos[..., :4], cache)
    with ops:
        stack(x[4:], pos[..., 4:], cache)
    assert "transpose" not in ops.names and "cos" not in ops.names, ops.names
    assert len(ops.names) <= 32, ops.names
