"""Mimi against moshi 0.2.13 (the reference): a tiny random Mimi built with moshi's classes, saved in
Kyutai's layout, loaded by omnivox; moshi's streaming mode one 1920-sample frame per call is the
truth. Inputs (espeak-ng speech, noise, silence) run 30 frames, far past the 4-frame attention window."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnivox.audio.io import load_audio
from omnivox.errors import CheckpointError
from omnivox.layers.streaming_conv import BatchedState
from omnivox.models.moshi.mimi_config import MimiConfig, mimi_checkpoint
from omnivox.models.moshi.mimi_weights import load_mimi
from tiny_mimi import build_reference, save_reference

pytest.importorskip("moshi")

F = 1920
FRAMES = 30
MEDIA = Path(__file__).resolve().parents[2] / "media"


def _signals() -> dict[str, torch.Tensor]:
    speech = torch.from_numpy(load_audio(MEDIA / "question_24k.wav", target_sr=24000))[: FRAMES * F]
    noise = 0.1 * torch.randn(FRAMES * F, generator=torch.Generator().manual_seed(3))
    return {"speech": speech, "noise": noise, "silence": torch.zeros(FRAMES * F)}


@pytest.fixture(scope="module")
def signals():
    return _signals()


@pytest.fixture(scope="module")
def reference(signals):
    calibration = torch.stack([signals["speech"].roll(7 * F), 0.1 * torch.randn(FRAMES * F)])[:, None]
    return build_reference(calibration)


@pytest.fixture(scope="module")
def folder(reference, tmp_path_factory):
    return save_reference(reference, tmp_path_factory.mktemp("mimi-tiny"))


@pytest.fixture(scope="module")
def mimi(folder):
    weights, cfg = mimi_checkpoint(folder)
    return load_mimi(weights, cfg)


@pytest.fixture(scope="module")
def expected(reference, signals):
    """Per signal: moshi's streaming codes [1, 8, FRAMES] and its streaming decode of them [1, 1, FRAMES*F]."""
    out = {}
    with torch.no_grad():
        for name, x in signals.items():
            with reference.streaming(1):
                codes = torch.cat([reference.encode(x[None, None, i:i + F]) for i in range(0, x.numel(), F)], -1)
            with reference.streaming(1):
                audio = torch.cat([reference.decode(codes[..., i:i + 1]) for i in range(FRAMES)], -1)
            out[name] = codes, audio
    return out


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * want.abs().max().item(), f"max error {err} vs peak {want.abs().max().item()}"


def test_released_defaults_are_kyutais():
    from moshi.models import loaders

    assert MimiConfig.from_dict(loaders._mimi_config) == MimiConfig()
    assert MimiConfig().frame_size == 1920 and MimiConfig().steps_per_frame == 2


@pytest.mark.parametrize("name", ["speech", "noise", "silence"])
def test_streaming_frame_by_frame_equals_moshi(mimi, signals, expected, name):
    want_codes, want_audio = expected[name]
    x = signals[name]
    with torch.no_grad():
        enc, dec = mimi.init_encoder_state(1), mimi.init_decoder_state(1)
        codes = torch.cat([mimi.encode_step(x[None, None, i:i + F], enc) for i in range(0, x.numel(), F)], -1)
        audio = torch.cat([mimi.decode_step(want_codes[..., i:i + 1], dec) for i in range(FRAMES)], -1)
    assert torch.equal(codes, want_codes)
    assert len(set(want_codes[0, 0].tolist())) > 1  # not a degenerate codec
    _close(audio, want_audio)


def test_frames_per_call_equal_single_frames(mimi, signals, expected):
    """k frames in one call = k one-frame calls (the ring window's eviction per frame is kept)."""
    want_codes, want_audio = expected["speech"]
    x = signals["speech"]
    with torch.no_grad():
        enc, dec = mimi.init_encoder_state(1), mimi.init_decoder_state(1)
        codes = torch.cat([mimi.encode_step(x[None, None, i:i + 3 * F], enc) for i in range(0, x.numel(), 3 * F)], -1)
        audio = torch.cat([mimi.decode_step(want_codes[..., i:i + 5], dec) for i in range(0, FRAMES, 5)], -1)
    assert torch.equal(codes, want_codes)
    _close(audio, want_audio)


# (signal, first tick, frames): sessions join and leave a shared batch at different times
SESSIONS = [("speech", 0, 30), ("noise", 3, 20), ("silence", 7, 12), ("speech", 11, 16), ("noise", 12, 8)]


def test_batched_sessions_each_equal_their_own_run(mimi, signals, expected):
    enc = dec = None
    rows: list[int] = []  # session index of each batch row
    codes = {s: [] for s in range(len(SESSIONS))}
    audio = {s: [] for s in range(len(SESSIONS))}
    with torch.no_grad():
        for tick in range(max(start + n for _, start, n in SESSIONS)):
            alive = [r for r, s in enumerate(rows) if tick < SESSIONS[s][1] + SESSIONS[s][2]]
            alive = alive[::-1] if tick % 5 == 4 else alive  # rows also move within the batch
            if len(alive) < len(rows) or alive != list(range(len(rows))):
                rows = [rows[r] for r in alive]
                enc, dec = (enc.select(alive), dec.select(alive)) if rows else (None, None)
            joining = [s for s, (_, start, _) in enumerate(SESSIONS) if start == tick]
            if joining:
                fresh = [mimi.init_encoder_state(len(joining)), mimi.init_decoder_state(len(joining))]
                enc = fresh[0] if enc is None else BatchedState.concat([enc, fresh[0]])
                dec = fresh[1] if dec is None else BatchedState.concat([dec, fresh[1]])
                rows += joining
            frame = [tick - SESSIONS[s][1] for s in rows]
            pcm = torch.stack([signals[SESSIONS[s][0]][f * F:(f + 1) * F] for s, f in zip(rows, frame)])[:, None]
            want = torch.stack([expected[SESSIONS[s][0]][0][0, :, f] for s, f in zip(rows, frame)])[..., None]
            got = mimi.encode_step(pcm, enc)
            out = mimi.decode_step(want, dec)
            for i, s in enumerate(rows):
                codes[s].append(got[i])
                audio[s].append(out[i])
    for s, (name, _, n) in enumerate(SESSIONS):
        want_codes, want_audio = expected[name]
        assert torch.equal(torch.cat(codes[s], -1), want_codes[0, :, :n]), f"session {s}"
        _close(torch.cat(audio[s], -1), want_audio[0, :, :n * F])


def test_bad_frames_are_one_line_errors(mimi):
    state = mimi.init_encoder_state(1)
    with pytest.raises(ValueError, match=r"Mimi encodes \[B, 1, k \* 1920\] samples, got \[1, 1, 1000\]"):
        mimi.encode_step(torch.zeros(1, 1, 1000), state)
    with pytest.raises(ValueError, match=r"Mimi decodes codes \[B, 8, k\], got \[1, 4, 1\]"):
        mimi.decode_step(torch.zeros(1, 4, 1, dtype=torch.long), mimi.init_decoder_state(1))


def test_checkpoint_errors_name_the_tensor(folder, tmp_path):
    weights, cfg = mimi_checkpoint(folder)
    tensors = load_file(str(weights))

    def broken(edit) -> Path:
        t = dict(tensors)
        edit(t)
        save_file(t, str(tmp_path / "bad.safetensors"))
        return tmp_path / "bad.safetensors"

    conv = "encoder.model.0.conv.conv.weight"
    with pytest.raises(CheckpointError, match=rf"^bad.safetensors: missing tensor {conv} "):
        load_mimi(broken(lambda t: t.pop(conv)), cfg)
    with pytest.raises(CheckpointError, match=r"^bad.safetensors: decoder_transformer.transformer.layers.1."
                                              r"linear1.weight has shape \[3, 32\], the config expects \[64, 32\]$"):
        load_mimi(broken(lambda t: t.update({"decoder_transformer.transformer.layers.1.linear1.weight":
                                             torch.zeros(3, 32)})), cfg)
    book = "quantizer.rvq_rest.vq.layers.2._codebook.embedding_sum"
    with pytest.raises(CheckpointError, match=rf"^bad.safetensors: missing tensor {book} "):
        load_mimi(broken(lambda t: t.pop(book)), cfg)
    with pytest.raises(CheckpointError, match=r"^bad.safetensors: unexpected tensor extra.weight "):
        load_mimi(broken(lambda t: t.update({"extra.weight": torch.zeros(1)})), cfg)


def test_checkpoint_config_names_and_defaults(tmp_path):
    (tmp_path / "m.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text('{"mimi_name": "m.safetensors", "n_q": 32, "dep_q": 16}')
    weights, cfg = mimi_checkpoint(tmp_path)  # no mimi_config_name: Kyutai's released Mimi
    assert weights == tmp_path / "m.safetensors" and cfg == MimiConfig(num_codebooks=16)
    (tmp_path / "config.json").write_text('{"mimi_name": "m.safetensors", "mimi_config_name": "c.json"}')
    with pytest.raises(CheckpointError, match=r"c.json not found \(config.json's mimi_config_name\)$"):
        mimi_checkpoint(tmp_path)


def test_unsupported_config_is_one_line():
    from tiny_mimi import tiny_mimi_config

    cfg = tiny_mimi_config()
    cfg["transformer"]["gating"] = "silu"
    with pytest.raises(CheckpointError, match=r"^mimi config transformer: gating='silu' unsupported \(expected one of"):
        MimiConfig.from_dict(cfg)
    cfg = tiny_mimi_config()
    del cfg["seanet"]["ratios"]
    with pytest.raises(CheckpointError, match=r"^mimi config: missing key 'ratios'$"):
        MimiConfig.from_dict(cfg)
