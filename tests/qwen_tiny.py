"""Tiny random Qwen3-Omni checkpoints built with transformers (the parity reference).

Every parameter gets explicit seeded values scaled so each layer moves the signal:
transformers leaves the talker experts uninitialised and most blocks near-identity
(spec section 13, pitfalls 14 and 15), which would make parity vacuous.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from omnivox.models.qwen3_omni.demo import TINY_CONFIG
from omnivox.models.qwen3_omni.random_init import randomize_

# The real released token ids (spec 3.1) on the demo model's tiny sizes (spec 2.2).
REAL_IDS = {
    "im_start_token_id": 151644, "im_end_token_id": 151645,
    "system_token_id": 8948, "user_token_id": 872, "assistant_token_id": 77091,
    "tts_pad_token_id": 151671, "tts_bos_token_id": 151672, "tts_eos_token_id": 151673,
    "thinker_config": {
        "audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656,
        "audio_start_token_id": 151669, "audio_end_token_id": 151670,
        "vision_start_token_id": 151652, "vision_end_token_id": 151653, "user_token_id": 872,
        "text_config": {"vocab_size": 152064},
    },
    "talker_config": {
        "audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656,
        "audio_start_token_id": 151669, "vision_start_token_id": 151652,
    },
}


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k not in ("speaker_id",):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


BASE = merge(TINY_CONFIG, REAL_IDS)

# A second shape: more layers and experts, other top-k, fewer code groups, another accept layer.
VARIANT = {
    "thinker_config": {
        "text_config": {"num_hidden_layers": 3, "num_experts": 6, "num_experts_per_tok": 3,
                        "hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 1,
                        "head_dim": 16, "moe_intermediate_size": 24},
        "audio_config": {"output_dim": 48, "encoder_layers": 3},
        "vision_config": {"out_hidden_size": 48, "depth": 3, "deepstack_visual_indexes": [0, 2]},
    },
    "talker_config": {
        "num_code_groups": 8, "thinker_hidden_size": 48, "accept_hidden_layer": 2,
        "text_config": {"num_hidden_layers": 3, "num_experts": 5, "num_experts_per_tok": 1},
        "code_predictor_config": {"num_code_groups": 8, "num_hidden_layers": 1},
    },
    "code2wav_config": {"num_quantizers": 8, "num_hidden_layers": 1, "decoder_dim": 48},
}


def tiny_config(variant: dict | None = None):
    from transformers import Qwen3OmniMoeConfig

    return Qwen3OmniMoeConfig(**merge(BASE, variant or {}))


def build_reference(variant: dict | None = None, seed: int = 0):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(tiny_config(variant)).eval()
    randomize_(model.named_parameters(), seed)
    # The default grouped-GEMM experts path rejects float64; the eager loop is the reference math.
    model.set_experts_implementation("eager")
    return model


def save_reference(model, folder: Path, max_shard_size: str | None = None) -> Path:
    folder = Path(folder)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


# ---- prompts and transformers generation for end-to-end comparisons ----

IM_START, IM_END, NL, USER, ASSISTANT, SYSTEM = 151644, 151645, 198, 872, 77091, 8948
AUDIO_START, AUDIO_END, AUDIO_PAD = 151669, 151670, 151675
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 151652, 151653, 151655, 151656


def chat(user: list[int], system: bool = True) -> list[int]:
    head = [IM_START, SYSTEM, NL, 100, 101, IM_END, NL] if system else []
    return head + [IM_START, USER, NL, *user, IM_END, NL, IM_START, ASSISTANT, NL]


def suppressed_ids(ref) -> list[int]:
    """What omnivox's Thinker never samples for this checkpoint (no tokenizer: the config's control
    ids), passed to transformers as `suppress_tokens` so both sides decode alike."""
    from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
    from omnivox.models.qwen3_omni.media import reply_suppressed_ids

    return reply_suppressed_ids(Qwen3OmniConfig.from_hf(ref.config.to_dict()))


def reference_generate(ref, ids, max_tokens, max_frames, suppress=None, **media):
    """-> (generated ids, codes [T, Q] or None, waveform) from transformers, with the Thinker's
    suppressed ids (`suppress`, by default the engine's for this config)."""
    captured = {}
    orig = ref.code2wav.chunked_decode

    def spy(codes, *a, **k):
        captured["codes"] = codes.clone()
        return orig(codes, *a, **k)

    ref.code2wav.chunked_decode = spy
    try:
        x = torch.tensor([ids])
        seq, wav = ref.generate(input_ids=x, attention_mask=torch.ones_like(x), thinker_max_new_tokens=max_tokens,
                                thinker_do_sample=False, talker_do_sample=False,
                                thinker_suppress_tokens=suppressed_ids(ref) if suppress is None else list(suppress),
                                talker_max_new_tokens=max_frames + 1, speaker="Ethan", **media)
    finally:
        ref.code2wav.chunked_decode = orig
    return seq[0, len(ids):].tolist(), captured["codes"][0].T.numpy(), wav.reshape(-1).float().numpy()




def mixed_requests(omni) -> list[dict]:
    """Omni.generate requests over the tiny checkpoint: spoken replies (one sampled, with seed),
    a text-only reply (index 4), an audio-in and an image-in request."""
    import numpy as np

    from omnivox.audio.io import load_audio
    from omnivox.audio.mel import log_mel, num_audio_tokens
    from omnivox.models.qwen3_omni.image_processor import num_vision_tokens, preprocess_image

    wave = load_audio(Path(__file__).resolve().parent / "media" / "speech_16k.wav")
    n_audio = num_audio_tokens(log_mel(wave).shape[-1])
    image = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    n_img = num_vision_tokens(preprocess_image(image, omni.processor.vision)[1], 2)
    reqs = [dict(prompt_ids=chat([1000 + 37 * i + k for k in range(3 + 3 * i)], system=i % 2 == 0),
                 max_tokens=6 + 2 * i, max_frames=8 + 3 * i, greedy=True) for i in range(4)]
    reqs[1].update(greedy=False, seed=7, temperature=0.8, top_k=40)
    reqs.append(dict(prompt_ids=chat([1400, 1401, 1402]), max_tokens=8, return_audio=False, greedy=True))
    reqs.append(dict(prompt_ids=chat([AUDIO_START, *[AUDIO_PAD] * n_audio, AUDIO_END, 500]), audio=[wave],
                     max_tokens=10, max_frames=12, greedy=True))
    reqs.append(dict(prompt_ids=chat([VISION_START, *[IMAGE_PAD] * n_img, VISION_END, 501]), images=[image],
                     max_tokens=9, max_frames=15, greedy=True))
    return reqs
