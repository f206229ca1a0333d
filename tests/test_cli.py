"""`omnivox generate` end to end in a subprocess (output, files), its one-line errors and
`serve`'s flag errors in this process (`cli`) where a subprocess adds nothing to the check."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import soundfile as sf
from cli_inprocess import cli

MEDIA = Path(__file__).parent / "media"


def run(*args, cwd=None):
    env = dict(os.environ)
    env.pop("OMNIVOX_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "omnivox.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


def test_generate_json_and_wav_on_the_demo_model(tmp_path):
    out = tmp_path / "reply.wav"
    r = run("generate", "--prompt", "Hello! Who are you?", "--audio", str(MEDIA / "speech_16k.wav"),
            "--greedy", "--max-tokens", "6", "--max-frames", "12", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert set(data) >= {"text", "text_ids", "codes", "audio_seconds", "sample_rate"}
    assert len(data["text_ids"]) == 6 and len(data["codes"]) == 12 and len(data["codes"][0]) == 16
    assert data["sample_rate"] == 24000
    assert abs(data["audio_seconds"] - (12 * 1920 - 555) / 24000) < 1e-6
    wav, sr = sf.read(out)
    assert sr == 24000 and wav.shape == (12 * 1920 - 555,)


def test_generate_plain_output_says_demo_is_noise():
    r = cli("generate", "--prompt", "Hi", "--max-tokens", "3", "--max-frames", "4")
    assert r.returncode == 0, r.stderr
    assert "random weights" in r.stderr and "noise" in r.stderr


def test_prompt_ids_and_speaker(tmp_path):
    from omnivox.models.qwen3_omni.demo import demo_model_path
    from omnivox.models.qwen3_omni.tokenizer import load_tokenizer
    ids = load_tokenizer(demo_model_path()).encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    r = cli("generate", "--prompt-ids", ",".join(map(str, ids)), "--speaker", "chelsie", "--greedy",
            "--max-tokens", "2", "--max-frames", "3", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["text_ids"]) == 2
    r = cli("generate", "--prompt-ids", "1,2,3", "--max-tokens", "2")  # not a chat layout: clear error
    assert r.returncode == 2 and "assistant header" in r.stderr


def _bad_checkpoint(tmp_path, kind):
    from omnivox.models.qwen3_omni.demo import demo_model_path
    import shutil
    src = demo_model_path()
    dst = tmp_path / kind
    shutil.copytree(src, dst)
    if kind == "corrupt":
        (dst / "model.safetensors").write_bytes(b"garbage" * 10)
    elif kind == "noconfig":
        (dst / "config.json").unlink()
    return dst


@pytest.mark.parametrize("case", ["missing", "corrupt", "noconfig", "audio", "image", "speaker", "context", "ids"])
def test_bad_input_is_one_line_error(tmp_path, case):
    args = ["generate", "--prompt", "Hi", "--max-tokens", "2", "--max-frames", "2"]
    if case == "missing":
        args += ["--model", str(tmp_path / "nope")]
    elif case in ("corrupt", "noconfig"):
        args += ["--model", str(_bad_checkpoint(tmp_path, case))]
    elif case == "audio":
        (tmp_path / "bad.wav").write_bytes(b"RIFF....not audio")
        args += ["--audio", str(tmp_path / "bad.wav")]
    elif case == "image":
        (tmp_path / "bad.png").write_bytes(b"\x89PNG broken")
        args += ["--image", str(tmp_path / "bad.png")]
    elif case == "speaker":
        args += ["--speaker", "nobody"]
    elif case == "context":
        args = ["generate", "--prompt", "word " * 5000, "--max-tokens", "2"]
    elif case == "ids":
        args = ["generate", "--prompt-ids", "1,2,99999999", "--max-tokens", "2"]
    r = cli(*args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert lines and lines[-1].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    assert len(lines[-1]) < 300


def test_api_key_sources(tmp_path):
    import argparse

    from omnivox.errors import OmnivoxError
    from omnivox.serve import resolve_api_key

    def args(key=None, key_file=None):
        return argparse.Namespace(api_key=key, api_key_file=key_file)
    (tmp_path / "k").write_text("  sk-file  \nignored\n")
    (tmp_path / "empty").write_text("\n")
    assert resolve_api_key(args(key_file=tmp_path / "k"), {}) == "sk-file"
    assert resolve_api_key(args(key="sk-arg"), {"OMNIVOX_API_KEY": "sk-env"}) == "sk-arg"
    assert resolve_api_key(args(), {"OMNIVOX_API_KEY": " sk-env "}) == "sk-env"
    assert resolve_api_key(args(), {}) is None
    for bad, words in ((args(key_file=tmp_path / "empty"), "is empty"), (args(key_file=tmp_path / "nope"), "cannot read"),
                       (args(key="a", key_file=tmp_path / "k"), "one of")):
        with pytest.raises(OmnivoxError, match=words):
            resolve_api_key(bad, {})


@pytest.mark.parametrize("args,words", [
    (["--voice-alias", "alloy"], "expected NAME=VOICE"),  # argparse: before anything loads
    (["--allowed-local-media-path", "/nonexistent/omnivox-media"], "is not a directory"),
    (["--voice-alias", "ethan=chelsie"], "'ethan' is already one of this model's voices"),
    (["--voice-alias", "alloy=bob"], "'bob' is not one of this model's voices"),
    (["--first-chunk-frames", "0"], "--first-chunk-frames must be within 1-25"),
], ids=["syntax", "media-dir", "alias-hides-a-voice", "alias-to-nothing", "first-chunk"])
def test_serve_flag_errors_are_one_line(args, words):
    # the alias checks need the model loaded, after binding: a real process; the rest fail before it
    r = (run if "--voice-alias" in args and "=" in args[-1] else cli)("serve", "--port", "0", *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert lines and "error: " in lines[-1] and words in lines[-1], r.stderr
    assert "Traceback" not in r.stderr
