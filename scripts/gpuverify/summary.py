"""The summary table: one line per figure, with its goal where the issue sets one."""
from __future__ import annotations

from typing import Any

Row = tuple[str, str, str, str]  # figure, value, goal, met


def _get(d: Any, *keys, default=None):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def _goal(value, limit: float, below: bool, full: bool) -> str:
    if value is None or not full:
        return "-"
    return "met" if (value <= limit if below else value >= limit) else "NOT met"


def rows(phases: list[dict], full: bool) -> list[Row]:
    by = {p["name"]: p for p in phases}
    out: list[Row] = [("phases ok", f"{sum(p['ok'] for p in phases)}/{len(phases)}: " +
                       " ".join(f"{p['name']}{'' if p['ok'] else '(!)'}" for p in phases), "", "")]
    r = _get(by, "probe", "results") or {}
    if "copy" in r:
        out += [("probe: copy (read + write)", f"{r['copy']['tb_s']} TB/s", "~4.3 TB/s", ""),
                ("probe: bf16 matmul", f"{r['matmul']['tflop_s']} TFLOP/s", "~790", "")]
    r = _get(by, "build", "results") or {}
    if "omnivox" in r:
        o, t = r["omnivox"], r.get("transformers", {})
        out.append(("build: omnivox Qwen3-Omni", f"{o['params'] / 1e9:.2f} B params, {o['gib']} GiB, "
                    f"fill {o['fill_s']} s", "", ""))
        out.append(("build: transformers twin", f"shared {t.get('shared_gib')} GiB, copied {t.get('copied_gib')} GiB, "
                    f"unmatched {t.get('n_unmatched')}" if "shared_gib" in t else str(t.get("skipped")), "", ""))
    for c in _get(by, "kernels", "results", "attention", default=[]):
        value = c.get("error") or (f"triton {c.get('triton_paged_us')} us / torch {c.get('torch_ref_us')} us; "
                                   f"err {c.get('triton_paged_rel_err', float('nan')):.1e}")
        out.append((f"attention {c['shape']} {c['step']}", value, "err <= 1e-2", "met" if c["ok"] else "NOT met"))
    for c in _get(by, "kernels", "results", "moe", default=[]):
        value = c.get("error") or f"{c['us']} us, {c['experts_hit']} experts, {c['gb_s']} GB/s ({c['impl']})"
        out.append((f"moe {c['layer']} B={c['batch']}", value, "", "" if c["ok"] else "NOT ok"))
    g = _get(by, "graphs", "results") or {}
    if "skipped" in g or "error" in g:
        out.append(("graphs: replay == eager", f"{'skipped' if 'skipped' in g else 'error'}: "
                    f"{g.get('skipped') or g.get('error')}"[:200], "", ""))
    for part, goal in (("fp32_exact", "equal"), ("bf16", "(info)")):
        for key, c in (_get(g, part, "buckets") or {}).items():
            met = ("met" if c["ok"] else "NOT met") if part == "fp32_exact" else ""
            out.append((f"graphs {part} {key}: replay vs eager", f"text {c['text_equal']}/{c['requests']}, codes "
                        f"{c['codes_equal']}/{c['requests']} (first diff frame {c['first_frame_differing']}/"
                        f"{c['frames']}); ms/step eager {c['eager_ms_per_step']} / graph {c['graph_ms_per_step']}",
                        goal, met))
    for name in ("thinker", "talker", "code2wav"):
        p = _get(by, "parity", "results", name)
        if p and not all(k in p for k in ("implementation", "ours", "floor")):
            out.append((f"parity {name}", f"incomplete: {p.get('errors')}"[:200], "within floor", "NOT met"))
        elif p:
            top = f", top-1 {p['ours'].get('top1')} vs floor {p['floor'].get('top1')}" if "top1" in p["ours"] else ""
            out.append((f"parity {name}", f"impl cos {p['implementation']['cos_min']:.5f}; ours cos "
                        f"{p['ours']['cos_mean']:.5f} vs floor {p['floor']['cos_mean']:.5f}{top}", "within floor",
                        "met" if p["ok"] else "NOT met"))
    out += _speed_rows("omnivox", _get(by, "qwen_speed", "results") or {}, full, text=True)
    kv = _get(by, "qwen_speed", "results", "kv_budget")
    if kv:
        out.append(("KV budget at 0.9 (no --kv-cache-mb), worst-case steps beside it", kv["line"][:160]
                    + (f"; peak reserved {kv['peak_reserved_gib']} of {kv['total_gib']} GiB" if "total_gib" in kv else ""),
                    "no OOM, within 0.9", "met" if kv["ok"] else "NOT met"))
    out += _placement_rows(_get(by, "placement", "results") or {})
    out += _tp_rows(_get(by, "tp", "results") or {})
    h = _get(by, "hf_generate", "results") or {}
    if "text" in h:
        out.append(("transformers: Thinker text tokens/s (overall)", str(h["text"]["tokens_per_s_overall"]), "", ""))
    if "speech_1" in h:
        out.append(("transformers: speech 1 stream TTFA / RTF", f"{h['speech_1']['ttfa_ms']} ms / {h['speech_1']['rtf']}",
                    "", ""))
    out += _speed_rows("S2 Pro", _get(by, "s2_speed", "results") or {}, full, text=False)
    for key, row in (_get(by, "spec", "results") or {}).items():
        for method, name in (("dflash", "DFlash"), ("eagle3", "EAGLE-3")):
            if key.startswith("B=") and method in row:  # a verify step (7 drafts a row) against a plain step
                m = row[method]
                out.append((f"{name} verify / plain step ms ({key})", f"{m['ms_per_step']} / "
                            f"{row['plain']['ms_per_step']} = {m['verify_vs_plain_step']}x", "same output",
                            "met" if m["same_output"] else "NOT met"))
    f = _get(by, "fp8", "results") or {}
    for what in ("linear", "moe"):  # the block-FP8 kernels against bf16 on the dequantized weights
        for c in f.get(what, []):
            if "us_fp8" in c:
                vs = f" vs bf16 {c['us_bf16']:.0f} µs" if "us_bf16" in c else ""
                out.append((f"FP8 {what} B={c['batch']}: µs, rel err", f"{c['us_fp8']:.0f}{vs}; {c['rel_err_fp8']:.3g}",
                            "error bound", "met" if c["ok"] else "NOT met"))
    for key, row in (f.get("decode") or {}).items():
        if key.startswith("B="):  # the narrow model's Thinker decode step, FP8 against the float run
            base = next(k for k in row if k.endswith("_ms_per_step") and not k.startswith("fp8"))
            out.append((f"FP8 vs {base.split('_')[0]} Thinker step ms ({key})",
                        f"{row['fp8_ms_per_step']} vs {row[base]} (ids equal {row['ids_equal_share']:.0%})", "(info)", ""))
    out += _duplex_rows(_get(by, "duplex", "results") or {}, full)
    return out


def _duplex_rows(r: dict, full: bool) -> list[Row]:
    """Moshi (released depths, narrow): ms per engine frame step against the 80 ms frame, per B."""
    out: list[Row] = []
    bad = next((k for k in ("skipped", "error", "out_of_time") if k in r), None)
    if bad:
        out.append(("duplex: Moshi frame step", f"{bad}: {r[bad]}"[:200], "", "NOT ok"))
    for key, c in r.items():
        if key.startswith("B="):
            out.append((f"duplex: Moshi frame step ms ({key})", f"{c['ms_per_step']} (headroom {c['headroom']}x; "
                        f"{c['ms_per_session_frame']} per session-frame)", "<= 80 ms",
                        _goal(c["ms_per_step"], 80.0, True, full)))
    if "kv" in r:
        out.append(("duplex: KV pages per session, sessions at once", f"{r['kv']['session_pages']}, "
                    f"{r['kv']['max_sessions']} (in {r['kv']['kv_cache_mb']:g} MB)", "(info)", ""))
    return out


def _placement_rows(r: dict) -> list[Row]:
    """Thinker on the GPU, Talker + vocoder on the CPU: two loops equal one, and what they overlap."""
    out: list[Row] = []
    e, v, o = r.get("equality"), r.get("vs_one_device") or {}, r.get("overlap") or {}
    bad = next((k for k in ("skipped", "error", "out_of_time") if k in r), None)
    if bad and not e:
        out.append(("placement: Thinker GPU, Talker+vocoder CPU", f"{bad}: {r[bad]}"[:200], "", "NOT ok"))
    if e:
        one = (f"; vs one device: text {v['text_equal']}/{v['requests']}, frames equal {v['codes_frames_equal']:.0%}"
               if v.get("codes_frames_equal") is not None else "")
        out.append(("placement: two loops vs one (text, codes, audio)", f"text {e['text_equal']}/{e['requests']}, "
                    f"codes {e['codes_equal']}/{e['requests']}, audio diff {e['audio_max_abs_diff']}{one}",
                    "equal", "met" if e["ok"] else "NOT met"))
    if o.get("serial_ms_per_step"):
        pct = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
        cross = (o.get("crossing_ms_per_step") or {}).get("overlapped")
        out.append(("placement: ms/step one device | serial | two loops", f"{o.get('one_device_ms_per_step')} | "
                    f"{o['serial_ms_per_step']} | {o.get('overlapped_ms_per_step')} (overlap {pct(o.get('overlap'))}, "
                    f"ideal {pct(o.get('ideal_overlap'))}; crossings {cross} ms/step)", "(info)", ""))
    return out


def _tp_rows(r: dict) -> list[Row]:
    """TP 2 on one GPU (gloo) equals TP 1; its step cost and the per-rank layers' ms."""
    out: list[Row] = []
    e, st = r.get("equality"), r.get("step") or {}
    bad = next((k for k in ("skipped", "error", "out_of_time") if k in r), None)
    if bad and not e:
        out.append(("tp: TP 2 (one GPU, gloo) vs TP 1", f"{bad}: {r[bad]}"[:200], "", "NOT ok"))
    if e:
        out.append(("tp: TP 2 (one GPU, gloo) vs TP 1 (text, codes, audio)", f"text {e['text_equal']}/{e['requests']}, "
                    f"codes {e['codes_equal']}/{e['requests']}, audio diff {e['audio_max_abs_diff']}", "identical",
                    "met" if e["text_ids_identical"] and e["codes_identical"] else "NOT met"))
    if st.get("tp1_ms_per_step"):
        layer = {(c["tp"], c["batch"]): c.get("layer_ms") for c in _get(r, "per_rank_kernels", "rows", default=[])}
        per = "; ".join(f"B={b} " + "|".join(str(layer.get((n, b))) for n in (1, 2, 4)) for b in (1, 64)
                        if (1, b) in layer)
        out.append(("tp: ms/step TP 1 | TP 2; layer ms TP 1|2|4", f"{st['tp1_ms_per_step']} (graphs "
                    f"{st.get('tp1_graphs_ms_per_step')}) | {st['tp2_ms_per_step']}, {st['tp2_bytes_per_step']} B/step "
                    f"sent; attn+MoE {per}", "(info)", ""))
    return out


def _speed_rows(who: str, r: dict, full: bool, text: bool) -> list[Row]:
    out: list[Row] = []
    t = r.get("text", {})
    if text and "tokens_per_s" in t:
        out.append((f"{who}: Thinker text tokens/s (decode, B=1)", f"{t['tokens_per_s']} ({t['gb_s']} GB/s, "
                    f"{t['of_peak']:.0%} of 4.3 TB/s)", ">= 300 (vLLM 229)", _goal(t["tokens_per_s"], 300, False, full)))
    s1 = r.get("speech_1", {})
    if s1:
        out.append((f"{who}: speech 1 stream TTFA p50", f"{s1.get('ttfa_ms_p50')} ms", "<= 120 ms",
                    _goal(s1.get("ttfa_ms_p50"), 120, True, full)))
        rtf = s1.get("rtf_mean", s1.get("rtf_partial"))
        out.append((f"{who}: speech 1 stream RTF", f"{rtf}", "<= 0.05 (stretch)", _goal(rtf, 0.05, True, full)))
    lp = r.get("speech_loop", {})
    if lp:
        rtf = lp.get("rtf_mean", lp.get("rtf_partial"))
        extra = f", {lp['gb_s']} GB/s" if "gb_s" in lp else ""
        out.append((f"{who}: speech closed loop RTF per stream", f"{rtf} ({lp['requests_done']} done, "
                     f"{lp.get('audio_s_per_s')} audio-s/s{extra}{', cut short' if lp.get('cut_short') else ''})",
                     "<= 0.3", _goal(rtf, 0.3, True, full)))
    sc = r.get("scheduling", {})
    if "slack" in sc:
        f, s = sc["fifo"], sc["slack"]
        out.append((f"{who}: gap-free at 1.5x capacity (slack | fifo)",
                    f"{s['gap_free']:.0%} | {f['gap_free']:.0%} (goodput {s['goodput']} | {f['audio_s_per_s']} "
                    f"audio-s/s)", ">= 95 %, goodput >= 70 % of fifo's",
                    _goal(s["gap_free"] if s["goodput"] >= 0.7 * f["audio_s_per_s"] else 0.0, 0.95, False, full)))
    return out


def table(rs: list[Row]) -> str:
    w = [max(len(r[i]) for r in rs) for i in range(4)]
    head = ("figure", "value", "goal", "met")
    w = [max(a, len(b)) for a, b in zip(w, head)]
    line = lambda r: "  ".join(c.ljust(n) for c, n in zip(r, w)).rstrip()  # noqa: E731
    return "\n".join([line(head), "-" * (sum(w) + 6)] + [line(r) for r in rs])
