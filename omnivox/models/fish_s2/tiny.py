"""A tiny random S2 checkpoint in the OFFICIAL layout (spec 2.1): config.json, two safetensors
shards + index (fused wqkv, no lm_head), codec.pth with both weight-norm styles and stale
buffers, codec_config.json, and a byte-level BPE tokenizer.json whose special tokens carry the
real names (`<|im_start|>`, `<|voice|>`, `<|semantic:i|>`, ...) at the tiny ids.

Seeded; weights are scaled so every block changes the output (norm gains and layer scales
near 1, not the training init's tiny values).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from omnivox.models.fish_s2.codec import FishCodec
from omnivox.models.fish_s2.codec_layers import StridedCausalConv
from omnivox.layers.streaming_conv import CausalConv1d, CausalConvTranspose1d
from omnivox.models.fish_s2.config import (ARConfig, CodecConfig, CodecTransformerConfig, FishConfig,
                                           codec_config_to_json)
from omnivox.models.fish_s2.fast_ar import FastAR
from omnivox.models.fish_s2.slow_ar import SlowAR

TINY_SPECIALS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|voice|>": 3, "<|pad|>": 4}

TINY_CONFIG = FishConfig(
    text=ARConfig(vocab_size=512, n_layer=2, dim=64, n_head=4, n_local_heads=2, head_dim=16,
                  intermediate_size=128, rope_base=1e6, norm_eps=1e-6, max_seq_len=512, qk_norm=True,
                  tie_word_embeddings=True),
    fast=ARConfig(vocab_size=64, n_layer=2, dim=64, n_head=4, n_local_heads=2, head_dim=16,
                  intermediate_size=128, rope_base=1e6, norm_eps=1e-6, max_seq_len=5, qk_norm=False),
    codebook_size=64, num_codebooks=4, eos_id=2, pad_id=4, semantic_begin=256, semantic_end=319)

_TINY_TF = CodecTransformerConfig(n_layer=1, dim=32, n_head=2, head_dim=16, intermediate_size=96, window=8)
TINY_CODEC = CodecConfig(sample_rate=44100, encoder_dim=8, encoder_rates=(2, 2), decoder_dim=32,
                         decoder_rates=(2, 2), codebook_dim=4, semantic_codebook_size=64, codebook_size=16,
                         n_residual=3, downsample_factor=(2, 2), encoder_transformer=_TINY_TF,
                         pre_module=_TINY_TF, post_module=_TINY_TF)


def randomize(module: nn.Module, gen: torch.Generator) -> None:
    """Seeded weights with O(1) effect per block: Linear/Conv ~ U(+-1/sqrt(fan_in)), embeddings
    N(0, 0.3) (codec codebooks N(0, 1)), norm weights / layer scales / Snake alphas ~ 1 + U(-0.3, 0.3) (alphas positive).

    Drawn per checkpoint tensor (`state_dict()` names and shapes, merged parameters as their
    parts), so the values do not depend on how the modules merge them. Values are drawn on the
    generator's device (a CUDA generator fills a full-size model without a host copy)."""
    values = {}
    for name, p in module.state_dict().items():
        leaf = name.rsplit(".", 1)[-1]
        kw = dict(generator=gen, device=gen.device)
        if leaf in ("gamma", "alpha") or "norm" in name and leaf == "weight":
            values[name] = 1.0 + 0.6 * (torch.rand(p.shape, **kw) - 0.5)
        elif p.dim() == 1:
            values[name] = 0.2 * torch.randn(p.shape, **kw)
        elif "embeddings" in name:  # also the tied head: std 0.3 keeps logits O(1), not one-hot
            values[name] = 0.3 * torch.randn(p.shape, **kw)
        elif "codebook" in name:
            values[name] = torch.randn(p.shape, **kw)
        else:
            fan_in = p[0].numel()
            values[name] = (torch.rand(p.shape, **kw) * 2 - 1) / fan_in ** 0.5
    module.load_state_dict(values)


def build_tiny_llm(seed: int = 0, cfg: FishConfig = TINY_CONFIG) -> tuple[SlowAR, FastAR]:
    gen = torch.Generator().manual_seed(seed)
    slow, fast = SlowAR(cfg), FastAR(cfg)
    randomize(slow, gen)
    randomize(fast, gen)
    return slow.eval(), fast.eval()


def build_tiny_codec(seed: int = 0, cfg: CodecConfig = TINY_CODEC) -> FishCodec:
    codec = FishCodec(cfg)
    randomize(codec, torch.Generator().manual_seed(seed + 1))
    return codec.eval()


def llm_tensors(slow: SlowAR, fast: FastAR) -> dict[str, torch.Tensor]:
    """On-disk names: text_model.model.*, audio_decoder.* (codebook_embeddings stored there)."""
    out = {}
    for k, t in slow.state_dict().items():
        name = ("audio_decoder." + k) if k.startswith("codebook_embeddings") else ("text_model.model." + k)
        out[name] = t.detach().clone().contiguous()
    out.update({"audio_decoder." + k: t.detach().clone().contiguous() for k, t in fast.state_dict().items()})
    return out


def weight_norm_conv_names(codec: FishCodec) -> list[str]:
    """The inner `.conv` of every causal conv wrapper in encoder and decoder (new-style weight norm)."""
    wrappers = (CausalConv1d, StridedCausalConv, CausalConvTranspose1d)
    return [f"{name}.conv" for name, m in codec.named_modules()
            if isinstance(m, wrappers) and name.startswith(("encoder.", "decoder."))]


def raw_codec_state(codec: FishCodec, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The codec's weights in codec.pth's raw form: (g, v) pairs whose fold is NOT v itself,
    plus stale freqs_cis / causal_mask buffers."""
    sd = {k: t.detach().clone() for k, t in codec.state_dict().items()}
    new_style = set(weight_norm_conv_names(codec))
    old_style = {f"{n}.{p}" for n, m in codec.named_modules() if n.endswith("quantizers.0") or ".quantizers." in n
                 for p in ("in_proj", "out_proj") if hasattr(m, p)}
    out: dict[str, torch.Tensor] = {}
    for key, w in sd.items():
        base = key[: -len(".weight")] if key.endswith(".weight") else None
        if base in new_style or base in old_style:
            v = w * (1.0 + 0.5 * torch.rand(w.shape[0], *([1] * (w.dim() - 1)), generator=gen))
            g = torch.rand(w.shape[0], *([1] * (w.dim() - 1)), generator=gen) + 0.5
            if base in new_style:
                out[base + ".parametrizations.weight.original0"], out[base + ".parametrizations.weight.original1"] = g, v
            else:
                out[base + ".weight_g"], out[base + ".weight_v"] = g, v
        else:
            out[key] = w
    last = len(codec.cfg.encoder_rates)
    for prefix in (f"encoder.block.{last}.block.5", "quantizer.pre_module", "quantizer.post_module"):
        out[prefix + ".freqs_cis"] = torch.randn(64, 8, 2, generator=gen).to(torch.bfloat16)
        out[prefix + ".causal_mask"] = torch.ones(64, 64, dtype=torch.bool).tril()
    return out


def write_tokenizer(folder: Path, cfg: FishConfig = TINY_CONFIG) -> None:
    """Byte-level BPE (no merges) over the free ids; specials at the tiny ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = dict(TINY_SPECIALS)
    specials.update({f"<|semantic:{i}|>": cfg.semantic_begin + i for i in range(cfg.codebook_size)})
    used = set(specials.values())
    free = (i for i in range(cfg.text.vocab_size) if i not in used)
    vocab = {ch: next(free) for ch in sorted(pre_tokenizers.ByteLevel.alphabet())}  # sorted: alphabet() order varies per call
    vocab.update(specials)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s, _ in sorted(specials.items(), key=lambda kv: kv[1])])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|pad|>"}))


def write_tiny_checkpoint(folder: str | Path, seed: int = 0, codec_wrap: str | None = None,
                          codec: CodecConfig = TINY_CODEC) -> Path:
    """Write the tiny official-layout checkpoint into `folder` and return it.

    codec_wrap: None (plain state dict), "state_dict" (under a state_dict key) or "generator"
    (keys prefixed `generator.`), the variants the real loader must accept. codec: the codec's
    sizes (the built-in demo passes one with the released 2048-sample hop).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG.to_hf(), indent=1))
    tensors = llm_tensors(*build_tiny_llm(seed))
    shards = {"model-00001-of-00002.safetensors": {k: v for k, v in tensors.items() if k.startswith("text_model.")},
              "model-00002-of-00002.safetensors": {k: v for k, v in tensors.items() if k.startswith("audio_decoder.")}}
    weight_map = {}
    for fname, part in shards.items():
        save_file(part, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    raw = raw_codec_state(build_tiny_codec(seed, codec), torch.Generator().manual_seed(seed + 2))
    if codec_wrap == "generator":
        raw = {"generator." + k: v for k, v in raw.items()}
    elif codec_wrap == "state_dict":
        raw = {"state_dict": raw}
    torch.save(raw, str(folder / "codec.pth"))
    (folder / "codec_config.json").write_text(json.dumps(codec_config_to_json(codec)))
    write_tokenizer(folder)
    return folder
