"""The verdicts of ``gpu_check.sh``'s steps, and its exit code: small rules, kept out of the shell
so that they are tested (``benchmarks/tests/test_benchmarks.py``) rather than trusted.

- ``pytest``: a test step is ``ok`` only if something passed. In GPU mode a run with
  nothing passed (every test skipped because the tests saw no device, or no tests
  collected) is ``FAIL``; on the CPU, where skipping is the point, it is ``skipped``, and
  the detail says what GPU mode would have said.
- ``sanitizer``: ``ok``, ``ERRORS`` (the tool found some), ``WRONG`` (an output missed the
  bar), ``TIMEOUT``, ``REFUSED`` (the tool could not run on this device or driver).
- ``bench``: ``ok``, ``PARTIAL`` (cut short, what was measured is written) or ``FAIL``
  (no JSON, or no timed row of ours in it).
- ``exit-code``: 0 when the run produced benchmark rows of ours, 1 when it did not (a run
  that measured nothing is a failed run, whatever else passed).
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


def sanitizer_verdict(rc: int, text: str) -> tuple[str, str]:
    verdict = " ".join(line.strip() for line in text.splitlines()
                       if re.search(r"ERROR SUMMARY|RACECHECK SUMMARY|sanitize_cases:", line))
    status = {0: "ok", 3: "ERRORS", 1: "WRONG"}.get(rc, "TIMEOUT" if rc in TIMEOUT_RCS else "REFUSED")
    if re.search(r"device not supported|unable to (find|load|initialize)|not supported on this", text, re.I):
        status = "REFUSED"  # the sanitizer could not instrument this device or driver
    if status == "REFUSED" or not verdict:
        tail = " ".join(line.strip() for line in text.splitlines() if line.strip())[-200:]
        verdict = f"{verdict} {tail}".strip()
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
    b = sub.add_parser("bench")
    b.add_argument("--rc", type=int, required=True)
    b.add_argument("--json")
    e = sub.add_parser("exit-code")
    e.add_argument("--json")
    j = sub.add_parser("json-status")
    j.add_argument("path")
    f = sub.add_parser("flashinfer")
    f.add_argument("path")
    t = sub.add_parser("selftest")
    t.add_argument("--json")
    args = parser.parse_args(argv)
    if args.command == "exit-code":
        code = 0 if timed_rows(load_json(args.json)) else 1
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
    else:
        try:
            with open(args.log, errors="replace") as f:
                text = f.read()
        except OSError:
            text = ""
        status, detail = (pytest_verdict(args.rc, text, args.mode) if args.command == "pytest"
                          else sanitizer_verdict(args.rc, text))
    print(f"{status}\t{detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
