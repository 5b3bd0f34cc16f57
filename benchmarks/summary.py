"""The last word of ``gpu_check.sh``: one summary of every step, the targets, and a short table.

This module owns ``summary.md`` (rewritten after every step, so a run cut off from
outside still brings one back) and the short plain-text table ``gpu_check.sh`` prints
LAST: the device tool returns only the last 12,000 characters of a run's output, so the
table is kept to short lines and a few dozen of them:

- the step table (``steps.tsv``: name, status, seconds, detail), a running step if any;
- the copy bandwidth and the targets (pass/fail) from the benchmark JSON;
- the mma self-test's verdict (whether the mma rows ran mma);
- the decisive configurations: simt against mma per arm in % of copy, the static SASS
  model's predicted ceiling beside each ``[n]``, the speed-up, and the baselines;
- the ``heads_per_cta`` sweep (per model), the old-vs-new kernel comparison, the L2 probe;
- per model: the policy's default arm's % of copy, batch by context;
- the decisive cells (``metrale-attn check``'s report), last before the verdict so that a cut tail
  keeps them: the default kernel, simt and the peers in % of copy on each cell, the call model's
  MODELLED prediction for that call beside the default kernel's, each implementation's fault named;
- ``OVERALL``: ok, or FAIL with the steps that failed (the last line).

Usage: ``python -m benchmarks.summary --steps steps.tsv --env env.json --bench X_bench.json
--check decisive/report.json --sass-json sass_model.json --probe l2_probe.json --mode gpu
--out summary.md [--running benchmark] [--quiet]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from metrale_attn.check.report import timing_cells

from . import report
from .l2_probe import probe_text
from .model.predictions import Predictions, arch_digits
from .steps import check_cells, load_json, timed_rows

FAILING = ("FAIL", "TIMEOUT", "ERRORS", "WRONG", "FALLBACK")


def read_steps(path: str) -> list[dict]:
    steps = []
    try:
        with open(path) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) >= 4:
                    steps.append(dict(name=parts[0], status=parts[1], seconds=parts[2], detail=parts[3]))
    except OSError:
        pass
    return steps


def _value(r: dict, pct: bool) -> str:
    if r.get("median_us") is None:
        return r["status"]
    if pct and r.get("pct_of_copy") is not None:
        return f"{r['pct_of_copy']:.1f}"
    return f"{r['median_us']:.0f}us"


def _pct_mode(result: dict) -> bool:
    return bool(result.get("copy_tb_per_s")) and result.get("mode") != "cpu"


def _ours_cell(r, pct: bool) -> str:
    """``88.3*[100]``: measured (``!`` a wrong output; a status where nothing was timed), ``*`` the
    policy's default, ``[n]`` the SASS model's predicted ceiling %."""
    if r is None:
        return "-"
    pred = (r.get("sass") or {}).get("ceiling_pct")
    return (_value(r, pct) + ("!" if r.get("median_us") is not None and r.get("status") != "ok" else "")
            + ("*" if r.get("default") else "") + (f"[{pred:.0f}]" if isinstance(pred, (int, float)) else "[-]"))


def check_lines(check: dict, predictions: Predictions = None) -> list[str]:
    """The decisive cells of ``metrale-attn check``: % of copy per implementation, the call model's
    prediction beside the default kernel's (``[n]``; ``!`` a wrong output, not timed)."""
    if not check:
        return []
    timing = check.get("timing") or []
    out = []
    if not timing or check.get("timing_note"):
        n_ok = sum(r["status"] == "ok" for r in check.get("correctness", []))
        out.append(f"decisive cells: {n_ok} of {len(check.get('correctness', []))} correctness cells ok; "
                   f"{check.get('timing_note') or 'nothing timed'}")
    else:
        impls, cells = timing_cells(check)
        out.append("decisive cells, metrale-attn check (% of copy; [n] the call model's MODELLED %; ! wrong output; "
                   "s: simt ran):")
        out.append(f"  {'cell':<26}" + "".join(f"{i:>13}" for i in impls))
        for (name, kv, batch, context), by in cells.items():
            texts = []
            for impl in impls:
                r = by.get(impl)
                text = "-" if r is None else (f"{r['pct_of_copy']:.1f}" if r.get("pct_of_copy") is not None
                                              else ("!" if r["status"] == "FAIL" else r["status"][:6]))
                if r is not None and r.get("impl_ran") not in (None, impl):
                    text += "s"  # mma has no kernel of the shape: its request ran simt's (no mma prediction)
                elif r is not None and impl == "mma" and predictions is not None and r.get("arm_ran"):
                    layer = r["spec"]["layer"]
                    pred = predictions.lookup(impl="mma", arm=r["arm_ran"], q_heads=layer["num_q_heads"],
                                              kv_heads=layer["num_kv_heads"], head_dim=layer["head_dim"],
                                              q_dtype="bf16", kv_dtype=kv, heads_per_cta=r.get("heads_per_cta", 0),
                                              batch=batch, context=context)
                    if pred and pred.get("predicted_pct") is not None:
                        text += f"[{pred['predicted_pct']:.0f}]"
                texts.append(f"{text:>13}")
            out.append(f"  {name[:11] + ' ' + kv + ' b' + str(batch) + 'x' + report._ctx(context):<26}" + "".join(texts))
    for f in check.get("faults") or []:
        out.append(f"  FAULT {f['impl']} in {f['cell']}: {f['error'][:90]}")
    out.append(f"  check verdict: {check.get('verdict')}" + (f" ({check['failures'][0][:80]})"
                                                             if check.get("failures") else ""))
    return out


def decisive_lines(result: dict, width: int = 118) -> list[str]:
    """The decisive configurations: per arm, simt against mma (% of copy, the SASS model's prediction
    beside each), the speed-up, and the baselines on the configuration's first line."""
    pct = _pct_mode(result)
    rows = [r for r in result.get("rows", []) if str(r.get("tier", "")).startswith("decisive")]
    if not rows:
        return []
    out = [f"decisive configurations, simt vs mma ({'% of copy' if pct else 'simulator us'}; [n] SASS model's "
           "predicted %; * policy's default; ! wrong output):",
           f"  {'configuration':<24} {'arm':<5} {'simt':>12} {'mma':>12} {'mma/simt':>8}  baselines"]
    by_cfg: dict = {}
    for r in rows:
        by_cfg.setdefault((r["model"], r["kv_dtype"], r["batch"], r["context"]), []).append(r)
    for (model, kv, batch, context), rs in by_cfg.items():
        ours = [r for r in rs if r["impl"] == "metrale"]
        bases = "  ".join(f"{report.short_label(r)} {_value(r, pct) if r.get('median_us') is not None else '-'}"
                          for r in rs if r["impl"] != "metrale")
        by_arm: dict = {}
        for r in ours:
            by_arm.setdefault(r.get("arm"), {})[r.get("kernel_impl") or r.get("impl_asked")] = r
        label = f"{model} {kv} b{batch} {report._ctx(context)}"
        for arm, by in by_arm.items():
            old, new = by.get("simt"), by.get("mma")
            speed = (f"{old['median_us'] / new['median_us']:.2f}x" if old and new and old.get("median_us")
                     and new.get("median_us") else "-")
            line = (f"  {label:<24} {report.ARM_SHORT.get(arm, arm):<5} {_ours_cell(old, pct):>12} "
                    f"{_ours_cell(new, pct):>12} {speed:>8}")
            if bases:
                if len(line) + 2 + len(bases) > width:
                    out.append(line)
                    line = " " * 66
                line += "  " + bases
            out.append(line)
            label, bases = "", ""
    return out


def _wrap(head: str, parts: list[str], width: int = 110) -> list[str]:
    """``head`` then ``parts`` two spaces apart, continued on indented lines past ``width``."""
    lines, line = [], head
    for part in parts:
        if len(line) + 2 + len(part) > width and line.strip() != head.strip():
            lines.append(line)
            line = " " * 6
        line += ("  " if line.strip() else "") + part
    return lines + [line]


def hpc_lines(result: dict) -> list[str]:
    info = result.get("hpc_sweep") or {}
    by_model = report.hpc_rows(result)
    if not by_model:
        return [f"heads_per_cta sweep: {info.get('status', 'not planned')}"] if info else []
    pct = _pct_mode(result)
    r0 = next(iter(next(iter(by_model.values())).values()))[0]
    out = [f"heads_per_cta sweep (mma, {r0['kv_dtype']} {report._ctx(r0['context'])}; "
           f"{'% of copy' if pct else 'us'}; * the plan's choice):"]
    for model, by_batch in by_model.items():
        for batch, rs in sorted(by_batch.items()):
            cells = [f"h{r['heads_per_cta']}{'*' if r.get('hpc_choice') else ''} {_value(r, pct)}" for r in rs]
            out += _wrap(f"  {model} b{batch}:", cells)
    return out


def impl_line(result: dict) -> list[str]:
    if not result.get("kernel_impls"):
        return []
    pairs = [{impl: r["median_us"] for impl, r in by.items()} for by in report.impl_pairs(result).values()]
    speedups = sorted(p["simt"] / p["mma"] for p in pairs if "simt" in p and "mma" in p)
    if not speedups:
        return ["old vs new kernels: no configuration timed both"]
    return [f"old vs new kernels: mma over simt {speedups[0]:.2f}x min, {statistics.median(speedups):.2f}x median, "
            f"{speedups[-1]:.2f}x max over {len(speedups)} arm x configuration pairs"]


def grid_tables(result: dict) -> list[str]:
    """Per model: the default arm's % of copy (us on the CPU), rows batch, columns context,
    one block of columns per KV dtype; then its slowest speed-up over the fastest baseline."""
    rows = [r for r in report.default_rows(result) if r.get("median_us") is not None]
    if not rows:
        return ["(no benchmark rows)"]
    pct = bool(result.get("copy_tb_per_s")) and result.get("mode") != "cpu"
    fastest_base: dict = {}
    for r in result["rows"]:
        if r["impl"] != "metrale" and r.get("median_us") is not None:
            k = report._key(r)
            fastest_base[k] = min(fastest_base.get(k, float("inf")), r["median_us"])
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == model]
        dtypes = list(dict.fromkeys(r["kv_dtype"] for r in rs))
        contexts = sorted({r["context"] for r in rs})
        cell = {(r["kv_dtype"], r["batch"], r["context"]): r for r in rs}
        width = 6 if pct else 8
        out.append(f"{model} ({rs[0]['shape']}): {'% of copy' if pct else 'simulator us'}, default arm")
        blocks = [f"KV {dt}".center(len(contexts) * (width + 1) - 1) for dt in dtypes]
        out.append(f"  {'':>5} " + " | ".join(blocks))
        out.append(f"  {'batch':>5} " + " | ".join(" ".join(f"{report._ctx(c):>{width}}" for c in contexts)
                                                  for _ in dtypes))
        for b in sorted({r["batch"] for r in rs}):
            parts = []
            for dt in dtypes:
                vals = []
                for c in contexts:
                    r = cell.get((dt, b, c))
                    if r is None:
                        vals.append(f"{'-':>{width}}")
                    else:
                        vals.append(f"{r['pct_of_copy']:>{width}.1f}" if pct else f"{r['median_us']:>{width}.0f}")
                parts.append(" ".join(vals))
            out.append(f"  {b:>5} " + " | ".join(parts))
        speedups = sorted(fastest_base[report._key(r)] / r["median_us"] for r in rs
                          if report._key(r) in fastest_base)
        if speedups:
            out.append(f"  vs fastest baseline: min {speedups[0]:.2f}x, median {speedups[len(speedups) // 2]:.2f}x "
                       f"over {len(speedups)} configurations")
    return out


def overall(steps: list[dict], result: dict, mode: str, check: dict = None) -> str:
    """``OVERALL: ok``, or ``OVERALL: FAIL (gpu_tests FAIL; ...)``, with the targets' statuses."""
    problems = [f"{s['name']} {s['status']}" for s in steps if s["status"] in FAILING]
    if not timed_rows(result) and not check_cells(check):
        problems.append("no benchmark rows")
    targets = result.get("targets") or []
    if any(t["id"] == "C" and t["status"] == "FAIL" for t in targets):
        problems.append("a wrong output (C FAIL)")
    verdict = f"FAIL ({'; '.join(dict.fromkeys(problems))})" if problems else "ok"
    tail = ", ".join(f"{t['id']} {t['status']}" for t in targets)
    return f"OVERALL{' (CPU dry run)' if mode == 'cpu' else ''}: {verdict}" + (f"; targets {tail}" if tail else "")


def render(steps: list[dict], env: dict, result: dict, total_s: str, *, probe: dict = None, running: str = None,
           mode: str = None, check: dict = None, predictions: Predictions = None) -> tuple[str, str]:
    """(summary.md text, the short plain-text table)."""
    dev = (result.get("environment") or env).get("device", {})
    copy = result.get("copy_bandwidth") or env.get("copy_bandwidth", {})
    mode = result.get("mode") or mode or env.get("mode", "?")
    head = f"metrale-attn gpu_check: {dev.get('name', '?')}"
    if dev.get("sm_count"):
        head += f", {dev['sm_count']} SMs"
    head += f"; mode {mode}"
    if result.get("profile"):
        head += f", profile {result['profile']}"
    head += f"; {total_s} s in all"
    copy_line = (f"copy bandwidth {copy['tb_per_s']:.3f} TB/s (decimal, read + write)" if copy.get("tb_per_s")
                 else f"copy bandwidth not measured ({copy.get('error', '?')})")
    text = [head, copy_line, ""]
    text.append(f"{'step':<18} {'status':<9} {'s':>4}  detail")
    for s in steps:
        text.append(f"{s['name']:<18} {s['status']:<9} {s['seconds']:>4}  {s['detail'][:84]}")
    if running:
        text.append(f"{running:<18} {'running':<9} {'':>4}  (this summary was written while it ran)")
    text.append("")
    if result:
        budget = result.get("budget", {})
        if budget.get("stopped_early"):
            text.append(f"benchmark STOPPED EARLY: {budget.get('reason')}; {len(result.get('not_measured', []))} "
                        "configurations not measured")
        text.append(report.targets_table(result.get("targets") or report.evaluate_targets(result)))
        text.append("")
        text.append(report.selftest_line(result))
        for block in (decisive_lines(result), hpc_lines(result), impl_line(result)):
            text += block
        text.append("")
    text += probe_text(probe or result.get("l2_probe"))
    text.append("")
    if result:
        text += grid_tables(result)
    else:
        text.append("no benchmark result")
    if check:  # last but the verdict: the device tool keeps a run's last 12,000 characters
        text += [""] + check_lines(check, predictions)
    if mode == "cpu":
        text.append("CPU backend simulator; not kernel performance")
    text.append(overall(steps, result, mode, check))
    md = [f"# {head}", "", f"- {copy_line}", "", "| step | status | seconds | detail |", "| --- | --- | --- | --- |"]
    md += [f"| {s['name']} | {s['status']} | {s['seconds']} | {s['detail'].replace('|', '/')} |" for s in steps]
    if running:
        md.append(f"| {running} | running | | this summary was written while it ran |")
    md += ["", "## Short table", "", "```", *text, "```", ""]
    if result:
        md += ["Full tables, baselines, host overhead, the L2 probe and plots: the `*_bench.md` beside this file.", ""]
    return "\n".join(md), "\n".join(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", required=True)
    parser.add_argument("--env")
    parser.add_argument("--bench")
    parser.add_argument("--probe", help="l2_probe.py's JSON (when the benchmark JSON does not carry it yet)")
    parser.add_argument("--check", help="the decisive step's report.json (metrale-attn check)")
    parser.add_argument("--sass-json", help="the SASS model's report, for the decisive cells' predictions")
    parser.add_argument("--mode", choices=("gpu", "cpu"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--total-s", default="?")
    parser.add_argument("--running", help="a step still running (a checkpoint's summary)")
    parser.add_argument("--quiet", action="store_true", help="write summary.md only")
    args = parser.parse_args(argv)
    env = load_json(args.env) or {}
    check = load_json(args.check)
    cc = ((check or {}).get("device") or {}).get("compute_capability") or \
        (env.get("device") or {}).get("compute_capability")
    predictions = Predictions.load(args.sass_json, f"sm_{arch_digits(cc)}" if cc else "sm_90")
    md, text = render(read_steps(args.steps), env, load_json(args.bench) or {}, args.total_s,
                      probe=load_json(args.probe), running=args.running, mode=args.mode, check=check,
                      predictions=predictions)
    tmp = os.path.join(os.path.dirname(os.path.abspath(args.out)), f".{os.path.basename(args.out)}.tmp")
    with open(tmp, "w") as f:
        f.write(md)
    os.replace(tmp, args.out)
    if not args.quiet:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
