"""The Thinker never samples control ids (media placeholders, turn markers, the tokenizer's added
special tokens) into a reply, but the end-of-turn ids; parity with transformers holds when it is
given the same ids as `suppress_tokens`."""
import pytest
import torch

from omnivox import Omni
from omnivox.models.qwen3_omni.media import reply_suppressed_ids
from qwen_tiny import IM_END, IMAGE_PAD, build_reference, chat, reference_generate, suppressed_ids


def test_the_suppressed_set_is_control_ids_but_the_turn_end():
    ref = build_reference()
    ids = suppressed_ids(ref)
    th = ref.config.thinker_config
    for named in (th.image_token_id, th.video_token_id, th.audio_token_id, th.audio_start_token_id,
                  ref.config.im_start_token_id, ref.config.tts_bos_token_id):
        assert named in ids
    assert IM_END not in ids
    assert ref.config.user_token_id not in ids  # role words are ordinary tokens


def test_the_demo_suppresses_its_tokenizers_special_tokens_but_its_end_ids():
    omni = Omni(progress=False)
    try:
        specials = omni.tokenizer.special_ids
        ends = {omni.cfg.im_end_token_id, *omni.chat_options.stop_ids}
        assert set(omni.suppressed_ids) == (specials | set(reply_suppressed_ids(omni.cfg))) - ends
        assert ends.isdisjoint(omni.suppressed_ids)
    finally:
        omni.close()


@pytest.fixture(scope="module")
def lured(tmp_path_factory):
    """A checkpoint whose greedy reply would be an image placeholder: its lm_head row for
    <|image_pad|> is the winning row scaled up, so argmax picks it unless it is suppressed."""
    ref = build_reference()
    ids = chat([1000, 2000])
    natural = reference_generate(ref, ids, 4, 4, suppress=())[0]
    with torch.no_grad():
        head = ref.thinker.lm_head.weight
        head[IMAGE_PAD] = head[natural[0]] * 4
    assert reference_generate(ref, ids, 4, 4, suppress=())[0][0] == IMAGE_PAD  # the lure works
    folder = tmp_path_factory.mktemp("lured")
    ref.save_pretrained(folder)
    return ref, Omni(model=folder, progress=False), ids


def test_a_reply_never_holds_a_placeholder_and_equals_transformers(lured):
    ref, omni, ids = lured
    want_ids, want_codes, _ = reference_generate(ref, ids, 6, 8)
    out = omni.generate(prompt_ids=ids, greedy=True, max_tokens=6, max_frames=8, speaker="ethan")
    assert IMAGE_PAD not in out.text_ids and not set(out.text_ids) & set(omni.suppressed_ids)
    assert out.text_ids == want_ids
    assert (out.codes == want_codes).all()
    seeded = omni.generate(prompt_ids=ids, max_tokens=6, temperature=1.0, seed=3, return_audio=False)
    assert not set(seeded.text_ids) & set(omni.suppressed_ids)
    omni.close()
