"""The built-in Moshi demo (`--model moshi-demo`): a tiny random checkpoint in Kyutai's layout,
written deterministically (seed 0, no network, no `moshi` package) to the cache on first use.
Its text and audio are noise.

It has the release's time structure (24 kHz, 1920-sample frames, Mimi's 250-step window, the
LM's 3000-frame context, the acoustic delays, 8 + 8 codebooks) at narrow widths: the LM dim 64
x 2 layers (depformer 32 x 2), Mimi's SEANet 4 filters and a 32-wide transformer, codebooks of
64. Mimi's codebooks are drawn from the spread of its own latents on a fixed synthetic signal
(a random codec's zero codebooks would make every code 0); a sentencepiece tokenizer of 64
pieces is trained on a fixed text (single-threaded: the same bytes every build).
"""
from __future__ import annotations

import io
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from omnivox.demo import NOISE_NOTE, build_lock, cache_root

MOSHI_DEMO_VERSION = 1
MARKER = "OMNIVOX_DEMO"
SEED = 0
FILES = {"moshi_name": "model.safetensors", "mimi_name": "mimi.safetensors", "tokenizer_name": "tokenizer.model",
         "mimi_config_name": "mimi_config.json"}
DEMO_LM = {
    "model_type": "moshi", "dim": 64, "text_card": 64, "existing_text_padding_id": 3, "n_q": 16, "dep_q": 8,
    "card": 64, "num_heads": 4, "num_layers": 2, "hidden_scale": 4.125, "causal": True, "layer_scale": None,
    "context": 3000, "max_period": 10000, "gating": "silu", "norm": "rms_norm_f32", "positional_embedding": "rope",
    "depformer_dim": 32, "depformer_dim_feedforward": 132, "depformer_num_heads": 2, "depformer_num_layers": 2,
    "depformer_layer_scale": None, "depformer_multi_linear": True, "depformer_context": 8,
    "depformer_max_period": 10000, "depformer_gating": "silu", "depformer_pos_emb": "none",
    "depformer_weights_per_step": True, "delays": [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
}
DEMO_MIMI = {  # moshi's mimi config layout, narrowed
    "sample_rate": 24000, "channels": 1, "frame_rate": 12.5,
    "seanet": {"channels": 1, "dimension": 32, "causal": True, "n_filters": 4, "n_residual_layers": 1,
               "activation": "ELU", "compress": 2, "dilation_base": 2, "disable_norm_outer_blocks": 0,
               "kernel_size": 7, "residual_kernel_size": 3, "last_kernel_size": 3, "norm": "none",
               "pad_mode": "constant", "ratios": [8, 6, 5, 4], "true_skip": True},
    "quantizer": {"dimension": 16, "n_q": 8, "bins": 64, "input_dimension": 32, "output_dimension": 32},
    "transformer": {"d_model": 32, "num_heads": 4, "num_layers": 2, "causal": True, "layer_scale": 0.01,
                    "context": 250, "conv_layout": True, "max_period": 10000, "gating": "none",
                    "norm": "layer_norm", "positional_embedding": "rope", "dim_feedforward": 64,
                    "input_dimension": 32, "output_dimensions": [32]},
}
TOKENIZER_TEXT = ("hello there how are you doing today", "i am fine thank you and you",
                  "the weather is nice and warm", "let us talk about music and films",
                  "what do you think about that", "yes no maybe later sure")


def moshi_demo_path() -> Path:
    """The demo folder, built on first use (atomically; once for processes started together)."""
    folder = cache_root() / f"demo-moshi-v{MOSHI_DEMO_VERSION}"
    if (folder / MARKER).exists():
        return folder
    with build_lock(folder):
        if (folder / MARKER).exists():
            return folder
        tmp = Path(tempfile.mkdtemp(prefix=".demo-moshi-", dir=folder.parent))
        try:
            write_demo_checkpoint(tmp)
            (tmp / MARKER).write_text(NOISE_NOTE + "\n")
            if folder.exists():  # a stale folder without the marker
                shutil.rmtree(folder)
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def write_demo_checkpoint(folder: Path, seed: int = SEED, lm: dict = DEMO_LM, mimi: dict | None = DEMO_MIMI) -> Path:
    """config.json, the LM and Mimi safetensors under moshi's keys, mimi_config.json, tokenizer.model.
    Other shapes the same way: `lm` the LM's keyword arguments, `mimi` moshi's mimi config (None: no
    mimi_config.json, Kyutai's released Mimi). The tokenizer has at most 64 pieces (ids past it are
    out of vocabulary, read as no text)."""
    from omnivox.models.moshi.mimi_config import MimiConfig

    folder.mkdir(parents=True, exist_ok=True)
    files = FILES if mimi is not None else {k: v for k, v in FILES.items() if k != "mimi_config_name"}
    (folder / "config.json").write_text(json.dumps(lm | files, indent=1))
    if mimi is not None:
        (folder / FILES["mimi_config_name"]).write_text(json.dumps(mimi, indent=1))
    mimi_cfg = MimiConfig.from_dict(mimi, num_codebooks=8) if mimi is not None else MimiConfig(num_codebooks=8)
    save_file(_lm_weights(seed, lm | files), str(folder / FILES["moshi_name"]))
    save_file(_mimi_weights(seed + 1, mimi_cfg), str(folder / FILES["mimi_name"]))
    (folder / FILES["tokenizer_name"]).write_bytes(_tokenizer(min(64, lm["text_card"])))
    return folder


def _lm_weights(seed: int, config: dict) -> dict[str, torch.Tensor]:
    """Embeddings N(0, 1), projections U(+-2/sqrt(fan_in)) (scaled up so greedy tokens vary), norms 1."""
    from omnivox.models.moshi.config import MoshiConfig
    from omnivox.models.moshi.lm import MoshiLM

    with torch.device("meta"):
        model = MoshiLM(MoshiConfig.from_json(config))
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.state_dict().items():
        if "emb" in name:
            out[name] = torch.randn(p.shape, generator=gen)
        elif p.dim() == 2:
            out[name] = (torch.rand(p.shape, generator=gen) * 2 - 1) * 2 / math.sqrt(p.shape[1])
        else:
            out[name] = torch.ones(p.shape)
    return out


def _mimi_weights(seed: int, cfg) -> dict[str, torch.Tensor]:
    """Our Mimi, randomised (variance-keeping convs, layer scales that matter), its codebooks drawn
    level by level from the residual of its latents on a fixed signal; saved under moshi's names."""
    from omnivox.models.moshi.mimi import Mimi
    from omnivox.models.moshi.mimi_weights import checkpoint_names

    model = Mimi(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layer_scale_1.scale") or name.endswith("layer_scale_2.scale"):
                p.copy_(0.2 + 0.4 * torch.rand(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:  # conv biases
                p.copy_(0.01 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p[0].numel() if "convtr" not in name else p.shape[0] // _groups(model, name) * p.shape[2]
                p.copy_(torch.randn(p.shape, generator=gen) * 1.3 / math.sqrt(fan_in))
        for p in model.decoder.model[-1].parameters():  # the output conv: speech-like levels (peak ~1, not ~10)
            p.mul_(0.1)
        tables = _calibrate(model, gen)
    names = checkpoint_names(model)
    state = {theirs: model.state_dict()[ours].contiguous() for ours, theirs in names.items()}
    for prefix, levels in tables.items():
        for i, table in enumerate(levels):
            usage = 0.5 + torch.rand(table.shape[0], generator=gen)
            base = f"quantizer.{prefix}.vq.layers.{i}._codebook"
            state[f"{base}.embedding_sum"] = table * usage[:, None]
            state[f"{base}.cluster_usage"] = usage
            state[f"{base}._initialized"] = torch.ones(1)
    return state


def _groups(model, name: str) -> int:
    module = model.get_submodule(name.rsplit(".", 1)[0])
    return getattr(module, "groups", 1)


def _calibrate(model, gen: torch.Generator) -> dict[str, list[torch.Tensor]]:
    """Per RVQ, per level: a Gaussian codebook with the residual's mean and spread."""
    from omnivox.layers.streaming_conv import stream_step

    frames, f = 25, model.frame_size
    t = torch.arange(frames * f) / model.cfg.sample_rate
    signal = 0.3 * torch.sin(2 * math.pi * (120 + 400 * t) * t) + 0.05 * torch.randn(t.shape, generator=gen)
    state = model.init_encoder_state(1)
    skip = torch.zeros(1, dtype=torch.long)
    x, _ = stream_step(model.encoder.model, state.convs, signal[None, None], skip)
    x = model.encoder_transformer.step(x, state.transformer)
    if model.downsample is not None:
        x, _ = model.downsample.conv.step(x, state.downsample, skip)
    tables = {}
    for prefix, rvq in (("rvq_first", model.quantizer.rvq_first), ("rvq_rest", model.quantizer.rvq_rest)):
        levels, bins, dim = rvq.codebooks.shape
        residual = rvq.input_proj(x).transpose(1, 2).reshape(-1, dim)
        tables[prefix] = []
        for _ in range(levels):
            table = residual.mean(0) + residual.std(0) * torch.randn(bins, dim, generator=gen)
            tables[prefix].append(table)
            residual = residual - table[torch.cdist(residual, table).argmin(-1)]
    return tables


def _tokenizer(vocab: int) -> bytes:
    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TOKENIZER_TEXT * 4), model_writer=out, vocab_size=vocab, model_type="bpe",
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, num_threads=1, minloglevel=2, character_coverage=1.0,
        normalization_rule_name="identity")
    return out.getvalue()
