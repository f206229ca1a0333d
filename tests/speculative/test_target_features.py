"""The Thinker's target features (what a learned drafter reads): the outputs of configured layers as
device tensors inside its step, pinned against transformers' `output_hidden_states` on text
(`hidden_states[i + 1]` = output of layer i; at the last layer the entry there is final-normed, and
so is the tap),
across chunked prefill and decode steps; at image positions the rows after the DeepStack addition
(vLLM's convention), at audio positions the layer's output."""
from pathlib import Path

import numpy as np
import pytest
import torch

from omnivox import Omni
from omnivox.engine.config import EngineConfig
from omnivox.models.qwen3_omni.image_processor import num_vision_tokens, preprocess_image
from features import attach, reference_features
from qwen_tiny import IMAGE_PAD, VISION_END, VISION_START, chat

ATOL = 2e-5


@pytest.fixture(scope="module")
def chunked(tiny_reference):
    """Prefill chunked into 5-token steps."""
    o = Omni(model=tiny_reference[1], progress=False, engine_config=EngineConfig(token_budget=5))
    yield o
    o.close()


def test_text_features_equal_hidden_states_across_chunks_and_decode(tiny_reference, chunked):
    ref = tiny_reference[0]
    rec = attach(chunked, (0, 1))
    prompt = chat([1000 + 3 * k for k in range(14)])
    out = chunked.generate(prompt_ids=prompt, greedy=True, max_tokens=6, return_audio=False)
    full = prompt + out.text_ids[:-1]  # every position the Thinker computed
    got = rec.by_position(len(full))
    assert all(f.device.type == "cpu" for f, _, _ in rec.calls) and len(rec.calls) > 6  # chunks + decode steps
    want, hidden = reference_features(ref, full, (0, 1))
    torch.testing.assert_close(got[:, :32], hidden[1][0], rtol=0, atol=ATOL)  # hidden_states[0 + 1]
    torch.testing.assert_close(got[:, :32], want[:, :32], rtol=0, atol=ATOL)
    # the last layer (1 of 2): transformers' last hidden state is final-normed, and so is its tap
    torch.testing.assert_close(got[:, 32:], hidden[2][0], rtol=0, atol=ATOL)
    assert (got[:, 32:] - want[:, 32:]).abs().max() > 100 * ATOL  # not the raw output


def test_image_rows_are_taken_after_the_deepstack_addition(tiny_reference, chunked):
    ref = tiny_reference[0]
    rec = attach(chunked, (0,))
    image = np.random.default_rng(3).integers(0, 256, (32, 48, 3), dtype=np.uint8)
    pix, grid = preprocess_image(image, chunked.processor.vision)
    n = num_vision_tokens(grid, 2)
    prompt = chat([VISION_START, *[IMAGE_PAD] * n, VISION_END, 501])
    chunked.generate(prompt_ids=prompt, images=[image], greedy=True, max_tokens=1, return_audio=False)
    got = rec.by_position(len(prompt))
    want, hidden = reference_features(ref, prompt, (0,), pixel_values=pix, image_grid_thw=torch.tensor([grid]))
    visual = torch.tensor([t == IMAGE_PAD for t in prompt])
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    torch.testing.assert_close(got[~visual], hidden[1][0][~visual], rtol=0, atol=ATOL)
    assert (got[visual] - hidden[1][0][visual]).abs().max() > 100 * ATOL  # the addition is in there


def test_audio_rows_are_the_layer_output(tiny_reference, chunked):
    """No DeepStack for audio: its rows are the layer's output, as transformers' hidden states."""
    from omnivox.audio.io import load_audio
    from omnivox.audio.mel import log_mel, num_audio_tokens
    from qwen_tiny import AUDIO_END, AUDIO_PAD, AUDIO_START

    rec = attach(chunked, (0,))
    wave = load_audio(Path(__file__).parent.parent / "media" / "speech_16k.wav")[:16000]
    feats = log_mel(wave)
    prompt = chat([AUDIO_START, *[AUDIO_PAD] * num_audio_tokens(feats.shape[-1]), AUDIO_END, 500])
    chunked.generate(prompt_ids=prompt, audio=[wave], greedy=True, max_tokens=1, return_audio=False)
    _, hidden = reference_features(tiny_reference[0], prompt, (0,), input_features=feats[None],
                                   feature_attention_mask=torch.ones(1, feats.shape[-1], dtype=torch.long))
    torch.testing.assert_close(rec.by_position(len(prompt)), hidden[1][0], rtol=0, atol=ATOL)
