"""The CLI's rough edges: numeric flags refused at parse time (usage error, exit 2, before anything
loads), `omnivox --version` and defaults in every subcommand's --help, in this process (`cli`);
`omnivox bench` printing a clean table (no library warnings, n/a with its reason instead of nan,
ratios worded in the direction of the numbers), in a real subprocess (a warning shows once per
process)."""
import os
import re
import subprocess
import sys
from importlib.metadata import version

import pytest
from cli_inprocess import cli


def run(*args, merge=False):
    """The CLI in a subprocess; `merge`: stderr into stdout's pipe, in the order the lines are written."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OMNIVOX_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "omnivox.cli", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True, timeout=300, env=env)


@pytest.mark.parametrize("args,words", [
    (["serve", "--port", "99999"], "argument --port: must be an integer within 0-65535"),
    (["serve", "--port", "-1"], "argument --port: must be an integer within 0-65535"),
    (["serve", "--port", "0", "--cpu-threads", "0"], "argument --cpu-threads: must be an integer >= 1"),
    (["serve", "--port", "0", "--max-body-mb", "inf"], "argument --max-body-mb: must be a positive number"),
    (["serve", "--port", "0", "--body-timeout", "nan"], "argument --body-timeout: must be a positive number"),
    (["serve", "--port", "0", "--kv-cache-mb", "1e300"], "argument --kv-cache-mb: must be a positive number up to"),
    (["serve", "--port", "0", "--speculative-config", "{ngram}"],
     "argument --speculative-config: speculative config is not valid JSON"),
    (["serve", "--port", "0", "--speculative-config", '{"method": "ngram", "num_tokens": 4}'],
     "argument --speculative-config: unknown speculative config key(s) num_tokens"),
    # the proposer's host work grows with the window: 10^9 made a 0.4 s request take 38 s
    (["serve", "--port", "0", "--speculative-config", '{"method": "ngram", "prompt_lookup_max": 1000000000}'],
     "argument --speculative-config: speculative prompt_lookup_max must be at most 16"),
    (["serve", "--port", "0", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 65}'],
     "argument --speculative-config: speculative num_speculative_tokens must be at most 64"),
    (["bench", "--seed", "-1"], "argument --seed: must be an integer >= 0"),
    (["bench", "--reply-tokens", "0"], "argument --reply-tokens: must be an integer >= 1"),
    (["bench", "--rate", "nan"], "argument --rate: must be a positive number"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_numbers_are_usage_errors(args, words):
    r = cli(*args)  # a flag let through fails at binding (cli), after loading the model
    assert r.returncode == 2, (r.returncode, r.stderr)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"omnivox {args[0]}: error: ") and words in last, r.stderr
    assert "Traceback" not in r.stderr and "internal" not in r.stderr
    assert "loading weights" not in r.stderr  # refused before any model loads


def test_speculative_config_on_a_model_without_a_thinker_is_refused():
    """S2 has no Thinker to draft for: one line, exit 2, before binding (was: accepted and ignored)."""
    r = cli("serve", "--port", "0", "--model", "fish-demo", "--speculative-config", '{"method": "ngram"}')
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.strip().splitlines() == ["error: --speculative-config drafts a Thinker's text; Fish S2 has no "
                                             "Thinker: remove the flag"]


def test_version_comes_from_the_package_metadata():
    r = cli("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"omnivox {version('omnivox')}"


@pytest.mark.parametrize("command,shown", [
    ("generate", ["--dtype {float32,bfloat16,float16} weights' dtype (default: float32)"]),
    ("speak", ["--device DEVICE cpu, cuda, cuda:1, ... (default: cpu)"]),
    ("serve", ["--port PORT port to bind; 0 picks a free one (default: 8000)",
               "--max-running MAX_RUNNING requests running at once (default: 32)",
               "(408 and the connection closed beyond) (default: 60.0)"]),
    ("bench", ["--num-requests NUM_REQUESTS requests measured", "(default: 16)",
               "--seed SEED seed of the prompts (and S2's sampling: seed + i) (default: 0)"]),
])
def test_help_shows_defaults_without_noise(command, shown):
    r = cli(command, "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # argparse wraps lines at the terminal's width
    for words in shown:
        assert words in text, text
    for noise in ("(default: None)", "(default: False)", "(default: [])", "(default: )"):
        assert noise not in text


RATIO = re.compile(r"^(\S+) vs (.+): TTFA p50 (.+), throughput (.+), RTF (.+)$")
COLS = ["ttfa_p50", "ttfa_p90", "rtf", "on_time", "no_stall", "audio_s_per_s", "wall"]


def _direction(words: str, mine: float, theirs: float, lower_is_better: bool) -> None:
    """`words` ("2.46x lower (better)") says how `mine` stands against `theirs` (as printed, 3 decimals)."""
    if words == "the same":
        assert abs(mine - theirs) <= 0.002, (mine, theirs)
        return
    m = re.fullmatch(r"(\d+\.\d\d)x (lower|higher) \((better|worse)\)", words)
    assert m, words
    factor, way, verdict = float(m[1]), m[2], m[3]
    assert factor >= 1
    if abs(mine - theirs) > 0.002:  # the printed values tell the direction
        assert way == ("lower" if mine < theirs else "higher"), (words, mine, theirs)
        assert abs(factor - max(mine, theirs) / min(mine, theirs)) <= 0.1 * factor, (words, mine, theirs)
    assert verdict == ("better" if (way == "lower") == lower_is_better else "worse"), words


@pytest.mark.parametrize("model,extra,systems", [
    ("qwen-demo", ["--prompt-tokens", "16", "--reply-tokens", "2"],  # vs transformers one by one and batched
     ["omnivox", "hf batch=1", "hf batch=2"]),
    ("fish-demo", [], ["omnivox", "omnivox-seq"]),  # vs omnivox one request at a time
    ("qwen-demo", ["--prompt-tokens", "16", "--reply-tokens", "6", "--hf-batched-only",  # drafts: a spec_len column
                   "--speculative-config", '{"method": "dflash", "model": "demo"}'], ["omnivox", "hf batch=2"]),
])
def test_bench_output_is_one_clean_table(model, extra, systems):
    r = run("bench", "--model", model, "--num-requests", "2", "--concurrency", "2", "--reply-frames", "3", *extra,
            merge=True)  # stderr into the same pipe: a warning anywhere would show among the lines
    assert r.returncode == 0, r.stdout
    lines = r.stdout.splitlines()
    cols = COLS + (["spec_len"] if "--speculative-config" in extra else [])  # the column only where measured
    assert lines[0].startswith("model ") and lines[1].split() == ["system", *cols], r.stdout
    row = re.compile(r"^\s*(\S.*?)" + r"\s+(\S+)" * len(cols) + "$")
    assert not re.search(r"\bnan\b", r.stdout, re.IGNORECASE), r.stdout
    tail = 2 if "spec_len" in cols else 1  # the audio line, then what the drafts did
    assert lines[-1].startswith("speculation (dflash): ") or tail == 1, r.stdout
    rows, notes, ratios = {}, [], []
    for line in lines[2:-tail]:
        if line.startswith("n/a: "):
            notes.append(line)
        elif RATIO.match(line):
            ratios.append(RATIO.match(line))
        else:  # a table row, nothing else (no warning, no progress bar) inside the table
            m = row.match(line)
            assert m and not ratios and not notes, f"unexpected line {line!r} in:\n{r.stdout}"
            rows[m[1]] = {c: (None if v == "n/a" else float(v)) for c, v in zip(cols, m.groups()[1:])}
    assert lines[-tail].startswith("audio: "), r.stdout
    assert list(rows) == systems and [m[2] for m in ratios] == systems[1:], r.stdout
    assert ("of 24 kHz audio each" if model == "qwen-demo" else "audio produced at 44100 Hz") in lines[0], lines[0]
    for system, row in rows.items():  # each n/a is explained under the table
        for col, v in row.items():
            if v is None:
                assert any(n.startswith(f"n/a: {col} of ") and system in n for n in notes), r.stdout
    if model == "qwen-demo":  # transformers returns each reply whole: its on_time cannot be measured
        assert rows["hf batch=2"]["on_time"] is None
    if "spec_len" in cols:  # omnivox's mean tokens per verify step (the demo draft accepts); the baseline has none
        assert rows["omnivox"]["spec_len"] >= 1 and rows["hf batch=2"]["spec_len"] is None, r.stdout
    for ratio in ratios:
        base, other = rows["omnivox"], rows[ratio[2]]
        _direction(ratio[3], base["ttfa_p50"], other["ttfa_p50"], lower_is_better=True)
        _direction(ratio[4], base["audio_s_per_s"], other["audio_s_per_s"], lower_is_better=False)
        _direction(ratio[5], base["rtf"], other["rtf"], lower_is_better=True)
