"""3-D prompt positions and rope deltas against transformers 5.24's `get_rope_index` (exact equality).

The reference receives what the model receives from the processor: `image_grid_thw`,
`video_grid_thw`, `second_per_grids` (float32 tensor, `temporal_patch_size / fps`) and the audio
lengths in mel frames (`feature_attention_mask.sum(-1)`); ours receives audio token counts.
"""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from omnivox.errors import InputError
from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
from omnivox.models.qwen3_omni.positions import (audio_in_video_pads, decode_positions, rope_index_for,
                                                 talker_rope_index_for)
from qwen_tiny import build_reference

IM_START, USER, ASSISTANT, NL, IM_END = 151644, 872, 77091, 198, 151645
AUDIO, IMAGE, VIDEO = 151675, 151655, 151656
A_START, A_END, V_START, V_END = 151669, 151670, 151652, 151653
HEADER = [IM_START, USER, NL]
TAIL = [IM_END, NL, IM_START, ASSISTANT, NL]


@pytest.fixture(scope="module")
def ref():
    return build_reference()


@pytest.fixture(scope="module")
def cfg(ref):
    return Qwen3OmniConfig.from_hf(ref.config.to_dict())


def tokens_per_clip(mel_frames: int) -> int:
    """Spec 5.2: 13 per full 100 frames, plus three halvings of the remainder."""
    r, n = mel_frames % 100, 13 * (mel_frames // 100)
    if r:
        for _ in range(3):
            r = (r - 1) // 2 + 1
        n += r
    return n


def audio(mel_frames: int) -> list[int]:
    return [A_START] + [AUDIO] * tokens_per_clip(mel_frames) + [A_END]


def image(grid) -> list[int]:
    return [V_START] + [IMAGE] * (grid[0] * grid[1] * grid[2] // 4) + [V_END]


def video(grid) -> list[int]:
    return [V_START] + [VIDEO] * (grid[0] * grid[1] * grid[2] // 4) + [V_END]


def processor_audio_in_video(grid, second_per_grid: float, mel_frames: int) -> list[int]:
    """The block transformers' processor builds (its own `replace_video_with_audio_token`)."""
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

    fake = types.SimpleNamespace(video_processor=types.SimpleNamespace(merge_size=2), audio_bos_token="<",
                                 audio_eos_token=">", video_token="V", audio_token="A")
    text = Qwen3OmniMoeProcessor.replace_video_with_audio_token(
        fake, {"video_grid_thw": np.array([grid]), "video_second_per_grid": [second_per_grid]}, 0,
        {"num_audio_tokens": np.array([tokens_per_clip(mel_frames)])}, 0, position_id_per_seconds=13.0)
    inner = {"<": A_START, ">": A_END, "V": VIDEO, "A": AUDIO}
    return [V_START] + [inner[ch] for ch in text] + [V_END]


def reference(model, ids, images=(), videos=(), spg=(), mel=(), use_audio_in_video=False):
    """(positions [3, S], delta) from transformers, called as the model calls it."""
    x = torch.tensor([ids])
    pos, delta = model.get_rope_index(
        x, torch.tensor(images).view(-1, 3) if images else None, torch.tensor(videos).view(-1, 3) if videos else None,
        torch.ones_like(x), use_audio_in_video, torch.tensor(mel) if mel else None,
        torch.tensor(spg, dtype=torch.float32) if spg else None)
    return pos[:, 0], float(delta)


def ours(cfg, ids, images=(), videos=(), spg=(), mel=(), use_audio_in_video=False):
    return rope_index_for(cfg.thinker, ids, image_grids=images, video_grids=videos, second_per_grids=spg,
                          audio_token_counts=[tokens_per_clip(f) for f in mel], use_audio_in_video=use_audio_in_video)


def assert_same(ref_out, our_out):
    (rp, rd), (op, od) = ref_out, our_out
    assert op.shape == rp.shape
    assert torch.equal(op.to(rp.dtype), rp), (op - rp).abs().max()
    assert od == rd
    whole = torch.equal(rp, rp.floor())
    assert op.dtype == (torch.int64 if whole else torch.float32)


@pytest.mark.parametrize("frames", [100, 250, 1234, 70, 37, 0, 3000])
def test_tokens_per_clip_matches_reference(frames):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    assert tokens_per_clip(frames) == int(_get_feat_extract_output_lengths(torch.tensor(frames)))


def test_pure_text(ref, cfg):
    ids = [IM_START, 8948, NL, 100, 101, IM_END, NL] + HEADER + [1000, 2000, 3000] + TAIL
    pos, delta = ours(cfg, ids)
    assert_same(reference(ref.thinker, ids), (pos, delta))
    assert torch.equal(pos, torch.arange(len(ids)).expand(3, -1)) and delta == 0.0


def test_worked_example_image_then_audio(ref, cfg):
    ids = HEADER + image((1, 4, 6)) + audio(250) + [7, 8] + TAIL
    pos, delta = ours(cfg, ids, images=[(1, 4, 6)], mel=[250])
    assert_same(reference(ref.thinker, ids, images=[(1, 4, 6)], mel=[250]), (pos, delta))
    assert pos[:, :12].tolist() == [[0, 1, 2, 3, 4, 4, 4, 4, 4, 4, 7, 8],
                                    [0, 1, 2, 3, 4, 4, 4, 5, 5, 5, 7, 8],
                                    [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8]]
    assert pos[0, 12:46].tolist() == list(range(9, 43))  # 33 audio tokens then <audio_end>
    assert delta == -3.0


@pytest.mark.parametrize("fps", [1.0, 2.0, 3.0, 5.0, 29.97])
def test_video_second_per_grid(ref, cfg, fps):
    """spg = temporal_patch_size / fps; 5 fps gives 0.4 (T steps of 5.2) and fractional positions.

    Two videos, the second starting at a fractional value after 50+ text tokens, stress float32
    round-off: equality is bit-exact.
    """
    g1, g2 = (5, 4, 6), (3, 6, 2)
    spg = [2 / fps, 2 / fps]
    ids = HEADER + list(range(1000, 1050)) + video(g1) + [5, 6] + video(g2) + [7] + TAIL
    got = ours(cfg, ids, videos=[g1, g2], spg=spg)
    assert_same(reference(ref.thinker, ids, videos=[g1, g2], spg=spg), got)
    if fps == 5.0:
        assert got[0].dtype == torch.float32
        first = 3 + 50 + 1
        assert got[0][0, first + 6].item() == pytest.approx(got[0][0, first].item() + 5.2, abs=1e-4)


def test_float32_rounding_order(ref, cfg):
    """A fractional text run crossing 256: the next block starts at f32(start + len), not one
    past the run's last value (these differ by one ulp here)."""
    ids = [1] * 50 + video((2, 2, 2)) + [2] * 195 + image((1, 2, 2)) + [3]
    kw = dict(images=[(1, 2, 2)], videos=[(2, 2, 2)], spg=[2 / 3.0])
    assert_same(reference(ref.thinker, ids, **kw), ours(cfg, ids, **kw))


def test_images_and_audio_mixed_with_text(ref, cfg):
    ids = (HEADER + audio(250) + [11, 12] + image((1, 4, 6)) + [13] + image((1, 8, 4)) + image((1, 2, 2))
           + [14, 15, 16] + audio(1234) + TAIL)
    images, mel = [(1, 4, 6), (1, 8, 4), (1, 2, 2)], [250, 1234]
    assert_same(reference(ref.thinker, ids, images=images, mel=mel), ours(cfg, ids, images=images, mel=mel))


AIV_CASES = [
    ((4, 4, 4), 1.0, 400),   # 2 fps: slices at 0, 13, 26, 39 between 52 audio tokens, ties go to video
    ((3, 4, 6), 0.4, 250),   # fractional slice times 0, 5.2, 10.4
    ((2, 48, 48), 0.4, 100),  # audio ends the block but the frame is wider than the audio is long
]


@pytest.mark.parametrize("grid,spg,mel", AIV_CASES)
def test_audio_in_video_pad_order_matches_processor(grid, spg, mel):
    block = processor_audio_in_video(grid, spg, mel)
    pads = audio_in_video_pads(grid, spg, tokens_per_clip(mel), video_token_id=VIDEO, audio_token_id=AUDIO,
                               spatial_merge_size=2, position_id_per_seconds=13)
    assert block[2:-2] == pads
    assert 0 < pads.index(AUDIO) and pads[-1] == AUDIO  # really interleaved


@pytest.mark.parametrize("grid,spg,mel", AIV_CASES)
def test_audio_in_video(ref, cfg, grid, spg, mel):
    ids = (HEADER + [21, 22] + processor_audio_in_video(grid, spg, mel) + [23] + image((1, 4, 4)) + audio(70)
           + [24] + TAIL)
    kw = dict(images=[(1, 4, 4)], videos=[grid], spg=[spg], mel=[mel, 70], use_audio_in_video=True)
    got = ours(cfg, ids, **kw)
    assert_same(reference(ref.thinker, ids, **kw), got)
    if grid == (2, 48, 48):
        # transformers' rule, mirrored: the end markers follow the block's final (audio) stretch,
        # s + 13, although the frame reaches s + 23.
        s, end = 7, 5 + len(processor_audio_in_video(grid, spg, mel)) - 2  # index of <audio_end>
        assert got[0][:, end].tolist() == [s + 13] * 3
        assert got[0][:, 7:end].max().item() == s + 23


def test_audio_in_video_near_tie_follows_the_pads(ref, cfg):
    """transformers bug, not mirrored: at 7 fps slice 21 sits at 21 * (2/7) * 13 = 78 exactly in the
    processor's float64 (video pad first, a tie) but at 78.0000076 in the model's float32 (audio
    first), so transformers gives that video pad the audio token's position and vice versa.
    Ours gives each pad its own kind's values; everything else is equal."""
    grid, spg, mel = (22, 2, 2), 2 / 7, 610  # 22 one-token slices, 80 audio tokens
    ids = HEADER + processor_audio_in_video(grid, spg, mel) + TAIL
    kw = dict(videos=[grid], spg=[spg], mel=[mel], use_audio_in_video=True)
    (rp, rd), (op, od) = reference(ref.thinker, ids, **kw), ours(cfg, ids, **kw)
    swapped = (rp != op).any(0).nonzero().flatten().tolist()
    assert swapped == [104, 105] and ids[104:106] == [VIDEO, AUDIO]
    assert torch.equal(op[:, [104, 105]], rp[:, [105, 104]]) and od == rd
    s = 5  # first pad value: 3 header tokens + 2 start markers
    assert op[1:, 104].tolist() == [s, s] and op[:, 105].tolist() == [s + 78] * 3


def test_audio_in_video_needs_the_flag(cfg):
    ids = HEADER + processor_audio_in_video((2, 4, 4), 1.0, 100) + TAIL
    with pytest.raises(InputError, match="use_audio_in_video"):
        ours(cfg, ids, videos=[(2, 4, 4)], spg=[1.0], mel=[100])


@pytest.mark.parametrize("case", ["text", "image_audio", "video_fractional", "audio_in_video", "aiv_wide_frame"])
def test_decode_continues_from_cache_length_plus_delta(ref, cfg, case):
    """Step k gets what transformers computes from `cache_length + rope_deltas` with S + k cached tokens."""
    kw = {"text": dict(),
          "image_audio": dict(images=[(1, 4, 6)], mel=[250]),
          "video_fractional": dict(videos=[(5, 4, 6)], spg=[0.4]),
          "audio_in_video": dict(videos=[(3, 4, 6)], spg=[0.4], mel=[250], use_audio_in_video=True),
          "aiv_wide_frame": dict(videos=[(2, 48, 48)], spg=[0.4], mel=[100], use_audio_in_video=True)}[case]
    body = {"text": [1, 2, 3], "image_audio": image((1, 4, 6)) + audio(250),
            "video_fractional": list(range(1000, 1100)) + video((5, 4, 6)),
            "audio_in_video": processor_audio_in_video((3, 4, 6), 0.4, 250),
            "aiv_wide_frame": processor_audio_in_video((2, 48, 48), 0.4, 100)}[case]
    ids = HEADER + body + TAIL
    pos, delta = ours(cfg, ids, **kw)
    steps = 600  # far enough to cross the float32 binades at 128, 256 and 512
    model = ref.thinker.model
    x = torch.tensor([ids])
    model.rope_deltas = None
    t = {k: torch.tensor(v) for k, v in kw.items() if k != "use_audio_in_video"}
    model.compute_3d_position_ids(x, t.get("images"), t.get("videos"), None, torch.ones_like(x), None,
                                  kw.get("use_audio_in_video", False), t.get("mel"), t.get("spg"))  # prefill

    class Cache:  # the one method compute_3d_position_ids reads
        def __init__(self, n):
            self.n = n

        def get_seq_length(self, *_):
            return self.n

    embeds = torch.zeros(1, 1, 32)  # one decode token
    expected = torch.stack([model.compute_3d_position_ids(None, None, None, embeds, None, Cache(len(ids) + k))[:, 0, 0]
                            for k in range(steps)], 1)  # [3, steps]
    got = decode_positions(len(ids) + delta, steps)
    assert torch.equal(got.to(expected.dtype), expected)
    assert got[0, 0].item() == pos.max().item() + 1
    if case == "video_fractional":
        assert got.dtype == torch.float32 and not (len(ids) + delta).is_integer()


def test_talker_positions_restart_at_user_turn(ref, cfg):
    """Talker ids: the kept user turn, then 9 tts pads; its own merge size and time scale."""
    ids = HEADER + image((1, 4, 6)) + [5, 6] + video((3, 4, 4)) + [IM_END, NL] + [151671] * 9
    kw = dict(image_grids=[(1, 4, 6)], video_grids=[(3, 4, 4)], second_per_grids=[0.4])
    pos, delta = talker_rope_index_for(cfg.thinker, cfg.talker, ids, **kw)
    ref_out = reference(ref.talker, ids, images=[(1, 4, 6)], videos=[(3, 4, 4)], spg=[0.4])
    assert_same(ref_out, (pos, delta))
    assert pos[:, 0].tolist() == [0, 0, 0]


def test_talker_with_audio(ref, cfg, monkeypatch):
    """transformers 5.24's talker reads `config.audio_config.n_window`, which its config lacks, and
    crashes on audio + image prompts; lend it the thinker's audio config to compare."""
    monkeypatch.setattr(ref.talker.config, "audio_config", ref.thinker.config.audio_config, raising=False)
    ids = HEADER + audio(250) + image((1, 4, 6)) + [IM_END, NL] + [151671] * 9
    pos, delta = talker_rope_index_for(cfg.thinker, cfg.talker, ids, image_grids=[(1, 4, 6)],
                                       audio_token_counts=[tokens_per_clip(250)])
    assert_same(reference(ref.talker, ids, images=[(1, 4, 6)], mel=[250]), (pos, delta))


@pytest.mark.parametrize("bad", ["too_few_pads", "too_many_pads", "missing_grid", "extra_grid", "no_end"])
def test_inconsistent_media_raise_input_error(cfg, bad):
    ids, images = HEADER + image((1, 4, 6)) + [1] + TAIL, [(1, 4, 6)]
    if bad == "too_few_pads":
        ids.remove(IMAGE)
    elif bad == "too_many_pads":
        ids.insert(5, IMAGE)
    elif bad == "missing_grid":
        images = []
    elif bad == "extra_grid":
        images = images + [(1, 2, 2)]
    else:
        ids = HEADER + [V_START] + [IMAGE] * 6
    with pytest.raises(InputError):
        ours(cfg, ids, images=images)
