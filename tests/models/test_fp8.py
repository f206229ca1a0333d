"""Block-FP8 weights (layers/fp8.py): the format, the config's errors, FP8 checkpoints of a tiny
Qwen3-Omni and S2 against the same checkpoints holding the dequantized values (identical ids and
codes), online quantization equal to offline, the weights float8 in memory.

NOTE: equality runs use fifo scheduling: slack sizes prefill chunks from measured step times, so
the shapes (and the last bits of fp32 sums) would vary from run to run."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8_checkpoints import qwen_rule, s2_rule, write_fp8
from omnivox import Omni
from omnivox.engine.config import EngineConfig
from omnivox.errors import CheckpointError
from omnivox.layers.fp8 import FP8, FP8Config, FP8Experts, FP8Linear, dequantize, quantize
from omnivox.models.qwen3_omni.random_init import save_random_checkpoint
from omnivox.models.qwen3_omni.weights import load_model
from omnivox import FishTTS
from qwen_tiny import BASE, chat

FIFO = EngineConfig(scheduling="fifo")


def test_quantize_blocks_scales_and_cut_short_edges():
    w = torch.randn(50, 70) * 3
    w[24:48, 24:48] = 0  # one all-zero block
    q, s = quantize(w, (24, 24))
    assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (3, 3)  # 50 = 24+24+2, 70 = 24+24+22
    assert s[1, 1] == 1 and torch.equal(s[2, 2], w[48:, 48:].abs().max() / 448)
    assert torch.equal(s[0, 0], w[:24, :24].abs().max() / 448)
    d = dequantize(q, s, (24, 24))
    assert (d - w).abs().max() <= w.abs().max() / 8  # e4m3 keeps 3 mantissa bits
    assert q.abs().float().max() <= 448 and torch.equal(d[24:48, 24:48], torch.zeros(24, 24))


@pytest.mark.parametrize("raw, says", [
    ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
    ({"quant_method": "fp8"}, "weight_block_size None"),
])
def test_config_errors_are_one_line(raw, says):
    with pytest.raises(CheckpointError, match=says) as e:
        FP8Config.from_hf(raw)
    assert "\n" not in str(e.value)


def test_modules_to_not_convert_match_by_substring():
    cfg = FP8Config.from_hf({"quant_method": "fp8", "weight_block_size": [8, 8], "modules_to_not_convert": ["mlp"]})
    assert not cfg.converts("thinker.model.layers.0.mlp.experts") and cfg.converts("thinker.model.layers.0.self_attn")


@pytest.fixture(scope="module")
def qwen_src(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen-fp32") / "m"
    save_random_checkpoint(BASE, folder, seed=5)
    return folder


_PAIRS: dict = {}


def _pair(qwen_src, tmp_path_factory, block):
    """(FP8 folder, its dequantized twin) with `block` x `block` blocks, written once per module."""
    if (qwen_src, block) not in _PAIRS:
        root = tmp_path_factory.mktemp(f"qwen-b{block}")
        _PAIRS[qwen_src, block] = (write_fp8(qwen_src, root / "fp8", (block, block), qwen_rule),
                                   write_fp8(qwen_src, root / "deq", (block, block), qwen_rule, dequantized=True))
    return _PAIRS[qwen_src, block]


def _run(omni):
    ids = chat([1000, 2000, 3000])
    greedy = omni.generate(prompt_ids=ids, greedy=True, max_tokens=5, max_frames=6, speaker="ethan")
    seeded = omni.generate(prompt_ids=ids, temperature=0.9, top_k=50, seed=7, max_tokens=5, max_frames=6,
                           speaker="ethan")
    omni.close()
    return greedy, seeded


@pytest.mark.parametrize("block", [32, 24])  # tiny dims 16..128: multi-block tensors and cut-short last blocks
def test_fp8_checkpoint_generates_as_its_dequantized_values(qwen_src, tmp_path_factory, block):
    fp8, deq = _pair(qwen_src, tmp_path_factory, block)
    a, b = Omni(model=fp8, progress=False, engine_config=FIFO), Omni(model=deq, progress=False, engine_config=FIFO)
    layer = a.model.thinker.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, FP8Linear) and isinstance(layer.mlp.experts, FP8Experts)
    assert a.model.talker.code_predictor.model.layers[0].mlp.down_proj.weight.dtype == FP8
    assert a.model.thinker.lm_head.weight.dtype == a.model.thinker.model.layers[0].mlp.gate.weight.dtype == torch.float32
    fp8_bytes = sum(p.numel() for p in a.model.thinker.parameters() if p.dtype == FP8)
    assert a.weight_bytes()["thinker"]["float8_e4m3fn"] == fp8_bytes > 0
    assert "float8_e4m3fn" not in b.weight_bytes()["thinker"] and "float8_e4m3fn" not in a.weight_bytes()["vocoder"]
    for out_a, out_b in zip(_run(a), _run(b)):
        assert out_a.text_ids == out_b.text_ids and len(out_a.text_ids) > 1
        np.testing.assert_array_equal(out_a.codes, out_b.codes)
        np.testing.assert_allclose(out_a.audio, out_b.audio, rtol=0, atol=3e-5)


def test_fp8_generation_with_cuda_graphs_equals_eager(qwen_src, tmp_path_factory):
    """The graph runner's plumbing on CPU (a fake graph, as tests/engine/test_graphs.py) with FP8 layers."""
    fp8, _ = _pair(qwen_src, tmp_path_factory, 24)
    graphed = Omni(model=fp8, progress=False, engine_config=EngineConfig(scheduling="fifo", cuda_graphs="fake",
                                                                         graph_buckets=(1,)))
    eager = Omni(model=fp8, progress=False, engine_config=FIFO)
    req = dict(prompt_ids=chat([2000, 2001, 2002]), temperature=0.8, seed=50, max_tokens=5, max_frames=5,
               speaker="ethan")
    try:
        a, b = eager.generate(**req), graphed.generate(**req)
        assert a.text_ids == b.text_ids
        np.testing.assert_array_equal(a.codes, b.codes)
        stages = graphed.engine.stages.stages
        assert stages["thinker"].graphs.replays > 0 and stages["talker"].graphs.replays > 0
    finally:
        eager.close(), graphed.close()


@torch.no_grad()
def test_transformers_fp8_loading_agrees(qwen_src, tmp_path_factory):
    """transformers' fine-grained FP8 loading (it dequantizes on CPU; it needs `accelerate`) of a checkpoint
    whose block (16) divides every dimension: the Thinker's logits over a prompt match omnivox's FP8 layers'."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    fp8, _ = _pair(qwen_src, tmp_path_factory, 16)
    ref = Qwen3OmniMoeForConditionalGeneration.from_pretrained(fp8, dtype=torch.float32, device_map="cpu").eval()
    ref.set_experts_implementation("eager")
    ids = torch.tensor([chat([1000, 2000, 3000])])
    want = ref.thinker(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]  # [S, V]
    model = load_model(fp8, progress=False)
    assert model.thinker.model.layers[0].mlp.experts.gate_up_proj.dtype == FP8
    n = ids.shape[1]
    hidden, _, _ = model.thinker(model.thinker.embed(ids)[0], torch.arange(n).expand(3, 1, n))
    got = model.thinker.logits(hidden[0])
    assert want.abs().max() > 1 and torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_fp8_weights_take_a_quarter_of_the_fp32_bytes(qwen_src, tmp_path_factory):
    fp8, _ = _pair(qwen_src, tmp_path_factory, 16)
    a, b = load_model(fp8, progress=False), load_model(qwen_src, progress=False)
    qa = a.thinker.model.layers[1].self_attn.qkv_proj
    qb = b.thinker.model.layers[1].self_attn.qkv_proj
    assert qa.weight.element_size() == 1 and qa.weight.untyped_storage().nbytes() == qb.weight.numel()
    assert qa.weight_scale_inv.shape == (128 // 16, 32 // 16)
    experts = a.thinker.model.layers[1].mlp.experts
    assert experts.gate_up_proj.untyped_storage().nbytes() * 4 == b.thinker.model.layers[1].mlp.experts.gate_up_proj.untyped_storage().nbytes()


def test_online_quantization_equals_offline(qwen_src, tmp_path_factory):
    offline = write_fp8(qwen_src, tmp_path_factory.mktemp("q128") / "m", (128, 128), qwen_rule)
    a = load_model(qwen_src, progress=False, quantization="fp8")
    b = load_model(offline, progress=False)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and any(t.dtype == FP8 for t in sa.values())
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k].view(torch.uint8) if sa[k].dtype == FP8 else sa[k],
                                                          sb[k].view(torch.uint8) if sb[k].dtype == FP8 else sb[k]), k


def test_modules_to_not_convert_stay_in_the_model_dtype(qwen_src, tmp_path_factory):
    folder = write_fp8(qwen_src, tmp_path_factory.mktemp("skip") / "m", (16, 16), qwen_rule, not_convert=("talker.",))
    m = load_model(folder, progress=False)
    assert m.talker.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert m.thinker.model.layers[0].self_attn.o_proj.weight.dtype == FP8


def _edit(folder, fn):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def test_bad_fp8_checkpoints_fail_with_one_line(qwen_src, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    name = "thinker.model.layers.0.mlp.experts.1.down_proj.weight_scale_inv"
    missing = write_fp8(qwen_src, root / "missing", (16, 16), qwen_rule)
    _edit(missing, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"lacks 1 tensor\(s\), e.g. {name} \(the float32 block scales \[2, 1\]"):
        load_model(missing, progress=False)
    wrong = write_fp8(qwen_src, root / "wrong", (16, 16), qwen_rule)
    _edit(wrong, lambda t: t.update({name: torch.ones(3, 1)}))
    with pytest.raises(CheckpointError, match=rf"^{name}: shape \(3, 1\) in the checkpoint, \(2, 1\) expected"):
        load_model(wrong, progress=False)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["quantization_config"]["fmt"] = "e5m2"
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="fmt 'e5m2' is not supported"):
        load_model(wrong, progress=False)
    del cfg["quantization_config"]
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="float8 in the checkpoint, but .* no quantization_config"):
        load_model(wrong, progress=False)


@pytest.fixture(scope="module")
def s2_src(tmp_path_factory):
    from omnivox.models.fish_s2.tiny import write_tiny_checkpoint
    return write_tiny_checkpoint(tmp_path_factory.mktemp("s2") / "m", seed=0)


def test_s2_fp8_checkpoint_synthesizes_as_its_dequantized_values_and_online_equals_offline(s2_src, tmp_path_factory):
    root = tmp_path_factory.mktemp("s2fp8")
    runs = []
    for folder, q in ((write_fp8(s2_src, root / "fp8", (24, 24), s2_rule), None),
                      (write_fp8(s2_src, root / "deq", (24, 24), s2_rule, dequantized=True), None),
                      (s2_src, "fp8"), (write_fp8(s2_src, root / "q128", (128, 128), s2_rule), None)):
        tts = FishTTS(folder, progress=False, engine_config=FIFO, quantization=q)
        runs.append((tts.speak("hello there", max_frames=10, seed=3, temperature=0.8),
                     {k: v.view(torch.uint8) if v.dtype == FP8 else v for k, v in tts.slow.state_dict().items()}))
        tts.close()
    assert runs[0][1]["layers.0.attention.wqkv.weight"].dtype == torch.uint8  # viewed: float8 in the model
    assert runs[0][1]["layers.0.attention.wqkv.weight_scale_inv"].shape == (math.ceil(128 / 24), math.ceil(64 / 24))
    (fp8, _), (deq, _), (online, s_online), (offline, s_offline) = runs
    np.testing.assert_array_equal(fp8.codes, deq.codes)
    assert fp8.codes.shape[0] > 1
    np.testing.assert_allclose(fp8.audio, deq.audio, rtol=0, atol=1e-4)
    assert s_online.keys() == s_offline.keys() and all(torch.equal(s_online[k], s_offline[k]) for k in s_online)
    np.testing.assert_array_equal(online.codes, offline.codes)


def test_s2_online_quantization_holds_one_layers_float_weights_at_a_time(s2_src, monkeypatch):
    """Each float weight bound for a float8 parameter is quantized as it is read (a legacy wq/wk/wv
    waits for its two siblings): never the whole float checkpoint beside the FP8 model."""
    import weakref

    from omnivox.models.fish_s2 import weights

    alive, most, real = [], [0], weights.iter_llm_tensors

    def tracking(folder):
        for name, t in real(folder):
            if ".layers." in name and name.endswith(("wqkv.weight", "wq.weight", "wk.weight", "wv.weight", "wo.weight",
                                                     "w1.weight", "w2.weight", "w3.weight")):
                alive.append(weakref.ref(t))
                most[0] = max(most[0], sum(r() is not None for r in alive))
            yield name, t
    monkeypatch.setattr(weights, "iter_llm_tensors", tracking)
    _, slow, fast = weights.load_llm(s2_src, torch.float32, "cpu", quantization="fp8")
    assert slow.layers[0].attention.wqkv.weight.dtype == FP8 == fast.layers[0].feed_forward.w2.weight.dtype
    assert len(alive) > 8 and most[0] <= 3, (len(alive), most[0])  # read whole, all of them would be alive
