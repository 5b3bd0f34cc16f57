"""The verdicts of ``gpu_check.sh``'s steps, and its exit code: small rules, kept out of the shell
so that they are tested (``benchmarks/tests/test_benchmarks.py``) rather than trusted.

- ``pytest``: a test step is ``ok`` only if something passed. In GPU mode a run with
  nothing passed (every test skipped because the tests saw no device, or no tests
  collected) is ``FAIL``; on the CPU, where skipping is the point, it is ``skipped``, and
  the detail says what GPU mode would have said.
- ``sanitizer``: ``ok``, ``ERRORS`` (the tool found some), ``WRONG`` (an output missed the
  bar), ``TIMEOUT``, ``REFUSED`` (the tool could not run on this device or driver). racecheck's
  findings are ``HAZARDS``, not a failure: it reports hazards on ``cp.async`` rings that the
  kernels order with ``cp.async.wait_group`` and barriers it does not model; its log says which.
- ``check``: the decisive step (``metrale-attn check``'s ``report.json``): ``ok`` when every cell
  of ours that ran passed and measured something, ``FAIL`` with the first failure or fault named,
  ``PARTIAL`` when a worker passed its cap; the detail counts each implementation's cells.
- ``bench``: ``ok``, ``PARTIAL`` (cut short, what was measured is written) or ``FAIL``
  (no JSON, or no timed row of ours in it).
- ``exit-code``: 0 when the run measured cells of ours (the decisive check's, timed on a GPU or
  checked on the CPU) or benchmark rows of ours, 1 when it did neither (a run that measured
  nothing is a failed run, whatever else passed).
- ``json-status``: ``status<TAB>detail`` of a step's own JSON (the L2 probe's).
- ``flashinfer``: the JIT prewarm's status file: ``ok`` when a spec built, each spec's fate.
- ``selftest``: the mma self-test's record in the benchmark JSON: ``ok`` (the mma rows ran mma),
  ``FALLBACK`` (the device disagreed with the emulation: ``DecodeAttention`` built simt, the mma
  rows were not timed) or ``skipped`` (nothing was built).

Each command prints ``STATUS<TAB>DETAIL`` (``exit-code`` prints the code and exits with it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Optional

TIMEOUT_RCS = (124, 137)


def pytest_counts(text: str) -> dict:
    """The counts of pytest's closing line (``3 failed, 250 passed, 5 skipped in 80.1s``)."""
    counts = {}
    lines = [line for line in text.splitlines() if re.search(r"\b(passed|failed|skipped|error|errors|no tests ran|"
                                                            r"deselected|xfailed)\b", line)]
    last = lines[-1] if lines else ""
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", last):
        counts["error" if word.startswith("error") else word] = int(n)
    counts["line"] = last.strip(" =")
    return counts


def pytest_verdict(rc: int, text: str, mode: str) -> tuple[str, str]:
    counts = pytest_counts(text)
    detail = f"rc={rc} {counts['line']}".strip()
    # A worker that hit a sticky CUDA error ends itself (tests/conftest.py); xdist then names its test.
    crashed = re.findall(r"worker '?(\w+)'? crashed while running '?([^'\n]+)", text)
    if crashed:
        names = ", ".join(f"{test.strip()} ({worker})" for worker, test in crashed)
        return "FAIL", f"{detail}; a worker crashed: {names}"[:600]
    if rc in TIMEOUT_RCS:
        return "TIMEOUT", f"timed out; {detail}"
    if rc not in (0, 5):  # 5: pytest collected nothing (judged below, like an all-skipped run)
        return "FAIL", detail
    if counts.get("failed") or counts.get("error"):
        return "FAIL", detail
    if not counts.get("passed"):
        if mode == "gpu":
            return "FAIL", f"nothing passed: {detail or 'no pytest summary'}"
        return "skipped", f"{detail}; nothing passed (FAIL in GPU mode)"
    return "ok", detail


def sanitizer_verdict(rc: int, text: str, tool: str = "memcheck") -> tuple[str, str]:
    verdict = " ".join(line.strip() for line in text.splitlines()
                       if re.search(r"ERROR SUMMARY|RACECHECK SUMMARY|sanitize_cases:", line))
    status = {0: "ok", 3: "ERRORS", 1: "WRONG"}.get(rc, "TIMEOUT" if rc in TIMEOUT_RCS else "REFUSED")
    if re.search(r"device not supported|unable to (find|load|initialize)|not supported on this", text, re.I):
        status = "REFUSED"  # the sanitizer could not instrument this device or driver
    if status == "REFUSED" or not verdict:
        tail = " ".join(line.strip() for line in text.splitlines() if line.strip())[-200:]
        verdict = f"{verdict} {tail}".strip()
    if tool == "racecheck" and status == "ERRORS":
        status = "HAZARDS"
    return status, f"rc={rc} {verdict}"


def load_json(path: Optional[str]) -> Optional[dict]:
    """A JSON file's content; None when there is no path, no file, or no valid JSON in it."""
    if not path:
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def timed_rows(result: Optional[dict]) -> int:
    """Timed rows of ours in a benchmark result."""
    if not result:
        return 0
    return sum(1 for r in result.get("rows", []) if r.get("impl") == "metrale" and r.get("median_us") is not None)


def bench_verdict(rc: int, json_path: Optional[str]) -> tuple[str, str]:
    result = load_json(json_path)
    if result is None:
        return "FAIL", f"rc={rc} no benchmark JSON"
    n = timed_rows(result)
    budget = result.get("budget", {})
    detail = f"rc={rc} {n} rows of ours timed, {len(result.get('not_measured', []))} not measured"
    if not n:
        return "FAIL", f"{detail}: no benchmark rows"
    if rc != 0:
        return "PARTIAL", f"{detail}; {budget.get('reason', 'cut short')}"
    return "ok", detail + (f"; stopped early: {budget.get('reason')}" if budget.get("stopped_early") else "")


OURS = ("mma", "simt")


def check_cells(report: Optional[dict]) -> int:
    """Cells of ours that measured something in a check report: timed on a GPU, checked on the CPU."""
    if not report:
        return 0
    timed = [r for r in report.get("timing", []) if r.get("impl") in OURS and r.get("median_us") is not None]
    if report.get("timed"):
        return len(timed)
    return sum(r.get("impl") in OURS and r.get("status") == "ok" for r in report.get("correctness", []))


def check_verdict(rc: int, path: str) -> tuple[str, str]:
    """The decisive step: ``metrale-attn check``'s report (see the module's docstring)."""
    report = load_json(path)
    if report is None:
        return ("TIMEOUT" if rc in TIMEOUT_RCS else "FAIL"), f"rc={rc} no check report ({path})"
    parts = []
    for impl in dict.fromkeys(r["impl"] for r in report.get("timing", []) + report.get("correctness", [])):
        timed = [r for r in report.get("timing", []) if r["impl"] == impl]
        correct = [r for r in report.get("correctness", []) if r["impl"] == impl]
        part = f"{impl}"
        if timed:
            part += f" {sum(r.get('median_us') is not None for r in timed)}/{len(timed)} timed"
        if correct:
            part += f" {sum(r['status'] == 'ok' for r in correct)}/{len(correct)} correct"
        parts.append(part)
    detail = f"rc={rc} " + "; ".join(parts)
    if report.get("verdict") != "ok":
        first = (report.get("failures") or ["?"])[0]
        return "FAIL", f"{detail}; {len(report.get('failures', []))} failure(s), first: {first}"[:600]
    if not check_cells(report):
        return "FAIL", f"{detail}: no cell of ours measured"
    capped = [f for f in report.get("faults", []) if "cap" in f.get("error", "")]
    if capped or rc in TIMEOUT_RCS:
        return "PARTIAL", f"{detail}; cut short: " + ", ".join(f"{f['impl']} at {f['cell']}" for f in capped)
    return "ok", detail


def flashinfer_verdict(path: str) -> tuple[str, str]:
    """The JIT prewarm's status file: ``ok`` when a spec built, each spec's status and seconds."""
    data = load_json(path)
    if data is None:
        return "FAIL", f"no prewarm status ({path})"
    if data.get("import_error"):
        return "skipped", data["import_error"]
    specs = data.get("specs", {})
    detail = "; ".join(f"{name} {v.get('status')}" + (f" {v['seconds']:.0f}s" if v.get("seconds") is not None else "")
                       for name, v in specs.items())
    built = any(v.get("status") == "ok" for v in specs.values())
    return ("ok" if built else "FAIL"), detail or "no spec"


def selftest_verdict(json_path: Optional[str]) -> tuple[str, str]:
    record = ((load_json(json_path) or {}).get("kernel_impls") or {}).get("selftest") or {}
    status = {"ok": "ok", "fallback": "FALLBACK"}.get(record.get("status"), "skipped")
    return status, record.get("detail") or "no benchmark JSON, or nothing built"


def json_status(path: str) -> tuple[str, str]:
    data = load_json(path)
    if data is None:
        return "FAIL", f"no result ({path})"
    return str(data.get("status", "?")), str(data.get("detail", ""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pytest")
    p.add_argument("--rc", type=int, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--mode", choices=("gpu", "cpu"), required=True)
    s = sub.add_parser("sanitizer")
    s.add_argument("--rc", type=int, required=True)
    s.add_argument("--log", required=True)
    s.add_argument("--tool", default="memcheck")
    c = sub.add_parser("check")
    c.add_argument("--rc", type=int, required=True)
    c.add_argument("--report", required=True)
    b = sub.add_parser("bench")
    b.add_argument("--rc", type=int, required=True)
    b.add_argument("--json")
    e = sub.add_parser("exit-code")
    e.add_argument("--json")
    e.add_argument("--check", help="the decisive check's report.json")
    j = sub.add_parser("json-status")
    j.add_argument("path")
    f = sub.add_parser("flashinfer")
    f.add_argument("path")
    t = sub.add_parser("selftest")
    t.add_argument("--json")
    args = parser.parse_args(argv)
    if args.command == "exit-code":
        code = 0 if timed_rows(load_json(args.json)) or check_cells(load_json(args.check)) else 1
        print(code)
        return code
    if args.command == "json-status":
        status, detail = json_status(args.path)
    elif args.command == "flashinfer":
        status, detail = flashinfer_verdict(args.path)
    elif args.command == "selftest":
        status, detail = selftest_verdict(args.json)
    elif args.command == "bench":
        status, detail = bench_verdict(args.rc, args.json)
    elif args.command == "check":
        status, detail = check_verdict(args.rc, args.report)
    else:
        try:
            with open(args.log, errors="replace") as f:
                text = f.read()
        except OSError:
            text = ""
        status, detail = (pytest_verdict(args.rc, text, args.mode) if args.command == "pytest"
                          else sanitizer_verdict(args.rc, text, args.tool))
    print(f"{status}\t{detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
