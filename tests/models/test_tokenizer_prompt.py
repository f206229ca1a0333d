"""Tokenizer loading, chat-template rendering and prompt ids (spec 3.5), and the demo model's text side.

transformers 5.24 is the reference for template rendering, tokenization, the feature extractor /
PIL image processor token counts and config construction (the PIL image back end: torchvision is
not installed here).
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from omnivox.errors import CheckpointError, InputError
from omnivox.models.qwen3_omni.config import Qwen3OmniConfig
from omnivox.models.qwen3_omni.demo import (DEMO_CHAT_TEMPLATE, DEMO_SPECIAL_TOKENS, build_demo_tokenizer,
                                            demo_config_dict, write_demo_files)
from omnivox.models.qwen3_omni.prompt import expand_media_tokens, media_in_order, render_messages
from omnivox.models.qwen3_omni.tokenizer import load_chat_template, load_tokenizer

SYSTEM = "You are a helpful assistant."
UNICODE_TEXTS = [
    "Hello, world!",
    "héllo wörld — naïve café ½ ∑ ≠",
    "你好，世界！日本語のテキスト",
    "emoji 🎉👩‍👩‍👧 and flags 🇯🇵",
    "e\u0301 (decomposed) vs \u00e9, tabs\tand\r\nnewlines\n\n  spaces  ",
    "\x00\x1f control, \ufffd replacement char, zero\u200bwidth",
]


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("omnivox-demo")
    write_demo_files(folder)
    return folder


@pytest.fixture(scope="module")
def tok(demo_folder):
    return load_tokenizer(demo_folder)


@pytest.fixture(scope="module")
def hf_tok(demo_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_folder)


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


# ---------------------------------------------------------------- demo tokenizer and config

def test_demo_files_are_deterministic_across_processes(demo_folder, tmp_path):
    assert build_demo_tokenizer().to_str() == build_demo_tokenizer().to_str()
    # A fresh interpreter (new hash seeds) must write byte-identical files.
    code = ("import sys; from pathlib import Path; from omnivox.models.qwen3_omni.demo import write_demo_files; "
            "write_demo_files(Path(sys.argv[1]))")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True,
                   env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}, cwd=Path(__file__).parents[2])
    assert _digest(tmp_path) == _digest(demo_folder)
    assert set(_digest(demo_folder)) == {"config.json", "generation_config.json", "tokenizer.json",
                                         "tokenizer_config.json", "chat_template.json", "preprocessor_config.json"}


def test_demo_special_ids_are_small_and_config_ids_come_from_tokenizer(demo_folder, tok):
    for i, token in enumerate(DEMO_SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i
        assert tok.encode(token) == [i]
    assert tok.special_ids == frozenset(range(len(DEMO_SPECIAL_TOKENS)))
    assert 1000 <= tok.vocab_size <= 2000
    for role in ("system", "user", "assistant"):
        assert len(tok.encode(role)) == 1

    cfg = json.loads((demo_folder / "config.json").read_text())
    assert cfg == demo_config_dict(build_demo_tokenizer())
    assert cfg["model_type"] == "qwen3_omni_moe"
    top = {"im_start_token_id": "<|im_start|>", "im_end_token_id": "<|im_end|>", "system_token_id": "system",
           "user_token_id": "user", "assistant_token_id": "assistant", "tts_pad_token_id": "<|tts_pad|>",
           "tts_bos_token_id": "<|tts_bos|>", "tts_eos_token_id": "<|tts_eos|>"}
    media = {"audio_token_id": "<|audio_pad|>", "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
             "audio_start_token_id": "<|audio_start|>", "audio_end_token_id": "<|audio_end|>",
             "vision_start_token_id": "<|vision_start|>"}
    thinker = {**media, "vision_end_token_id": "<|vision_end|>", "user_token_id": "user"}
    for section, fields in ((cfg, top), (cfg["thinker_config"], thinker), (cfg["talker_config"], media)):
        for key, token in fields.items():
            assert section[key] == tok.token_to_id(token), key
    vocab = cfg["thinker_config"]["text_config"]["vocab_size"]
    assert vocab % 64 == 0 and tok.vocab_size <= vocab < tok.vocab_size + 64
    assert cfg["talker_config"]["text_config"]["vocab_size"] == 3072
    assert cfg["talker_config"]["codec_eos_token_id"] == 2150

    gen = json.loads((demo_folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.token_to_id("<|im_end|>") and gen["max_new_tokens"] > 0


def test_demo_config_is_valid_for_transformers_and_omnivox(demo_folder, tok):
    from transformers import Qwen3OmniMoeConfig

    cfg = json.loads((demo_folder / "config.json").read_text())
    hf = Qwen3OmniMoeConfig(**cfg)
    ours = Qwen3OmniConfig.from_hf(cfg)
    assert hf.im_start_token_id == ours.im_start_token_id == tok.token_to_id("<|im_start|>")
    assert hf.im_end_token_id == ours.im_end_token_id == tok.token_to_id("<|im_end|>")
    assert hf.assistant_token_id == ours.assistant_token_id == tok.token_to_id("assistant")
    assert hf.tts_pad_token_id == ours.tts_pad_token_id == tok.token_to_id("<|tts_pad|>")
    assert hf.thinker_config.audio_token_id == ours.thinker.audio_token_id == tok.token_to_id("<|audio_pad|>")
    assert hf.thinker_config.vision_start_token_id == ours.thinker.vision_start_token_id
    assert hf.thinker_config.text_config.vocab_size == ours.thinker.text.vocab_size
    assert hf.talker_config.image_token_id == tok.token_to_id("<|image_pad|>")
    assert hf.talker_config.audio_start_token_id == tok.token_to_id("<|audio_start|>")
    assert hf.talker_config.speaker_id == {"chelsie": 2301, "ethan": 2302, "aiden": 2303}


def test_demo_preprocessor_config_loads_in_transformers(demo_folder):
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    fe = WhisperFeatureExtractor.from_pretrained(demo_folder)
    ip = Qwen2VLImageProcessorPil.from_pretrained(demo_folder)
    assert (fe.feature_size, fe.sampling_rate, fe.hop_length, fe.n_fft) == (128, 16000, 160, 400)
    assert list(ip.image_mean) == [0.5] * 3 and list(ip.image_std) == [0.5] * 3
    assert (ip.patch_size, ip.temporal_patch_size, ip.merge_size) == (16, 2, 2)


# ---------------------------------------------------------------- tokenizer

@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_byte_level_round_trip_matches_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids == hf_tok(text, add_special_tokens=False)["input_ids"]


def test_special_tokens_in_text_map_to_their_ids(tok):
    text = "<|im_start|>user\nhi<|im_end|>\n"
    ids = tok.encode(text)
    assert ids[:2] == [tok.token_to_id("<|im_start|>"), tok.token_to_id("user")]
    assert tok.token_to_id("<|im_end|>") in ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "user\nhi\n"
    assert tok.token_to_id("<|no_such_token|>") is None


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_decoder_deltas_concatenate_to_decode(tok, skip):
    text = "Grüße 你好 🎉👩‍👩‍👧<|im_end|> naïve ½"
    ids = tok.encode(text)
    dec = tok.incremental_decoder(skip_special_tokens=skip)
    deltas = [dec.push(i) for i in ids]
    tail = dec.flush()
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=skip)
    assert tail == ""  # the text ends on a complete character
    assert all("\ufffd" not in d for d in deltas)
    assert deltas.count("") > 3  # multi-byte characters span several byte-level tokens and were held back


def test_incremental_decoder_flush_releases_an_incomplete_tail(tok):
    ids = tok.encode("ok 🎉")[:-1]  # drop the last byte piece of the emoji
    dec = tok.incremental_decoder()
    streamed = "".join(dec.push(i) for i in ids)
    assert "\ufffd" not in streamed
    assert streamed + dec.flush() == tok.decode(ids)


def test_folder_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None
    assert load_chat_template(tmp_path) is None


def test_tokenizer_from_vocab_and_merges(tmp_path, demo_folder, tok):
    build_demo_tokenizer().model.save(str(tmp_path))  # vocab.json + merges.txt, no tokenizer.json
    (tmp_path / "tokenizer_config.json").write_bytes((demo_folder / "tokenizer_config.json").read_bytes())
    slow = load_tokenizer(tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()
    text = "<|im_start|>system\nThe weather, café 你好<|im_end|>\n<|audio_pad|>"  # NFC text: same ids
    assert slow.encode(text) == tok.encode(text)
    assert slow.special_ids == tok.special_ids
    assert slow.decode(slow.encode(text)) == tok.decode(tok.encode(text))


def test_added_token_id_mismatch_is_a_checkpoint_error(tmp_path, demo_folder):
    (tmp_path / "tokenizer.json").write_bytes((demo_folder / "tokenizer.json").read_bytes())
    cfg = json.loads((demo_folder / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"]["5000"] = {"content": "<|im_end|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="im_end"):
        load_tokenizer(tmp_path)


def test_load_chat_template_sources(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert load_chat_template(tmp_path) == "D"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "J"}))
    assert load_chat_template(tmp_path) == "J"
    (tmp_path / "chat_template.jinja").write_text("JINJA")
    assert load_chat_template(tmp_path) == "JINJA"
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "x", "template": "X"}]}))
    with pytest.raises(CheckpointError, match="default"):
        load_chat_template(other)


def test_demo_folder_template_is_found(demo_folder):
    assert load_chat_template(demo_folder) == DEMO_CHAT_TEMPLATE


# ---------------------------------------------------------------- rendering

CONVERSATIONS = [
    # spec 3.5: system turn, one user turn with audio, image and text parts, generation prompt
    [{"role": "system", "content": SYSTEM},
     {"role": "user", "content": [{"type": "audio", "audio": "a.wav"}, {"type": "image", "url": "i.png"},
                                  {"type": "text", "text": "What is this?"}]}],
    # multi-turn, OpenAI spellings, media after text, two texts concatenated, string content
    [{"role": "user", "content": [{"type": "text", "text": "Listen: "},
                                  {"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}},
                                  {"type": "text", "text": " and look."},
                                  {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]},
     {"role": "assistant", "content": "A bird and a bridge."},
     {"role": "user", "content": [{"type": "video", "video": "v.mp4"}, {"type": "audio", "path": "b.wav"},
                                  {"type": "text", "text": "And now?"}]}],
    # a system prompt given as parts
    [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
     {"role": "user", "content": "Hi 你好"}],
]


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers_and_fallback(hf_tok, tok, conv, add_generation_prompt):
    messages = CONVERSATIONS[conv]
    ours = render_messages(messages, DEMO_CHAT_TEMPLATE, add_generation_prompt,
                           template_vars=tok.special_tokens_map)
    ref = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == ref
    assert render_messages(messages, None, add_generation_prompt) == ours
    assert tok.encode(ours) == hf_tok(ref, add_special_tokens=False)["input_ids"]


def test_rendered_prompt_is_the_spec_layout():
    text = render_messages(CONVERSATIONS[0], DEMO_CHAT_TEMPLATE)
    assert text == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
                    "<|audio_start|><|audio_pad|><|audio_end|><|vision_start|><|image_pad|><|vision_end|>"
                    "What is this?<|im_end|>\n<|im_start|>assistant\n")


def test_system_argument_is_a_default(tok):
    user = [{"role": "user", "content": "Hi"}]
    for template in (DEMO_CHAT_TEMPLATE, None):
        assert render_messages(user, template, system=SYSTEM) == render_messages(
            [{"role": "system", "content": SYSTEM}, *user], template)
        own = [{"role": "system", "content": "Mine."}, *user]
        assert render_messages(own, template, system=SYSTEM) == render_messages(own, template)
    ids = tok.encode(render_messages(user, None, system=SYSTEM))
    assert ids[:3] == [tok.token_to_id("<|im_start|>"), tok.token_to_id("system"), tok.encode("\n")[0]]


def test_render_errors():
    with pytest.raises(InputError, match="not supported"):
        render_messages([{"role": "user", "content": [{"type": "file", "file": "x"}]}], DEMO_CHAT_TEMPLATE)
    with pytest.raises(InputError, match="non-empty"):
        render_messages([], None)
    with pytest.raises(InputError, match="roles must alternate"):
        render_messages([{"role": "user", "content": "x"}], "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(CheckpointError, match="does not compile"):
        render_messages([{"role": "user", "content": "x"}], "{% for %}")


def test_template_helpers_match_transformers(hf_tok):
    template = ("{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}{% if loop.first %}"
                "{% continue %}{% endif %}|{% endfor %}{{ eos_token }}")
    messages = [{"role": "user", "content": "héllo <b>"}, {"role": "assistant", "content": "ok"}]
    ours = render_messages(messages, template, template_vars={"eos_token": "<|im_end|>"})
    assert ours == hf_tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                              add_generation_prompt=True)


# ---------------------------------------------------------------- media order and pad expansion

def test_media_in_order_passes_payloads_through():
    payload = {"data": "UklG", "format": "wav"}
    audios, images, videos = media_in_order(CONVERSATIONS[1])
    assert audios[0] is CONVERSATIONS[1][0]["content"][1]["input_audio"]
    assert audios == [payload, {"path": "b.wav"}]
    assert images == [{"url": "data:image/png;base64,AA"}]
    assert videos == ["v.mp4"]
    assert media_in_order(CONVERSATIONS[2]) == ([], [], [])


def test_expansion_matches_processor_text_replacement(tok, hf_tok, demo_folder):
    """encode(one pad) + expand_media_tokens == tokenizing text whose pads the processor repeated."""
    from PIL import Image
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    rng = np.random.default_rng(0)
    clips = [rng.standard_normal(16000 * 3 // 2).astype(np.float32), rng.standard_normal(5200).astype(np.float32)]
    feats = WhisperFeatureExtractor.from_pretrained(demo_folder)(clips, sampling_rate=16000, return_attention_mask=True)
    audio_counts = [int(n) for n in _get_feat_extract_output_lengths(np.asarray(feats["attention_mask"]).sum(-1))]
    image = Image.fromarray(rng.integers(0, 255, (70, 130, 3), dtype=np.uint8))
    grid = Qwen2VLImageProcessorPil.from_pretrained(demo_folder)(images=[image])["image_grid_thw"]
    image_counts = [int(np.prod(np.asarray(g))) // 4 for g in grid]
    video_counts = [6]

    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": [{"type": "audio", "audio": clips[0]}, {"type": "image", "image": image},
                                             {"type": "text", "text": "compare with"},
                                             {"type": "video", "video": "v.mp4"}, {"type": "audio", "audio": clips[1]}]}]
    text = render_messages(messages, DEMO_CHAT_TEMPLATE)
    pads = {"audio": tok.token_to_id("<|audio_pad|>"), "image": tok.token_to_id("<|image_pad|>"),
            "video": tok.token_to_id("<|video_pad|>")}
    ids = expand_media_tokens(tok.encode(text), audio_token_id=pads["audio"], image_token_id=pads["image"],
                              video_token_id=pads["video"], audio_counts=audio_counts, image_counts=image_counts,
                              video_counts=video_counts)

    expanded = text  # what the processor does: replace each placeholder, in order, by n copies
    for token, counts in (("<|audio_pad|>", audio_counts), ("<|image_pad|>", image_counts),
                          ("<|video_pad|>", video_counts)):
        for n in counts:
            expanded = expanded.replace(token, "<|PLACEHOLDER|>" * n, 1)
        expanded = expanded.replace("<|PLACEHOLDER|>", token)
    assert ids == hf_tok(expanded, add_special_tokens=False)["input_ids"]
    assert ids.count(pads["audio"]) == sum(audio_counts) and audio_counts[0] != audio_counts[1]
    assert ids.count(pads["image"]) == sum(image_counts) and ids.count(pads["video"]) == 6
    first = ids.index(pads["audio"])
    assert ids[first:first + audio_counts[0] + 1] == [pads["audio"]] * audio_counts[0] + [
        tok.token_to_id("<|audio_end|>")]


def test_expansion_errors():
    kw = dict(audio_token_id=5, image_token_id=8, video_token_id=9)
    ids = [1, 3, 5, 4, 6, 8, 7, 3, 5, 4]
    assert expand_media_tokens(ids, **kw, audio_counts=[2, 1], image_counts=[3], video_counts=[]) == [
        1, 3, 5, 5, 4, 6, 8, 8, 8, 7, 3, 5, 4]
    with pytest.raises(InputError, match="2 audio placeholder"):
        expand_media_tokens(ids, **kw, audio_counts=[2], image_counts=[3], video_counts=[])
    with pytest.raises(InputError, match="1 image placeholder"):
        expand_media_tokens(ids, **kw, audio_counts=[2, 1], image_counts=[], video_counts=[])
    with pytest.raises(InputError, match="0 video placeholder"):
        expand_media_tokens(ids, **kw, audio_counts=[2, 1], image_counts=[3], video_counts=[4])
    with pytest.raises(InputError, match="at least one token"):
        expand_media_tokens(ids, **kw, audio_counts=[2, 0], image_counts=[3], video_counts=[])
