"""A check's report: the verdict, ``report.json``, ``report.md``, ``report.png`` and the short table.

Built from the workers' events (``events_<impl>.jsonl``, see ``worker.py``), never from what
was planned: a cell is reported as it ran, ``not run`` where its worker ended first.

The verdict is ``ok`` when every cell of ours that ran passed (a timing cell's output is
checked before it is timed) and no worker of ours faulted; ``FAIL`` otherwise, with each
failure named by its implementation, layer, KV dtype and arm or point. Peers never fail a
check: their cells are ``ok``, ``FAIL`` (an output off float64 by more than 1% of its max),
``unavailable`` or ``error``, and are shown beside ours.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from ..precompile import Layer
from .cells import OURS, shape_of

FAILED = ("FAIL", "error", "FALLBACK")
"""A cell of ours with one of these statuses fails the check (FALLBACK: the device failed the mma
self-test, so what serves there is simt, not the kernel asked for)."""


def read_jsonl(path: Path) -> list[dict]:
    """The events of one file; a torn last line (a process killed mid-write) is dropped."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return out


def read_events(folder: Path) -> list[dict]:
    """Every event of every implementation that ran into ``folder``."""
    return [e for path in sorted(Path(folder).glob("events_*.jsonl")) for e in read_jsonl(path)]


def running_cell(events: list[dict]) -> Optional[str]:
    """The cell a worker had started and not finished, if any."""
    started = [e["cell"] for e in events if e["event"] == "start"]
    done = {e["cell"] for e in events if e["event"] == "result"}
    return next((c for c in reversed(started) if c not in done), None)


def result_line(e: dict) -> str:
    """One short progress line of a cell's result."""
    spec = e.get("spec", {})
    detail = ""
    if e.get("pct_of_copy") is not None:
        detail = f" {e['median_us']:.1f} us, {e['pct_of_copy']:.1f}% of copy"
    elif e.get("max_ulp") is not None:
        detail = (f" {e['outputs_off']} of {e['outputs']} outputs off the bar (max {e['max_ulp']} ulp away from "
                  f"zero), lse off by {e.get('lse_max_abs_err', 0):.1e}")
    by = f", {e['impl_ran']} ran" if e.get("impl_ran") not in (None, e["impl"]) else ""
    ran = (f" [{e['arm_ran']}, {e['splits']} split(s){by}]" if e.get("arm_ran") and spec.get("kind") == "correct"
           else f" [{e['impl_ran']} ran]" if by else "")
    why = f": {e['message'][:150]}" if e.get("message") and e["status"] != "ok" else ""
    return f"{e['cell']}: {e['status']}{detail}{ran}{why}"


def build(events: list[dict], meta: dict) -> dict:
    """The report (a JSON-able dict) of ``events`` and the check's ``meta``."""
    results = [e for e in events if e["event"] == "result"]
    faults = [e for e in events if e["event"] == "fault"]
    envs = {e["impl"]: e for e in events if e["event"] == "env"}
    copies = {e["impl"]: e for e in events if e["event"] == "copy"}
    correct = [r for r in results if r["spec"]["kind"] == "correct"]
    timed = [r for r in results if r["spec"]["kind"] == "time"]
    failures = [f"{r['cell']}: {r['status']}" + (f" ({r['message'][:200]})" if r.get("message") else "")
                for r in results if r["impl"] in OURS and r["status"] in FAILED]
    failures += [f"{f['impl']} FAULT in {f['cell']}: {f['error'][:200]}" for f in faults if f["impl"] in OURS]
    device = next((e["device"] for e in envs.values() if e.get("gpu")), None) or \
        next((e["device"] for e in envs.values()), {"name": "?"})
    return dict(
        meta, device=device, verdict="ok" if not failures and results else "FAIL",
        failures=failures if results else failures + ["no cell ran"],
        timing_note=None if any(r.get("pct_of_copy") is not None for r in timed) else
        "no timing was taken" + ("" if meta.get("timed") else " (no GPU: the CPU backend runs a simulator)"),
        copy={impl: {k: e[k] for k in ("tb_per_s", "method") if k in e} for impl, e in copies.items()},
        correctness=correct, timing=timed, faults=faults,
        peer_faults=[f for f in faults if f["impl"] not in OURS])


def write(result: dict, folder: Path) -> list[Path]:
    """``report.json``, ``report.md`` and ``report.png`` (when matplotlib is installed) in ``folder``."""
    folder = Path(folder)
    paths = [folder / "report.json", folder / "report.md"]
    plot = folder / "report.png"
    plot_note = write_plot(result, plot)
    if plot_note is None:
        paths.append(plot)
    _atomic(paths[0], json.dumps(result, indent=1, default=str))
    _atomic(paths[1], markdown(result, plot.name if plot_note is None else None, plot_note))
    return paths


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _pct(r: Optional[dict]) -> str:
    """``88.3``, or ``88.3 (simt ran)`` where the plan ran another implementation than the cell's (an
    ``mma`` request of a shape only the simt kernels serve), or the status where nothing was timed."""
    if r is None:
        return "-"
    ran = f" ({r['impl_ran']} ran)" if r.get("impl_ran") not in (None, r["impl"]) else ""
    if r.get("pct_of_copy") is not None:
        return f"{r['pct_of_copy']:.1f}{ran}"
    return r["status"] + ran


COMPUTE_FLOP_PER_BYTE = 64.0
"""Cells at or past this many FLOPs per byte read get their TFLOP/s in the report: MLA at 128 heads
(242 FLOP/B bf16), not the GQA grid (4-8) or MLA at 16 heads (30). An H200's bf16 tensor ridge is
~200 FLOP/B, its CUDA-core fp32 one ~15."""


def timing_cells(result: dict) -> tuple[list[str], dict]:
    """(the implementations in the order they ran, ``{(layer, kv, batch, context): {impl: row}}`` in the
    order the cells ran): the timing rows as a table of cells by implementation."""
    impls = list(dict.fromkeys(r["impl"] for r in result["timing"]))
    cells: dict = {}
    for r in result["timing"]:
        spec = r["spec"]
        cells.setdefault((spec["layer"]["name"], spec["kv_dtype"], spec["batch"], spec["context"]), {})[r["impl"]] = r
    return impls, cells


def compute_lines(result: dict) -> list[str]:
    """``- mma deepseek-v3 128/1/576/512 bf16 b64x4k: 12.3 TFLOP/s (242 FLOP/B)``: the achieved arithmetic of
    each timed cell at ``COMPUTE_FLOP_PER_BYTE`` or more, where % of copy alone does not say how far it is."""
    out = []
    for r in result["timing"]:
        if r.get("tflops") is not None and r.get("flop_per_byte", 0) >= COMPUTE_FLOP_PER_BYTE:
            ran = f", {r['impl_ran']} ran" if r.get("impl_ran") not in (None, r["impl"]) else ""
            out.append(f"- {r['cell']}: {r['tflops']:.1f} TFLOP/s ({r['flop_per_byte']:.0f} FLOP/B read{ran})")
    return out


def timing_table(result: dict) -> list[list[str]]:
    """Rows ``[layer, kv, point, ours..., peers...]`` of % of copy bandwidth (a status where none)."""
    impls, cells = timing_cells(result)
    rows = [["layer", "kv", "batch x context", *impls]]
    for (layer, kv, batch, context), by in cells.items():
        rows.append([layer, kv, f"{batch} x {context}", *(_pct(by.get(i)) for i in impls)])
    return rows


def short_table(result: dict) -> list[str]:
    """The lines printed at the end of a check: what ran, what failed, % of copy by point."""
    dev = result["device"].get("name", "?")
    lines = ["", f"metrale-attn check: {result['model']} on {dev} ({result['backend']} backend), "
                 f"{result['seconds']} s"]
    n_ok = sum(r["status"] == "ok" for r in result["correctness"])
    lines.append(f"correctness: {n_ok} of {len(result['correctness'])} cells within the 1-ulp bar (lse too)")
    if result["timing_note"]:
        lines.append(f"timing: {result['timing_note']}")
    else:
        copy = next(iter(result["copy"].values()), {})
        lines.append(f"timing: % of the copy bandwidth ({copy.get('tb_per_s', 0):.3f} TB/s, measured in each "
                     "process), CUDA-graph replay, L2 flushed")
        widths = None
        table = timing_table(result)
        widths = [max(len(str(row[i])) for row in table) for i in range(len(table[0]))]
        lines += ["  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in table]
    for f in result["faults"]:
        lines.append(f"FAULT {f['impl']} in {f['cell']}: {f['error'][:160]}")
    lines += [f"FAILED {f[:200]}" for f in result["failures"] if "FAULT" not in f]
    lines.append(f"VERDICT: {result['verdict']}")
    return lines


def _layer_text(layer: dict) -> str:
    """``llama-3-8b 32/8/128``, ``deepseek-v3 128/1/576/512`` (V's width where narrower), or the shape
    alone; then the softmax scale where the model's config sets one (``full 8/1/512 sm_scale 1``)."""
    shape = shape_of(Layer(**layer))
    text = shape if layer["name"] == shape else f"{layer['name']} {shape}"
    scale = layer.get("sm_scale")
    return text if scale is None else f"{text} sm_scale {scale:.6g}"


def markdown(result: dict, plot: Optional[str], plot_note: Optional[str]) -> str:
    dev = result["device"]
    md = [f"# metrale-attn check: {result['model']}", "",
          f"- device: {dev.get('name', '?')}" + (f" ({dev.get('sm_count')} SMs)" if dev.get("sm_count") else ""),
          f"- backend: {result['backend']}; {result['seconds']} s",
          "- layers: " + "; ".join(_layer_text(layer) for layer in result["layers"]),
          f"- verdict: **{result['verdict']}**", ""]
    if result["failures"]:
        md += ["## Failures", "", *[f"- {f}" for f in result["failures"]], ""]
    md += ["## Correctness (float64 reference, 1-ulp bar; lse within 2e-6)", "",
           "| cell | status | arm ran | splits | max ulp | outputs off | lse max abs error |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["correctness"]:
        ran = f" ({r['impl_ran']})" if r.get("impl_ran") not in (None, r["impl"]) else ""
        md.append(f"| {r['cell']} | {r['status']} | {r.get('arm_ran', '-')}{ran} | {r.get('splits', '-')} | "
                  f"{r.get('max_ulp', '-')} | {r.get('outputs_off', '-')} | {r.get('lse_max_abs_err', '-')} |")
    md.append("")
    md += ["## Timing (% of the copy bandwidth)", ""]
    if result["timing_note"]:
        md += [result["timing_note"], ""]
    else:
        md += ["Ours with each layer's own window, soft-cap and sinks (a sink logit of 0 a head); the peers "
               "on plain layers only.", ""]
        table = timing_table(result)
        md += ["| " + " | ".join(table[0]) + " |", "|" + " --- |" * len(table[0])]
        md += ["| " + " | ".join(row) + " |" for row in table[1:]]
        md += ["", "Ours at the policy's default launch; every output checked against float64 on a few sequences "
               "before it was timed (a wrong one is not timed). sdpa: PyTorch SDPA over KV gathered inside the call. "
               "Bytes are those each implementation reads: a cached token's K rows and V rows, V once more only "
               "where it is read on its own (where V is K's first dims, MLA, ours reads a bf16 row once). "
               "`(simt ran)`: mma has no kernel of the shape, so its request ran the simt kernels.", ""]
        compute = compute_lines(result)
        if compute:
            md += [f"Achieved arithmetic (2 x batch x q heads x context x (head_dim + v_head_dim) FLOPs a call; cells "
                   f"at {COMPUTE_FLOP_PER_BYTE:.0f} FLOP/B read or more):", "", *compute, ""]
    if result["faults"]:
        md += ["## Faults", ""]
        md += [f"- {f['impl']} in {f['cell']}: {f['error']}" for f in result["faults"]]
        md.append("")
    md += [f"![% of copy bandwidth]({plot})" if plot else f"(no plot: {plot_note})", ""]
    return "\n".join(md)


def write_plot(result: dict, path: Path) -> Optional[str]:
    """Draw ``report.png``; returns None when drawn, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    rows = len(result["correctness"]) if result["timing_note"] else 0
    fig, ax = plt.subplots(figsize=(8, max(4.5, 0.18 * rows + 1.5)))
    if result["timing_note"] is None:
        table = timing_table(result)
        header, rows = table[0], table[1:]
        points = list(dict.fromkeys(row[2] for row in rows))
        for col in range(3, len(header)):
            for layer_kv in dict.fromkeys((row[0], row[1]) for row in rows):
                ys = [next((float(row[col].split()[0]) for row in rows if (row[0], row[1], row[2]) == (*layer_kv, p)
                            and _is_number(row[col].split()[0])), float("nan")) for p in points]
                ax.plot(points, ys, marker="o", label=f"{header[col]} {layer_kv[0]} {layer_kv[1]}")
        ax.set_ylabel("% of copy bandwidth")
        ax.set_xlabel("batch x context")
        ax.set_ylim(0, 105)
        ax.set_title(f"{result['model']} on {result['device'].get('name', '?')}")
        ax.legend(fontsize=7)
    else:
        cells = result["correctness"]
        labels = [r["cell"] for r in cells]
        values = [r.get("max_ulp", 0) for r in cells]
        colors = ["tab:green" if r["status"] == "ok" else "tab:red" for r in cells]
        ax.barh(range(len(cells)), values, color=colors)
        ax.set_yticks(range(len(cells)), labels, fontsize=6)
        ax.axvline(1, color="black", linestyle="--", label="the 1-ulp bar")
        ax.set_xlabel("max ulp off the float64 reference, away from zero (0 and 1 pass)")
        ax.set_xlim(0, max([2, *values]) + 0.5)
        ax.set_title(f"{result['model']}: correctness only, {result['timing_note']}", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
