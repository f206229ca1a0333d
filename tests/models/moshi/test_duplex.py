"""Full duplex offline (`omnivox.Duplex`, `omnivox duplex`) against moshi 0.2.13's plain streaming
loop: a tiny LM and Mimi built with moshi's classes, saved together in Kyutai's layout; the
reference is `mimi.encode(frame)` -> `LMGen.step` -> `mimi.decode(tokens[:, 1:])`, one 1920-sample
frame per call. Speech and noise run past the LM's 5-frame context and Mimi's 4-frame window."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import save_file

from omnivox import Duplex
from omnivox.audio.io import load_audio
from omnivox.errors import CheckpointError, InputError
from omnivox.models.moshi.demo import _tokenizer, write_demo_checkpoint
from omnivox.models.registry import detect

from cli_inprocess import cli

F = 1920
ROOT = Path(__file__).resolve().parents[3]
SPEECH = load_audio(ROOT / "tests" / "media" / "question_24k.wav", target_sr=24000)[: 14 * F + 700]  # a partial frame
NOISE = 0.1 * np.random.default_rng(3).standard_normal(9 * F).astype(np.float32)


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("moshi")
    import tiny_lm
    import tiny_mimi
    calibration = torch.stack([torch.from_numpy(SPEECH[: 12 * F]), torch.from_numpy(NOISE[: 12 * F].copy())
                               .repeat(2)[: 12 * F]])[:, None]
    mimi = tiny_mimi.build_reference(calibration)
    lm = tiny_lm.build_reference(seed=0, card=64)  # the LM's codebooks are Mimi's (64 bins)
    return lm, mimi


@pytest.fixture(scope="module")
def folder(reference, tmp_path_factory):
    """LM + Mimi + tokenizer in one folder: config.json names every file."""
    import tiny_lm
    import tiny_mimi
    lm, mimi = reference
    folder = tiny_lm.save_checkpoint(tmp_path_factory.mktemp("moshi"), lm, card=64)
    save_file({k: v.contiguous() for k, v in mimi.state_dict().items()}, str(folder / "codec.safetensors"))
    (folder / "codec.json").write_text(json.dumps(tiny_mimi.tiny_mimi_config()))
    (folder / "text.model").write_bytes(_tokenizer(tiny_lm.TINY_LM["text_card"]))
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(mimi_name="codec.safetensors", mimi_config_name="codec.json", tokenizer_name="text.model")
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def duplex(folder):
    return Duplex(model=folder, dtype="float32", device="cpu")


def moshi_loop(reference, pcm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """moshi's plain loop over pcm zero-padded to whole frames -> (tokens [frames, 9], audio)."""
    from moshi.models.lm import LMGen
    from moshi.utils.compile import no_compile
    lm, mimi = reference
    x = np.zeros(-(-pcm.size // F) * F, np.float32)
    x[: pcm.size] = pcm
    gen, tokens, audio = LMGen(lm, use_sampling=False), [], []
    with no_compile(), torch.no_grad(), mimi.streaming(1), gen.streaming(1):
        for i in range(0, x.size, F):
            out = gen.step(mimi.encode(torch.from_numpy(x[None, None, i:i + F])))
            if out is not None:
                tokens.append(out[0, :, 0].numpy())
                audio.append(mimi.decode(out[:, 1:])[0, 0].numpy())
    return np.stack(tokens), np.concatenate(audio)


@pytest.mark.parametrize("name", ["speech", "noise"])
def test_converse_equals_moshi_loop(duplex, reference, name):
    pcm = SPEECH if name == "speech" else NOISE
    want_tokens, want_audio = moshi_loop(reference, pcm)
    out = duplex.converse(pcm, sample_rate=24000, greedy=True)
    assert out.tokens.shape == (-(-pcm.size // F) - 1, 9) and out.tokens.dtype == np.int64
    assert len(set(out.tokens[:, 1].tolist())) > 3  # the codes move from frame to frame
    np.testing.assert_array_equal(out.tokens, want_tokens)
    assert out.audio.dtype == np.float32 and out.audio.shape == (out.frames * F,) and out.sample_rate == 24000
    err = np.abs(out.audio - want_audio).max()
    assert err <= 1e-4 * np.abs(want_audio).max(), err
    assert out.text == duplex.tokenizer.text(want_tokens[:, 0].tolist())


def test_another_sample_rate_is_resampled(duplex):
    from omnivox.audio.io import resample
    pcm16 = resample(SPEECH[: 6 * F], 24000, 16000)
    got = duplex.converse(pcm16, sample_rate=16000, greedy=True)
    want = duplex.converse(resample(pcm16, 16000, 24000), greedy=True)
    np.testing.assert_array_equal(got.tokens, want.tokens)


@pytest.mark.parametrize("greedy", [True, False])
def test_converse_many_equals_single_runs(duplex, greedy):
    sessions = [SPEECH[: 9 * F + 5], NOISE[: 4 * F], SPEECH[3 * F: 10 * F]]
    batched = duplex.converse_many(sessions, greedy=greedy, seed=7, max_batch=2)  # the third joins later
    for pcm, got in zip(sessions, batched):
        alone = duplex.converse(pcm, greedy=greedy, seed=7)
        np.testing.assert_array_equal(got.tokens, alone.tokens)
        np.testing.assert_allclose(got.audio, alone.audio, atol=1e-5 * np.abs(alone.audio).max())
    assert [o.frames for o in batched] == [9, 3, 6]


def test_bad_input_is_one_line(duplex):
    for pcm, match in (([], "empty"), (np.zeros((2, F)), "1-D"), ([np.nan], "NaN")):
        with pytest.raises(InputError, match=match):
            duplex.converse(pcm)
    with pytest.raises(InputError, match="sample_rate"):
        duplex.converse(SPEECH, sample_rate=0)


def test_folder_is_detected_and_refused_by_generate_speak_bench(folder, tmp_path):
    assert detect(str(folder), any_family=True)[0].name == "moshi"  # no model_type: Kyutai's file-name keys
    with pytest.raises(CheckpointError, match="generate, speak and bench do not take it"):
        detect(str(folder))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe"}))
    with pytest.raises(CheckpointError, match="not a Moshi checkpoint"):
        Duplex(model=other)


def test_demo_builds_deterministically(tmp_path):
    a, b = write_demo_checkpoint(tmp_path / "a"), write_demo_checkpoint(tmp_path / "b")
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and "tokenizer.model" in names
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def test_cli_on_the_demo(tmp_path, monkeypatch):
    """`omnivox duplex` in this process (`cli`; README.md's duplex block runs the real command)."""
    monkeypatch.chdir(tmp_path)
    wav = tmp_path / "in.wav"
    sf.write(str(wav), SPEECH[: 5 * F], 24000)
    r = cli("duplex", "--model", "moshi-demo", "--input", str(wav), "--out", "out.wav", "--json", "--greedy")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["input_frames"] == 5 and data["frames"] == 4 and data["sample_rate"] == 24000
    assert sf.info(str(tmp_path / "out.wav")).frames == 4 * F
    (tmp_path / "bad.wav").write_text("not audio")
    r = cli("duplex", "--model", "moshi-demo", "--input", "bad.wav", "--out", "x.wav")
    assert r.returncode == 2 and r.stderr.startswith("error: cannot decode") and len(r.stderr.splitlines()) == 1, \
        r.stderr


def test_demo_is_a_checkpoint_moshi_loads(tmp_path, monkeypatch):
    """moshi's own CheckpointInfo reads the demo (file names from config.json); its loop equals ours on it."""
    pytest.importorskip("moshi")
    from moshi.models import loaders
    folder = write_demo_checkpoint(tmp_path / "demo")
    monkeypatch.chdir(folder)  # hf_repo None: moshi reads mimi_config_name relative to the working directory
    raw = json.loads((folder / "config.json").read_text())
    info = loaders.CheckpointInfo.from_hf_repo(None, moshi_weights=folder / raw["moshi_name"],
                                               mimi_weights=folder / raw["mimi_name"],
                                               tokenizer=folder / raw["tokenizer_name"],
                                               config_path=folder / "config.json")
    reference = info.get_moshi(device="cpu", dtype=torch.float32), info.get_mimi(device="cpu")
    pcm = SPEECH[: 6 * F]
    want_tokens, want_audio = moshi_loop(reference, pcm)
    out = Duplex(model=folder).converse(pcm, greedy=True)
    np.testing.assert_array_equal(out.tokens, want_tokens)
    assert np.abs(out.audio - want_audio).max() <= 1e-4 * np.abs(want_audio).max()


def test_update_changes_sampling_from_the_next_frame(duplex):
    """`DuplexInput.update`: a session opened sampling and switched to greedy before its audio is the
    greedy session; max_seconds and bad values are refused."""
    from omnivox.serving_duplex import DuplexParams
    pcm = SPEECH[: 6 * F]
    want = duplex.converse(pcm, greedy=True)
    with duplex._threads():
        handle, inp = duplex.served.open_duplex(DuplexParams(temp=1.5, temp_text=1.5, seed=3))
        try:
            with pytest.raises(InputError, match="max_seconds"):
                inp.update(DuplexParams(max_seconds=1.0))
            with pytest.raises(InputError, match="temp"):
                inp.update(DuplexParams(temp=-1.0))
            inp.update(DuplexParams(greedy=True))
            inp.push(pcm)
        finally:
            inp.close()
        fin, audio = handle.collect()
    np.testing.assert_array_equal(np.asarray(fin.text_ids), want.tokens[:, 0])
    np.testing.assert_array_equal(fin.codes, want.tokens[:, 1:])
