"""The last word of ``gpu_check.sh``: one summary of every step, the targets, and a short table.

This script owns ``summary.md`` and the short plain-text table ``gpu_check.sh`` prints
LAST (so it is what a reader of the device run's output tail sees first):

- the step table (``steps.tsv``: name, status, seconds, detail, one line per step);
- the environment line and the copy bandwidth;
- the targets (pass/fail) from the benchmark JSON;
- per (model, KV dtype): % of the copy bandwidth of the policy's default arm, batch
  by context, and the slowest speed-up over the fastest baseline that ran.

Usage: ``python3 benchmarks/summarize.py --steps steps.tsv --env env.json --bench X_bench.json --out summary.md``
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_report  # noqa: E402


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


def _load(path) -> dict:
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError:
        return {}


def grid_tables(result: dict) -> list[str]:
    """Per model: the default arm's % of copy (TB/s on the CPU), rows batch, columns context,
    one block of columns per KV dtype; then its slowest speed-up over the fastest baseline."""
    rows = [r for r in bench_report.default_rows(result) if r.get("median_us") is not None]
    if not rows:
        return ["(no benchmark rows)"]
    pct = bool(result.get("copy_tb_per_s")) and result.get("mode") != "cpu"
    fastest_base: dict = {}
    for r in result["rows"]:
        if r["impl"] != "metrale" and r.get("median_us") is not None:
            k = bench_report._key(r)
            fastest_base[k] = min(fastest_base.get(k, float("inf")), r["median_us"])
    out = []
    models = list(dict.fromkeys(r["model"] for r in rows))
    for model in models:
        rs = [r for r in rows if r["model"] == model]
        dtypes = list(dict.fromkeys(r["kv_dtype"] for r in rs))
        contexts = sorted({r["context"] for r in rs})
        cell = {(r["kv_dtype"], r["batch"], r["context"]): r for r in rs}
        width = 6 if pct else 8
        out.append(f"{model} ({rs[0]['shape']}): {'% of copy' if pct else 'TB/s (CPU simulator)'}, default arm")
        blocks = [f"KV {dt}".center(len(contexts) * (width + 1) - 1) for dt in dtypes]
        out.append(f"  {'':>5} " + " | ".join(blocks))
        out.append(f"  {'batch':>5} " + " | ".join(" ".join(f"{bench_report._ctx(c):>{width}}" for c in contexts)
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
                        vals.append(f"{r['pct_of_copy']:>{width}.1f}" if pct else f"{r['tb_per_s']:>{width}.5f}")
                parts.append(" ".join(vals))
            out.append(f"  {b:>5} " + " | ".join(parts))
        speedups = sorted(fastest_base[bench_report._key(r)] / r["median_us"] for r in rs
                          if bench_report._key(r) in fastest_base)
        if speedups:
            out.append(f"  vs fastest baseline: min {speedups[0]:.2f}x, median {speedups[len(speedups) // 2]:.2f}x "
                       f"over {len(speedups)} configurations")
        out.append("")
    return out


def render(steps: list[dict], env: dict, result: dict, total_s: str) -> tuple[str, str]:
    """(summary.md text, the short plain-text table)."""
    dev = (result.get("environment") or env).get("device", {})
    copy = result.get("copy_bandwidth") or env.get("copy_bandwidth", {})
    mode = result.get("mode") or env.get("mode", "?")
    head = f"metrale-attn gpu_check: {dev.get('name', '?')}"
    if dev.get("sm_count"):
        head += f", {dev['sm_count']} SMs"
    head += f"; mode {mode}; {total_s} s in all"
    copy_line = (f"copy bandwidth {copy['tb_per_s']:.3f} TB/s (decimal, read + write)" if copy.get("tb_per_s")
                 else f"copy bandwidth not measured ({copy.get('error', '?')})")
    text = [head, copy_line, ""]
    text.append(f"{'step':<20} {'status':<9} {'s':>5}  detail")
    for s in steps:
        text.append(f"{s['name']:<20} {s['status']:<9} {s['seconds']:>5}  {s['detail'][:150]}")
    text.append("")
    if result:
        budget = result.get("budget", {})
        if budget.get("stopped_early"):
            text.append(f"benchmark STOPPED EARLY: {budget.get('reason')}; {len(result.get('not_measured', []))} "
                        "configurations not measured")
        text.append(bench_report.targets_table(result.get("targets") or bench_report.evaluate_targets(result)))
        text.append("")
        text += grid_tables(result)
        if mode == "cpu":
            text.append("CPU backend simulator; not kernel performance")
    else:
        text.append("no benchmark result")
    md = [f"# {head}", "", f"- {copy_line}", "", "| step | status | seconds | detail |", "| --- | --- | --- | --- |"]
    md += [f"| {s['name']} | {s['status']} | {s['seconds']} | {s['detail'].replace('|', '/')} |" for s in steps]
    md += ["", "## Short table", "", "```", *text, "```", ""]
    if result:
        md += ["Full tables, baselines, host overhead and plots: the `*_bench.md` beside this file.", ""]
    return "\n".join(md), "\n".join(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", required=True)
    parser.add_argument("--env")
    parser.add_argument("--bench")
    parser.add_argument("--out", required=True)
    parser.add_argument("--total-s", default="?")
    args = parser.parse_args(argv)
    md, text = render(read_steps(args.steps), _load(args.env), _load(args.bench), args.total_s)
    with open(args.out, "w") as f:
        f.write(md)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
