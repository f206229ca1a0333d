"""Every ```bash and ```python block of README.md runs as written, against real servers.

The Qwen3-Omni server is started as `make serve` starts it (`.venv/bin/omnivox serve --host
127.0.0.1`, on a free port), the S2 one with `--model fish-demo`; `:8000` in a block becomes the
server's port. A block preceded by `<!-- no-run: REASON -->` is skipped with that reason. Each
block runs in its own temporary folder that holds `.venv` (a link to the tests' venv) and a copy of
`tests/media`, so the README's relative paths work. It must exit 0 within BLOCK_TIMEOUT_S, print
something (stdout or stderr) and no traceback, and write every wav it names that was not there.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import soundfile

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
VENV = Path(sys.prefix)  # the venv running the tests: `make test` runs .venv's
VENV_BIN = VENV / "bin"
BLOCK_TIMEOUT_S = 120
SERVER_START_TIMEOUT_S = 120
NO_RUN = re.compile(r"^<!--\s*no-run:\s*(.+?)\s*-->$")
S2_MARKERS = ("omnivox-demo-fish-s2", "--model fish-demo")


@dataclass(frozen=True)
class Block:
    line: int            # README line of the opening fence
    lang: str            # "bash" | "python"
    text: str
    no_run: str | None   # the reason, when marked no-run

    @property
    def server(self) -> str | None:
        """Which server the block talks to: "s2", "qwen", or None (it runs offline)."""
        if ":8000" not in self.text:
            return None
        return "s2" if any(m in self.text for m in S2_MARKERS) else "qwen"


def readme_blocks(path: Path = README) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        lang, start = lines[i][3:].strip(), i
        end = next(j for j in range(start + 1, len(lines)) if lines[j].strip() == "```")
        if lang in ("bash", "python"):
            prev = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
            m = NO_RUN.match(prev)
            blocks.append(Block(start + 1, lang, "\n".join(lines[start + 1:end]) + "\n", m and m.group(1)))
        i = end + 1
    return blocks


BLOCKS = readme_blocks()


def test_blocks_found():
    """The parser sees blocks of both kinds, for both servers (a broken fence would drop the rest)."""
    assert {b.lang for b in BLOCKS} == {"bash", "python"}
    assert {b.server for b in BLOCKS if not b.no_run} == {None, "qwen", "s2"}


def test_no_foreground_server():
    """A bash block that runs `omnivox serve` would never return: it must be marked no-run."""
    assert not [b.line for b in BLOCKS if b.lang == "bash" and not b.no_run and re.search(r"\bomnivox serve\b", b.text)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    """This environment (OMNIVOX_CACHE included) without an API key: the examples send none."""
    return {k: v for k, v in os.environ.items() if k != "OMNIVOX_API_KEY"}


def _serve(tmp: Path, *args: str):
    """Start `omnivox serve` on a free port; return (port, stop). The process inherits the test
    session's OMNIVOX_CACHE (tests/conftest.py), so the demos are built there, not in ~/.cache."""
    port, log = _free_port(), tmp / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(VENV_BIN / "omnivox"), "serve", "--host", "127.0.0.1", "--port", str(port),
                                 *args], cwd=tmp, env=_env(), stdout=out, stderr=subprocess.STDOUT)

    def stop():
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"omnivox serve {' '.join(args)} exited {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=2) as r:  # 503 loading
                if r.status == 200:
                    return port, stop
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop()
            pytest.fail(f"omnivox serve {' '.join(args)} not healthy after {SERVER_START_TIMEOUT_S} s:\n"
                        f"{log.read_text()}")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory):
    """`make serve`'s server: the built-in Qwen3-Omni demo with the Makefile's flags."""
    port, stop = _serve(tmp_path_factory.mktemp("serve-qwen"))
    yield port
    stop()


@pytest.fixture(scope="module")
def s2_server(tmp_path_factory):
    """The S2 demo server; its saved voices go to a fresh folder, so a failed run leaves none behind."""
    tmp = tmp_path_factory.mktemp("serve-s2")
    port, stop = _serve(tmp, "--model", "fish-demo", "--voices-dir", str(tmp / "voices"))
    yield port
    stop()


def _workdir(tmp: Path) -> Path:
    (tmp / ".venv").symlink_to(VENV, target_is_directory=True)
    shutil.copytree(ROOT / "tests" / "media", tmp / "tests" / "media")
    return tmp


def _wav_outputs(block: Block, cwd: Path) -> list[Path]:
    """The wav files a block names that are not already there (inputs are)."""
    names = dict.fromkeys(re.findall(r"[\w./-]+\.wav\b", block.text))
    return [cwd / n for n in names if not (cwd / n).exists()]


@pytest.mark.parametrize("block", BLOCKS, ids=[f"README.md:{b.line}-{b.lang}" for b in BLOCKS])
def test_readme_block(block: Block, request, tmp_path):
    if block.no_run:
        pytest.skip(f"no-run: {block.no_run}")
    text = block.text
    if block.server:
        port = request.getfixturevalue("s2_server" if block.server == "s2" else "qwen_server")
        text = text.replace(":8000", f":{port}")
    cwd = _workdir(tmp_path)
    outputs = _wav_outputs(block, cwd)
    script = cwd / ("block.sh" if block.lang == "bash" else "block.py")
    script.write_text(text)
    cmd = ["bash", "-euo", "pipefail"] if block.lang == "bash" else [str(VENV_BIN / "python")]
    # its own process group: on timeout the block's children (curl, omnivox) go with it
    proc = subprocess.Popen([*cmd, str(script)], cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"README.md:{block.line} ran over {BLOCK_TIMEOUT_S} s:\n{text}\n--- stdout\n{stdout}\n"
                    f"--- stderr\n{stderr}")
    report = (f"README.md:{block.line}:\n{text}\n--- exit {proc.returncode}\n--- stdout\n{stdout}\n"
              f"--- stderr\n{stderr}")
    assert proc.returncode == 0, report
    assert "Traceback" not in stdout + stderr, report
    assert (stdout + stderr).strip(), "the block printed nothing\n" + report
    for wav in outputs:
        assert wav.exists() and soundfile.info(str(wav)).frames > 0, f"{wav.name} not written\n{report}"
