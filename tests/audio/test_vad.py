"""Server-side turn detection: Silero VAD (the package's own model) on audio time, OpenAI's events."""
from pathlib import Path

import numpy as np
import pytest
import torch

from omnivox.audio.io import encode_pcm16, load_audio, resample
from omnivox.audio.vad import TurnDetector, TurnEvent, load_silero_vad, silero_data_dir

MEDIA = Path(__file__).resolve().parents[1] / "media"
LEAD_MS, TAIL_MS = 1000, 1500


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    return load_audio(MEDIA / "speech_16k.wav")


def padded(speech: np.ndarray, rate: int, lead_ms: int = LEAD_MS, tail_ms: int = TAIL_MS,
           noise: float = 1e-3) -> np.ndarray:
    """Silence, the speech, silence, with a little noise throughout (a quiet room), at `rate`."""
    x = np.concatenate([np.zeros(16 * lead_ms, np.float32), speech, np.zeros(16 * tail_ms, np.float32)])
    x = x + (noise * np.random.default_rng(0).standard_normal(len(x))).astype(np.float32)
    return x if rate == 16000 else resample(x, 16000, rate)


def voiced_span_ms(speech: np.ndarray) -> tuple[float, float]:
    """First and last 10 ms block of the clip whose RMS is within 30 dB of the loudest one."""
    rms = np.sqrt((speech[:len(speech) // 160 * 160].reshape(-1, 160) ** 2).mean(axis=1))
    loud = np.nonzero(rms > rms.max() * 10 ** (-30 / 20))[0]
    return loud[0] * 10.0, (loud[-1] + 1) * 10.0


def run(detector: TurnDetector, data, sizes) -> list[tuple[TurnEvent, float]]:
    """Push `data` (pcm16 bytes or samples) in pieces; each event with the audio ms pushed so far
    when it came back."""
    per_ms = detector.resampler.orig_sr / 1000 * (2 if isinstance(data, bytes) else 1)
    out, i = [], 0
    for s in sizes:
        i += s
        out += [(e, i / per_ms) for e in detector.push(data[i - s:i])]
    return out


def chunk_sizes(total: int, per_ms: float, seed: int, lo_ms: float = 20, hi_ms: float = 100) -> list[int]:
    rng, sizes = np.random.default_rng(seed), []
    while sum(sizes) < total:
        sizes.append(int(rng.integers(int(lo_ms * per_ms), int(hi_ms * per_ms) + 1)))
    return sizes


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
def test_module_equals_the_package_model(speech):
    """Our module with the weights of the package's TorchScript model gives its probabilities."""
    jit = torch.jit.load(str(silero_data_dir() / "silero_vad.jit"), map_location="cpu").eval()
    model = load_silero_vad()
    x = torch.from_numpy(padded(speech, 16000, 300, 300))
    h = c = torch.zeros(1, 128)
    context = torch.zeros(1, 64)
    ours, theirs = [], []
    with torch.no_grad():
        for k in range(len(x) // 512):
            frame = x[None, k * 512:(k + 1) * 512]
            inp = torch.cat([context, frame], dim=1)
            p, h, c = model(inp, h, c)
            context = inp[:, -64:]
            ours.append(p.item())
            theirs.append(jit(frame, 16000).item())
    np.testing.assert_allclose(ours, theirs, atol=1e-6, rtol=0)
    assert max(ours) > 0.9 and min(ours) < 0.05


def test_loading_keeps_torch_threads():
    threads = torch.get_num_threads()
    load_silero_vad.cache_clear()
    load_silero_vad()
    assert torch.get_num_threads() == threads  # `import silero_vad` would have set it to 1


@pytest.mark.parametrize("rate", [16000, 24000])
def test_one_turn_in_padded_speech(speech, rate):
    """One start and one stop, at the speech's edges: start = onset - prefix padding, stop = offset
    + silence duration (both within a few 32 ms frames; the VAD decides per frame)."""
    pcm = encode_pcm16(padded(speech, rate))
    sizes = [2 * s for s in chunk_sizes(len(pcm) // 2, rate / 1000, seed=0)]
    events = [e for e, _ in run(TurnDetector(sample_rate=rate), pcm, sizes)]
    assert [e.type for e in events] == ["speech_started", "speech_stopped"]
    onset, offset = voiced_span_ms(speech)
    start, stop = events
    assert LEAD_MS + onset - 300 - 32 <= start.audio_ms <= LEAD_MS + onset - 300 + 160
    assert start.detected_ms == start.audio_ms + 300 + 32  # decided at the end of the first speech frame
    assert LEAD_MS + offset + 500 - 200 <= stop.audio_ms <= LEAD_MS + offset + 500 + 200
    assert stop.audio_ms <= stop.detected_ms < stop.audio_ms + 32


def test_24k_and_16k_agree(speech):
    ev16 = TurnDetector(sample_rate=16000).push(encode_pcm16(padded(speech, 16000)))
    ev24 = TurnDetector(sample_rate=24000).push(encode_pcm16(padded(speech, 24000)))
    assert [e.type for e in ev24] == [e.type for e in ev16]
    assert all(abs(a.audio_ms - b.audio_ms) <= 32 for a, b in zip(ev16, ev24))


@pytest.mark.parametrize("noise", [0.0, 1e-3, 1e-2])
def test_silence_gives_no_events(noise):
    x = (noise * np.random.default_rng(1).standard_normal(24000 * 4)).astype(np.float32)
    detector = TurnDetector()
    assert detector.push(encode_pcm16(x)) == [] and not detector.speaking
    assert detector.audio_ms == 4000 - 32  # the resampler's look-ahead holds back the last frame


def test_events_do_not_depend_on_chunking(speech):
    """Same events at the same audio times for 20-100 ms pieces, odd byte pieces, one piece, and
    float samples; each comes back from the push that carried its deciding frame."""
    x = padded(speech, 24000)
    pcm = encode_pcm16(x)
    whole = TurnDetector().push(pcm)
    assert len(whole) == 2
    for seed in range(3):
        got = run(TurnDetector(), pcm, [2 * s for s in chunk_sizes(len(pcm) // 2, 24, seed)])
        assert [e for e, _ in got] == whole
        for e, pushed_ms in got:
            assert e.detected_ms + 0.625 <= pushed_ms < e.detected_ms + 0.625 + 100
    odd = run(TurnDetector(), pcm, chunk_sizes(len(pcm), 48, seed=5, lo_ms=0.01, hi_ms=3))
    assert [e for e, _ in odd] == whole
    floats = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768.0
    assert [e for e, _ in run(TurnDetector(), floats, chunk_sizes(len(floats), 24, 6))] == whole


def test_two_turns_and_prefix_clamped_to_previous_turn(speech):
    """Two utterances ~430 ms apart with a 200 ms silence duration: two turns; the second turn's
    prefix padding would reach back into the first turn's audio, so it starts where that ended."""
    _, offset = voiced_span_ms(speech)
    first = speech[:int(offset + 20) * 16]  # cut espeak's trailing silence
    x = padded(np.concatenate([first, np.zeros(16 * 400, np.float32), speech]), 16000)
    events = TurnDetector(silence_duration_ms=200, sample_rate=16000).push(x)
    assert [e.type for e in events] == ["speech_started", "speech_stopped"] * 2
    assert events[2].audio_ms == events[1].audio_ms
    assert events[2].detected_ms - 32 - 300 < events[1].audio_ms  # the unclamped start was earlier
    no_prefix = TurnDetector(prefix_padding_ms=0, sample_rate=16000).push(padded(speech, 16000))
    assert no_prefix[0].audio_ms == no_prefix[0].detected_ms - 32  # the first speech frame's start


def test_threshold_and_parameters(speech):
    x = padded(speech, 16000)
    default = TurnDetector(sample_rate=16000).push(x)
    strict = TurnDetector(threshold=0.99, sample_rate=16000).push(x)
    assert strict[0].audio_ms >= default[0].audio_ms
    longer = TurnDetector(silence_duration_ms=800, sample_rate=16000).push(x)
    assert longer[1].audio_ms > default[1].audio_ms
    for bad in ({"threshold": 0.0}, {"threshold": 1.0}, {"prefix_padding_ms": -1}, {"silence_duration_ms": -5}):
        with pytest.raises(ValueError):
            TurnDetector(**bad)
