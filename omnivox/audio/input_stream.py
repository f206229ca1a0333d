"""Causal audio input for realtime sessions: pcm chunks in, 16 kHz samples and log-mel frames out.

- `StreamResampler`: the polyphase Kaiser FIR of `audio.io.resample` (scipy's `resample_poly`
  default) run on a stream. Output sample m is emitted once the input its filter reaches has
  arrived (a look-ahead of 10 * max(up, down) / up input samples: 15 samples, 0.6 ms, for
  24 -> 16 kHz), so the stream is aligned with the offline resampler, not delayed by the filter.
  `flush()` finishes with the zeros `resample_poly` assumes past the end: the whole stream then
  equals `audio.io.resample` of the concatenated input up to float64 summation order.
- `CausalLogMel`: the log-mel of `audio.mel.log_mel` with two changes that make it causal.
  (a) The (peak - 8) floor uses a running peak (the largest log-mel value seen so far in the
  stream, this frame included) or a fixed one, instead of the whole clip's maximum.
  (b) A frame is emitted only when its whole 400-sample window has arrived: no reflect padding
  at the end. The start keeps the reference's reflect padding (frame 0's left half mirrors
  samples 1..200, which lie inside its own window; frame 1's mirrors 1..40), so frame 0 comes
  out after 201 samples and frame t after t * 160 + 200, each equal to the reference's up to
  the floor. `flush()` ends a clip: when len % 160 < 40 the reference (len // 160 frames) has
  one frame more than the complete windows give; flush computes it with zeros past the end
  instead of a reflection.

NOTE (chunk invariance): every output value is computed by the same IEEE operations in the same
order whatever chunk it arrives in, so outputs are bit-identical for any chunking. BLAS does not
promise that (a one-column product rounds differently from a wide one), so the resampler
accumulates its taps one at a time and the mel projection is a fixed-order sum over each
filter's few non-zero FFT bins (at most 9) instead of a matmul. Against `log_mel`'s matmul this
reorders the sum: about 1e-7 relative on the mel power. torch.stft's FFT is per frame and gives
the same bits however many frames one call holds (checked, not promised: the chunking tests pin it).
"""
from __future__ import annotations

from functools import lru_cache
from math import gcd

import numpy as np
import torch
from scipy.signal import firwin

from omnivox.audio.mel import HOP_LENGTH, N_FFT, N_MELS, mel_filters
from omnivox.errors import InputError

FLOOR_DB = 8.0  # the reference floor: log10 power more than 8 below the peak is clamped
_PAD = N_FFT // 2  # centred framing: frame t covers x[t * 160 - 200 : t * 160 + 200]


def pcm16_to_float(data: bytes) -> np.ndarray:
    """Little-endian signed 16-bit PCM -> float64 in [-1, 1) (x / 32768, as soundfile reads it)."""
    if len(data) % 2:
        raise InputError(f"pcm16 data must hold whole samples, got {len(data)} bytes")
    return np.frombuffer(data, dtype="<i2").astype(np.float64) / 32768.0


def _as_samples(samples: np.ndarray) -> np.ndarray:
    x = np.asarray(samples)
    if x.ndim != 1:
        raise InputError(f"expected a 1-D mono chunk, got shape {tuple(x.shape)}")
    if x.dtype == np.int16:
        return x.astype(np.float64) / 32768.0
    x = x.astype(np.float64)
    if not np.isfinite(x).all():
        raise InputError("audio chunk contains NaN or infinite samples")
    return x


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, np.float32)


class StreamResampler:
    """Rational-rate polyphase resampler with carried input history. float64 inside, float32 out.

    Contract: concatenating every `push` (and `push_pcm16`) output, then `flush()`, gives
    ceil(N * target / orig) samples equal to `audio.io.resample` of the whole input (within float64
    round-off before the float32 cast), bit-identical for any way of cutting the input into chunks.
    """

    def __init__(self, orig_sr: int, target_sr: int = 16000):
        if orig_sr <= 0 or target_sr <= 0:
            raise InputError(f"sample rates must be positive, got {orig_sr} -> {target_sr}")
        g = gcd(int(orig_sr), int(target_sr))
        self.orig_sr, self.target_sr = int(orig_sr), int(target_sr)
        self.up, self.down = self.target_sr // g, self.orig_sr // g
        self._half = 10 * max(self.up, self.down)  # resample_poly's half filter length
        if self.passthrough:  # equal rates: samples pass unchanged (as resample_poly returns a copy)
            h = np.ones(1)
        else:
            h = firwin(2 * self._half + 1, 1.0 / max(self.up, self.down), window=("kaiser", 5.0)) * self.up
        self._taps = -(-len(h) // self.up)
        h = np.concatenate([h, np.zeros(self._taps * self.up - len(h))])
        self._phases = np.ascontiguousarray(h.reshape(self._taps, self.up).T)  # [up, taps]: h[r + j * up]
        self._buf = np.zeros(self._taps - 1)  # holds x[_start : samples_in]; zeros before the stream
        self._start = -(self._taps - 1)
        self._odd = b""  # half a pcm16 sample carried to the next chunk
        self.samples_in = 0
        self.samples_out = 0
        self._done = False

    @property
    def passthrough(self) -> bool:
        return self.up == self.down == 1

    def push_pcm16(self, data: bytes) -> np.ndarray:
        """Resample a chunk of little-endian pcm16 bytes (any length; an odd byte is carried)."""
        data = self._odd + bytes(data)
        whole = len(data) - len(data) % 2
        data, self._odd = data[:whole], data[whole:]
        step = 2 * self.orig_sr  # one window of bytes at a time (see `push`)
        return _joined([self.push(pcm16_to_float(data[i:i + step])) for i in range(0, max(whole, 1), step)])

    def push(self, samples: np.ndarray) -> np.ndarray:
        """Resample a chunk (float in [-1, 1] or int16) -> the newly final output samples. # [n] float32

        NOTE: a long chunk is taken one second of input at a time: the filter's work arrays scale
        with what one step emits (~31 float64 per output sample), so a whole 15 MiB append at once
        would need ~1 GB. The output is the same for any cutting (the contract above)."""
        if self._done:
            raise RuntimeError("StreamResampler.push after flush")
        x, step = np.asarray(samples), self.orig_sr
        if x.ndim == 1 and len(x) > step:
            return _joined([self._push(x[i:i + step]) for i in range(0, len(x), step)])
        return self._push(x)

    def _push(self, samples: np.ndarray) -> np.ndarray:
        x = _as_samples(samples)
        self.samples_in += len(x)
        if self.passthrough:
            self.samples_out += len(x)
            return x.astype(np.float32)
        self._buf = np.concatenate([self._buf, x])
        ready = (self.up * self.samples_in - 1 - self._half) // self.down + 1  # outputs whose taps all arrived
        return self._emit(max(ready, self.samples_out))

    def flush(self) -> np.ndarray:
        """End of stream: the remaining outputs, with zeros past the end. # [n] float32"""
        if self._odd:
            raise InputError("pcm16 stream ended in the middle of a sample (odd byte count)")
        self._done = True
        if self.passthrough:
            return np.zeros(0, np.float32)
        total = -(-self.samples_in * self.up // self.down)
        if total > self.samples_out:
            last = ((total - 1) * self.down + self._half) // self.up  # newest input the last output reads
            self._buf = np.concatenate([self._buf, np.zeros(max(0, last + 1 - self.samples_in))])
        return self._emit(max(total, self.samples_out))

    def _emit(self, end: int) -> np.ndarray:
        m = np.arange(self.samples_out, end)
        p = m * self.down + self._half
        base, phase = p // self.up - self._start, p % self.up  # index of x[p // up] in _buf; its phase
        coef = self._phases[phase]  # [M, taps]
        y = coef[:, 0] * self._buf[base]
        for j in range(1, self._taps):  # NOTE: one tap at a time keeps the summation order fixed
            y += coef[:, j] * self._buf[base - j]
        self.samples_out = end
        nxt = (end * self.down + self._half) // self.up - (self._taps - 1)  # oldest input still needed
        cut = min(max(0, nxt - self._start), len(self._buf))
        self._buf, self._start = self._buf[cut:], self._start + cut
        return y.astype(np.float32)


@lru_cache(maxsize=1)
def _hann() -> torch.Tensor:
    return torch.hann_window(N_FFT)  # periodic, as the reference


@lru_cache(maxsize=1)
def _sparse_filters() -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 mel filters as (bins [K, n_mels] long, weights [K, n_mels]): filter m is
    sum_k weights[k, m] * power[bins[k, m]], its non-zero bins in rising order, zero-padded to K."""
    dense = mel_filters().astype(np.float32)  # [F, n_mels], cast like the reference
    rows = [np.nonzero(dense[:, m])[0] for m in range(dense.shape[1])]
    k = max(len(r) for r in rows)
    bins = np.zeros((k, dense.shape[1]), np.int64)
    weights = np.zeros((k, dense.shape[1]), np.float32)
    for m, r in enumerate(rows):
        bins[:len(r), m] = r
        weights[:len(r), m] = dense[r, m]
    return torch.from_numpy(bins), torch.from_numpy(weights)


def _mel_power(power: torch.Tensor) -> torch.Tensor:
    """[T, F] power spectrum -> [T, n_mels] mel power, in a fixed order per value."""
    bins, weights = _sparse_filters()
    acc = power[:, bins[0]] * weights[0]
    for k in range(1, bins.shape[0]):
        acc = acc + power[:, bins[k]] * weights[k]  # NOTE: separate mul and add (no fused rounding)
    return acc


class CausalLogMel:
    """Streaming 128-bin log-mel of 16 kHz mono audio (one clip), frames emitted as they become final.

    peak, running: the floor is clamp(log_spec, peak_t - 8) with
      - running=True, peak=None (default): peak_t = the largest log10 mel value of frames 0..t;
      - running=True, peak=P: the same, but never below P (a prior, e.g. the previous turn's peak);
      - running=False, peak=P: a fixed floor at P - 8.
    `peak` is in the reference's log10-power units (before the (x + 4) / 4 map).
    Why running by default: a fixed peak ties the floor to an input level (too high and a quiet
    talker's speech is clamped away, too low and it is the same as no floor), while the running
    peak reaches the clip's own within the first loud syllable and only leaves the frames before
    it less clamped than the reference. A session can pass the last turn's `peak` as the prior.
    """

    def __init__(self, peak: float | None = None, running: bool = True):
        if not running and peak is None:
            raise ValueError("a fixed floor (running=False) needs a peak")
        self.running = running
        self._peak = np.float32(-np.inf if peak is None else peak)  # host data: a session keeps no tensor
        self._head = np.zeros(0, np.float32)  # samples before the reflect prefix can be built
        self._buf: np.ndarray | None = None  # padded signal from padded index _start on
        self._start = 0
        self.samples_in = 0
        self.frames_out = 0
        self._done = False

    @property
    def peak(self) -> float | None:
        """The peak the floor uses now (None before any frame of a running floor without prior)."""
        p = float(self._peak)
        return None if p == -np.inf else p

    def push(self, samples: np.ndarray) -> torch.Tensor:
        """Append 16 kHz samples -> the newly final frames. # [n_mels, t] float32"""
        if self._done:
            raise RuntimeError("CausalLogMel.push after flush")
        x = _as_samples(samples).astype(np.float32)
        self.samples_in += len(x)
        if self._buf is None:
            self._head = np.concatenate([self._head, x])
            if len(self._head) <= _PAD:
                return self._frames(0)
            # reflect padding at the start, as the reference: padded[i] = x[200 - i] for i < 200
            self._buf, self._head = np.concatenate([self._head[_PAD:0:-1], self._head]), None
        else:
            self._buf = np.concatenate([self._buf, x])
        ready = (self.samples_in + _PAD - N_FFT) // HOP_LENGTH + 1  # frames whose window ends in the input
        return self._frames(ready)

    def flush(self) -> torch.Tensor:
        """End of the clip: frames up to the reference's count (len // 160), zeros past the end."""
        self._done = True
        total = self.samples_in // HOP_LENGTH
        if self._buf is None or total <= self.frames_out:
            return self._frames(self.frames_out)
        need = (total - 1) * HOP_LENGTH + N_FFT - self._start  # padded samples the last frame reads
        self._buf = np.concatenate([self._buf, np.zeros(max(0, need - len(self._buf)), np.float32)])
        return self._frames(total)

    def _frames(self, end: int) -> torch.Tensor:
        t0 = self.frames_out
        if end <= t0:
            return torch.zeros(N_MELS, 0)
        lo = t0 * HOP_LENGTH - self._start
        seg = torch.from_numpy(np.ascontiguousarray(self._buf[lo:lo + (end - t0 - 1) * HOP_LENGTH + N_FFT]))
        spec = torch.stft(seg, N_FFT, HOP_LENGTH, window=_hann(), center=False, return_complex=True)
        power = (spec.abs() ** 2).T.contiguous()  # [T, F]
        log_spec = torch.clamp(_mel_power(power), min=1e-10).log10().T  # [n_mels, T]
        if self.running:
            peaks = torch.cummax(log_spec.amax(dim=0), dim=0).values  # [T]
            peaks = torch.maximum(peaks, torch.tensor(self._peak))
            self._peak = peaks[-1].numpy().copy()
        else:
            peaks = torch.tensor(self._peak).expand(end - t0)
        log_spec = torch.maximum(log_spec, (peaks - FLOOR_DB)[None, :])
        self.frames_out = end
        keep = end * HOP_LENGTH - self._start  # frame `end` starts here in the padded signal
        self._buf, self._start = self._buf[keep:], self._start + keep
        return ((log_spec + 4.0) / 4.0).contiguous()


def turn_features(pcm: np.ndarray, rate: int = 24000, peak: float | None = None) -> tuple[torch.Tensor, float | None]:
    """A whole realtime turn through the session's causal front end: (log-mel [128, T], the floor's
    peak after it). Equal to what `api.realtime.audio_input.TurnAudio` computes from the same
    samples in any pieces."""
    resampler = StreamResampler(rate, 16000)
    wave = np.concatenate([resampler.push(pcm), resampler.flush()])
    mel = CausalLogMel(peak=peak)
    return torch.cat([mel.push(wave), mel.flush()], dim=1), mel.peak
