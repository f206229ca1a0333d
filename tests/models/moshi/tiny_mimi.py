"""A tiny random Mimi built with moshi's own classes (the reference), saved as Kyutai lays it out:
safetensors under moshi's state-dict names plus a mimi config JSON.

A random MimiModel is degenerate (zero codebooks, layer scales of 0.01): the codebooks here are
drawn from the latents of calibration audio, level by level on the residual (as k-means starts),
and the transformers' layer scales are raised so they matter.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

TINY_CONTEXT = 8  # transformer steps = 4 frames: a test crosses the window within 5 frames


def tiny_mimi_config() -> dict:
    from moshi.models import loaders

    cfg = copy.deepcopy(loaders._mimi_config)
    cfg["seanet"].update(n_filters=4, dimension=32)  # released ratios: hop 960, 2 steps per frame
    cfg["quantizer"].update(dimension=16, n_q=16, bins=64, input_dimension=32, output_dimension=32)
    cfg["transformer"].update(d_model=32, num_heads=4, num_layers=2, context=TINY_CONTEXT, dim_feedforward=64,
                              input_dimension=32, output_dimensions=[32])
    return cfg


def build_reference(calibration: torch.Tensor, seed: int = 0, num_codebooks: int = 8):
    """moshi's MimiModel (eval, fp32, CPU) with sensible random weights; calibration [N, 1, L] audio."""
    from moshi.models import loaders

    torch.manual_seed(seed)
    model = loaders.get_mimi(None, tiny_mimi_config(), num_codebooks=num_codebooks)
    with torch.no_grad():
        _rescale_convs(model)
        for name, p in model.named_parameters():
            if name.endswith("layer_scale_1.scale") or name.endswith("layer_scale_2.scale"):
                p.uniform_(0.2, 0.6)
            elif "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        _calibrate_codebooks(model, calibration)
    return model.eval()


def _rescale_convs(model) -> None:
    """Variance-keeping conv weights and small biases: PyTorch's default init shrinks the signal
    threefold per conv, and the decoder would only play its biases whatever the codes."""
    for m in model.modules():
        if isinstance(m, torch.nn.Conv1d):
            fan_in = m.weight.shape[1] * m.weight.shape[2]
        elif isinstance(m, torch.nn.ConvTranspose1d):
            fan_in = m.weight.shape[0] // m.groups * m.weight.shape[2] // m.stride[0]
        else:
            continue
        m.weight.normal_(0.0, 1.3 / fan_in ** 0.5)
        if m.bias is not None:
            m.bias.mul_(0.1)


def _calibrate_codebooks(model, audio: torch.Tensor) -> None:
    """Level by level: Gaussian codebooks with the residual's mean and spread (never the
    calibration latents themselves, so no residual collapses to rounding noise)."""
    gen = torch.Generator().manual_seed(1)
    latent = model._encode_to_unquantized_latent(audio)  # [N, C, T], one shot
    for rvq in (model.quantizer.rvq_first, model.quantizer.rvq_rest):
        residual = rvq.input_proj(latent).transpose(1, 2).reshape(-1, rvq.dimension)
        for layer in rvq.vq.layers:
            book = layer._codebook
            noise = torch.randn(book.codebook_size, rvq.dimension, generator=gen)
            emb = residual.mean(0) + residual.std(0) * noise
            usage = 0.5 + torch.rand(book.codebook_size, generator=gen)
            book.cluster_usage.copy_(usage)
            book.embedding_sum.copy_(emb * usage[:, None])
            book._initialized.fill_(1.0)
            book.register_buffer("_embedding", None, persistent=False)  # drop moshi's cached table
            residual = residual - layer.decode(layer.encode(residual.T[None]))[0].T


def save_reference(model, folder: Path, weights: str = "mimi.safetensors", config: str = "mimi_config.json") -> Path:
    """The Moshi checkpoint layout's Mimi part: config.json names the files."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / weights))
    (folder / config).write_text(json.dumps(tiny_mimi_config()))
    (folder / "config.json").write_text(json.dumps({"mimi_name": weights, "mimi_config_name": config,
                                                    "n_q": 16, "dep_q": 8}))
    return folder
