"""The declared serving surface (`omnivox/serving.py`): the HTTP layer imports no family's package,
capabilities are `isinstance` checks on the protocols (and a check never starts an engine), the
parameters name the field they refuse, and a saved voice is the model's bytes."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

import omnivox
from omnivox.errors import InputError
from omnivox.serving import ChatModel, ChatParams, ServedModel, SpeechParams, VoiceCloner

PACKAGE = Path(omnivox.__file__).parent
FAMILIES = sorted(p.name for p in (PACKAGE / "models").iterdir() if (p / "__init__.py").is_file())


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (absolute names)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_the_api_imports_no_family():
    assert FAMILIES == ["fish_s2", "moshi", "qwen3_omni"]
    files = sorted((PACKAGE / "api").rglob("*.py"))
    assert len(files) > 20
    found = {f"{path.relative_to(PACKAGE)}: {name}" for path in files for name in imported_modules(path)
             if any(name == f"omnivox.models.{fam}" or name.startswith(f"omnivox.models.{fam}.")
                    for fam in FAMILIES) or name == "omnivox.offline"}
    assert not found, found


@pytest.fixture(scope="module")
def models(tiny_reference, tmp_path_factory):
    from omnivox import Omni
    from omnivox.models.fish_s2.tiny import write_tiny_checkpoint
    from omnivox import FishTTS

    omni = Omni(model=tiny_reference[1], progress=False)
    tts = FishTTS(model=write_tiny_checkpoint(tmp_path_factory.mktemp("fish"), seed=0), progress=False)
    yield omni, tts
    omni.close()
    tts.close()


def test_capabilities_are_the_protocols(models):
    omni, tts = (m.served for m in models)  # the offline API's served models
    assert isinstance(omni, ServedModel) and isinstance(omni, ChatModel) and not isinstance(omni, VoiceCloner)
    assert isinstance(tts, ServedModel) and isinstance(tts, VoiceCloner) and not isinstance(tts, ChatModel)
    assert omni._engine is None and tts._engine is None  # a check reads no property (`engine` starts one)
    assert not isinstance(object(), ServedModel)


@pytest.mark.parametrize("cls,kw,param", [
    (SpeechParams, dict(temperature="hot"), "temperature"), (SpeechParams, dict(seed=-1), "seed"),
    (SpeechParams, dict(max_frames=0), "max_frames"), (SpeechParams, dict(top_k=True), "top_k"),
    (SpeechParams, dict(repetition_penalty=0.0), "repetition_penalty"),
    (ChatParams, dict(max_tokens=0), "max_tokens"), (ChatParams, dict(max_frames=-1), "max_frames"),
    (ChatParams, dict(talker_top_p=float("nan")), "talker_top_p"), (ChatParams, dict(top_k=-2), "top_k")])
def test_params_name_the_field_they_refuse(cls, kw, param):
    with pytest.raises(InputError, match=param) as e:
        cls(**kw)
    assert e.value.param == param


def test_the_model_checks_what_only_it_knows(models):
    omni, tts = models
    with pytest.raises(InputError, match="unknown speaker"):
        omni.check_chat(ChatParams(speaker="nobody"))
    with pytest.raises(InputError, match="instructions are not supported") as e:
        tts.check_speech(SpeechParams(instructions="calm"))
    assert e.value.param == "instructions"
    tts.check_speech(SpeechParams(temperature=0.5, max_frames=3))


def test_a_voice_is_the_models_bytes(models):
    from omnivox.models.fish_s2.voice import Voice
    _, tts = models
    voice = Voice(np.arange(6, dtype=np.int64).reshape(2, 3), "a reference")
    back = tts.voice_from_bytes(tts.voice_to_bytes(voice))
    assert back.text == voice.text and np.array_equal(back.codes, voice.codes)
    with pytest.raises(InputError, match="not an omnivox voice file"):
        tts.voice_from_bytes(b"not a voice")


def test_the_old_prepare_name_still_builds_the_prompt_with_a_warning():
    import pytest

    from omnivox import Omni
    omni = Omni(progress=False)
    try:
        msgs = [{"role": "user", "content": "Hi"}]
        with pytest.warns(DeprecationWarning, match="Omni.prepare is now Omni.build_prompt"):
            old = omni.prepare(msgs)
        assert old.ids == omni.build_prompt(msgs).ids
    finally:
        omni.close()
