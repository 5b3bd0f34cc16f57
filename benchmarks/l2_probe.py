"""The L2 probe: Nsight Compute's counters on one small configuration per arm and kernel
implementation, to tell whether a low number comes from L2 amplification.

Three shapes with the same KV bytes and group sizes G = 1, 4 and 8 (8/8/128, 32/8/128,
64/8/128; batch 16 x 16k tokens, KV bf16: 1.07 GB each, far more than the 50-60 MB L2),
on the unpacked and split-K arms, with each kernel implementation (``PROBE_IMPLS``: simt,
the one-head-per-CTA CUDA-core kernels, and mma, whose CTA serves the plan's
``heads_per_cta`` heads of a KV head). ncu profiles the attention kernels only
(``attention_kernel_regex``: the first kernel of each launch in ``plan.KERNELS``; not the merges, not
the mma self-test). For each attention kernel ncu reads:

- ``dram__bytes_read.sum``: bytes read from HBM (each KV row once, ideally);
- ``lts__t_sectors_srcunit_tex_op_read.sum``: 32-byte sectors the SMs read from L2;
- ``gpu__time_duration.sum``, ``smsp__inst_executed.sum`` (warp instructions, per KiB of
  KV beside the static SASS model's ``instr_per_kib``), ``sm__inst_issued`` issue-slot
  use, registers, and the SchedulerStats / WarpStateStats sections (issue slots, stall
  reasons).

L2-read bytes / DRAM bytes should be about G / heads_per_cta: about G for one head per
CTA (each of the G CTAs of a KV head streams the same rows, L2 serves G - 1 of them) and
about 1 for a CTA that serves the whole group. A launch's implementation and heads per CTA
are read from the plan of what was built (an mma request that fell back to simt after a
failed self-test is recorded as ``fallback`` and not launched). ncu runs with ``--clock-control none``
(the device's clocks are never changed) and its default cache control (caches flushed
before each replay pass, so the DRAM bytes are cold). A refusal of ncu, or its absence,
is recorded in the result, never fatal.

Commands::

    python -m benchmarks.l2_probe probe --out l2_probe.json [--work DIR] [--cpu] [--ncu PATH|none]
    python -m benchmarks.l2_probe target --manifest m.json [--cpu]   # what ncu profiles
    python -m benchmarks.l2_probe report --csv ncu.csv --manifest m.json --out l2_probe.json

``--cpu`` runs the target on the CPU backend at a tiny size (2/2/256, 8/2/256, 16/2/256;
one sequence of 64 tokens) and uses ncu only when ``--ncu`` names one: the dry run of the
control flow. ``probe`` exits 0 whatever ncu did; the status is in the JSON.
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional

SECTOR_BYTES = 32
METRICS = ("dram__bytes_read.sum", "lts__t_sectors_srcunit_tex_op_read.sum", "gpu__time_duration.sum",
           "smsp__inst_executed.sum", "sm__inst_issued.avg.pct_of_peak_sustained_active",
           "launch__registers_per_thread")
SECTIONS = ("SchedulerStats", "WarpStateStats")
MINIMAL_METRICS = METRICS[:3]
"""The fallback pass, if the first is refused for a metric or section name this ncu does not know."""
GPU_SHAPES = ((8, 8, 128), (32, 8, 128), (64, 8, 128))
CPU_SHAPES = ((2, 2, 256), (8, 2, 256), (16, 2, 256))
PROBE_IMPLS = ("simt", "mma")
"""The implementations the probe profiles: both of ``impls.IMPLS`` (each profiled kernel costs an ncu pass)."""
ARMS = ("unpacked", "splitk")
REFUSALS = ("ERR_NVGPUCTRPERM", "LibraryNotLoaded", "Failed to initialize", "not supported", "permission",
            "Permission")
PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
"""ncu scales counts by decimal prefixes unless told --print-units base (Kbyte, Msector, Ginst, ...)."""
SECONDS = {"nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0}


# -- the target: what ncu profiles --------------------------------------------------------


def run_target(manifest_path: str, *, cpu: bool, batch: int, context: int) -> dict:
    """Run every probe configuration once and write the manifest: per launch, the shape, arm,
    implementation, heads per CTA and the names of the kernels it launched, in launch order."""
    from metrale_attn import DecodeAttention

    from . import impls
    from .sweep_plan import arm_options

    backend = "cpu" if cpu else "cupy"
    shapes = CPU_SHAPES if cpu else GPU_SHAPES
    data = _cpu_data if cpu else _gpu_data
    manifest = {"batch": batch, "context": context, "kv_dtype": "bf16", "launches": [], "impls": list(PROBE_IMPLS),
                "selftest": impls.selftest_record(None, backend)}
    for q_heads, kv_heads, head_dim in shapes:
        inputs, run_once = data(q_heads, kv_heads, head_dim, batch, context)
        kv_bytes = batch * context * kv_heads * head_dim * 2 * 2
        for arm in ARMS:
            for impl in PROBE_IMPLS:
                entry = dict(shape=f"{q_heads}/{kv_heads}/{head_dim}", group=q_heads // kv_heads, arm=arm,
                             impl=impl, kv_bytes=kv_bytes)
                try:
                    built = impls.build(DecodeAttention, q_heads, kv_heads, head_dim, 16, q_dtype="bf16",
                                        kv_dtype="bf16", max_batch=batch, backend=backend, impl=impl,
                                        **arm_options(arm))
                    if built.wanted == "mma" and manifest["selftest"]["status"] == "not run":
                        manifest["selftest"] = impls.selftest_record(built, backend)
                    if built.fell_back:  # it would launch simt again under an mma label: not profiled
                        entry.update(fallback=True, error=built.fallback_reason(), kernels=[])
                    else:
                        plan = built.attn.plan(batch)
                        run_once(built.attn, inputs)
                        entry.update(plan_arm=plan.arm, num_splits=plan.num_splits, impl=plan.impl,
                                     heads_per_cta=plan.heads_per_cta, kernels=[g.kernel for g in plan.launches])
                except Exception as err:  # recorded per launch: the others still run
                    entry.update(error=f"{type(err).__name__}: {err}"[:300], kernels=[])
                manifest["launches"].append(entry)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def _gpu_data(q_heads, kv_heads, head_dim, batch, context):
    import torch

    from metrale_attn.config import ModelShape

    from metrale_attn.check.data import GpuPool

    pool = GpuPool(ModelShape(q_heads, kv_heads, head_dim), "bf16", 16, batch * -(-context // 16), seed=1)
    case = pool.case(batch, context)

    def run_once(attn, c):
        out = torch.empty_like(c.q)
        attn.run(c.q, c.k_pool, c.v_pool, c.block_tables, c.seq_lens, out=out)
        torch.cuda.synchronize()
        if bool(torch.isnan(out).any()):
            raise RuntimeError("NaN in the probe's output")

    return case, run_once


def _cpu_data(q_heads, kv_heads, head_dim, batch, context):
    import numpy as np

    from metrale_attn.problems import make_problem

    p = make_problem(np.random.default_rng(1), num_seqs=batch, num_q_heads=q_heads,
                     num_kv_heads=kv_heads, head_dim=head_dim, page_size=16, seq_lens=context,
                     kv_dtype="bf16", q_dtype="bf16", layout="NHD")

    def run_once(attn, p):
        out = attn.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)
        if np.isnan(out.astype(np.float32)).any():
            raise RuntimeError("NaN in the probe's output")

    return p, run_once


# -- ncu's CSV ------------------------------------------------------------------------------


def parse_ncu_csv(text: str) -> list[dict]:
    """``ncu --csv --page raw`` output -> one dict per profiled kernel: ``kernel`` (its name) and every
    metric as a float in base units (bytes, seconds, %, counts), strings where not a number."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    body = [line for line in lines[start:] if line.startswith('"')]
    table = list(csv.reader(io.StringIO("\n".join(body))))
    header, rows = table[0], table[1:]
    units = {}
    if rows and not rows[0][0]:  # the units row: no ID
        units = dict(zip(header, rows[0]))
        rows = rows[1:]
    out = []
    for cells in rows:
        entry = {}
        for name, value in zip(header, cells):
            entry[name] = _number(value, units.get(name, ""))
        entry["kernel"] = str(entry.get("Kernel Name", entry.get("Function Name", "")))
        out.append(entry)
    return out


def _number(value: str, unit: str):
    text = value.replace(",", "").strip()
    try:
        x = float(text)
    except ValueError:
        return value
    return x * unit_scale(unit)


def unit_scale(unit: str) -> float:
    """The factor to base units: ``nsecond`` -> 1e-9 (seconds), ``Kbyte`` -> 1e3, ``Msector`` -> 1e6; else 1."""
    u = unit.strip().lower()
    if u in SECONDS:
        return SECONDS[u]
    match = re.fullmatch(r"([kmgt]?)(byte|sector|inst|warp|cycle|request)s?(/.*)?", u)
    return PREFIXES[match.group(1)] if match else 1.0


def stall_reasons(kernel: dict, top: int = 3) -> list[tuple[str, float]]:
    """The largest stall reasons of a kernel from the WarpStateStats metrics: warps stalled per issued
    instruction (``..._per_issue_active.ratio``), else the share of warps (``..._per_warp_active.pct``)."""
    for family in (r"_per_issue_active\.ratio$", r"_per_warp_active\.pct$"):
        found = {}
        for name, value in kernel.items():
            match = re.search(r"issue_stalled_([a-z_]+?)" + family, name)
            if match and isinstance(value, float) and match.group(1) not in ("selected", "not_selected"):
                found[match.group(1)] = value
        if found:
            return sorted(found.items(), key=lambda kv: -kv[1])[:top]
    return []


def match_kernels(manifest: dict, kernels: list[dict]) -> list[dict]:
    """Pair each profiled kernel with the launch that made it (both in launch order, by name)."""
    expected = [(i, name) for i, launch in enumerate(manifest.get("launches", [])) for name in launch.get("kernels", [])]
    pairs, j = [], 0
    for k in kernels:
        while j < len(expected) and expected[j][1] != k["kernel"]:
            j += 1
        if j == len(expected):
            break
        pairs.append(dict(k, launch=expected[j][0]))
        j += 1
    return pairs


def probe_rows(manifest: dict, kernels: list[dict]) -> list[dict]:
    """One row per probe launch: its attention kernel's counters, L2/DRAM against G / heads_per_cta."""
    by_launch: dict = {}
    for k in match_kernels(manifest, kernels):
        by_launch.setdefault(k["launch"], []).append(k)
    rows = []
    for i, launch in enumerate(manifest.get("launches", [])):
        row = {key: launch.get(key) for key in ("shape", "group", "arm", "impl", "heads_per_cta", "num_splits",
                                                "kv_bytes", "error")}
        row["expected_l2_over_dram"] = (launch["group"] / launch["heads_per_cta"] if launch.get("heads_per_cta")
                                        else None)
        ks = by_launch.get(i, [])
        if not ks:
            row["status"] = "fallback" if launch.get("fallback") else "failed" if launch.get("error") else "not profiled"
            rows.append(row)
            continue
        attn, rest = ks[0], ks[1:]
        dram = _metric(attn, "dram__bytes_read.sum")
        sectors = _metric(attn, "lts__t_sectors_srcunit_tex_op_read.sum")
        seconds = _metric(attn, "gpu__time_duration.sum")
        inst = _metric(attn, "smsp__inst_executed.sum")
        l2 = sectors * SECTOR_BYTES if sectors is not None else None
        row.update(status="ok", kernel=attn["kernel"], dram_bytes=dram, l2_read_bytes=l2,
                   l2_over_dram=(l2 / dram) if l2 and dram else None, time_us=seconds * 1e6 if seconds else None,
                   dram_tb_per_s=(dram / seconds / 1e12) if dram and seconds else None,
                   warp_instructions=inst,
                   instr_per_kib=(inst / (launch["kv_bytes"] / 1024)) if inst and launch.get("kv_bytes") else None,
                   issue_slots_pct=_metric(attn, "sm__inst_issued.avg.pct_of_peak_sustained_active"),
                   registers=_metric(attn, "launch__registers_per_thread"), stalls=stall_reasons(attn),
                   other_kernels=[dict(kernel=k["kernel"], time_us=(_metric(k, "gpu__time_duration.sum") or 0) * 1e6)
                                  for k in rest])
        rows.append(row)
    return rows


def _metric(kernel: dict, name: str) -> Optional[float]:
    value = kernel.get(name)
    return value if isinstance(value, float) else None


# -- the probe: ncu around the target -----------------------------------------------------------


def find_ncu(explicit: Optional[str], cpu: bool) -> Optional[str]:
    """``--ncu`` (``none``: absent), else ``$NCU``, else (not on the CPU) ncu on PATH or in the usual places."""
    choice = explicit or os.environ.get("NCU")
    if choice:
        return None if choice == "none" else shutil.which(choice) or (choice if os.path.exists(choice) else None)
    if cpu:
        return None
    found = shutil.which("ncu")
    for pattern in ("/usr/local/cuda/bin/ncu", "/usr/local/cuda*/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu"):
        for candidate in sorted(glob.glob(pattern), reverse=True):
            if not found and os.access(candidate, os.X_OK):
                found = candidate
    return found


def _run_capped(cmd: list[str], timeout_s: float, log_path: str) -> tuple[Optional[int], str]:
    """Run ``cmd`` in its own process group, killing the whole group at ``timeout_s``; (rc, output).
    rc None: timed out."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    with open(log_path, errors="replace") as f:
        return rc, f.read()


def attention_kernel_regex() -> str:
    """ncu's ``--kernel-name``: the attention kernel (the first launch) of each probed arm on each
    implementation, by exact name (``plan.KERNELS``); the merges and the mma self-test are left out."""
    from metrale_attn.config import IMPLS
    from metrale_attn.plan import KERNELS

    return "regex:^(" + "|".join(sorted(KERNELS[impl, arm][0] for impl in IMPLS for arm in ARMS)) + ")$"


def probe(*, out: str, work: str, cpu: bool, ncu: Optional[str], timeout_s: float, batch: int, context: int,
          kernel_regex: Optional[str] = None) -> dict:
    t0 = time.monotonic()
    kernel_regex = kernel_regex or attention_kernel_regex()
    os.makedirs(work, exist_ok=True)
    manifest_path = os.path.join(work, "l2_probe_manifest.json")
    # From the repository root, like the caller (gpu_check.sh puts the root on PYTHONPATH too).
    target = [sys.executable, "-m", "benchmarks.l2_probe", "target", "--manifest", manifest_path, "--batch",
              str(batch), "--context", str(context)] + (["--cpu"] if cpu else [])
    result: dict = {"batch": batch, "context": context, "kv_dtype": "bf16", "ncu": ncu, "passes": [], "rows": []}
    if ncu is None:
        result.update(status="absent", detail="ncu not found (NCU, PATH, /usr/local/cuda, /opt/nvidia): no counters")
        if cpu:  # the dry run still exercises the target
            rc, text = _run_capped(target, timeout_s, os.path.join(work, "l2_probe_target.log"))
            result["detail"] += f"; target alone rc={rc}"
    else:
        result.update(status="failed", detail=f"less than 10 s of the {timeout_s:g} s cap for an ncu pass")
        for metrics, sections in ((METRICS, SECTIONS), (MINIMAL_METRICS, ())):
            left = timeout_s - (time.monotonic() - t0)
            if left < 10:
                break
            csv_path = os.path.join(work, f"l2_probe_ncu_{len(result['passes'])}.csv")
            if os.path.exists(csv_path):
                os.remove(csv_path)
            cmd = [ncu, "--clock-control", "none", "--target-processes", "all", "--kernel-name", kernel_regex,
                   "--metrics", ",".join(metrics)]
            for section in sections:
                cmd += ["--section", section]
            cmd += ["--csv", "--page", "raw", "--print-units", "base", "--log-file", csv_path] + target
            t1 = time.monotonic()
            rc, text = _run_capped(cmd, left, os.path.join(work, f"l2_probe_ncu_{len(result['passes'])}.log"))
            csv_text = open(csv_path, errors="replace").read() if os.path.exists(csv_path) else ""
            kernels = parse_ncu_csv(csv_text)
            result["passes"].append(dict(metrics=list(metrics), sections=list(sections), rc=rc, kernels=len(kernels),
                                         seconds=round(time.monotonic() - t1, 1)))
            if kernels:
                break
            said = _said(text + "\n" + csv_text)
            if rc is None:
                result.update(status="timeout", detail=f"ncu did not finish within {left:.0f} s")
                break
            if "No kernels were profiled" in text + csv_text:
                result.update(status="no kernels", detail=f"no kernel matched {kernel_regex} (ncu rc={rc})")
                break
            # A counter refusal (permissions, gVisor) ends the probe; a metric or section this ncu
            # does not know gets one more pass with the minimal metrics.
            refused = any(r in said for r in REFUSALS) and not re.search(r"metric|section", said, re.I)
            result.update(status="refused" if refused else "failed", detail=f"ncu rc={rc}: {said}"[:400])
            if refused:
                break
        if os.path.exists(manifest_path) and result["passes"] and result["passes"][-1]["kernels"]:
            with open(manifest_path) as f:
                manifest = json.load(f)
            result["rows"] = probe_rows(manifest, kernels)
            result["impls"] = manifest.get("impls")
            result["selftest"] = manifest.get("selftest")
            ok = [r for r in result["rows"] if r.get("status") == "ok"]
            result.update(status="ok" if len(ok) == len(result["rows"]) else "partial",
                          detail=f"{len(ok)} of {len(result['rows'])} kernels profiled in "
                                 f"{len(result['passes'])} ncu pass(es)")
    result["seconds"] = round(time.monotonic() - t0, 1)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return result


def _said(text: str) -> str:
    """The lines of ncu's output that explain a failure."""
    keep = [line.strip() for line in text.splitlines() if "==ERROR==" in line or "==WARNING==" in line
            or any(r in line for r in REFUSALS)]
    return " | ".join(keep[:4]) or " | ".join(line.strip() for line in text.strip().splitlines()[-2:])


# -- rendering -------------------------------------------------------------------------------------


def _row_cells(r: dict) -> list[str]:
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    stalls = ", ".join(f"{name} {value:.1f}" for name, value in r.get("stalls") or [])
    return [r.get("shape") or "-", str(r.get("group")), r.get("arm") or "-", r.get("impl") or "-",
            str(r.get("heads_per_cta") or "-"), fmt(r.get("time_us"), ".0f"), fmt((r.get("dram_bytes") or 0) / 1e9, ".2f")
            if r.get("dram_bytes") else "-", fmt(r.get("l2_over_dram"), ".2f"), fmt(r.get("expected_l2_over_dram"), ".0f"),
            fmt(r.get("dram_tb_per_s"), ".2f"), fmt(r.get("issue_slots_pct"), ".0f"), fmt(r.get("instr_per_kib"), ".0f"),
            stalls or (r.get("status") if r.get("status") != "ok" else "-")]


HEAD = ["shape", "G", "arm", "impl", "h/CTA", "us", "DRAM GB", "L2/DRAM", "expect", "DRAM TB/s", "issue %",
        "instr/KiB", "top stalls (warps per issue)"]


def probe_markdown(probe: Optional[dict]) -> list[str]:
    if not probe:
        return []
    out = ["## L2 probe (Nsight Compute)", "",
           f"{probe.get('kv_dtype', 'bf16')} KV, batch {probe.get('batch')} x {probe.get('context')} tokens, equal KV "
           "bytes for G = 1, 4, 8; L2/DRAM = L2 read sectors x 32 B / DRAM bytes read, expected about G / heads per "
           f"CTA. Status **{probe.get('status')}**: {probe.get('detail', '')}", ""]
    if (probe.get("selftest") or {}).get("status") == "fallback":
        out += [f"mma self-test fell back to simt: {probe['selftest'].get('detail', '')}; the mma launches were not "
                "profiled.", ""]
    if probe.get("rows"):
        out += ["| " + " | ".join(HEAD) + " |", "|" + " --- |" * len(HEAD)]
        out += ["| " + " | ".join(_row_cells(r)) + " |" for r in probe["rows"]]
        out.append("")
    return out


def probe_text(probe: Optional[dict]) -> list[str]:
    """A few short lines for the summary printed last."""
    if not probe:
        return ["L2 probe: not run"]
    out = [f"L2 probe: {probe.get('status')} ({probe.get('detail', '')})"[:160]]
    if probe.get("rows"):
        out.append("  shape       G arm      impl h   us  L2/DRAM exp  TB/s iss% stalls")
        for r in probe["rows"]:
            c = _row_cells(r)
            stalls = ", ".join(f"{name} {value:.1f}" for name, value in (r.get("stalls") or [])[:2]) or c[12]
            out.append(f"  {c[0]:<11} {c[1]:>1} {c[2]:<8} {c[3]:<4} {c[4]:>1} {c[5]:>4}  {c[7]:>7} {c[8]:>3} "
                       f"{c[9]:>5} {c[10]:>4} {stalls[:36]}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("target", help="(under ncu) run every probe configuration once, write the manifest")
    p = sub.add_parser("probe", help="run the target under ncu and write the result JSON")
    r = sub.add_parser("report", help="rows from a saved ncu CSV and manifest")
    for q in (t, p):
        q.add_argument("--cpu", action="store_true", help="CPU backend, tiny shapes")
        q.add_argument("--batch", type=int)
        q.add_argument("--context", type=int)
    t.add_argument("--manifest", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--work", help="where the manifest, ncu CSV and logs go (default: beside --out)")
    p.add_argument("--ncu", help="ncu to use; 'none' for absent (default: $NCU, PATH, /usr/local/cuda, /opt/nvidia)")
    p.add_argument("--timeout-s", type=float, default=70.0, help="all ncu passes together")
    p.add_argument("--kernel-regex", help="ncu --kernel-name (default: attention_kernel_regex(), both implementations)")
    r.add_argument("--csv", required=True)
    r.add_argument("--manifest", required=True)
    r.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.command == "report":
        with open(args.csv, errors="replace") as f, open(args.manifest) as g:
            rows = probe_rows(json.load(g), parse_ncu_csv(f.read()))
        with open(args.out, "w") as f:
            json.dump({"status": "ok", "rows": rows}, f, indent=1)
        print("\n".join(probe_text({"status": "ok", "detail": args.csv, "rows": rows})))
        return 0
    batch = args.batch or (1 if args.cpu else 16)
    context = args.context or (64 if args.cpu else 16384)
    if args.command == "target":
        manifest = run_target(args.manifest, cpu=args.cpu, batch=batch, context=context)
        failed = [launch for launch in manifest["launches"] if launch.get("error")]
        print(f"l2_probe target: {len(manifest['launches'])} launches, {len(failed)} failed")
        return 0
    result = probe(out=args.out, work=args.work or os.path.dirname(os.path.abspath(args.out)), cpu=args.cpu,
                   ncu=find_ncu(args.ncu, args.cpu), timeout_s=args.timeout_s, batch=batch, context=context,
                   kernel_regex=args.kernel_regex)
    print("\n".join(probe_text(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
