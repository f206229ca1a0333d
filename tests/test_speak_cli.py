"""`omnivox speak` on both families and `omnivox bench` on the S2 demo, in subprocesses: wav files
at the right rate, a saved voice equal to the same reference given as a file; speak's one-line
errors in this process (`cli`)."""
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


def test_speak_fish_demo_saved_voice_equals_reference_file(cache, tmp_path):
    ref = tmp_path / "clip.wav"
    ref.write_bytes(reference_wav(seed=3))
    outs = {}
    for kind in ("plain", "ref", "saved"):
        args = ["speak", "--model", "fish-demo", "--text", "Hello there.", "--seed", "4", "--max-frames", "20",
                "--out", str(tmp_path / f"{kind}.wav")]
        if kind == "ref":
            args += ["--ref-audio", str(ref), "--ref-text", "a reference"]
        elif kind == "saved":
            voices = _save_voice(cache, tmp_path, ref)
            args += ["--voice", "bob", "--voices-dir", str(voices)]
        r = run(cache, *args)
        assert r.returncode == 0, r.stderr
        outs[kind], rate = sf.read(tmp_path / f"{kind}.wav", dtype="int16")
        assert rate == 44100 and outs[kind].size > 0 and "44100 Hz" in r.stderr
    assert np.array_equal(outs["saved"], outs["ref"]) and not np.array_equal(outs["plain"], outs["ref"])


def _save_voice(cache, tmp_path, ref):
    """A voice file as the server saves it (Voice.save of the encoded clip), in a voices folder."""
    code = ("import sys, torch; torch.set_num_threads(1)\n"
            "from omnivox import FishTTS\nfrom omnivox.models.fish_s2.demo import fish_demo_path\n"
            "t = FishTTS(fish_demo_path(), progress=False)\n"
            "t.encode_voice(sys.argv[1], 'a reference').save(sys.argv[2])\n")
    voices = tmp_path / "voices"
    voices.mkdir()
    env = dict(os.environ, OMNIVOX_CACHE=str(cache), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", code, str(ref), str(voices / "bob.voice")], check=True, env=env,
                   timeout=120)
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


def test_bench_on_the_fish_demo_prints_both_rows(cache):
    r = run(cache, "bench", "--model", "fish-demo", "--num-requests", "4", "--concurrency", "2",
            "--prompt-tokens", "6", "--reply-frames", "15")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "audio produced at 44100 Hz" in lines[0]
    header = next(i for i, line in enumerate(lines) if "ttfa_p50" in line)
    assert [line.split()[0] for line in lines[header + 1:header + 3]] == ["omnivox", "omnivox-seq"]
    assert any(line.startswith("omnivox vs omnivox-seq: TTFA p50") for line in lines)
