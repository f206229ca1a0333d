"""The built-in demo model's text side: a real byte-level BPE tokenizer and a tiny config.

With no `--model`, omnivox generates a tiny random Qwen3-Omni on first use, without network.
This module supplies everything but the weights: a tokenizer trained deterministically on the
small English corpus below (special tokens first, so they get ids 0..12), the chat template, and
the tiny `config.json` of spec section 2.2 whose every special id is read from that tokenizer.
The thinker vocabulary is the tokenizer's, rounded up to a multiple of 64. `demo_model_path`
writes the whole demo (random weights too) to the cache on first use.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path

import tokenizers
from tokenizers import Regex, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE

from omnivox.demo import NOISE_NOTE, build_lock, cache_root
from omnivox.models.qwen3_omni.tokenizer import QWEN2_SPLIT_REGEX

DEMO_VERSION = 1

DEMO_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
    "<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>",
]
DEMO_VOCAB_TARGET = 1536  # the corpus runs out of merges first (about 1050 tokens)
DEMO_VOCAB_MULTIPLE = 64
ROLE_WORDS = ("system", "user", "assistant")

# Role words open lines of the dialogue so that each becomes one token (the chat layout puts
# them right after <|im_start|>, with no leading space).
DEMO_CORPUS = """\
The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.
Every morning the small town wakes up slowly. The baker opens the shop at six o'clock,
the smell of fresh bread drifts down the street, and the first bus of the day rattles past
the old stone bridge. Children walk to school in pairs, talking about games, homework and
the weather. By nine the market square is full of people buying fruit, vegetables, cheese
and flowers, while musicians play near the fountain for anyone who stops to listen.

A speech model listens to sound and writes words. It hears a voice, splits the signal into
short frames, and turns each frame into numbers that describe how loud every frequency is.
Those numbers pass through many layers of a neural network until the model can guess which
sounds were spoken. A second model does the opposite: it reads text and speaks it aloud,
choosing the pitch, the rhythm and the pauses that make a sentence sound natural. When the
two work together, a computer can hold a conversation with a person in real time.

Pictures and videos are another kind of input. An image is cut into small square patches,
and each patch becomes a vector. A video is a series of images over time, so the model also
learns how things move from one frame to the next. With audio, images, video and text in
one model, a single question can mention a song, a photo and a short clip at the same time.

The weather today is mild and bright. In the afternoon a light wind will come from the west,
and clouds may gather in the evening. Tomorrow brings rain in the north and sunshine in the
south, with temperatures between twelve and twenty degrees. If you plan a walk, take a coat
and an umbrella, just in case. Numbers such as 1, 2, 3, 10, 42, 100 and 2025 appear in
reports, prices and dates; a ticket costs $4.50 and the train leaves at 7:45 from platform 9.

Good software is easy to read. Each file should hold one idea, each function should do one
thing, and the names should tell a new reader what the code means. Tests check that the
program still works after every change. When something breaks, a clear error message that
says what to fix saves hours of searching. Simple designs are faster to build, easier to
explain and much easier to keep correct over many years of work.

system
You are a helpful assistant. Answer briefly and clearly.
user
Hello! Can you tell me what time it is, and what the weather will be like tomorrow?
assistant
Hello! I cannot see a clock, but tomorrow should be sunny in the south and rainy in the north.
user
Please describe this picture and the sound in this recording.
assistant
The picture shows a river under a bridge. In the recording a bird sings while cars pass by.
user
Thank you, that is very useful. Could you say it again more slowly?
assistant
Of course. The picture shows a river, a bridge and some trees. The sound is a bird singing.
system
You are a friendly voice assistant. The user may speak, send images or share a video.
"""


# Spec 3.5 layout: <|im_start|>{role}\n{content}<|im_end|>\n per turn, one placeholder per media
# part in part order, and <|im_start|>assistant\n as the generation prompt. A system turn is
# simply the first message (render_messages' `system` argument prepends one).
DEMO_CHAT_TEMPLATE = r"""{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\n' }}
{%- if message['content'] is string %}
{{- message['content'] }}
{%- elif message['content'] is not none %}
{%- for part in message['content'] %}
{%- if part['type'] in ['audio', 'input_audio', 'audio_url'] %}
{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}
{%- elif part['type'] in ['image', 'image_url'] %}
{{- '<|vision_start|><|image_pad|><|vision_end|>' }}
{%- elif part['type'] in ['video', 'video_url'] %}
{{- '<|vision_start|><|video_pad|><|vision_end|>' }}
{%- elif part['type'] == 'text' %}
{{- part['text'] }}
{%- else %}
{{- raise_exception('unsupported content part type: ' + part['type']) }}
{%- endif %}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

DEMO_GENERATION_CONFIG = {"max_new_tokens": 16, "talker_max_new_tokens": 40, "do_sample": False}

_ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 2, 2], "interleaved": True}
# Sizes of spec section 2.2, shared with the parity tests' tiny checkpoints (tests/qwen_tiny.py);
# token ids are filled in from the tokenizer by demo_config_dict.
TINY_CONFIG = {
    "model_type": "qwen3_omni_moe",
    "enable_audio_output": True,
    "thinker_config": {
        "position_id_per_seconds": 13,
        "audio_config": {"num_mel_bins": 128, "encoder_layers": 2, "encoder_attention_heads": 2,
                         "encoder_ffn_dim": 64, "d_model": 32, "downsample_hidden_size": 8, "output_dim": 32,
                         "n_window": 50, "n_window_infer": 800, "max_source_positions": 1500},
        "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                          "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "out_hidden_size": 32, "num_position_embeddings": 64,
                          "deepstack_visual_indexes": [0, 1]},
        "text_config": {"hidden_size": 32, "intermediate_size": 64,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "head_dim": 16, "moe_intermediate_size": 16, "num_experts": 4,
                        "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 4096,
                        "rope_parameters": dict(_ROPE)},
    },
    "talker_config": {
        "num_code_groups": 16, "thinker_hidden_size": 32, "accept_hidden_layer": 1,
        "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150,
        "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
        "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
        "position_id_per_seconds": 13, "spatial_merge_size": 2,
        "text_config": {"vocab_size": 3072, "hidden_size": 32, "intermediate_size": 64,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "head_dim": 16, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32,
                        "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
                        "max_position_embeddings": 4096, "rope_parameters": dict(_ROPE)},
        "code_predictor_config": {"vocab_size": 2048, "hidden_size": 32, "intermediate_size": 64,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "head_dim": 16, "num_code_groups": 16,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    },
    "code2wav_config": {"codebook_size": 2048, "num_quantizers": 16, "hidden_size": 32, "intermediate_size": 64,
                        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                        "sliding_window": 72, "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2],
                        "decoder_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
}

# Merged Whisper feature extractor + Qwen2-VL image processor fields (spec 3.5, pitfall 18).
# max_pixels is lowered from the released 12845056 so a demo photo stays a few hundred patches.
_PREPROCESSOR = {
    "processor_class": "Qwen3OmniMoeProcessor",
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128, "sampling_rate": 16000, "hop_length": 160, "n_fft": 400, "chunk_length": 300,
    "n_samples": 4800000, "nb_max_frames": 30000, "padding_side": "right", "padding_value": 0.0,
    "return_attention_mask": True, "dither": 0.0,
    "image_processor_type": "Qwen2VLImageProcessor",
    "do_convert_rgb": True, "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "min_pixels": 3136, "max_pixels": 262144, "size": {"shortest_edge": 3136, "longest_edge": 262144},
}


def build_demo_tokenizer() -> tokenizers.Tokenizer:
    """Byte-level BPE trained on DEMO_CORPUS; the same bytes every build, on every machine.

    No normalizer (unlike Qwen's NFC), so every string round-trips exactly.
    """
    tok = tokenizers.Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=DEMO_VOCAB_TARGET, special_tokens=DEMO_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(DEMO_CORPUS.split("\n\n"), trainer)
    for word in ROLE_WORDS:
        if len(tok.encode(word, add_special_tokens=False).ids) != 1:
            raise RuntimeError(f"demo tokenizer: role word {word!r} is not a single token; extend DEMO_CORPUS")
    return tok


def _id(tok: tokenizers.Tokenizer, token: str) -> int:
    token_id = tok.token_to_id(token)
    if token_id is None:
        raise RuntimeError(f"demo tokenizer has no token {token!r}")
    return token_id


def demo_config_dict(tokenizer: tokenizers.Tokenizer) -> dict:
    """The demo `config.json`: spec 2.2 sizes, vocab and special ids from `tokenizer`."""
    ids = {
        "im_start": _id(tokenizer, "<|im_start|>"), "im_end": _id(tokenizer, "<|im_end|>"),
        "tts_pad": _id(tokenizer, "<|tts_pad|>"), "tts_bos": _id(tokenizer, "<|tts_bos|>"),
        "tts_eos": _id(tokenizer, "<|tts_eos|>"),
        "audio": _id(tokenizer, "<|audio_pad|>"), "image": _id(tokenizer, "<|image_pad|>"),
        "video": _id(tokenizer, "<|video_pad|>"),
        "audio_start": _id(tokenizer, "<|audio_start|>"), "audio_end": _id(tokenizer, "<|audio_end|>"),
        "vision_start": _id(tokenizer, "<|vision_start|>"), "vision_end": _id(tokenizer, "<|vision_end|>"),
        **{role: _id(tokenizer, role) for role in ROLE_WORDS},
    }
    media = {"audio_token_id": ids["audio"], "image_token_id": ids["image"], "video_token_id": ids["video"],
             "audio_start_token_id": ids["audio_start"], "audio_end_token_id": ids["audio_end"],
             "vision_start_token_id": ids["vision_start"]}
    vocab = -(-tokenizer.get_vocab_size(with_added_tokens=True) // DEMO_VOCAB_MULTIPLE) * DEMO_VOCAB_MULTIPLE
    cfg = copy.deepcopy(TINY_CONFIG)
    cfg.update({
        "im_start_token_id": ids["im_start"], "im_end_token_id": ids["im_end"],
        "system_token_id": ids["system"], "user_token_id": ids["user"], "assistant_token_id": ids["assistant"],
        "tts_pad_token_id": ids["tts_pad"], "tts_bos_token_id": ids["tts_bos"], "tts_eos_token_id": ids["tts_eos"],
    })
    cfg["thinker_config"].update(media, vision_end_token_id=ids["vision_end"], user_token_id=ids["user"])
    cfg["thinker_config"]["text_config"]["vocab_size"] = vocab
    cfg["talker_config"].update(media)
    return cfg


def _tokenizer_config(tokenizer: tokenizers.Tokenizer) -> dict:
    added = tokenizer.get_added_tokens_decoder()
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",  # loads tokenizer.json as written
        "added_tokens_decoder": {
            str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                     "single_word": t.single_word, "special": t.special}
            for i, t in sorted(added.items())},
        "extra_special_tokens": {"audio_token": "<|audio_pad|>", "image_token": "<|image_pad|>",
                                 "video_token": "<|video_pad|>"},
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "model_max_length": TINY_CONFIG["thinker_config"]["text_config"]["max_position_embeddings"],
        "clean_up_tokenization_spaces": False, "errors": "replace", "split_special_tokens": False,
        "chat_template": DEMO_CHAT_TEMPLATE,
    }


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_demo_files(folder: Path) -> None:
    """Write the demo checkpoint's non-weight files into `folder` (created if needed)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_demo_tokenizer()
    config = demo_config_dict(tok)
    (folder / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    _write_json(folder / "tokenizer_config.json", _tokenizer_config(tok))
    _write_json(folder / "chat_template.json", {"chat_template": DEMO_CHAT_TEMPLATE})
    _write_json(folder / "config.json", config)
    _write_json(folder / "generation_config.json", {
        **DEMO_GENERATION_CONFIG, "eos_token_id": config["im_end_token_id"],
        "pad_token_id": _id(tok, "<|endoftext|>")})
    _write_json(folder / "preprocessor_config.json", _PREPROCESSOR)


def demo_model_path() -> Path:
    """The demo checkpoint folder, created on first use (atomically, safe under races; built once
    by processes started together: `build_lock`)."""
    folder = cache_root() / f"demo-qwen3-omni-v{DEMO_VERSION}"
    if (folder / "OMNIVOX_DEMO").exists():
        return folder
    with build_lock(folder):
        return _build_demo(folder)


def _build_demo(folder: Path) -> Path:
    from omnivox.models.qwen3_omni.random_init import save_random_checkpoint

    if (folder / "OMNIVOX_DEMO").exists():  # built while this process waited for the lock
        return folder
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=folder.parent))
    try:
        write_demo_files(tmp)
        save_random_checkpoint(json.loads((tmp / "config.json").read_text()), tmp, seed=0)
        (tmp / "OMNIVOX_DEMO").write_text(NOISE_NOTE + "\n")
        try:
            os.replace(tmp, folder)
        except OSError:  # another process won the race (or a stale folder without the marker)
            if not (folder / "OMNIVOX_DEMO").exists():
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
