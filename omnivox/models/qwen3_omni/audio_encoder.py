"""AuT audio encoder (`thinker.audio_tower`, spec section 5.3).

log-mel clips -> 100-frame chunks -> conv stem (time / 8) -> per-chunk sinusoid positions ->
packed tokens -> encoder layers with block-diagonal attention over 104-token windows per clip ->
ln_post -> proj1 -> GELU -> proj2. Module names equal the on-disk names under
`thinker.audio_tower.`; the sinusoid table is a recomputed, non-persistent buffer.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from omnivox.audio.mel import conv_stem_len
from omnivox.models.qwen3_omni.config import AudioEncoderConfig

# Chunks per conv-stem call: bounds the stem's activation memory for very long audio.
CONV_BATCH = 500


def sinusoid_table(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Whisper-style [sin | cos] positions, built in float32 like the reference. # [length, channels]"""
    half = channels // 2
    log_step = math.log(max_timescale) / (half - 1)
    inv_timescales = torch.exp(-log_step * torch.arange(half).float())  # [half]
    angles = torch.arange(length)[:, None] * inv_timescales[None, :]  # [length, half]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


class AudioAttention(nn.Module):
    """Bidirectional multi-head attention inside each window (biases on q, k, v and out)."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """x [W, S, D] (one row per window); key_mask [W, 1, 1, S] True where the key is real."""
        w, s, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(w, s, self.num_heads, d // self.num_heads).transpose(1, 2)  # [W, H, S, hd]

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)),
                                             heads(self.v_proj(x)), attn_mask=key_mask)
        return self.out_proj(out.transpose(1, 2).reshape(w, s, d))


class AudioEncoderLayer(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then h + fc2(gelu(fc1(ln(h))))."""

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.self_attn = AudioAttention(cfg.d_model, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_mask)
        x = x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:  # NOTE: the reference clamps fp16 activations after every layer
            limit = torch.finfo(torch.float16).max - 1000
            x = x.clamp(-limit, limit)
        return x


class AudioEncoder(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.cfg = cfg
        ch = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, ch, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(ch, ch, 3, 2, padding=1)
        self.conv_out = nn.Linear(ch * conv_stem_len(cfg.num_mel_bins), cfg.d_model, bias=False)
        self.register_buffer("positional_embedding",
                             sinusoid_table(cfg.max_source_positions, cfg.d_model), persistent=False)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)

    def reset_buffers(self) -> None:
        """Recompute the sinusoid table (after building on the meta device and `to_empty`).

        Built on the CPU in float32 like the reference, then moved; forward casts it to the activations.
        """
        table = sinusoid_table(self.cfg.max_source_positions, self.cfg.d_model)
        self.positional_embedding = table.to(self.proj2.weight.device)

    @property
    def chunks_per_window(self) -> int:
        """The reference attention window in chunks of 2 * n_window frames (8 = 8 s for the real model)."""
        return self.cfg.n_window_infer // (2 * self.cfg.n_window)

    def forward(self, features: list[torch.Tensor], window_chunks: int | None = None) -> torch.Tensor:
        """One `[n_mels, T_i]` log-mel tensor per clip -> packed tokens `[sum_i num_audio_tokens(T_i), output_dim]`.

        Contract: tokens come out in clip order, then time order. Clips with T_i = 0 yield nothing.
        `window_chunks` overrides the attention window (in chunks; default `chunks_per_window`), as
        realtime sessions do (see `audio_stream.AudioStreamEncoder`).
        NOTE: like the reference, every chunk is zero-padded to the longest chunk of the call before
        the conv stem, and what the stem computes on that padding reaches the last stem outputs of a
        shorter chunk (then, through attention, its whole window). A clip's tokens are therefore
        batch-independent only while some clip of the call has >= 2 * n_window frames (every chunk
        is then padded to the full chunk length).
        """
        features = [f for f in features if f.shape[-1] > 0]
        if not features:
            return self.proj2.weight.new_zeros(0, self.cfg.output_dim)
        chunks = [c for f in features for c in f.split(2 * self.cfg.n_window, dim=-1)]
        chunk_tokens = [conv_stem_len(c.shape[-1]) for c in chunks]
        x = self.embed_chunks(chunks, chunk_tokens)  # [N_tok, D]
        # Window rule of the reference: (tokens of the longest chunk in the call) x n_window_infer / chunk.
        window = max(chunk_tokens) * (window_chunks or self.chunks_per_window)
        lengths = _window_lengths(self._clip_tokens(features, chunk_tokens), window)
        return self.encode_windows(x, lengths)

    def encode_windows(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Encoder layers + head over packed embedded tokens cut into attention windows.

        x [N, d_model] (from `embed_chunks`), sum(lengths) == N -> [N, output_dim]; each run of
        `lengths[i]` consecutive rows attends only within itself.
        """
        xw, valid = _to_windows(x, lengths)  # [W, S, D], [W, S]
        key_mask = None if min(lengths) == max(lengths) else valid[:, None, None, :]
        for layer in self.layers:
            xw = layer(xw, key_mask)
        x = xw[valid]  # [N_tok, D]
        return self.proj2(F.gelu(self.proj1(self.ln_post(x))))

    def _clip_tokens(self, features: list[torch.Tensor], chunk_tokens: list[int]) -> list[int]:
        counts, i = [], 0
        for f in features:
            n_chunks = -(-f.shape[-1] // (2 * self.cfg.n_window))
            counts.append(sum(chunk_tokens[i:i + n_chunks]))
            i += n_chunks
        return counts

    def embed_chunks(self, chunks: list[torch.Tensor], chunk_tokens: list[int]) -> torch.Tensor:
        """Conv stem + conv_out + per-chunk positions; keeps each chunk's valid tokens. # [N_tok, D]

        Chunks `[n_mels, L_i]` are zero-padded to the longest before the stem; chunk i keeps its
        first `chunk_tokens[i]` outputs (`conv_stem_len` of its unpadded length)."""
        w = self.conv2d1.weight
        padded = nn.utils.rnn.pad_sequence([c.T for c in chunks], batch_first=True)  # [N, L_max, n_mels]
        padded = padded.transpose(1, 2).unsqueeze(1).to(device=w.device, dtype=w.dtype)  # [N, 1, n_mels, L_max]
        stem = torch.cat([self._stem(part) for part in padded.split(CONV_BATCH)], dim=0)  # [N, C, F', t]
        n, c, f, t = stem.shape
        x = self.conv_out(stem.permute(0, 3, 1, 2).reshape(n, t, c * f))  # [N, t, D]
        x = x + self.positional_embedding[:t].to(x.dtype)
        lens = torch.tensor(chunk_tokens, device=x.device)
        keep = torch.arange(t, device=x.device)[None, :] < lens[:, None]  # [N, t]
        return x[keep]

    def _stem(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv2d1(x))
        x = F.gelu(self.conv2d2(x))
        return F.gelu(self.conv2d3(x))


def _window_lengths(clip_tokens: list[int], window: int) -> list[int]:
    """Each clip's tokens cut into runs of `window`, the last run keeping the remainder."""
    lengths = []
    for n in clip_tokens:
        lengths += [window] * (n // window) + ([n % window] if n % window else [])
    return lengths


def _to_windows(x: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay consecutive runs of packed rows out as padded windows.

    x [N, D], sum(lengths) == N -> ([W, S_max, D], valid [W, S_max]); `out[valid]` restores x.
    """
    lens = torch.tensor(lengths, device=x.device)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(max(lengths), device=x.device)[None, :]  # [1, S_max]
    valid = pos < lens[:, None]  # [W, S_max]
    index = torch.where(valid, starts[:, None] + pos, torch.zeros_like(pos))
    return x[index], valid
