"""3-D multimodal position ids (M-RoPE rows T, H, W) of one Qwen3-Omni prompt and of its decode steps.

The prompt is walked left to right (spec section 7.4). Text, every start/end marker and every
audio token take one sequential value on all three rows. An image or video block takes
`(s + tau * second_per_grid * position_id_per_seconds, s + r, s + c)` per merged patch, where `s`
follows its start marker(s). An audio-in-video block mixes both, each kind of pad taking its own
values in order (transformers re-sorts them in float32 instead; see `_interleave`).

Contract of the result:
- positions `[3, S]`: int64 when every value is whole, float32 when a video's temporal step is
  fractional (e.g. `second_per_grid = 0.4`). RoPE uses the float values as they are.
- `delta = max(positions) + 1 - S`, a Python float (whole unless positions are fractional);
  generated token i then sits at `S + delta + i` on all three rows (`decode_positions`).

NOTE: values are computed in float32 with the reference's own sequence of roundings (each run of
tokens is `start + arange(n)`, and a run's `start` is one past the previous run's maximum), so
fractional positions are bit-identical to transformers 5.24. Do not "simplify" the walk into one
running counter: `f32(f32(x + a) + b)` and `f32(x + a + b)` can differ by one ulp.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from omnivox.errors import InputError
from omnivox.models.qwen3_omni.config import TalkerConfig, ThinkerConfig

Grid = tuple[int, int, int]  # (t, h, w) in patches, before the spatial merge


@dataclass(frozen=True)
class _Media:
    """Token ids and per-item sizes of one prompt's media, consumed in prompt order."""

    image: int
    video: int
    audio: int
    vision_start: int
    audio_start: int
    image_grids: list[Grid]
    video_grids: list[Grid]
    second_per_grids: list[float]
    audio_counts: list[int]
    merge: int
    per_second: int


def rope_index(input_ids: Sequence[int], *, image_token_id: int, video_token_id: int, audio_token_id: int,
               vision_start_token_id: int, audio_start_token_id: int, image_grids: list[Grid],
               video_grids: list[Grid], second_per_grids: list[float], audio_token_counts: list[int],
               spatial_merge_size: int, position_id_per_seconds: int,
               use_audio_in_video: bool = False) -> tuple[torch.Tensor, float]:
    """Positions `[3, S]` and the rope delta of ONE unpadded prompt (see the module docstring).

    Grids, `second_per_grids` and `audio_token_counts` are listed in prompt order; audio-in-video
    blocks (`<vision_start><audio_start>` + interleaved pads + `<audio_end><vision_end>`) take one
    video grid and one audio count each, and need `use_audio_in_video=True`.
    Raises InputError when the prompt's pads disagree with the given media.
    """
    if len(second_per_grids) != len(video_grids):
        raise InputError(f"got {len(video_grids)} video grids but {len(second_per_grids)} second_per_grids")
    m = _Media(image_token_id, video_token_id, audio_token_id, vision_start_token_id, audio_start_token_id,
               list(image_grids), list(video_grids), [float(x) for x in second_per_grids],
               list(audio_token_counts), spatial_merge_size, position_id_per_seconds)
    ids = [int(t) for t in input_ids]
    used = {"image": 0, "video": 0, "audio": 0}
    runs: list[torch.Tensor] = []  # each [3, n] float32, in prompt order
    cursor = 0
    for begin in (i for i, t in enumerate(ids) if t in (m.vision_start, m.audio_start)):
        if begin < cursor:
            continue  # the audio start inside an audio-in-video block
        kind, n_bos = _block_kind(ids, begin, m, use_audio_in_video)
        if kind == "text":
            continue
        st = _after(runs)
        if begin > cursor:  # text before the block
            runs.append(_run(st, begin - cursor))
            st = st + (begin - cursor)
        runs.append(_run(st, n_bos))  # start marker(s)
        content = _content(kind, ids, begin + n_bos, st + n_bos, m, used)
        runs.extend(content)
        cursor = begin + n_bos + sum(r.shape[1] for r in content) + n_bos  # as many end markers as starts
        if cursor > len(ids):
            raise InputError(f"prompt ends inside a {kind} block; its end marker is missing")
        runs.append(_run(_after(runs), n_bos))  # end marker(s)
    _check_all_used(used, m)
    if cursor < len(ids):
        runs.append(_run(_after(runs), len(ids) - cursor))
    positions = torch.cat(runs, dim=1) if runs else torch.zeros(3, 0)  # [3, S]
    delta = float(positions.max() + 1 - len(ids)) if runs else 0.0
    if torch.equal(positions, positions.floor()):
        positions = positions.long()
    return positions, delta


def decode_positions(start: float, n: int) -> torch.Tensor:
    """`[3, n]` positions of the next n generated tokens: `start + i` on all three rows.

    Pass `start = S + delta` (S prompt tokens, more after each step: `S + delta + steps_done`).
    int64 when `start` is whole, else float32 rounded once from the exact sum, which is what
    transformers computes from `cache_length + rope_deltas`.
    """
    values = torch.arange(n, dtype=torch.float64) + float(start)  # [n], exact
    row = values.long() if float(start).is_integer() else values.float()
    return row.unsqueeze(0).expand(3, n).clone()


def rope_index_for(cfg: ThinkerConfig, input_ids: Sequence[int], *, image_grids: Sequence[Grid] = (),
                   video_grids: Sequence[Grid] = (), second_per_grids: Sequence[float] = (),
                   audio_token_counts: Sequence[int] = (),
                   use_audio_in_video: bool = False) -> tuple[torch.Tensor, float]:
    """`rope_index` for the thinker prompt, with the ids and sizes from its config."""
    return rope_index(input_ids, **_token_ids(cfg), spatial_merge_size=cfg.vision.spatial_merge_size,
                      position_id_per_seconds=cfg.position_id_per_seconds, image_grids=list(image_grids),
                      video_grids=list(video_grids), second_per_grids=list(second_per_grids),
                      audio_token_counts=list(audio_token_counts), use_audio_in_video=use_audio_in_video)


def talker_rope_index_for(thinker: ThinkerConfig, talker: TalkerConfig, talker_input_ids: Sequence[int], *,
                          image_grids: Sequence[Grid] = (), video_grids: Sequence[Grid] = (),
                          second_per_grids: Sequence[float] = (), audio_token_counts: Sequence[int] = (),
                          use_audio_in_video: bool = False) -> tuple[torch.Tensor, float]:
    """`rope_index` over the talker's position ids (spec 8.2 step 7: kept user turns + tts pads).

    Media token ids come from the thinker config; merge size and time scale from the talker's.
    Positions restart at 0 at the first kept user turn (the system turn is not in the ids).
    """
    return rope_index(talker_input_ids, **_token_ids(thinker), spatial_merge_size=talker.spatial_merge_size,
                      position_id_per_seconds=talker.position_id_per_seconds, image_grids=list(image_grids),
                      video_grids=list(video_grids), second_per_grids=list(second_per_grids),
                      audio_token_counts=list(audio_token_counts), use_audio_in_video=use_audio_in_video)


def audio_in_video_pads(video_grid: Grid, second_per_grid: float, audio_tokens: int, *, video_token_id: int,
                        audio_token_id: int, spatial_merge_size: int, position_id_per_seconds: float) -> list[int]:
    """The interleaved pad ids of one audio-in-video block, as the processor emits them.

    Video slice tau sits at time `tau * second_per_grid * position_id_per_seconds`, audio token a at
    time a; pads go in time order, video first at ties. (Python floats, like the processor.)
    """
    t, h, w = video_grid
    per_slice = (h // spatial_merge_size) * (w // spatial_merge_size)
    video_times = [tau * second_per_grid * position_id_per_seconds for tau in range(t) for _ in range(per_slice)]
    out: list[int] = []
    v = a = 0
    while v < len(video_times) and a < audio_tokens:
        if video_times[v] <= a:
            out.append(video_token_id)
            v += 1
        else:
            out.append(audio_token_id)
            a += 1
    return out + [video_token_id] * (len(video_times) - v) + [audio_token_id] * (audio_tokens - a)


def _token_ids(cfg: ThinkerConfig) -> dict[str, int]:
    return dict(image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
                audio_token_id=cfg.audio_token_id, vision_start_token_id=cfg.vision_start_token_id,
                audio_start_token_id=cfg.audio_start_token_id)


def _after(runs: list[torch.Tensor]) -> torch.Tensor:
    """Start of the next run: one past the maximum of the previous run (0 for the first)."""
    return runs[-1].max() + 1 if runs else torch.zeros((), dtype=torch.float32)


def _run(start: torch.Tensor, n: int) -> torch.Tensor:
    """`[3, n]` sequential values `start + i` on all rows (text-like tokens)."""
    return (torch.arange(n, dtype=torch.float32) + start).unsqueeze(0).expand(3, n)


def _block_kind(ids: list[int], begin: int, m: _Media, use_audio_in_video: bool) -> tuple[str, int]:
    """(kind, number of start markers) of the block whose first marker sits at `begin`."""
    nxt = ids[begin + 1] if begin + 1 < len(ids) else None
    if ids[begin] == m.audio_start:
        return ("audio", 1) if nxt == m.audio else ("text", 1)
    if nxt == m.image:
        return "image", 1
    if nxt == m.video:
        return "video", 1
    if nxt == m.audio_start:
        if not use_audio_in_video:
            raise InputError("prompt has an audio-in-video block (<vision_start><audio_start>); "
                             "pass use_audio_in_video=True")
        return "audio_in_video", 2
    raise InputError(f"token {ids[begin]} (vision start) at index {begin} is not followed by image or video pads")


def _content(kind: str, ids: list[int], at: int, s: torch.Tensor, m: _Media,
             used: dict[str, int]) -> list[torch.Tensor]:
    """The runs of one block's pads, starting at value `s`, checked against the pad ids at `at`."""
    if kind == "audio":
        n = _take(m.audio_counts, used, "audio")
        _expect(ids, at, n, "audio", m.audio)
        return [_run(s, n)]
    if kind == "image":
        grid = _take(m.image_grids, used, "image")
        block = _grid_positions(grid, 1.0, s, m)
        _expect(ids, at, block.shape[1], "image", m.image)
        return [block]
    if kind == "video":
        i = used["video"]
        block = _grid_positions(_take(m.video_grids, used, "video"), m.second_per_grids[i], s, m)
        _expect(ids, at, block.shape[1], "video", m.video)
        return [block]
    i = used["video"]
    video = _grid_positions(_take(m.video_grids, used, "video"), m.second_per_grids[i], s, m)
    audio = _run(s, _take(m.audio_counts, used, "audio"))
    return _interleave(ids, at, video, audio, m)


def _grid_positions(grid: Grid, second_per_grid: float, s: torch.Tensor, m: _Media) -> torch.Tensor:
    """`[3, t*h*w/merge^2]` (s + tau*step, s + r, s + c) over merged patches, t-major then rows."""
    t, h, w = (int(x) for x in grid)
    hm, wm = h // m.merge, w // m.merge
    # float32 products in this order, as the reference rounds them
    times = torch.arange(t, dtype=torch.float32) * torch.tensor(second_per_grid, dtype=torch.float32)
    times = times * m.per_second  # [t]
    tt = times.view(t, 1, 1).expand(t, hm, wm)
    rr = torch.arange(hm, dtype=torch.float32).view(1, hm, 1).expand(t, hm, wm)
    cc = torch.arange(wm, dtype=torch.float32).view(1, 1, wm).expand(t, hm, wm)
    return torch.stack([tt, rr, cc]).reshape(3, -1) + s


def _interleave(ids: list[int], at: int, video: torch.Tensor, audio: torch.Tensor, m: _Media) -> list[torch.Tensor]:
    """Audio-in-video pads: each pad kind takes its own values in order, wherever the prompt puts it.

    NOTE: transformers instead re-sorts the values by T in float32 and hands them out in that order,
    which swaps a video/audio pair at float64 ties the processor broke the other way (e.g. 7 fps,
    slice 21 at 78 vs audio token 78). Wherever the two orders agree, the positions are equal.

    Returned as two runs split before the block's final same-kind stretch: the value after the
    block is one past THAT stretch's maximum (transformers' rule), which is below the block's
    maximum when the audio track ends the block and the frame is taller or wider than the audio
    is long. The rope delta still uses the overall maximum.
    """
    n_v, n_a = video.shape[1], audio.shape[1]
    span = ids[at:at + n_v + n_a]
    if span.count(m.video) != n_v or span.count(m.audio) != n_a or len(span) != n_v + n_a:
        raise InputError(f"audio-in-video block at index {at}: expected {n_v} video and {n_a} audio pads "
                         f"between the markers")
    is_video = torch.tensor([t == m.video for t in span])
    block = torch.empty(3, len(span), dtype=torch.float32)
    block[:, is_video] = video
    block[:, ~is_video] = audio
    tail = len(span) - 1
    while tail > 0 and span[tail - 1] == span[-1]:
        tail -= 1
    return [block[:, :tail], block[:, tail:]] if tail else [block]


def _take(items: list, used: dict[str, int], kind: str):
    i = used[kind]
    if i >= len(items):
        raise InputError(f"prompt has more {kind} blocks than {kind} inputs ({len(items)})")
    used[kind] += 1
    return items[i]


def _expect(ids: list[int], at: int, n: int, kind: str, pad_id: int) -> None:
    """Exactly n pads of `pad_id` start at `at`."""
    have = 0
    while at + have < len(ids) and ids[at + have] == pad_id:
        have += 1
    if have != n:
        raise InputError(f"{kind} block at index {at}: the {kind} input needs {n} pad tokens, the prompt has {have}")


def _check_all_used(used: dict[str, int], m: _Media) -> None:
    for kind, items in (("image", m.image_grids), ("video", m.video_grids), ("audio", m.audio_counts)):
        if used[kind] != len(items):
            raise InputError(f"got {len(items)} {kind} inputs but the prompt has {used[kind]} {kind} blocks")
