"""Moshi's LM against the reference (`moshi` 0.2.13's LMModel + LMGen, greedy, fp32 CPU): the LM
stage on the paged KV (`lm_stage.LMStage`, pages of 4 positions under the 5-position window) gives
the same tokens every frame, past the temporal transformer's context window, alone and batched
with sessions joining and leaving; sampling checked by distribution."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("moshi")

from lm_stage import LMStage  # noqa: E402
from tiny_lm import FILES, TINY_LM, build_reference, reference_tokens, save_checkpoint, user_codes  # noqa: E402

from omnivox.errors import CheckpointError  # noqa: E402
from omnivox.models.moshi.config import MoshiConfig  # noqa: E402
from omnivox.models.moshi.lm_sampling import MoshiSampler, MoshiSamplingParams  # noqa: E402
from omnivox.models.moshi.lm_weights import load_lm  # noqa: E402

FRAMES = 14  # > 2 x context (5): the window wraps


@pytest.fixture(scope="module")
def reference():
    return build_reference(seed=0)


@pytest.fixture(scope="module")
def folder(reference, tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("moshi-lm"), reference)


@pytest.fixture(scope="module")
def ours(folder):
    return load_lm(folder, dtype=torch.float32)


@pytest.fixture(scope="module")
def sessions(reference):
    """Three sessions' user codes and their single reference runs (frame -> None or [1 + dep_q])."""
    out = []
    for seed, frames in ((1, FRAMES), (2, 10), (3, 8)):
        codes = user_codes(frames, 1, seed=seed)[0]  # [T, 8]
        ref = reference_tokens(reference, codes[None])
        out.append((codes, [None if r is None else r[0] for r in ref]))
    return out


def _run_alone(model, codes, params=None, seed=0) -> list[torch.Tensor | None]:
    return LMStage(model).run(codes, *(() if params is None else (params, seed)))


def _assert_same(ours, ref):
    assert len(ours) == len(ref)
    for t, (a, b) in enumerate(zip(ours, ref)):
        assert (a is None) == (b is None), f"frame {t}: ready differs"
        if a is not None:
            assert torch.equal(a, b), f"frame {t}: {a.tolist()} != reference {b.tolist()}"


def test_greedy_equals_reference_past_the_window(ours, sessions):
    codes, ref = sessions[0]
    assert ref[0] is None and ref[1] is not None  # LMGen's first step (max_delay = 1) returns None
    texts = {int(r[0]) for r in ref[1:]}
    assert len(texts) > 4, "degenerate fixture: the text tokens do not vary"
    _assert_same(_run_alone(ours, codes), ref)


def test_batch_with_sessions_joining_and_leaving_equals_single_runs(ours, sessions):
    """Session 0 runs throughout, session 1 joins at step 3, session 2 at step 5; each leaves
    when its input ends (session 2 before session 1); every session equals its own single run."""
    starts = [0, 3, 5]
    lm = LMStage(ours)
    reqs: dict[int, object] = {}
    for step in range(max(s + len(c) for s, (c, _) in zip(starts, sessions))):
        for s, start in enumerate(starts):
            t = step - start
            if t == 0:
                reqs[s] = lm.open()
            if 0 <= t < len(sessions[s][0]):
                lm.push(reqs[s], sessions[s][0][t])
            elif t == len(sessions[s][0]):
                reqs[s].encoded.close()  # it leaves
        lm.step()
        for s, req in reqs.items():
            t = min(step - starts[s], len(sessions[s][0]) - 1)
            assert len(lm.outputs(req)) == t + 1  # a frame out per frame in, in the same step
    for req in reqs.values():
        if not req.encoded.closed:
            req.encoded.close()
    for _ in range(3):  # the closes are taken in one step
        lm.step()
    assert not lm.graph.active
    outs = [lm.outputs(reqs[s]) for s in range(len(sessions))]
    for got, (_, ref) in zip(outs, sessions):
        _assert_same(got, ref)


# moshi's other options: LayerNorm, plain FFN, sin + RoPE, layer scale, grouped kv heads, a depformer
# weight schedule with its own norms and sin positions, output biases
VARIANT = {"norm": "layer_norm", "gating": "none", "positional_embedding": "sin_rope", "layer_scale": 0.1,
           "kv_repeat": 2, "depformer_gating": "silu", "depformer_pos_emb": "sin",
           "depformer_weights_per_step_schedule": [0, 0, 1, 1, 2, 2, 3, 3], "depformer_norm": "rms_norm",
           "bias_proj": True}


def test_config_variant_equals_reference(tmp_path):
    lm = build_reference(seed=1, **VARIANT)
    model = load_lm(save_checkpoint(tmp_path, lm, **VARIANT), dtype=torch.float32)
    codes = user_codes(12, 1, seed=4)[0]
    ref = [None if r is None else r[0] for r in reference_tokens(lm, codes[None])]
    _assert_same(_run_alone(model, codes), ref)


def test_released_fused_spelling_loads_the_same_weights(reference, ours, tmp_path):
    folder = save_checkpoint(tmp_path, reference, fused=True)
    names = json.loads((folder / "config.json").read_text())
    assert names["moshi_name"] == FILES["moshi_name"]
    fused = load_lm(folder, dtype=torch.float32)
    a, b = ours.state_dict(), fused.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_errors_are_one_line(reference, tmp_path):
    from safetensors.torch import load_file, save_file
    folder = save_checkpoint(tmp_path, reference)
    weights = folder / FILES["moshi_name"]
    good = load_file(str(weights))

    def fails(state=None, config=None) -> str:
        save_file(good if state is None else state, str(weights))
        (folder / "config.json").write_text(json.dumps(config or TINY_LM | FILES))
        with pytest.raises(CheckpointError) as e:
            load_lm(folder, dtype=torch.float32)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "missing tensor 'text_linear.weight'" in fails({k: v for k, v in good.items() if k != "text_linear.weight"})
    assert "unknown tensor 'extra.weight'" in fails(good | {"extra.weight": torch.zeros(2)})
    assert "'out_norm.alpha' has shape [1, 1, 8]" in fails(good | {"out_norm.alpha": torch.ones(1, 1, 8)})
    assert "missing file name key(s) tokenizer_name" in fails(config=TINY_LM | {"moshi_name": "model.safetensors",
                                                                               "mimi_name": "m.safetensors"})
    assert "unknown LM key(s) 'bogus'" in fails(config=TINY_LM | FILES | {"bogus": 1})
    assert "delays must hold n_q + 1 = 17" in fails(config=TINY_LM | FILES | {"delays": [0, 1]})


def test_released_config_kv_bytes():
    from moshi.models.loaders import _lm_kwargs
    cfg = MoshiConfig.from_json(_lm_kwargs | FILES)
    assert cfg.transformer.head_dim == 128 and cfg.transformer.context == 3000
    assert cfg.depformer.dim_feedforward == (4224,) * 8 and cfg.depformer.positional_embedding == "none"
    assert cfg.kv_bytes_per_step(2) == 2 * 32 * 4096 * 2  # 512 KiB per frame in bf16


def test_top_k_one_sampling_equals_greedy(ours, sessions):
    codes, ref = sessions[2]
    one = MoshiSamplingParams(use_sampling=True, temp=1.5, temp_text=1.5, top_k=1, top_k_text=1)
    _assert_same(_run_alone(ours, codes, one, 1234), ref)


def test_sampling_follows_softmax_over_top_k():
    """Over many seeds (rows), a fixed logits row's draws match softmax(logits / temp) restricted
    to the top k, for the text knobs and the audio knobs; a row's draw depends only on (seed, step)."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, 3.0, -1.0])
    n = 20_000
    params = MoshiSamplingParams(temp=0.9, top_k=5, temp_text=1.3, top_k_text=3)
    sampler = MoshiSampler.build([params] * n, range(n), "cpu")
    step = torch.full((n,), 7)
    for draw, temp, k in ((lambda x: sampler.text(x, step), 1.3, 3), (lambda x: sampler.audio(x, 2, step), 0.9, 5)):
        ids = draw(logits.expand(n, -1))
        top = torch.topk(logits, k).indices
        want = torch.zeros(8)
        want[top] = torch.softmax(logits[top] / temp, dim=0)
        freq = torch.bincount(ids, minlength=8).float() / n
        assert freq[want == 0].sum() == 0
        assert (freq - want).abs().max() < 0.015, (freq, want)
    again = MoshiSampler.build([params] * 3, [5, 6, 7], "cpu").text(logits.expand(3, -1), torch.full((3,), 7))
    assert torch.equal(again, sampler.text(logits.expand(n, -1), step)[5:8])
    greedy = MoshiSampler.build([MoshiSamplingParams(use_sampling=False)], [0], "cpu")
    assert greedy.greedy and int(greedy.text(logits[None], step[:1])[0]) == 6


def test_tokenizer_pieces(tmp_path):
    sentencepiece = pytest.importorskip("sentencepiece")
    from omnivox.models.moshi.tokenizer import MoshiTokenizer
    text = tmp_path / "corpus.txt"
    text.write_text("hello there, how are you today?\nI am fine, thank you very much.\n" * 20)
    sentencepiece.SentencePieceTrainer.Train(input=str(text), model_prefix=str(tmp_path / "tok"), vocab_size=40,
                                             model_type="bpe", minloglevel=2, num_threads=1)
    cfg = MoshiConfig.from_json(TINY_LM | FILES | {"tokenizer_name": "tok.model"})
    tok = MoshiTokenizer.from_folder(tmp_path, cfg)
    ids = tok.encode("hello there")
    assert tok.text(ids).strip() == "hello there"
    assert tok.text([3, 0] + ids + [3]) == tok.text(ids)  # padding ids carry no text
    with pytest.raises(CheckpointError, match="not found"):
        MoshiTokenizer(tmp_path / "absent.model")


def test_lm_gen_config_sets_the_sampling_defaults():
    cfg = MoshiConfig.from_json(TINY_LM | FILES | {"lm_gen_config": {"temp": 0.6, "top_k_text": 10}})
    assert cfg.gen == MoshiSamplingParams(temp=0.6, temp_text=0.7, top_k=250, top_k_text=10)
