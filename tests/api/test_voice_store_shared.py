"""Several servers on one --voices-dir behave as one store: two `VoiceStore`s in two processes on
one folder, racing name for name, never both create one name, and never pass --max-voices
together (each process saves as fast as it can once both are released at once)."""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import numpy as np
from api_helpers import ROOT

from omnivox.api.voices import VoiceStore
from omnivox.models.fish_s2.voice import Voice

RACER = """
import json, sys
import numpy as np
from omnivox.api.errors import ApiError
from omnivox.api.voices import VoiceStore
from omnivox.models.fish_s2.voice import Voice

store = VoiceStore(sys.argv[1], max_voices=int(sys.argv[2]))
voice = Voice(np.ones((2, 3), dtype=np.int64), "a reference")
print("ready", flush=True)
sys.stdin.readline()  # both racers are released by one line each
won, refused = [], {}
for name in sys.argv[3].split(","):
    try:
        store.save(name, voice.to_bytes(), "cons_1")
        won.append(name)
    except ApiError as e:
        refused[name] = e.code
print(json.dumps({"won": won, "refused": refused}), flush=True)
"""


@contextlib.contextmanager
def racers(folder, max_voices: int, *name_lists: list[str]):
    """One process per name list, each with its own VoiceStore on `folder`; yields a function
    that releases them together and returns what each won and what each was refused."""
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(folder), str(max_voices), ",".join(names)],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for names in name_lists]

    def race() -> list[dict]:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", "a racer failed to start"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=60)
            assert p.returncode == 0, out
            results.append(json.loads(out))
        return results

    try:
        yield race
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def saved(folder) -> set[str]:
    return {p.stem for p in folder.glob("*.voice")}


def test_two_processes_creating_the_same_names_one_wins_each(tmp_path):
    names = [f"v{i}" for i in range(150)]
    with racers(tmp_path, 1000, names, names) as race:
        a, b = race()
    assert not set(a["won"]) & set(b["won"]), "a name created by both processes"
    assert set(a["won"]) | set(b["won"]) == set(names) == saved(tmp_path)
    assert set(a["refused"].values()) <= {"voice_exists"} and set(b["refused"].values()) <= {"voice_exists"}
    assert set(a["refused"]) == set(b["won"]) and set(b["refused"]) == set(a["won"])
    for name in names:  # every sidecar is the winner's, written once the name was won
        assert json.loads((tmp_path / f"{name}.json").read_text())["consent"] == "cons_1"


def test_max_voices_holds_across_processes(tmp_path):
    existing = 10  # saved by a third store: they count too
    store = VoiceStore(tmp_path, max_voices=40)
    for i in range(existing):
        store.save(f"old{i}", Voice(np.ones((2, 3), dtype=np.int64), "x").to_bytes(), "cons_0")
    with racers(tmp_path, 40, [f"a{i}" for i in range(60)], [f"b{i}" for i in range(60)]) as race:
        a, b = race()
    assert len(saved(tmp_path)) == 40 == existing + len(a["won"]) + len(b["won"])
    assert set(a["refused"].values()) | set(b["refused"].values()) == {"voice_limit_reached"}
    assert store.names() == sorted(saved(tmp_path))  # the store in this process sees the others' voices
