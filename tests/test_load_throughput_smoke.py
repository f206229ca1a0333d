"""benchmarks/load_throughput.py: the synthetic checkpoint has the released layout, and one
measurement runs end to end on a small sharded checkpoint (no timings asserted)."""
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import load_throughput as lt  # noqa: E402


def test_released_layout_and_the_depth_cut():
    released = json.loads(lt.RELEASED.read_text())
    layout = lt.disk_layout(released)
    assert len(layout) == 28010  # the released index's tensor count (spec 12.1)
    assert "thinker.model.layers.47.mlp.experts.127.down_proj.weight" in dict(layout)
    assert lt.checkpoint_bytes(released) == 2 * 35_259_818_545  # every parameter once, bf16
    cfg = lt.config_for(16.0)
    assert cfg["thinker_config"]["text_config"]["num_hidden_layers"] == 4
    assert 14e9 < lt.checkpoint_bytes(cfg) <= 16e9


def test_one_measurement_on_a_small_sharded_checkpoint(tmp_path):
    from qwen_tiny import build_reference, save_reference

    folder = save_reference(build_reference(), tmp_path / "ckpt", max_shard_size="20MB")
    git = shutil.which("git") is not None and (ROOT / ".git").exists()
    r = lt.measure(folder, "float32", "cpu", repeat=1, profile=False, baseline="HEAD" if git else None)
    assert r["files"] > 1
    for key in ("raw", "warm", "fresh", "loader") + (("baseline",) if git else ()):
        assert r[key]["gb_s"] > 0 and len(r[key]["all_seconds"]) == 1
    assert "loader / raw disk" in lt.report(r)
