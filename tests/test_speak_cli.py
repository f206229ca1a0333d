"""`omnivox speak` on both families: a wav file at the right rate from a real subprocess, and in
this process (`cli`) a saved voice equal to the same reference given as a file and one-line errors."""
import os
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "api"))
from cli_inprocess import cli  # noqa: E402
from speech_helpers import reference_wav  # noqa: E402


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("speak-cache")


def run(cache, *args):
    env = dict(os.environ, OMNIVOX_CACHE=str(cache), OMP_NUM_THREADS="1")
    env.pop("OMNIVOX_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "omnivox.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_speak_qwen_demo(cache, tmp_path):
    out = tmp_path / "q.wav"
    r = run(cache, "speak", "--text", "Hello there.", "--voice", "aiden", "--max-frames", "4", "--seed", "1",
            "--out", str(out))
    assert r.returncode == 0, r.stderr
    wav, rate = sf.read(out)
    assert rate == 24000 and wav.shape == (4 * 1920 - 555,)
    assert "24000 Hz" in r.stderr and "noise" in r.stderr


def test_speak_fish_demo_saved_voice_equals_reference_file(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIVOX_CACHE", str(cache))
    ref = tmp_path / "clip.wav"
    ref.write_bytes(reference_wav(seed=3))
    outs = {}
    for kind in ("plain", "ref", "saved"):
        args = ["speak", "--model", "fish-demo", "--text", "Hello there.", "--seed", "4", "--max-frames", "20",
                "--out", str(tmp_path / f"{kind}.wav")]
        if kind == "ref":
            args += ["--ref-audio", str(ref), "--ref-text", "a reference"]
        elif kind == "saved":
            voices = _save_voice(tmp_path, ref)
            args += ["--voice", "bob", "--voices-dir", str(voices)]
        r = cli(*args)
        assert r.returncode == 0, r.stderr
        outs[kind], rate = sf.read(tmp_path / f"{kind}.wav", dtype="int16")
        assert rate == 44100 and outs[kind].size > 0 and "44100 Hz" in r.stderr
    assert np.array_equal(outs["saved"], outs["ref"]) and not np.array_equal(outs["plain"], outs["ref"])


def _save_voice(tmp_path, ref):
    """A voice file as the server saves it (Voice.save of the encoded clip), in a voices folder."""
    from omnivox import FishTTS
    from omnivox.models.fish_s2.demo import fish_demo_path

    voices = tmp_path / "voices"
    voices.mkdir()
    tts = FishTTS(fish_demo_path(), progress=False)
    try:
        tts.encode_voice(str(ref), "a reference").save(voices / "bob.voice")
    finally:
        tts.close()
    return voices


@pytest.mark.parametrize("case", ["unknown-saved", "bad-name", "qwen-ref", "half-ref", "both", "speaker",
                                  "model-type", "empty"])
def test_speak_errors_are_one_line(cache, tmp_path, case):
    args = {"unknown-saved": ["--model", "fish-demo", "--voice", "nobody"],
            "bad-name": ["--model", "fish-demo", "--voice", "../x"],
            "qwen-ref": ["--ref-audio", __file__, "--ref-text", "x"],
            "half-ref": ["--model", "fish-demo", "--ref-audio", __file__],
            "both": ["--model", "fish-demo", "--voice", "a", "--ref-audio", __file__, "--ref-text", "x"],
            "speaker": ["--voice", "nobody", "--max-frames", "2"],
            "model-type": ["--model", str(tmp_path)],
            "empty": ["--model", "fish-demo", "--text", " "]}[case]
    if case == "model-type":
        (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    text = [] if "--text" in args else ["--text", "Hi"]
    r = cli("speak", *text, *args, "--out", str(tmp_path / "x.wav"), env={"OMNIVOX_CACHE": str(cache)})
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and "Traceback" not in r.stderr and len(lines[-1]) < 300, r.stderr
    assert not (tmp_path / "x.wav").exists()
