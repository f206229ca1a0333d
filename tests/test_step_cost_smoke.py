"""benchmarks/step_cost.py on a shallow checkpoint: the structure of what it measures (no timings,
no values), and that it leaves torch's Tensor methods as it found them."""
import importlib.util
import json
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "step_cost.py"


def _script():
    spec = importlib.util.spec_from_file_location("step_cost", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_step_cost_smoke(tmp_path):
    sc = _script()
    folder = sc.ensure_checkpoint(sc.SMALL_DEPTH, root=tmp_path)
    assert sc.ensure_checkpoint(sc.SMALL_DEPTH, root=tmp_path) == folder  # cached, not rebuilt
    tolist = torch.Tensor.tolist
    out = tmp_path / "cost.json"
    sc.main(["--no-baseline", "--model", str(folder), "--batches", "1,2", "--max-tokens", "2", "--max-frames", "3",
             "--json", str(out)])
    assert torch.Tensor.tolist is tolist and "__bool__" not in torch.Tensor.__dict__
    result = json.loads(out.read_text())
    assert result["old"] is None
    new = result["new"]
    assert set(new["runs"]) == {"1", "2"}
    for run in new["runs"].values():
        assert run["tokens"] == [2] and run["frames"] == [3]  # ignore_eos: every request runs to its limits
        assert run["steps"] > 0 and run["steps"] == run["steps_timed"]
        assert run["ops"] > 0 and run["cpu_ms"] > 0 and run["reads_ids"] > 0 and run["reads_audio"] > 0
        assert set(run["stages"]) == set(sc.STAGES)
        for name in ("thinker", "talker", "vocoder"):
            assert run["stages"][name]["ops"] > 0 and run["stages"][name]["cpu_ms"] > 0
        assert sum(s["ops"] for s in run["stages"].values()) == run["ops"]
        assert run["stages"]["vocoder"]["reads_audio"] == run["reads_audio"]  # audio copies are the vocoder's
        assert len(run["each_step"]["ops_per_step"]) == run["steps"]
    assert result["goals"][0][0].startswith("<= 2 host reads")  # no B=32 here: no ratio goal
    assert "per stage" in result["table"]
