"""Turns a benchmark result (the dict ``sweep.py`` builds) into files a reader uses.

This module owns the presentation of a run, not its measurement:

- ``evaluate_targets``: the performance bar of docs/architecture.md as pass/fail lines:
  T1 >= 90% of the copy bandwidth for batch >= 16 at context >= 4k (the policy's
  default arm), T2 >= 80% for batch 1 at context >= 32k on the split-K arm (the
  default kernel implementation), T3 faster than every baseline that ran (same
  configuration, default arm), and C every timed output of ours met the correctness bar.
- ``render_markdown``: environment, copy bandwidth, targets, one table per (model,
  KV dtype) with every arm x implementation and baseline as ``us (% of copy)``, the
  old-vs-new kernel comparison, the ``heads_per_cta`` sweep, every timed row beside
  the static SASS model's prediction, the L2 probe (``l2_probe.probe_markdown``),
  baseline status with reasons, skipped and unmeasured configurations, host overhead.
- ``plot``: TB/s (left axis) and % of copy bandwidth (right axis, same curve) against
  context, one line per batch size: ours (default arm) against the baselines, and
  ours arm by arm. Needs matplotlib; without it the plots are skipped and the
  markdown says so.
- ``write_outputs``: ``STEM_bench.json``, ``STEM_bench.md``, ``STEM_bench.png``,
  ``STEM_arms.png`` where STEM is ``DATE_DEVICE`` (``2026-11-30_H200``); each written
  whole under a temporary name first (the sweep rewrites them as it goes).

Re-render a saved result: ``python -m benchmarks.report RESULT.json --out-dir DIR``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Optional

from .l2_probe import probe_markdown

T1_PCT, T1_MIN_BATCH, T1_MIN_CONTEXT = 90.0, 16, 4096
T2_PCT, T2_BATCH, T2_MIN_CONTEXT = 80.0, 1, 32768
BASELINE_LABELS = {
    "sdpa_gather": "SDPA+gather",
    "sdpa_nogather": "SDPA (pre-gathered)",
    "flex_paged": "FlexAttention",
    "flashinfer": "FlashInfer",
}
ARM_LABELS = {"unpacked": "unpacked", "splitk": "split-K", "gqa_packed": "GQA-packed", "default": "default"}
BASELINE_SHORT = {"sdpa_gather": "sdpa+g", "sdpa_nogather": "sdpa", "flex_paged": "flex", "flashinfer": "fi"}
ARM_SHORT = {"unpacked": "unp", "splitk": "spk", "gqa_packed": "pack", "default": "dflt"}
"""Names on the short progress and summary lines."""


FEATURE_SHORT = {"window": "win", "multi_token": "mt", "soft_cap": "cap", "sinks": "sink"}


def short_label(r: dict) -> str:
    """A row on a short line: ``spk/mma``, ``dflt/mma/h4``, ``sdpa+g``, ``+win`` (a feature row)."""
    if r["impl"] != "metrale":
        return BASELINE_SHORT.get(r["impl"], r["impl"])
    if r.get("feature"):
        return "+" + FEATURE_SHORT.get(r["feature"], r["feature"])
    arm, _, rest = (r.get("arm_label") or r.get("arm") or "ours").partition("/")
    return ARM_SHORT.get(arm, arm) + (f"/{rest}" if rest else "")


# -- selection helpers ---------------------------------------------------------------


def _key(r: dict) -> tuple:
    return (r["model"], r["kv_dtype"], r["batch"], r["context"])


def _timed(r: dict) -> bool:
    return r.get("median_us") is not None


def default_rows(result: dict) -> list[dict]:
    """Ours, the policy's default geometry, one per configuration."""
    return [r for r in result["rows"] if r["impl"] == "metrale" and r.get("default")]


SWEEPS = ("heads_per_cta", "features")
"""Tiers whose rows force something other than the arm: reported in their own tables."""


def arm_rows(result: dict) -> list[dict]:
    """Ours with an arm (and implementation) forced, or the default: every row but the sweeps' (``SWEEPS``)."""
    return [r for r in result["rows"] if r["impl"] == "metrale" and r.get("sweep") not in SWEEPS]


def arm_label(r: dict) -> str:
    """``splitk``, ``splitk/mma``: a row's arm and implementation (the heads_per_cta suffix left off)."""
    return r.get("arm") if not r.get("kernel_impl") else f"{r.get('arm')}/{r['kernel_impl']}"


def _fmt_pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1f}%"


# -- targets -------------------------------------------------------------------------


def evaluate_targets(result: dict) -> list[dict]:
    """The performance and correctness bar as a list of ``{id, description, status, value, detail}``."""
    rows = result["rows"]
    if result.get("mode") == "cpu":
        note = "CPU backend simulator; not kernel performance"
        targets = [dict(id=t, description=d, status="N/A", value=None, detail=note) for t, d in _DESCRIPTIONS[:3]]
    else:
        targets = [_t1(result), _t2(result), _t3(result)]
    targets.append(_correctness(rows))
    return targets


_DESCRIPTIONS = [
    ("T1", f">= {T1_PCT:.0f}% of copy bandwidth, batch >= {T1_MIN_BATCH}, context >= {T1_MIN_CONTEXT // 1024}k "
           "(default arm)"),
    ("T2", f">= {T2_PCT:.0f}% of copy bandwidth, batch {T2_BATCH}, context >= {T2_MIN_CONTEXT // 1024}k "
           "(split-K arm)"),
    ("T3", "faster than every baseline that ran (default arm, same configuration)"),
    ("C", "every timed output of ours met the correctness bar before timing"),
]


def _pct_target(tid: str, rows: list[dict], bar: float, copy_known: bool) -> dict:
    desc = dict(_DESCRIPTIONS)[tid]
    if not copy_known:
        return dict(id=tid, description=desc, status="NOT MEASURED", value=None, detail="no copy bandwidth")
    if not rows:
        return dict(id=tid, description=desc, status="NOT MEASURED", value=None, detail="no such configuration ran")
    timed = [r for r in rows if _timed(r)]
    # A row whose output missed the bar does not pass on speed (an empty or broken launch is fast).
    wrong = [r for r in timed if r.get("status") not in (None, "ok")]
    failing = [r for r in timed if r["pct_of_copy"] < bar or r in wrong]
    untimed = [r for r in rows if not _timed(r)]
    worst = min(timed, key=lambda r: r["pct_of_copy"]) if timed else None
    status = "PASS" if timed and not failing and not untimed else ("FAIL" if timed else "NOT MEASURED")
    detail = f"{len(timed) - len(failing)}/{len(rows)} configurations at or above {bar:.0f}%"
    if worst:
        detail += f"; worst {worst['pct_of_copy']:.1f}% ({_label(worst)})"
    if wrong:
        detail += f"; {len(wrong)} with a wrong output"
    if untimed:
        detail += f"; {len(untimed)} not timed"
    return dict(id=tid, description=desc, status=status, value=worst["pct_of_copy"] if worst else None,
                detail=detail, failures=[_label(r) for r in failing + untimed][:20])


def _label(r: dict) -> str:
    arm = f" {r.get('arm_label') or r['arm']}" if r.get("arm") else ""
    return f"{r['model']} {r['kv_dtype']} b{r['batch']} ctx{r['context']}{arm}"


def _t1(result: dict) -> dict:
    rows = [r for r in default_rows(result) if r["batch"] >= T1_MIN_BATCH and r["context"] >= T1_MIN_CONTEXT]
    return _pct_target("T1", rows, T1_PCT, bool(result.get("copy_tb_per_s")))


def _t2(result: dict) -> dict:
    default_impl = (result.get("kernel_impls") or {}).get("default_impl")
    rows = [r for r in arm_rows(result) if r.get("arm") == "splitk" and r.get("kernel_impl") == default_impl
            and r["batch"] == T2_BATCH and r["context"] >= T2_MIN_CONTEXT]
    return _pct_target("T2", rows, T2_PCT, bool(result.get("copy_tb_per_s")))


def _t3(result: dict) -> dict:
    desc = dict(_DESCRIPTIONS)["T3"]
    ours = {_key(r): r for r in default_rows(result) if _timed(r)}
    per_baseline: dict = {}
    losses = []
    for r in result["rows"]:
        if r["impl"] == "metrale" or not _timed(r) or _key(r) not in ours:
            continue
        mine = ours[_key(r)]
        won = mine["median_us"] < r["median_us"]
        entry = per_baseline.setdefault(r["impl"], {"wins": 0, "total": 0, "min_speedup": math.inf})
        entry["total"] += 1
        entry["wins"] += int(won)
        entry["min_speedup"] = min(entry["min_speedup"], r["median_us"] / mine["median_us"])
        if not won:
            losses.append(f"{BASELINE_LABELS.get(r['impl'], r['impl'])} at {_label(mine)}: "
                          f"{r['median_us']:.1f} us vs ours {mine['median_us']:.1f} us")
    if not per_baseline:
        return dict(id="T3", description=desc, status="NOT MEASURED", value=None, detail="no baseline ran")
    parts = [f"{BASELINE_LABELS.get(k, k)} {v['wins']}/{v['total']} (min speed-up {v['min_speedup']:.2f}x)"
             for k, v in per_baseline.items()]
    return dict(id="T3", description=desc, status="FAIL" if losses else "PASS",
                value=min(v["min_speedup"] for v in per_baseline.values()), detail="; ".join(parts),
                failures=losses[:20])


def _correctness(rows: list[dict]) -> dict:
    desc = dict(_DESCRIPTIONS)["C"]
    ours = [r for r in rows if r["impl"] == "metrale"]
    checked = [r for r in ours if r.get("check")]
    bad = [r for r in checked if r["check"].get("status") != "ok"]
    failed = [r for r in ours if r["status"] == "failed"]
    if not checked:
        return dict(id="C", description=desc, status="NOT MEASURED", value=None, detail="nothing checked")
    detail = f"{len(checked) - len(bad)}/{len(checked)} outputs met the bar"
    if failed:
        detail += f"; {len(failed)} runs failed before checking"
    return dict(id="C", description=desc, status="FAIL" if bad or failed else "PASS", value=len(bad),
                detail=detail, failures=[f"{_label(r)}: {r['check'].get('message', '')[:200]}" for r in bad][:20]
                + [f"{_label(r)}: {r.get('reason', '')[:200]}" for r in failed][:20])


def targets_table(targets: list[dict], width: int = 96) -> str:
    """Plain-text target lines for a terminal (details cut at ``width``; the markdown has them whole)."""
    lines = [f"{'target':<6} {'status':<13} description / detail"]
    for t in targets:
        detail = t["detail"] if len(t["detail"]) <= width else t["detail"][: width - 3] + "..."
        lines.append(f"{t['id']:<6} {t['status']:<13} {t['description']}")
        lines.append(f"{'':<6} {'':<13} {detail}")
    return "\n".join(lines)


# -- markdown ------------------------------------------------------------------------


def render_markdown(result: dict, plot_files: Optional[list[str]] = None, plot_note: str = "") -> str:
    env, copy = result.get("environment", {}), result.get("copy_bandwidth", {})
    dev = env.get("device", {})
    libs = env.get("libraries", {})
    smi = env.get("nvidia_smi", {})
    out = [f"# metrale-attn paged decode benchmark: {result.get('device_label')} ({result.get('created_utc')})", ""]
    if result.get("mode") == "cpu":
        out += ["**CPU backend simulator; not kernel performance.** A smoke run of the harness on the CUDA-on-CPU "
                "simulator: the times are the simulator's wall clock and the 'copy bandwidth' is host memory.", ""]
    out += [f"- timing: {result.get('timing_note')}"]
    if dev:
        out.append(f"- device: {dev.get('name')} (compute capability {dev.get('compute_capability', '-')}, "
                   f"{dev.get('sm_count', '-')} SMs, L2 {_mb(dev.get('l2_bytes'))}, memory "
                   f"{_gb(dev.get('memory_bytes'))}); driver {smi.get('driver_version', dev.get('cuda_driver', '-'))}, "
                   f"CUDA runtime {dev.get('cuda_runtime', '-')}, nvcc {env.get('cuda_tools', {}).get('nvcc', '-')}")
    if smi and "clocks.sm" in smi:
        out.append(f"- clocks at probe: SM {smi.get('clocks.sm')} (max {smi.get('clocks.max.sm')}), memory "
                   f"{smi.get('clocks.mem')} (max {smi.get('clocks.max.mem')}); power {smi.get('power.draw')} / "
                   f"{smi.get('power.limit')}; {smi.get('pstate', '')}")
    out.append("- libraries: " + ", ".join(f"{k} {v}" for k, v in libs.items() if v))
    if copy.get("tb_per_s"):
        out.append(f"- **copy bandwidth: {copy['tb_per_s']:.3f} TB/s** (decimal; {copy.get('method')}); every % "
                   "below is against it")
    else:
        out.append(f"- copy bandwidth: not measured ({copy.get('error', 'unknown')})")
    caps = result.get("kernel_impls")
    if caps:
        out.append(f"- kernel implementations: {', '.join(caps.get('impls') or []) or '-'}; default "
                   f"{caps.get('default_impl') or '-'}; {selftest_line(result)}")
    budget = result.get("budget", {})
    line = f"- sweep ({result.get('profile', 'full')} profile): {budget.get('elapsed_s', '-')} s of a " \
           f"{budget.get('time_budget_s', '-')} s budget"
    if budget.get("stopped_early"):
        line += f"; **stopped early: {budget.get('reason')}**"
        if result.get("not_measured"):
            line += f" ({len(result['not_measured'])} configurations not measured, listed below)"
    out += [line, "", "## Targets", "", "| target | status | bar | detail |", "| --- | --- | --- | --- |"]
    for t in result.get("targets", []):
        out.append(f"| {t['id']} | **{t['status']}** | {t['description']} | {t['detail']} |")
    for t in result.get("targets", []):
        if t.get("failures"):
            out += ["", f"{t['id']} misses:", ""] + [f"- {f}" for f in t["failures"]]
    out += ["", "## Results", "",
            "Bytes per call = K+V touched + q + out; TB/s decimal; % of the copy bandwidth above. `default` is the "
            "policy's choice (arm, implementation and split count); the arm columns force each arm (and kernel "
            "implementation), each as us (% of copy); baselines are charged the same bytes. `x best base` = fastest "
            "baseline time / ours (> 1: ours faster).", ""]
    out += _result_tables(result)
    out += _impl_comparison(result) + _hpc_sweep(result) + _feature_sweep(result) + _predictions(result)
    out += probe_markdown(result.get("l2_probe"))
    if plot_files:
        out += ["", "## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plot_files]
    elif plot_note:
        out += ["", f"Plots: {plot_note}"]
    out += ["", "## Baselines", ""]
    for name, entry in result.get("baselines", {}).items():
        label = BASELINE_LABELS.get(name, name)
        reasons = entry.get("not_run_reasons") or {}
        line = f"- **{label}**: {entry.get('status')}; ran on {entry.get('ran', 0)}/{entry.get('configs', 0)} " \
               "configurations"
        if entry.get("reason"):
            line += f"; {entry['reason']}"
        out.append(line)
        for why, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
            out.append(f"  - not run on {n}: {why}")
    prewarm = result.get("flashinfer_prewarm")
    if prewarm:
        parts = [f"{k}: {v.get('status')} ({v.get('seconds', '-')} s) {v.get('reason', '')}".strip()
                 for k, v in prewarm.get("specs", {}).items()]
        if prewarm.get("import_error"):
            parts.append(prewarm["import_error"])
        out.append("- FlashInfer JIT prewarm: " + "; ".join(parts))
    if result.get("host_overhead"):
        out += ["", "## Host overhead", "",
                "Python microseconds per call, no synchronization in the loop: an eager `run` (validation, plan "
                "lookup, 1-2 launches) and a CUDA-graph launch, beside the GPU time of the same call.", "",
                "| model | kv | batch | context | arm | eager run us | graph launch us | GPU us |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for h in result["host_overhead"]:
            if "error" in h:
                out.append(f"| {h['model']} | {h['kv_dtype']} | | | {h['arm']} | {h['error']} | | |")
            else:
                out.append(f"| {h['model']} | {h['kv_dtype']} | {h['batch']} | {h['context']} | {h['arm']} "
                           f"({h['plan_arm']}) | {h['eager_run_us']:.1f} | {h['graph_launch_us']:.1f} | "
                           f"{h['gpu_median_us']:.1f} |")
    for title, key in (("Skipped (over the memory cap)", "skipped"), ("Not measured", "not_measured")):
        items = result.get(key) or []
        if items:
            out += ["", f"## {title}", ""]
            out += [f"- {r.get('tier', '')} {r['model']} {r['kv_dtype']} b{r['batch']} ctx{r['context']}: {r['reason']}"
                    .replace("-  ", "- ") for r in items]
    failed = [r for r in result["rows"] if r["status"] in ("failed", "wrong")]
    if failed:
        out += ["", "## Failures", ""]
        for r in failed:
            why = r.get("reason") or (r.get("check") or {}).get("message", "")
            out.append(f"- {BASELINE_LABELS.get(r['impl'], r['impl'])} {_label(r)}: {r['status']}: {why[:300]}")
    if result.get("compile_s"):
        out += ["", "Construction (compile or cache load) seconds: " +
                ", ".join(f"{k} {v}" for k, v in result["compile_s"].items())]
    return "\n".join(out) + "\n"


def _mb(x) -> str:
    return "-" if not x else f"{x / 1e6:.0f} MB"


def _gb(x) -> str:
    return "-" if not x else f"{x / 1e9:.0f} GB"


def _us(r: Optional[dict]) -> str:
    if r is None:
        return ""
    if _timed(r):
        flag = "" if r["status"] == "ok" else " (!)"
        return f"{r['median_us']:.1f}{flag}"
    return "n/a" if r["status"] == "unavailable" else r["status"]


def _us_pct(r: Optional[dict]) -> str:
    """``950.1 (91.2%)``: a timed row's microseconds and % of copy; the status where none."""
    text = _us(r)
    if r is not None and _timed(r) and r.get("pct_of_copy") is not None:
        text += f" ({r['pct_of_copy']:.1f}%)"
    return text


def _arm_columns(rows: list[dict]) -> list[str]:
    """Forced arm x implementation columns present, in arm order then implementation order."""
    labels = list(dict.fromkeys(arm_label(r) for r in rows if r.get("arm") not in (None, "default")))
    order = {a: i for i, a in enumerate(("unpacked", "splitk", "gqa_packed"))}
    seen = {lab: i for i, lab in enumerate(labels)}
    return sorted(labels, key=lambda lab: (order.get(lab.split("/")[0], 3), lab.split("/")[0], seen[lab]))


def _column_label(label: str) -> str:
    """``splitk/mma`` -> ``split-K/mma``."""
    arm, _, impl = label.partition("/")
    return ARM_LABELS.get(arm, arm) + (f"/{impl}" if impl else "")


def _result_tables(result: dict) -> list[str]:
    ours = arm_rows(result)
    rows = ours + [r for r in result["rows"] if r["impl"] != "metrale"]
    groups: dict = {}
    for r in rows:
        by_cfg = groups.setdefault((r["model"], r["shape"], r["kv_dtype"]), {})
        by_cfg.setdefault((r["batch"], r["context"]), []).append(r)
    arms = _arm_columns(ours)
    bases = [b for b in BASELINE_LABELS if any(r["impl"] == b for r in rows)]
    bases += sorted({r["impl"] for r in rows if r["impl"] != "metrale" and r["impl"] not in BASELINE_LABELS})
    out = []
    for (model, shape, kv), by_cfg in groups.items():
        title = f"{model} ({shape} q/kv/head_dim)" if model != shape else f"{shape} (q/kv/head_dim)"
        out += [f"### {title}, KV {kv}", ""]
        head = ["batch", "context", "MB", "default (splits)", "us", "TB/s", "% copy"]
        head += [f"{_column_label(a)} us (% copy)" for a in arms]
        head += [f"{BASELINE_LABELS.get(b, b)} us (% copy)" for b in bases] + ["x best base"]
        out += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for (batch, context), rs in sorted(by_cfg.items()):
            d = next((r for r in rs if r["impl"] == "metrale" and r.get("default")), None)
            cells = [str(batch), _ctx(context), f"{rs[0]['bytes'] / 1e6:.1f}"]
            if d is not None:
                impl = f"/{d['kernel_impl']}" if d.get("kernel_impl") else ""
                cells += [f"{d.get('plan_arm', d.get('arm'))}{impl} ({d.get('num_splits', '-')})", _us(d),
                          _tb(d['tb_per_s']) if _timed(d) else "-", _fmt_pct(d.get("pct_of_copy"))]
            else:
                cells += ["-", "-", "-", "-"]
            for a in arms:
                cells.append(_us_pct(next((r for r in rs if r["impl"] == "metrale" and r.get("arm") != "default"
                                           and arm_label(r) == a), None)))
            base_times = []
            for b in bases:
                r = next((r for r in rs if r["impl"] == b), None)
                cells.append(_us_pct(r))
                if r is not None and _timed(r):
                    base_times.append(r["median_us"])
            cells.append(f"{min(base_times) / d['median_us']:.2f}x" if base_times and d is not None and _timed(d)
                         else "-")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return out


def selftest_line(result: dict) -> str:
    """``mma self-test: ok (...)``, or ``FELL BACK to simt`` with the device's warning: whether the mma
    rows are mma."""
    record = (result.get("kernel_impls") or {}).get("selftest") or {}
    status = record.get("status", "not run")
    word = "FELL BACK to simt, the mma rows were not timed" if status == "fallback" else status
    return f"mma self-test: {word}" + (f" ({record['detail']})" if record.get("detail") else "")


def impl_pairs(result: dict) -> dict:
    """``{(configuration key, arm): {impl: row}}``: the forced-arm rows timed on each implementation
    (the ``kernel_impl`` the plan ran)."""
    pairs: dict = {}
    for r in arm_rows(result):
        if _timed(r) and r.get("arm") != "default" and r.get("kernel_impl"):
            pairs.setdefault((_key(r), r["arm"]), {})[r["kernel_impl"]] = r
    return pairs


def _speedup(old: dict | None, new: dict | None) -> str:
    """``old``'s time over ``new``'s (``1.20x``: new is 20% faster), ``-`` when either did not run."""
    return f"{old['median_us'] / new['median_us']:.2f}x" if old and new else "-"


def _impl_comparison(result: dict) -> list[str]:
    """Old (simt) against new (mma) kernels, arm by arm, on every configuration both ran: the
    speed-up of mma over simt."""
    out = ["## Old vs new kernels (simt vs mma)", "", selftest_line(result) + ".", ""]
    pairs = impl_pairs(result)
    if not any(len(by) > 1 for by in pairs.values()):
        return out + ["Not compared: no configuration timed both implementations.", ""]
    out += ["| configuration | arm | simt us (% copy) | mma us (% copy) | mma / simt |", "|" + " --- |" * 5]
    for (key, arm), by in pairs.items():
        old, new = by.get("simt"), by.get("mma")
        r = old or new
        out.append(f"| {r['model']} {r['kv_dtype']} b{r['batch']} {_ctx(r['context'])} | {arm} | {_us_pct(old)} | "
                   f"{_us_pct(new)} | {_speedup(old, new)} |")
    return out + [""]


def hpc_rows(result: dict) -> dict:
    """The heads_per_cta tier's rows: ``{model: {batch: [rows in heads_per_cta order]}}``."""
    out: dict = {}
    for r in result["rows"]:
        if r.get("sweep") == "heads_per_cta":
            out.setdefault(r["model"], {}).setdefault(r["batch"], []).append(r)
    return out


def _hpc_sweep(result: dict) -> list[str]:
    """The heads_per_cta tier: per model, % of copy per value and batch, the plan's choice marked."""
    info = result.get("hpc_sweep") or {}
    by_model = hpc_rows(result)
    out = ["## heads_per_cta sweep", ""]
    if not by_model:
        return out + [f"Not run: {info.get('status', 'not planned')}.", ""]
    for model, by_batch in by_model.items():
        r0 = next(iter(by_batch.values()))[0]
        values = sorted({r["heads_per_cta"] for rs in by_batch.values() for r in rs})
        out += [f"{model} ({r0['shape']}, group {r0['q_heads'] // r0['kv_heads']}), mma kernels, KV "
                f"{r0['kv_dtype']}, context {_ctx(r0['context'])}, the policy's split count; every heads_per_cta "
                "the group allows; `*` = the plan's choice; us (% of copy).", "",
                "| batch | " + " | ".join(f"h={v}" for v in values) + " | plan's choice |",
                "|" + " --- |" * (len(values) + 2)]
        for batch, rs in sorted(by_batch.items()):
            cells = []
            for v in values:
                r = next((r for r in rs if r["heads_per_cta"] == v), None)
                mark = "*" if r and r.get("hpc_choice") else ""
                cells.append((_us_pct(r) if r is None or _timed(r) else r["status"]) + mark)
            choice = info.get("choices", {}).get(f"{model} b{batch}")
            out.append(f"| {batch} | " + " | ".join(cells) + f" | {'-' if choice is None else choice} |")
        out.append("")
    return out


def _feature_sweep(result: dict) -> list[str]:
    """The features tier: each feature's time against plain decode on the same configuration."""
    rows = [r for r in result["rows"] if r.get("sweep") == "features"]
    out = ["## Features against plain decode", ""]
    if not rows:
        return out + ["Not run.", ""]
    r0 = rows[0]
    out += [f"{r0['model']} ({r0['shape']}), batch {r0['batch']} x {_ctx(r0['context'])}, mma kernels, the "
            "policy's arm; each row against plain decode (dense page table, host scales) on the same KV dtype. "
            "% of copy counts the K/V each row must read (a window reads its keys only); multi-token decodes 4 "
            "query tokens per sequence.", "",
            "| KV | feature | us | % of copy (K/V read) | vs plain | check |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        pct = r.get("pct_of_copy")
        read = None if pct is None else pct * (r.get("kv_fraction") or 1.0)
        vs = r.get("vs_plain")
        check = (r.get("check") or {}).get("status", r["status"])
        out.append(f"| {r['kv_dtype']} | {r.get('feature')} | {_us(r)} | {_fmt_pct(read)} | "
                   f"{'-' if vs is None else f'{vs:.2f}x'} | {check} |")
    return out + [""]


def _predictions(result: dict) -> list[str]:
    """Every timed row of ours beside the static SASS model's prediction for the same spec."""
    model = result.get("sass_model") or {}
    rows = [r for r in result["rows"] if r["impl"] == "metrale" and _timed(r) and r.get("sweep") != "features"]
    with_pred = [r for r in rows if r.get("sass")]
    out = ["## Measured vs the static SASS model", "",
           f"Report: {model.get('source') or '-'}; {model.get('note', 'no prediction')}."]
    if not with_pred:
        return out + [""]
    out += ["", "| configuration | spec | h/CTA | measured % copy | predicted ceiling % | measured / predicted | "
                "binding | call model % (binding) | measured / call model | instr/KiB | KiB in flight/SM | regs | "
                "spill B |", "|" + " --- |" * 13]
    for r in with_pred:
        p = r["sass"]
        ratio = f"{r['pred_ratio']:.2f}" if r.get("pred_ratio") is not None else "-"
        call = "-" if p.get("predicted_pct") is None else f"{p['predicted_pct']:.0f} ({p.get('predicted_binding')})"
        cratio = f"{r['call_ratio']:.2f}" if r.get("call_ratio") is not None else "-"
        out.append(f"| {r['model']} {r['kv_dtype']} b{r['batch']} {_ctx(r['context'])} | {r.get('arm_label') or r['arm']}"
                   f" | {r.get('heads_per_cta', '-')} | {_fmt_pct(r.get('pct_of_copy'))} | {_num(p.get('ceiling_pct'))}"
                   f" | {ratio} | {p.get('binding', '-')} | {call} | {cratio} | {_num(p.get('instr_per_kib'))} | "
                   f"{_num(p.get('kib_in_flight_per_sm'))} | {_num(p.get('registers'))} | {_num(p.get('spill_bytes'))} |")
    missing = len(rows) - len(with_pred)
    if missing:
        out += ["", f"{missing} timed rows have no prediction (no matching row in the report)."]
    return out + [""]


def _num(x) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if isinstance(x, float) else str(x)


def _tb(x: float) -> str:
    return f"{x:.2f}" if x >= 0.01 else f"{x:.2e}"


def _ctx(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


# -- plots ---------------------------------------------------------------------------


def plot(result: dict, bench_path: str, arms_path: str) -> tuple[list[str], str]:
    """Write the two figures; returns (paths written, note). Without matplotlib: ([], why)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError as err:
        return [], f"not drawn: matplotlib missing ({err})"
    rows = [r for r in result["rows"] if _timed(r)]
    if not rows:
        return [], "not drawn: nothing was timed"
    panels = sorted({(r["model"], r["shape"], r["kv_dtype"]) for r in rows},
                    key=lambda k: (_first_index(result, k[0]), k[2]))
    models = list(dict.fromkeys(p[0] for p in panels))
    dtypes = list(dict.fromkeys(p[2] for p in sorted(panels, key=lambda p: p[2])))
    batches = sorted({r["batch"] for r in rows})
    colors = {b: plt.get_cmap("viridis")(i / max(len(batches) - 1, 1)) for i, b in enumerate(batches)}
    copy = result.get("copy_tb_per_s")
    unit = "TB/s" if result.get("mode") != "cpu" else "TB/s (CPU simulator)"
    written = []

    contexts = sorted({r["context"] for r in rows})
    overlay = bool(copy) and result.get("mode") != "cpu"  # the host memcpy is no ceiling for the simulator

    def figure(series: list[tuple[str, callable, str, str]], path: str, title: str):
        fig, axes = plt.subplots(len(dtypes), len(models), figsize=(max(5.2 * len(models), 7.0), 3.9 * len(dtypes)),
                                 squeeze=False)
        for (model, shape, kv) in panels:
            ax = axes[dtypes.index(kv)][models.index(model)]
            for label, select, style, marker in series:
                for b in batches:
                    pts = sorted((r["context"], r["tb_per_s"]) for r in rows
                                 if (r["model"], r["kv_dtype"], r["batch"]) == (model, kv, b) and select(r))
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle=style, marker=marker,
                                color=colors[b], markersize=3.5, linewidth=1.3)
            ax.set_xscale("log", base=2)
            ax.set_xticks(contexts)
            ax.set_xticklabels([_ctx(c) for c in contexts])
            ax.minorticks_off()
            ax.set_title(f"{model} ({shape}), KV {kv}" if model != shape else f"{shape}, KV {kv}", fontsize=9)
            ax.set_xlabel("context (tokens)", fontsize=8)
            ax.set_ylabel(unit, fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, alpha=0.3)
            ax.set_ylim(bottom=0)
            if overlay:
                top = max(ax.get_ylim()[1], copy * 1.02)
                ax.set_ylim(0, top)
                for pct, ls in ((T1_PCT, ":"), (T2_PCT, "-.")):
                    ax.axhline(copy * pct / 100, color="tab:red", linestyle=ls, linewidth=0.9, alpha=0.7)
                ax.axhline(copy, color="black", linewidth=0.8)
                right = ax.twinx()
                right.set_ylim(0, 100 * top / copy)
                right.set_ylabel("% of copy bandwidth", fontsize=8)
                right.tick_params(labelsize=7)
        for r_i in range(len(dtypes)):
            for c_i in range(len(models)):
                if not axes[r_i][c_i].has_data():
                    axes[r_i][c_i].set_visible(False)
        handles = [Line2D([], [], color=colors[b], label=f"batch {b}") for b in batches]
        handles += [Line2D([], [], color="black", linestyle=s, marker=m, label=lab) for lab, _, s, m in series]
        if overlay:
            handles += [Line2D([], [], color="black", linewidth=0.8, label=f"copy {copy:.2f} TB/s"),
                        Line2D([], [], color="tab:red", linestyle=":", label=f"{T1_PCT:.0f}% of copy (T1)"),
                        Line2D([], [], color="tab:red", linestyle="-.", label=f"{T2_PCT:.0f}% of copy (T2)")]
        ncol = max(3, min(len(handles), 4 * len(models)))
        legend_rows = math.ceil(len(handles) / ncol)
        fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=7, frameon=False)
        fig.suptitle(title, fontsize=10)
        bottom = (0.02 + 0.3 * legend_rows) / fig.get_size_inches()[1]
        fig.tight_layout(rect=(0, bottom, 1, 0.96))
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    styles = ["--", ":", "-.", (0, (5, 1, 1, 1))]
    ours = [("ours (default arm)", lambda r: r["impl"] == "metrale" and r.get("default"), "-", "o")]
    base_names = [b for b in dict.fromkeys(r["impl"] for r in rows) if b != "metrale"]
    base_series = [(BASELINE_LABELS.get(b, b), (lambda name: lambda r: r["impl"] == name)(b),
                    styles[i % len(styles)], "x") for i, b in enumerate(base_names)]
    device = result.get("device_label")
    figure(ours + base_series, bench_path, f"paged decode on {device}: ours vs baselines "
                                           f"({result.get('created_utc', '')[:10]})")
    forced = [r for r in rows if r["impl"] == "metrale" and r.get("arm") and r.get("sweep") not in SWEEPS]
    forced_ids = {id(r) for r in forced}
    arm_names = list(dict.fromkeys(arm_label(r) for r in forced))  # one series per arm x implementation
    arm_series = [(_column_label(a), (lambda name: lambda r: id(r) in forced_ids and arm_label(r) == name)(a),
                   ["-", "--", ":", "-."][i % 4], "os^dv"[i % 5]) for i, a in enumerate(arm_names)]
    figure(arm_series, arms_path, f"paged decode on {device}: each arm forced")
    return written, ""


def _first_index(result: dict, model: str) -> int:
    for i, r in enumerate(result["rows"]):
        if r["model"] == model:
            return i
    return 0


# -- files -----------------------------------------------------------------------------


def default_stem(result: dict) -> str:
    date = (result.get("created_utc") or time.strftime("%Y-%m-%d", time.gmtime()))[:10]
    return f"{date}_{result.get('device_label') or 'unknown'}"


def write_outputs(result: dict, out_dir: str, stem: Optional[str] = None, *, plots: bool = True) -> list[str]:
    """Write JSON, markdown and (``plots``) the plots; returns their paths. Each file is written
    to a temporary name and renamed, so a reader (or a run killed mid-write) never sees half of one."""
    os.makedirs(out_dir, exist_ok=True)
    stem = stem or default_stem(result)
    base = os.path.join(out_dir, stem)
    if plots:
        try:
            drawn, note = plot(result, f"{base}_bench.png", f"{base}_arms.png")
        except Exception as err:  # a plotting bug must not lose the numbers
            drawn, note = [], f"not drawn: {type(err).__name__}: {err}"
    else:
        drawn, note = [], "drawn at the end of the run"
    result["plots"] = [os.path.basename(p) for p in drawn]
    result["plot_note"] = note
    _write_atomic(f"{base}_bench.json", json.dumps(result, indent=1, default=_json_default))
    _write_atomic(f"{base}_bench.md", render_markdown(result, drawn, note))
    return [f"{base}_bench.json", f"{base}_bench.md"] + drawn


def _write_atomic(path: str, text: str) -> None:
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _json_default(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Re-render a benchmark result JSON.")
    parser.add_argument("result")
    parser.add_argument("--out-dir", default=".")
    parser.add_argument("--stem")
    args = parser.parse_args(argv)
    with open(args.result) as f:
        result = json.load(f)
    result["targets"] = evaluate_targets(result)
    for path in write_outputs(result, args.out_dir, args.stem):
        print(f"wrote {path}")
    print(targets_table(result["targets"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
