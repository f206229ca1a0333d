"""scripts/gpu_verify.py --tiny: every phase of the GPU check runs on CPU with the demo-sized models,
in a child Python that lacks what the GPU machine lacks (soundfile, fastapi, uvicorn, pydantic), so
the first minute on a lent GPU is not spent on a typo or a missing package."""
import importlib.util
import json
import os
import subprocess

from gpu_machine import ROOT, python

PHASES = ["probe", "build", "kernels", "graphs", "parity", "qwen_speed", "placement", "tp", "hf_generate", "s2_speed",
          "spec", "fp8", "duplex", "summary"]


def test_tiny_dry_run_writes_every_phase(tmp_path):
    code = ("import runpy; sys.argv = ['scripts/gpu_verify.py', '--tiny', '--out', "
            f"{str(tmp_path)!r}]; runpy.run_path('scripts/gpu_verify.py', run_name='__main__')")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    # ~30 s quiet; the script bounds itself (--budget-s 480, each phase in its time box): only a hang ends here
    r = subprocess.run(python(code), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_verify.json").read_text())
    phases = {p["name"]: p for p in doc["phases"]}
    assert list(phases) == PHASES
    assert all(set(p) == {"name", "ok", "seconds", "results"} for p in doc["phases"])

    # graphs: fake capture; tp: two processes on the CPU (gloo)
    expect_ok = {"probe", "build", "graphs", "qwen_speed", "placement", "tp", "s2_speed", "spec", "duplex",
                 "summary"}
    if importlib.util.find_spec("triton") is not None:
        expect_ok |= {"kernels", "fp8"}
    if importlib.util.find_spec("transformers") is not None:
        expect_ok |= {"parity", "hf_generate"}
    failed = {n: phases[n]["results"] for n in expect_ok if not phases[n]["ok"]}
    assert not failed, json.dumps(failed, indent=1, default=str)[:4000]
    exact = phases["graphs"]["results"]["fp32_exact"]
    assert exact["all_replayed"] and all(c["ok"] for c in exact["buckets"].values())

    # the figures the summary is made of are there, and the table names them
    q = phases["qwen_speed"]["results"]
    assert q["kv_budget"]["ok"] and q["kv_budget"]["line"].startswith("KV budget cpu: 0.9 x 0.1 GiB")
    assert q["text"]["tokens"] == 16 and q["speech_loop"]["requests_done"] == 4 and q["speech_1"]["rtf_mean"] > 0
    assert phases["s2_speed"]["results"]["speech_loop"]["requests_done"] == 4
    sched = q["scheduling"]  # issue 21's comparison: both policies ran every request
    assert sched["rate_per_s"] > 0 and all(0 <= sched[p]["gap_free"] <= 1 and not sched[p]["cut_short"]
                                           for p in ("fifo", "slack"))
    pl = phases["placement"]["results"]  # two loops on the CPU ("thinker,talker+vocoder") equal one loop exactly
    eq, one = pl["equality"], pl["vs_one_device"]
    assert eq["ok"] and eq["text_equal"] == eq["codes_equal"] == eq["requests"] == 3
    assert eq["audio_max_abs_diff"] <= 1e-4
    assert one["text_equal"] == one["requests"] and 0 <= one["codes_frames_equal"] <= 1
    assert pl["runs"]["overlapped"]["loops"] == [["encoder", "thinker"], ["talker", "vocoder"]]  # the encoder feeds the Thinker
    assert all(pl["overlap"][f"{k}_ms_per_step"] > 0 for k in ("one_device", "serial", "overlapped"))
    tp = phases["tp"]["results"]  # TP 2 (two processes on the CPU, gloo) equals TP 1; every worker stopped
    assert tp["equality"]["text_ids_identical"] and tp["equality"]["codes_identical"]
    assert tp["equality"]["requests"] == 3 and tp["equality"]["audio_max_abs_diff"] is not None
    assert tp["runs"]["tp2"]["rank_devices"] == ["cpu", "cpu"] and tp["runs"]["tp2"]["workers_left"] == 0
    assert tp["step"]["tp2_bytes_per_step"] > 0 and tp["step"]["tp1_ms_per_step"] > 0
    assert {(c["tp"], c["batch"]) for c in tp["per_rank_kernels"]["rows"] if c["ok"]} == {
        (n, b) for n in (1, 2, 4) for b in (1, 8, 64)}
    fp8 = phases["fp8"]["results"]  # the kernels at the Thinker's shapes; the narrow model's steps, FP8 vs float
    if "fp8" in expect_ok:
        d = fp8["decode"]
        assert d["fp8_thinker_float8_bytes"] > 0 == d["float32_thinker_float8_bytes"] and d["B=1"]["fp8_ms_per_step"] > 0
    spec = phases["spec"]["results"]  # DFlash and EAGLE-3 verify steps against a plain decode step
    assert all(spec["B=1"][m]["same_output"] and spec["B=1"][m]["ms_per_step"] > 0 for m in ("dflash", "eagle3"))
    dx = phases["duplex"]["results"]  # Moshi frame steps at each B; its KV facts under the phase's budget
    assert all(dx[f"B={b}"]["ms_per_step"] > 0 for b in (1, 3))
    assert dx["kv"]["session_pages"] > 0 and dx["kv"]["max_sessions"] == 3
    if "parity" in expect_ok:
        assert phases["parity"]["results"]["thinker"]["implementation"]["cos_min"] > 0.999
    table = phases["summary"]["results"]["table"]
    for figure in ("Thinker text tokens/s", "speech 1 stream TTFA", "closed loop RTF", "gap-free at 1.5x",
                   "placement: two loops vs one", "tp: TP 2 (one GPU, gloo) vs TP 1", "S2 Pro",
                   "duplex: Moshi frame step"):
        assert figure in table
    assert table in r.stdout
