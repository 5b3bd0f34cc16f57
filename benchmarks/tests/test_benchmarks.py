"""The benchmark harness (the benchmarks package) without a GPU: its CPU dry run end to end, and its
reporting (targets, markdown, plots, summary) on a synthetic GPU-shaped result.

The GPU run itself (``benchmarks/gpu_check.sh`` on a device) is not tested here; what
is tested is everything it is built from that runs on a CPU: the CPU-backend sweep
through the same job loop and output writers (the tiers' order, the per-step packing of
logs and summary, a run killed mid-sweep), the step verdicts (an all-skipped GPU test
step is FAIL, no benchmark rows is exit 1), the L2 probe's control flow with ncu absent,
refusing or faked, the FlashInfer prewarm's scheduling, both kernel implementations (simt
and mma) and the heads_per_cta sweep on the real API, a device that fails the mma self-test
(DecodeAttention falls back to simt: recorded, the mma rows not timed), the sanitizer cases'
own checks on the CPU backend, the pass/fail arithmetic of the targets, and the shell
scripts' syntax.
Plots are checked only where matplotlib is installed (it is not a dependency).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest

from benchmarks import baselines, impls, l2_probe, report, steps, summary, sweep, sweep_plan
from benchmarks.model import predictions

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks")

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_BASH = shutil.which("bash") is not None
OUT_NAME = re.compile(r"^[A-Za-z0-9._-]+$")  # what a device run's $OUT may hold


def _python_env(tmp_path, **extra):
    env = dict(os.environ)
    env["PYTHON"] = sys.executable  # the interpreter running the tests, with the package installed
    env["OUT"] = str(tmp_path / "out")
    env["TMPDIR"] = str(tmp_path)
    env.pop("NCU", None)
    env.update(extra)
    return env


def _gpu_check_cpu(tmp_path, *flags, **extra):
    return subprocess.run(["bash", os.path.join(BENCH, "gpu_check.sh"), "--cpu", *flags], cwd=REPO,
                          env=_python_env(tmp_path, **extra), capture_output=True, text=True, timeout=240)


def _steps(summary_md: str) -> dict:
    """``{step: (status, detail)}`` from summary.md's step table."""
    out = {}
    for line in summary_md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] not in ("step", "---"):
            out[cells[0]] = (cells[1], cells[3])
    return out


def _sass_row(impl, arm, heads_per_cta, ceiling, kv_dtype="bf16", arch="sm_90", binding="issue"):
    return dict(impl=impl, arm=arm, q_heads=6, kv_heads=1, head_dim=256, q_dtype="bf16", kv_dtype=kv_dtype, arch=arch,
                heads_per_cta=heads_per_cta, instr_per_kib=110.0, kib_in_flight_per_sm=40.0, registers=96,
                spill_bytes=0, ceiling_pct=ceiling, binding=binding)


SASS_ROWS = [  # a stand-in for sass_model.py --json: the CPU profile's shape on sm_90, both implementations as the
    # report writes them (mma at the group's largest heads per CTA, 6), one fp8 row, one sm_100 row
    _sass_row("simt", "unpacked", 1, 41.0), _sass_row("simt", "splitk", 1, 40.0),
    _sass_row("simt", "gqa_packed", 6, 60.0),
    _sass_row("mma", "unpacked", 6, 99.0), _sass_row("mma", "splitk", 6, 98.0), _sass_row("mma", "gqa_packed", 6, 97.0),
    _sass_row("simt", "unpacked", 1, 75.0, kv_dtype="fp8_e4m3", binding="alu"),
    _sass_row("simt", "unpacked", 1, 1.0, arch="sm_100", binding="x"),
]


@pytest.mark.slow  # ~35 s on two cores: .ci/run's slow step runs it
@pytest.mark.skipif(not HAVE_BASH, reason="needs bash")
def test_gpu_check_cpu_dry_run_writes_every_output(tmp_path):
    """The dry run end to end: tiers in order, the failure rules, a failed wheel install that the
    run goes on from, the L2 probe with ncu absent, SASS predictions joined, the short table last."""
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip file")
    sass = tmp_path / "sass_model.json"
    sass.write_text(json.dumps(SASS_ROWS))
    done = _gpu_check_cpu(tmp_path, WHEELS_DIR=str(wheels), WHEEL_TARGET=str(tmp_path / "site"),
                          SASS_MODEL_JSON=str(sass))
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "out"
    files = sorted(os.listdir(out))
    assert len(files) <= 8 and all(OUT_NAME.match(f) for f in files), files
    assert "summary.md" in files and "logs.tar.gz" in files
    (json_name,) = [f for f in files if f.endswith("_bench.json")]
    assert json_name.endswith("_cpu_bench.json")
    result = json.loads((out / json_name).read_text())
    assert result["mode"] == "cpu" and "not kernel performance" in result["timing_note"]
    ours = [r for r in result["rows"] if r["impl"] == "metrale"]
    assert all(r["check"]["status"] == "ok" and r["median_us"] > 0 for r in ours)
    # Tiers in order after the check's decisive cells: the heads_per_cta sweep, the features, the forced arms
    # of the decisive configurations, then the grid.
    assert list(dict.fromkeys(r["tier"] for r in ours)) == ["heads_per_cta", "features", "decisive-bf16",
                                                             "decisive-fp8", "rest"]
    # The features tier: every feature on bf16, then fp8's host-scale dense row beside its CSR and
    # device-scale rows, each checked against the float64 reference.
    features = [(r["kv_dtype"], r["feature"]) for r in ours if r["tier"] == "features"]
    assert features == [("bf16", f) for f in sweep_plan.FEATURES] + [("fp8", f) for f in sweep_plan.FP8_FEATURES]
    assert [r["vs_plain"] for r in ours if r["tier"] == "features" and r["feature"] == "plain"] == [1.0, 1.0]
    # Every forced arm on both implementations, each row saying what its plan ran; the default flagged once.
    caps = result["kernel_impls"]
    assert caps["impls"] == ["simt", "mma"] and caps["default_impl"] == "mma"
    assert caps["selftest"]["status"] == "ok" and "CPU backend" in caps["selftest"]["detail"]
    for tier in ("decisive-bf16", "decisive-fp8"):
        rows = [r for r in ours if r["tier"] == tier]
        assert {(r["arm"], r["kernel_impl"]) for r in rows} == {(a, i) for a in ("unpacked", "splitk", "gqa_packed")
                                                                 for i in ("simt", "mma")}
        assert [(r["arm"], r["kernel_impl"]) for r in rows if r["default"]] == [("splitk", "mma")]
        assert all(r["heads_per_cta"] == (6 if r["arm"] == "gqa_packed" else 1)
                   for r in rows if r["kernel_impl"] == "simt")
        assert all(r["kernels"][0].startswith("decode_") for r in rows if r["kernel_impl"] == "mma")
    # The sweep: every heads_per_cta of each group (4: 1, 2, 4; 8: 1, 2, 4, 8) on mma, the plan's choice marked once.
    hpc = [r for r in ours if r.get("sweep") == "heads_per_cta"]
    assert {(r["model"], r["batch"]) for r in hpc} == {(m, b) for m in ("4/1/64", "8/1/64") for b in (1, 2)}
    for (model, values) in (("4/1/64", [1, 2, 4]), ("8/1/64", [1, 2, 4, 8])):
        for batch in (1, 2):
            rs = [r for r in hpc if (r["model"], r["batch"]) == (model, batch)]
            assert [r["heads_per_cta"] for r in rs] == [r["plan_heads_per_cta"] for r in rs] == values
            assert all(r["kernel_impl"] == "mma" for r in rs)
            (choice,) = [r["heads_per_cta"] for r in rs if r["hpc_choice"]]
            assert result["hpc_sweep"]["choices"][f"{model} b{batch}"] == choice
    assert {t["id"]: t["status"] for t in result["targets"]} == {"T1": "N/A", "T2": "N/A", "T3": "N/A", "C": "PASS"}
    assert all(b["status"] == "not run" for b in result["baselines"].values())
    # The SASS model's prediction beside each row: by implementation, arm, shape, dtypes and heads per CTA (what
    # the plan ran), sm_90 only. The mma split-K plan serves 2 heads per CTA at batch 2: not in the report.
    by_spec = {(r["kv_dtype"], r["arm"], r["kernel_impl"]): r for r in ours if r["tier"].startswith("decisive")}
    assert by_spec[("bf16", "unpacked", "simt")]["sass"]["ceiling_pct"] == 41.0
    assert by_spec[("bf16", "gqa_packed", "simt")]["sass"]["ceiling_pct"] == 60.0
    assert by_spec[("bf16", "gqa_packed", "mma")]["sass"]["ceiling_pct"] == 97.0
    assert by_spec[("bf16", "splitk", "mma")]["heads_per_cta"] == 2 and by_spec[("bf16", "splitk", "mma")][
        "sass"] is None
    assert by_spec[("fp8", "unpacked", "simt")]["sass"]["binding"] == "alu"
    assert by_spec[("fp8", "splitk", "simt")]["sass"] is None
    assert result["sass_model"]["rows"] == 7
    assert "l2_probe" not in result  # the L2 probe runs in the rerun (--quick)
    md = (out / json_name.replace(".json", ".md")).read_text()
    assert "## Features against plain decode" in md and "| multi_token |" in md
    assert "CPU backend simulator; not kernel performance" in md
    assert "## Measured vs the static SASS model" in md and "| issue |" in md
    assert "## heads_per_cta sweep" in md and "## Old vs new kernels" in md
    if HAVE_MPL:
        assert any(f.endswith("_bench.png") for f in files) and any(f.endswith("_arms.png") for f in files)
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = {os.path.basename(n) for n in tar.getnames()}
    assert {"steps.tsv", "env.json", "bench.log", "summary.txt", "pytest_gpu.log", "decisive.log",
            "wheels.log"} <= names
    summary = (out / "summary.md").read_text()
    table = _steps(summary)
    assert table["wheels"][0] == "FAIL" and "going on without FlashInfer" in table["wheels"][1]
    assert table["gpu_tests"][0] == "skipped" and "FAIL in GPU mode" in table["gpu_tests"][1]
    assert table["benchmark"][0] == "ok" and "CPU backend simulator" in summary
    assert table["mma_selftest"][0] == "ok"
    # The decisive step: metrale-attn check's own code, its report in $OUT/decisive/ (correctness only on the CPU).
    # The named MLA cell (schedule.DECISIVE_CELLS_CPU) adds its 2 arms on mma, whose request runs simt there, and
    # none on simt (the same kernels twice).
    assert table["decisive"][0] == "ok" and "mma 6/6 correct; simt 4/4 correct" in table["decisive"][1]
    check = json.loads((out / "decisive" / "report.json").read_text())
    assert check["verdict"] == "ok" and "no timing was taken" in check["timing_note"]
    mla = [r for r in check["correctness"] if r["spec"]["layer"]["head_dim"] == 576]
    assert [(r["impl"], r["impl_ran"], r["v_read_from_k"]) for r in mla] == [("mma", "simt", True)] * 2
    assert "decisive cells: 10 of 10 correctness cells ok" in done.stdout
    assert list(table)[:5] == ["wheels", "import", "environment", "compile", "decisive"]
    # The decode loop (the vLLM backend's serving path): eager checked, then a step timed on ours and on SDPA.
    assert table["decode_loop"][0] == "ok" and table["decode_loop"][1].startswith("eager ok; step: ours")
    assert "decode_loop.json" in names and "[decode_loop] eager: ok" in done.stdout
    # The merge with and without programmatic dependent launch: the same bytes both ways (the CPU runs both plainly).
    assert table["pdl_check"][0] == "ok" and "bytes equal both ways" in table["pdl_check"][1]
    assert all(r["bytes_equal"] for r in json.loads((out / "pdl_check.json").read_text())["rows"])
    # Progress lines as they come, short; the short table printed last, its verdict the last line.
    progress = [line for line in done.stdout.splitlines() if line.startswith("[bench ")]
    # < 320: a decisive line has 6 slots here (3 arms x simt, mma) in microseconds (`unp/mma 13946us`); a GPU's
    # line gives % of copy (`unp/mma 88%`), shorter
    assert len(progress) >= 6 and all(len(line) < 320 for line in progress), max(progress, key=len)
    assert "decisive configurations, simt vs mma" in done.stdout and "L2 probe: not run" in done.stdout
    assert re.search(r"^  6/1/256 bf16 b2 300 +unp +\d+us\[41\] +\d+us\[-\] +\d\.\d\dx\n {27}spk .*\n"
                     r" {27}pack +\d+us\[60\] +\d+us\[97\] +\d\.\d\dx$", done.stdout, re.M)
    assert "mma self-test: ok" in done.stdout and "  8/1/64 b2:  h1" in done.stdout
    last = done.stdout.rstrip().splitlines()
    assert last[-2].startswith("CPU backend simulator")
    assert last[-1].startswith("OVERALL (CPU dry run): FAIL (wheels FAIL)")


@pytest.mark.skipif(not HAVE_BASH, reason="needs bash")
def test_gpu_check_quick_exits_1_when_the_sweep_times_nothing(tmp_path):
    """The rerun's steps (--quick: no tests, no wheels, no correctness cells, so nothing of the decisive
    step runs on the CPU), and a run that measured nothing is a failed run."""
    done = _gpu_check_cpu(tmp_path, "--quick", BENCH_ARGS="--kv-cap-gb 0", L2_PROBE="0")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.rstrip().splitlines()[-1].startswith(
        "OVERALL (CPU dry run): FAIL (decisive FAIL; benchmark FAIL; no benchmark rows)")
    table = _steps((tmp_path / "out" / "summary.md").read_text())
    assert table["benchmark"][0] == "FAIL" and "no benchmark rows" in table["benchmark"][1]
    assert table["gpu_tests"][0] == "skipped" and "--quick" in table["gpu_tests"][1]
    assert table["wheels"][0] == "skipped" and table["l2_probe"][0] == "skipped"
    assert table["decode_loop"][0] == "skipped" and "--quick" in table["decode_loop"][1]
    assert table["pdl_check"][0] == "skipped" and "--quick" in table["pdl_check"][1]


@pytest.mark.slow  # ~20 s on two cores: .ci/run's slow step runs it
@pytest.mark.skipif(not HAVE_BASH, reason="needs bash")
def test_a_run_killed_mid_sweep_still_leaves_logs_summary_and_numbers(tmp_path):
    """The device tool kills a command at its limit: what was packed after each step, and what the
    sweep checkpointed, must already be in $OUT; the progress lines already on stdout."""
    env = _python_env(tmp_path, CHECKPOINT_S="1", BENCH_ARGS="--cpu-target-s 1 --checkpoint-s 0")
    proc = subprocess.Popen(["bash", os.path.join(BENCH, "gpu_check.sh"), "--cpu"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = tmp_path / "out"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            summary = (out / "summary.md").read_text() if (out / "summary.md").exists() else ""
            partial = [f for f in os.listdir(out) if f.endswith("_bench.json")] if out.exists() else []
            if "| benchmark | running |" in summary and partial:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the sweep never checkpointed")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout = proc.communicate(timeout=30)[0]
    files = os.listdir(out)
    assert len(files) <= 8 and all(OUT_NAME.match(f) for f in files), files
    result = json.loads((out / partial[0]).read_text())
    assert result["rows"] and result["rows"][0]["tier"] == "heads_per_cta"
    table = _steps((out / "summary.md").read_text())
    assert table["gpu_tests"][0] == "skipped" and table["decisive"][0] == "ok"
    assert (out / "decisive" / "report.json").exists()
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = {os.path.basename(n) for n in tar.getnames()}
    assert {"steps.tsv", "env.json", "pytest_gpu.log", "decisive.log"} <= names
    assert re.search(r"^\[bench \d+s\] heads_per_cta 4/1/64 bf16 b1 64: ", stdout, re.M), stdout


@pytest.mark.slow  # ~9 s on two cores: .ci/run's slow step runs it
def test_sanitizer_cases_pass_on_the_cpu_backend():
    done = subprocess.run([sys.executable, "-m", "benchmarks.sanitize_cases", "--cpu"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert [(line[1], line[2]) for line in lines] == [(i, a) for i in ("mma", "simt")
                                                      for a in sweep_plan.DEFAULT_ARMS
                                                      for _ in range(2)]
    assert all(f") {line[1]} (" in " ".join(line) for line in lines)  # the plan ran the implementation asked for
    assert "0 failure(s)" in done.stdout


@pytest.mark.skipif(not HAVE_BASH, reason="needs bash")
@pytest.mark.parametrize("script", ["gpu_check.sh", "fetch_wheels.sh"])
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", os.path.join(BENCH, script)], check=True)


def test_the_readme_gives_both_run_calls_as_the_schedule_plans_them():
    """benchmarks/README.md's two device calls: an H200 asked for, each call's timeout_s the schedule's
    (whose deadlines leave a margin under them, benchmarks/tests/test_schedule.py), commands within the
    tool's 2,000 characters."""
    from benchmarks import schedule

    readme = open(os.path.join(BENCH, "README.md")).read()
    calls = {c: (int(t), k) for c, t, k in re.findall(
        r'run\(command="(bash benchmarks/gpu_check\.sh[^"]*)", timeout_s=(\d+), kind="([\w-]+)"', readme)}
    assert set(calls) == {"bash benchmarks/gpu_check.sh", "bash benchmarks/gpu_check.sh --quick"}
    assert calls["bash benchmarks/gpu_check.sh"] == (schedule.CALL_TIMEOUT_S["full"], "nvidia-h200")
    assert calls["bash benchmarks/gpu_check.sh --quick"] == (schedule.CALL_TIMEOUT_S["quick"], "nvidia-h200")
    assert all(t <= 600 and len(c) <= 2000 for c, (t, _) in calls.items())
    assert 'carry=[".whl"]' in readme


# -- step verdicts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rc, log, mode, status", [
    (0, "ssss\n258 skipped in 0.88s\n", "gpu", "FAIL"),  # the tests saw no device: nothing proven
    (0, "ssss\n258 skipped in 0.88s\n", "cpu", "skipped"),
    (5, "no tests ran in 0.01s\n", "gpu", "FAIL"),
    (0, "6 workers [258 items]\n.....\n250 passed, 8 skipped in 80.10s\n", "gpu", "ok"),
    (1, "FAILED tests/test_gpu.py::x\n1 failed, 249 passed in 81.0s\n", "gpu", "FAIL"),
    (1, "===== 3 passed, 1 error in 2.00s =====\n", "gpu", "FAIL"),
    (124, "....", "gpu", "TIMEOUT"),
])
def test_pytest_step_verdicts(rc, log, mode, status):
    assert steps.pytest_verdict(rc, log, mode)[0] == status


def test_sanitizer_step_verdicts():
    assert steps.sanitizer_verdict(0, "========= ERROR SUMMARY: 0 errors\nsanitize_cases: 0 failure(s)")[0] == "ok"
    assert steps.sanitizer_verdict(3, "========= ERROR SUMMARY: 2 errors")[0] == "ERRORS"
    assert steps.sanitizer_verdict(1, "sanitize_cases: 1 failure(s)")[0] == "WRONG"
    assert steps.sanitizer_verdict(255, "========= Error: Device not supported")[0] == "REFUSED"
    assert steps.sanitizer_verdict(124, "")[0] == "TIMEOUT"


def test_bench_verdict_and_exit_code(tmp_path):
    assert steps.bench_verdict(1, None)[0] == "FAIL"
    empty, full = tmp_path / "empty.json", tmp_path / "full.json"
    empty.write_text(json.dumps({"rows": [{"impl": "metrale", "status": "failed"}], "budget": {}}))
    full.write_text(json.dumps({"rows": [{"impl": "metrale", "median_us": 3.0}], "budget": {"reason": "SIGTERM"}}))
    assert steps.bench_verdict(0, str(empty)) == ("FAIL", "rc=0 0 rows of ours timed, 0 not measured: no benchmark rows")
    assert steps.bench_verdict(0, str(full))[0] == "ok" and steps.bench_verdict(1, str(full))[0] == "PARTIAL"
    assert steps.main(["exit-code", "--json", str(empty)]) == 1 and steps.main(["exit-code", "--json", str(full)]) == 0
    assert steps.main(["exit-code"]) == 1
    fi = tmp_path / "fi.json"
    fi.write_text(json.dumps({"specs": {"hd128-kvbf16-decode": {"status": "ok", "seconds": 95.2},
                                           "hd256-kvbf16-tensorcore": {"status": "dropped"}}}))
    assert steps.flashinfer_verdict(str(fi)) == ("ok", "hd128-kvbf16-decode ok 95s; hd256-kvbf16-tensorcore dropped")
    fi.write_text(json.dumps({"specs": {}, "import_error": "wheel install failed"}))
    assert steps.flashinfer_verdict(str(fi)) == ("skipped", "wheel install failed")


# -- what runs, in which order --------------------------------------------------------------------------


def _planned(*argv):
    return sweep_plan.plan_jobs(sweep.parse_args(list(argv)))


def test_the_full_profile_runs_heads_per_cta_and_the_features_then_the_decisive_forced_arms_then_the_grid():
    """The check's decisive step has timed the default launch of the decisive cells already: the sweep
    starts with what that step does not answer."""
    jobs = _planned()
    hpc = jobs[:6]  # every heads_per_cta of each group: 4 -> 1, 2, 4; 8 -> 1, 2, 4, 8
    assert [(j.kind, j.config.model, j.config.batch, j.config.context, j.hpc_values) for j in hpc] == [
        ("hpc", m, b, 16384, values) for m, values in (("llama-3-8b", (1, 2, 4)), ("llama-3-70b", (1, 2, 4, 8)))
        for b in (1, 16, 64)]
    features = jobs[6:8]  # plain and every feature on one configuration, bf16 then fp8
    assert [(j.kind, j.config.model, j.config.kv_dtype, j.config.batch, j.config.context) for j in features] == [
        ("features", "llama-3-8b", dt, 64, 16384) for dt in ("bf16", "fp8")]
    assert [len(sweep_plan.slots_for(j, [])) for j in features] == [7, 3]
    arms = [(j.tier, j.config.model, j.config.batch, j.config.context) for j in jobs[8:20]]
    decisive = [("llama-3-8b", 64, 4096), ("llama-3-8b", 64, 16384), ("llama-3-8b", 1, 32768),
                ("llama-3-70b", 64, 4096), ("llama-3-70b", 1, 32768), ("qwen3.8-27b", 64, 4096)]
    assert arms == [(f"decisive-{dt}", *c) for dt in ("bf16", "fp8") for c in decisive]
    assert all(j.baselines == ("sdpa_gather", "sdpa_nogather") for j in jobs[8:20])
    # simt and mma timed side by side on every forced arm
    assert all({s.impl for s in sweep_plan.slots_for(j, list(sweep_plan.DEFAULT_ARMS))} == {
        "simt", "mma"} for j in jobs[8:20])
    rest = jobs[20:]
    assert rest and all(j.tier == "rest" and not j.baselines for j in rest)
    assert {j.config.batch for j in rest} == {1, 16, 64, 256} and {j.config.context for j in rest} == {
        4096, 16384, 65536}  # no batch 4, no 1k contexts
    points = [j.config for j in jobs if j.kind == "arms"]
    assert len(points) == len(set(points)) == 72 + 4  # 3 models x 2 dtypes x 4 batches x 3 contexts; 2 x 1 x 32k
    quick = _planned("--profile", "quick")
    assert [j.tier for j in quick] == [j.tier for j in jobs[:6] + jobs[8:20]] and not any(j.baselines for j in quick)


def test_slots_force_every_arm_on_every_implementation():
    jobs = _planned()
    assert [s.label for s in sweep_plan.slots_for(jobs[13], list(sweep_plan.DEFAULT_ARMS))] == [  # 24/4/256
        f"{arm}/{i}" for arm in ("unpacked", "splitk", "gqa_packed") for i in ("simt", "mma")]
    assert [s.label for s in sweep_plan.slots_for(jobs[8], list(sweep_plan.DEFAULT_ARMS))] == [  # 32/8/128: no pack
        f"{arm}/{i}" for arm in ("unpacked", "splitk") for i in ("simt", "mma")]
    assert [s.label for s in sweep_plan.slots_for(jobs[3], [])] == [  # 64/8/128: group 8
        "default/mma/h1", "default/mma/h2", "default/mma/h4", "default/mma/h8"]
    assert [s.label for s in sweep_plan.slots_for(jobs[-1], ["unpacked"])] == [  # the grid: simt and mma only
        "unpacked/simt", "unpacked/mma"]


# -- the mma self-test: a device that disagrees gets simt, and the harness says so --------------------------

DISAGREEING_DEVICE_DRIVER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from metrale_attn.backends.cpu_backend import CpuBackend
CpuBackend.verify_mma = lambda self: ["mma.m16n8k16 bf16"]  # as the CuPy backend reports a disagreeing device
from benchmarks import l2_probe, sweep
rc = sweep.main(sys.argv[3:])
manifest = l2_probe.run_target(sys.argv[2], cpu=True, batch=1, context=64)
sys.exit(rc)
"""


def test_a_device_that_fails_the_mma_self_test_runs_simt_and_the_run_says_so(tmp_path):
    """DecodeAttention warns and builds simt: ``impls.build`` sees it from the plan of what was built, the sweep
    records the warning and times no mma row (status ``fallback``), the probe profiles no mma launch, and the
    step table and the verdict say FALLBACK."""
    from metrale_attn.backends.cpu_backend import CpuBackend

    class Disagreeing(CpuBackend):
        def verify_mma(self):
            return ["ldmatrix.x4"]

    built = impls.build(sweep.DecodeAttention, 8, 2, 64, 16, q_dtype="bf16", kv_dtype="bf16", max_batch=2,
                        backend=Disagreeing(), impl="mma")
    assert built.fell_back and built.impl == "simt" and "ldmatrix.x4" in built.fallback_reason()
    assert not impls.build(sweep.DecodeAttention, 8, 2, 64, 16, q_dtype="bf16", kv_dtype="bf16", max_batch=2,
                           backend="cpu", impl="mma").fell_back
    with pytest.raises(ValueError, match="heads_per_cta"):  # a bad heads_per_cta is the build's refusal
        impls.build(sweep.DecodeAttention, 8, 2, 64, 16, q_dtype="bf16", kv_dtype="bf16", max_batch=2,
                    backend="cpu", heads_per_cta=3)

    driver = tmp_path / "driver.py"
    driver.write_text(DISAGREEING_DEVICE_DRIVER)
    out, manifest = tmp_path / "out", tmp_path / "manifest.json"
    done = subprocess.run([sys.executable, str(driver), REPO, str(manifest), "--cpu", "--out-dir", str(out),
                           "--decisive", "6/1/256:1:64", "--decisive-dtypes", "bf16", "--hpc-models", "4/1/64",
                           "--hpc-batches", "1", "--rest", "off"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (name,) = [f for f in os.listdir(out) if f.endswith("_bench.json")]
    result = json.loads((out / name).read_text())
    record = result["kernel_impls"]["selftest"]
    assert record["status"] == "fallback" and "disagree" in record["detail"] and result["kernel_impls"][
        "default_impl"] == "simt"
    ours = [r for r in result["rows"] if r["impl"] == "metrale"]
    assert {r["status"] for r in ours if r["impl_asked"] == "mma"} == {"fallback"}
    assert all(r["kernel_impl"] == "simt" for r in ours if r.get("median_us") is not None)
    assert [(r["arm"], r["kernel_impl"]) for r in ours if r["default"]] == [("splitk", "simt")]
    assert [r["status"] for r in ours if r.get("sweep") == "heads_per_cta"] == ["fallback"] * 3
    assert "mma self-test: fallback" in done.stdout
    launches = json.loads(manifest.read_text())["launches"]
    assert {x["impl"] for x in launches if x.get("kernels")} == {"simt"}
    assert all(x.get("fallback") for x in launches if x["impl"] == "mma")
    assert steps.selftest_verdict(str(out / name))[0] == "FALLBACK"
    table = [dict(name="mma_selftest", status="FALLBACK", seconds="0", detail=record["detail"])]
    _, text = summary.render(table, {}, result, "9")
    assert "mma self-test: FELL BACK to simt" in text and "fallback[-]" in text
    assert text.splitlines()[-1].startswith("OVERALL (CPU dry run): FAIL (mma_selftest FALLBACK)")


# -- the L2 probe ---------------------------------------------------------------------------------------

FAKE_NCU = r"""#!PYTHON
# A stand-in for ncu: runs the target, then writes ncu-style raw CSV for the kernels its manifest lists.
import csv, json, os, re, subprocess, sys
args = sys.argv[1:]
mode = os.environ.get("FAKE_NCU", "ok")
log = args[args.index("--log-file") + 1]
target = args[args.index("--log-file") + 2:]
if mode == "refuse":
    open(log, "w").write("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU "
                         "Performance Counters on the target device 0.\n")
    sys.exit(1)
if mode == "badmetric" and "--section" in args:
    print("==ERROR== Failed to find metric sm__inst_issued.avg.pct_of_peak_sustained_active")
    sys.exit(1)
subprocess.check_call(target)
manifest = json.load(open(target[target.index("--manifest") + 1]))
wanted = re.compile(args[args.index("--kernel-name") + 1].removeprefix("regex:"))  # ncu profiles these only
metrics = args[args.index("--metrics") + 1].split(",")
stall = "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"
header = ["ID", "Kernel Name"] + metrics + [stall]
units = {"dram__bytes_read.sum": "Kbyte", "gpu__time_duration.sum": "nsecond", "launch__registers_per_thread":
         "register/thread", "lts__t_sectors_srcunit_tex_op_read.sum": "sector"}
with open(log, "w") as f:
    f.write("==PROF== Connected to process 1234\n")
    w = csv.writer(f, quoting=csv.QUOTE_ALL)
    w.writerow(header)
    w.writerow([""] * 2 + [units.get(m, "") for m in metrics] + [""])
    i = 0
    for launch in manifest["launches"]:
        for j, kernel in enumerate(launch["kernels"]):
            if not wanted.search(kernel):
                continue
            dram = launch["kv_bytes"] if j == 0 else 4096  # the merge reads little
            l2 = dram * launch["group"] / launch["heads_per_cta"] if j == 0 else dram
            values = {"dram__bytes_read.sum": f"{dram / 1000:,.3f}", "lts__t_sectors_srcunit_tex_op_read.sum": l2 / 32,
                      "gpu__time_duration.sum": 50000, "smsp__inst_executed.sum": 1000,
                      "sm__inst_issued.avg.pct_of_peak_sustained_active": 25.5, "launch__registers_per_thread": 96}
            w.writerow([i, kernel] + [values.get(m, 0) for m in metrics] + [7.5])
            i += 1
"""


@pytest.mark.parametrize("mode, status, passes", [("ok", "ok", 1), ("badmetric", "ok", 2), ("refuse", "refused", 1)])
def test_the_l2_probe_parses_ncu_and_records_a_refusal(tmp_path, mode, status, passes):
    ncu = tmp_path / "ncu"
    ncu.write_text(FAKE_NCU.replace("PYTHON", sys.executable))
    ncu.chmod(0o755)
    out = tmp_path / "l2.json"
    env = dict(os.environ, FAKE_NCU=mode)
    done = subprocess.run([sys.executable, "-m", "benchmarks.l2_probe", "probe", "--cpu", "--ncu", str(ncu),
                           "--out", str(out), "--work", str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr  # never fatal
    result = json.loads(out.read_text())
    assert result["status"] == status and len(result["passes"]) == passes, result
    if status == "refused":
        assert "ERR_NVGPUCTRPERM" in result["detail"] and not result["rows"]
        return
    rows = result["rows"]
    assert [(r["shape"], r["arm"], r["impl"]) for r in rows] == [
        (s, a, i) for s in ("2/2/256", "8/2/256", "16/2/256") for a in ("unpacked", "splitk") for i in ("simt", "mma")]
    assert result["impls"] == ["simt", "mma"] and result["selftest"]["status"] == "ok"
    for r in rows:  # L2 serves each KV row G / heads_per_cta times (the plan's heads per CTA)
        assert r["expected_l2_over_dram"] == r["group"] / r["heads_per_cta"]
        assert r["l2_over_dram"] == pytest.approx(r["expected_l2_over_dram"])
        assert r["dram_bytes"] == r["kv_bytes"] and r["time_us"] == pytest.approx(50.0)
        assert r["kernel"] == ("simt_" if r["impl"] == "simt" else "") + "decode_" + r["arm"]
        assert r["other_kernels"] == []  # the merges (and the mma self-test) are not profiled
        if mode == "ok":
            assert r["stalls"] == [["long_scoreboard", 7.5]] and r["issue_slots_pct"] == 25.5
    assert all(r["heads_per_cta"] == 1 for r in rows if r["impl"] == "simt")
    text = "\n".join(l2_probe.probe_text(result))
    assert "L2 probe: ok" in text and max(len(line) for line in text.splitlines()) < 120
    assert "| 16/2/256 | 8 | splitk | mma |" in "\n".join(l2_probe.probe_markdown(result))


def test_ncu_csv_parsing_scales_units_and_skips_noise():
    text = ('==PROF== Connected\n"ID","Kernel Name","dram__bytes_read.sum","gpu__time_duration.sum"\n'
            '"","","Mbyte","usecond"\n"0","simt_decode_unpacked","1,073.74","250.5"\n==PROF== Disconnected\n')
    (k,) = l2_probe.parse_ncu_csv(text)
    assert k["kernel"] == "simt_decode_unpacked" and k["dram__bytes_read.sum"] == pytest.approx(1.07374e9)
    assert k["gpu__time_duration.sum"] == pytest.approx(250.5e-6)
    assert l2_probe.parse_ncu_csv("==ERROR== nothing\n") == []
    assert l2_probe.unit_scale("Msector") == 1e6 and l2_probe.unit_scale("register/thread") == 1.0
    stalls = {"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": 4.0,
              "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio": 1.0,
              "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": 0.5,
              "smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct": 60.0}
    assert l2_probe.stall_reasons(stalls) == [("long_scoreboard", 4.0), ("barrier", 0.5)]


# -- the FlashInfer prewarm's scheduling -------------------------------------------------------------------


def _fake_build(seconds, rc=0):
    return lambda h, kv, d, dt: [sys.executable, "-c", f"import time, sys; time.sleep({seconds}); sys.exit({rc})"]


def test_flashinfer_prewarm_builds_the_decode_variants_first_and_drops_what_cannot_finish(tmp_path):
    status = tmp_path / "fi.json"
    shapes = [(32, 8, 128), (24, 4, 256)]
    state = baselines.flashinfer_prewarm(shapes, ["bf16", "fp8"], timeout_s=30, log_dir=str(tmp_path),
                                         status_path=str(status), min_late_s=1000, command=_fake_build(0.1),
                                         check_import=False, poll_s=0.05)
    v = state["specs"]
    assert v["hd128-kvbf16-decode"]["status"] == v["hd128-kvfp8-decode"]["status"] == "ok"
    assert v["hd256-kvbf16-tensorcore"]["status"] == "dropped" and "cannot build in time" in \
        v["hd256-kvbf16-tensorcore"]["reason"]
    assert json.loads(status.read_text())["running"] is False
    state = baselines.flashinfer_prewarm(shapes, ["bf16"], timeout_s=30, log_dir=str(tmp_path), min_late_s=0,
                                         command=_fake_build(0.1), check_import=False, poll_s=0.05)
    v = state["specs"]
    assert v["hd256-kvbf16-tensorcore"]["status"] == "ok"
    state = baselines.flashinfer_prewarm([(32, 8, 128)], ["bf16"], timeout_s=0.3, log_dir=str(tmp_path),
                                         command=_fake_build(30), check_import=False, poll_s=0.05)
    assert state["specs"]["hd128-kvbf16-decode"]["status"] == "timeout"
    state = baselines.flashinfer_prewarm([(32, 8, 128)], ["bf16"], timeout_s=30, log_dir=str(tmp_path),
                                         command=_fake_build(0, rc=2), check_import=False, poll_s=0.05)
    assert state["specs"]["hd128-kvbf16-decode"]["status"] == "failed"
    # What the sweep's late phase waits for: only what a running prewarm has not finished.
    running = {"running": True, "specs": {"a": {"status": "building"}, "b": {"status": "ok"},
                                             "c": {"status": "queued"}}}
    assert baselines.pending_builds(running, ["a", "b", "c", "d"]) == ["a", "c"]
    assert baselines.pending_builds(dict(running, running=False), ["a", "c"]) == []


# -- the SASS model's predictions --------------------------------------------------------------------------


def test_predictions_join_by_variant_on_the_device_arch(tmp_path):
    path = tmp_path / "sass.json"
    old = {k: v for k, v in _sass_row("simt", "unpacked", 1, 33.0).items() if k != "impl"}  # a report before impl=
    path.write_text(json.dumps(SASS_ROWS[1:] + [old]))  # SASS_ROWS[0] is the simt unpacked bf16 row
    p = predictions.Predictions.load(str(path), "sm_90")
    key = dict(arm="unpacked", q_heads=6, kv_heads=1, head_dim=256, q_dtype="bf16")
    assert p.lookup(**key, impl="simt", kv_dtype="fp8", heads_per_cta=1)["binding"] == "alu"  # fp8: fp8_e4m3 there
    assert p.lookup(**key, impl="mma", kv_dtype="bf16", heads_per_cta=6)["ceiling_pct"] == 99.0
    assert p.lookup(**key, impl="mma", kv_dtype="bf16", heads_per_cta=1) is None  # only the group's largest
    assert p.lookup(**key, impl="simt", kv_dtype="bf16", heads_per_cta=1)["ceiling_pct"] == 33.0  # no impl: simt
    packed = dict(key, arm="gqa_packed", kv_dtype="bf16", heads_per_cta=6)  # the same key but the implementation
    assert [p.lookup(**packed, impl=i)["ceiling_pct"] for i in ("simt", "mma")] == [60.0, 97.0]
    assert predictions.Predictions.load(str(path), "9.0").rows == p.rows
    assert predictions.Predictions.load(str(path), "sm_100").lookup(**key, impl="simt", kv_dtype="bf16",
                                                                    heads_per_cta=1)["ceiling_pct"] == 1.0
    missing = predictions.Predictions.load(str(tmp_path / "none.json"), "sm_90")
    assert missing.lookup(**key, impl="simt", kv_dtype="bf16", heads_per_cta=1) is None
    assert "no prediction" in missing.describe()["note"]
    assert predictions.ratio(80.0, {"ceiling_pct": 88.0}) == pytest.approx(80 / 88)
    assert predictions.ratio(None, {"ceiling_pct": 88.0}) is None and predictions.ratio(80.0, None) is None


def test_the_committed_sass_model_predicts_every_decisive_variant_of_both_implementations():
    """benchmarks/model/results/sass_model.json (``sass_model.py --json``) joined as the sweep joins it: every forced
    arm on simt and mma at every decisive configuration, at the heads per CTA its plan on an H200 runs. The
    report gives mma at the group's largest heads per CTA only, so the one plan that picks fewer (unpacked, one
    sequence: 8 KV heads x 4 / h CTAs, h = 1 to cover half the SMs; and 64/8/128's one sequence, h = 1 unpacked,
    h = 4 split-K) has none."""
    from metrale_attn.config import LayerConfig
    from metrale_attn.plan import make_plan
    from metrale_attn.targets import get_target, resolve_target_policy

    p = predictions.Predictions.load(os.path.join(BENCH, "model", "results", "sass_model.json"), "sm_90")
    decisive, missing = [j for j in _planned() if j.tier.startswith("decisive")], []
    for job in decisive:
        c = job.config
        for slot in sweep_plan.slots_for(job, list(sweep_plan.DEFAULT_ARMS)):
            target_policy = resolve_target_policy(get_target("hopper"), environ={}, **sweep_plan.arm_options(slot.arm))
            plan = make_plan(LayerConfig(c.shape, 16, "bf16", c.kv_dtype, c.batch, target_policy, impl=slot.impl), c.batch)
            found = p.lookup(impl=plan.impl, arm=plan.arm, q_heads=c.shape.num_q_heads,
                             kv_heads=c.shape.num_kv_heads, head_dim=c.shape.head_dim, q_dtype="bf16",
                             kv_dtype=c.kv_dtype, heads_per_cta=plan.heads_per_cta)
            if found is None:
                missing.append((c.short(), slot.label, plan.heads_per_cta))
            else:
                assert isinstance(found["ceiling_pct"], float) and found["binding"], (c.short(), slot.label)
    assert missing == [m for kv in ("bf16", "fp8") for m in (
        (f"llama-3-8b {kv} b1 32k", "unpacked/mma", 1), (f"llama-3-70b {kv} b1 32k", "unpacked/mma", 1),
        (f"llama-3-70b {kv} b1 32k", "splitk/mma", 4))]  # one sequence: the plans pick fewer heads per CTA


def test_bytes_per_call_count_k_and_v_q_and_out():
    shape = sweep.MODELS["qwen3.8-27b"]
    c = sweep.Config("qwen3.8-27b", shape, "bf16", batch=2, context=1024, page_size=16)
    kv = 2 * 1024 * 4 * 256 * 2 * 2  # seqs x tokens x kv_heads x head_dim x bf16 x (K, V)
    assert c.kv_bytes == kv
    assert c.bytes_moved == kv + 2 * (2 * 24 * 256 * 2)  # + q and out, bf16
    assert sweep.Config("x", shape, "fp8", 2, 1024, 16).kv_bytes == kv // 2


def test_arms_are_forced_only_where_the_shape_fits():
    MODELS = sweep.MODELS
    assert sweep.arms_for(MODELS["qwen3.8-27b"], ["unpacked", "splitk", "gqa_packed"]) == [
        "unpacked", "splitk", "gqa_packed"]
    assert sweep.arms_for(MODELS["llama-3-8b"], ["unpacked", "splitk", "gqa_packed"]) == ["unpacked", "splitk"]
    assert sweep.arm_options("splitk:4") == dict(splitk="4", gqa_pack=False)
    assert sweep.arm_options("unpacked") == dict(splitk="off", gqa_pack=False)
    assert [m for m, _ in sweep.parse_models("llama-3-70b,6/1/256")] == ["llama-3-70b", "6/1/256"]


# -- reporting on a synthetic GPU-shaped result -------------------------------------------------------


def synthetic_result(copy: float = 4.0) -> dict:
    """A GPU-shaped result: two configurations, ours at a given % of copy, and two baselines."""
    shape = sweep.MODELS["llama-3-8b"]
    rows = []

    def ours(batch, context, arm, us, default):
        c = sweep.Config("llama-3-8b", shape, "bf16", batch, context, 16)
        timing = sweep.Timing(us, us, us, 5, "cuda-graph")
        return sweep.make_row(c, "metrale", arm=arm, timing=timing, copy_tb_per_s=copy, status="ok",
                                     check={"status": "ok"}, default=default)

    def base(batch, context, name, us=None, reason=""):
        c = sweep.Config("llama-3-8b", shape, "bf16", batch, context, 16)
        timing = sweep.Timing(us, us, us, 5, "cuda-graph") if us else None
        return sweep.make_row(c, name, timing=timing, copy_tb_per_s=copy,
                                     status="ok" if us else "unavailable", reason=reason)

    for batch, context in ((1, 65536), (16, 4096), (64, 16384)):
        c = sweep.Config("llama-3-8b", shape, "bf16", batch, context, 16)
        at = lambda pct: c.bytes_moved / (pct / 100 * copy * 1e12) * 1e6  # microseconds at pct % of copy
        rows.append(ours(batch, context, "splitk", at(92 if batch > 1 else 85), True))
        rows.append(ours(batch, context, "unpacked", at(50 if batch == 1 else 88), False))
        rows.append(base(batch, context, "sdpa_gather", at(30)))
        rows.append(base(batch, context, "flashinfer", at(95) if batch == 64 else at(70)))
        rows.append(base(batch, context, "flex_paged", reason="FlexAttention compile budget of 60 s spent"))
    result = {"mode": "gpu", "device_label": "H200", "created_utc": "2026-11-30T00:00:00Z",
              "timing_note": "synthetic", "copy_tb_per_s": copy,
              "copy_bandwidth": {"tb_per_s": copy, "method": "synthetic"},
              "environment": {"device": {"name": "NVIDIA H200", "sm_count": 132}},
              "rows": rows, "skipped": [], "not_measured": [], "host_overhead": [], "baselines": {},
              "budget": {"time_budget_s": 150, "elapsed_s": 10, "stopped_early": False}}
    sweep.summarize_baselines(result)
    return result


def test_targets_pass_and_fail_where_they_should():
    result = synthetic_result()
    targets = {t["id"]: t for t in report.evaluate_targets(result)}
    assert targets["T1"]["status"] == "PASS" and targets["T1"]["value"] == pytest.approx(92)
    assert targets["T2"]["status"] == "PASS" and targets["T2"]["value"] == pytest.approx(85)
    # FlashInfer is faster at batch 64: T3 fails and names that configuration.
    assert targets["T3"]["status"] == "FAIL"
    assert any("FlashInfer" in f and "b64" in f for f in targets["T3"]["failures"])
    assert targets["C"]["status"] == "PASS"
    slow = synthetic_result()
    for r in slow["rows"]:  # the same times against twice the bandwidth: 46%
        if r.get("pct_of_copy"):
            r["pct_of_copy"] /= 2
    t1 = {t["id"]: t for t in report.evaluate_targets(slow)}["T1"]
    assert t1["status"] == "FAIL" and "b16" in " ".join(t1["failures"])


def test_markdown_names_baselines_that_did_not_run_and_why():
    result = synthetic_result()
    result["targets"] = report.evaluate_targets(result)
    md = report.render_markdown(result)
    assert "FlexAttention**: did not run" in md and "compile budget of 60 s spent" in md
    assert "| 64 | 16k |" in md and "T3 misses" in md
    assert result["baselines"]["flashinfer"]["ran"] == 3


def test_outputs_and_summary_from_a_synthetic_result(tmp_path):
    result = synthetic_result()
    result["targets"] = report.evaluate_targets(result)
    paths = report.write_outputs(result, str(tmp_path))
    names = {os.path.basename(p) for p in paths}
    expected = {"2026-11-30_H200_bench.json", "2026-11-30_H200_bench.md"}
    if HAVE_MPL:
        expected |= {"2026-11-30_H200_arms.png", "2026-11-30_H200_bench.png"}
    assert names == expected
    json.loads((tmp_path / "2026-11-30_H200_bench.json").read_text())
    steps = [dict(name="gpu_tests", status="ok", seconds="80", detail="252 passed")]
    md, text = summary.render(steps, {}, result, "300")
    assert "gpu_tests" in text and "T1     PASS" in text and "% of copy" in text
    assert "vs fastest baseline" in text and md.startswith("# metrale-attn gpu_check")


def test_markdown_gives_percent_of_copy_for_every_arm():
    result = synthetic_result()
    result["targets"] = report.evaluate_targets(result)
    md = report.render_markdown(result)
    assert "| unpacked us (% copy) | split-K us (% copy) |" in md
    row = next(line for line in md.splitlines() if line.startswith("| 16 | 4k |"))
    assert "(88.0%)" in row and "(92.0%)" in row and "(30.0%)" in row  # unpacked, split-K, SDPA


def full_size_result(copy: float = 4.3) -> dict:
    """The largest result a full run can bring back: every job of the full profile, both kernel
    implementations (mma twice as fast), every baseline on the decisive configurations, the heads_per_cta
    sweep on both groups, a 12-kernel L2 probe."""
    rows = []
    for job in sweep_plan.plan_jobs(sweep.parse_args([])):
        c = job.config
        at = lambda pct: c.bytes_moved / (pct / 100 * copy * 1e12) * 1e6  # noqa: E731  (us at pct % of copy)
        for slot in sweep_plan.slots_for(job, list(sweep_plan.DEFAULT_ARMS)):
            us = at(92.0 if slot.impl == "mma" else 46.0)
            row = sweep.make_row(c, "metrale", arm=slot.arm, copy_tb_per_s=copy, status="ok",
                                        timing=sweep.Timing(us, us, us, 20, "cuda-graph"),
                                        check={"status": "ok"}, slot=slot, tier=job.tier,
                                        default=(slot.arm, slot.impl) == ("splitk", "mma"),
                                        extra=dict(sass={"ceiling_pct": 100.0 if slot.impl == "mma" else 41.0,
                                                         "binding": "hbm"}))
            if job.kind == "hpc":
                row.update(sweep="heads_per_cta", hpc_choice=slot.heads_per_cta == 4)
            rows.append(row)
        late = sweep_plan.LATE_BASELINES if job.tier.startswith("decisive") else ()
        timing = sweep.Timing(at(60.0), at(60.0), at(60.0), 20, "cuda-graph")
        for name in job.baselines + late:
            rows.append(sweep.make_row(c, name, timing=timing, copy_tb_per_s=copy, status="ok", tier=job.tier))
    probe_rows = [dict(shape=s, group=g, arm=a, impl=i, heads_per_cta=1 if i == "simt" else g, status="ok",
                       time_us=301.0, dram_bytes=1.07e9, l2_over_dram=float(g), expected_l2_over_dram=float(g),
                       dram_tb_per_s=3.56, issue_slots_pct=22.0, instr_per_kib=101.0,
                       stalls=[["long_scoreboard", 5.1], ["wait", 1.2], ["barrier", 0.4]])
                  for s, g in (("8/8/128", 1), ("32/8/128", 4), ("64/8/128", 8)) for a in ("unpacked", "splitk")
                  for i in ("simt", "mma")]
    result = {"mode": "gpu", "profile": "full", "copy_tb_per_s": copy, "copy_bandwidth": {"tb_per_s": copy},
              "environment": {"device": {"name": "NVIDIA H200", "sm_count": 132}}, "rows": rows, "not_measured": [],
              "budget": {"stopped_early": True, "reason": "time budget of 290 s spent"},
              "kernel_impls": {"impls": ["simt", "mma"], "default_impl": "mma", "selftest": {
                  "status": "ok", "detail": "the device agrees with the emulation; the mma rows ran mma"}},
              "hpc_sweep": {"status": "planned", "choices": {f"{m} b{b}": 4 for m in ("llama-3-8b", "llama-3-70b")
                                                             for b in (1, 16, 64)}},
              "l2_probe": {"status": "ok", "detail": "12 of 12 kernels profiled in 1 ncu pass(es)", "rows": probe_rows}}
    result["targets"] = report.evaluate_targets(result)
    return result


def _full_check_report() -> dict:
    """A check report of every decisive cell on mma, simt, SDPA and FlashInfer (synthetic numbers)."""
    from benchmarks import schedule

    timing = []
    for name, shape in (("llama-3-8b", (32, 8, 128)), ("llama-3-70b", (64, 8, 128)), ("qwen3.8-27b", (24, 4, 256))):
        layer = dict(name=name, num_q_heads=shape[0], num_kv_heads=shape[1], head_dim=shape[2], window_left=-1,
                     logits_soft_cap=None, sinks=False)
        for kv in schedule.DECISIVE_KV:
            for batch, context in schedule.DECISIVE_POINTS:
                for impl in ("mma", "simt", "sdpa", "flashinfer"):
                    spec = dict(kind="time", impl=impl, layer=layer, kv_dtype=kv, arm=None, batch=batch, context=context)
                    timing.append(dict(impl=impl, cell=f"{impl} {name}", spec=spec, status="ok", median_us=100.0,
                                       pct_of_copy=88.8, arm_ran="splitk", heads_per_cta=4))
    for name, kv, (batch, context) in schedule.DECISIVE_CELLS:  # the named wide cells: mma (simt ran), sdpa, flashinfer
        layer = dict(name=name, num_q_heads=16, num_kv_heads=1, head_dim=576, v_head_dim=512, window_left=-1,
                     logits_soft_cap=None, sinks=False)
        for impl in ("mma", "sdpa", "flashinfer"):
            spec = dict(kind="time", impl=impl, layer=layer, kv_dtype=kv, arm=None, batch=batch, context=context)
            row = dict(impl=impl, cell=f"{impl} {name}", spec=spec, status="ok", median_us=100.0, pct_of_copy=8.8)
            if impl == "mma":
                row.update(arm_ran="splitk", heads_per_cta=1, impl_ran="simt")
            if impl == "flashinfer":
                row = dict(row, status="unavailable", median_us=None, pct_of_copy=None)
            timing.append(row)
    return dict(model="decisive", timed=True, timing_note=None, verdict="ok", failures=[], correctness=[],
                timing=timing, faults=[], device={})


def test_the_short_table_of_a_full_run_fits_the_device_tools_output_tail():
    """The device tool returns the last 12,000 characters: the table printed last must leave room for the
    progress lines above it, in short lines, and compare simt with mma on every decisive configuration in % of
    copy, the SASS model's prediction beside each."""
    from benchmarks import schedule

    result = full_size_result()
    names = [s.name for s in schedule.FULL + schedule.QUICK] + ["mma_selftest"]
    table = [dict(name=n, status="ok", seconds="99", detail="x" * 300) for n in dict.fromkeys(names)]
    check = _full_check_report()
    _, text = summary.render(table, {}, result, "463", check=check,
                             predictions=predictions.Predictions.load(os.path.join(BENCH, "model", "results", "sass_model.json"),
                                                                      "sm_90"))
    lines = text.splitlines()
    # A full sweep's tables (a real run's sweep gets ~30 s, far fewer) and the 18 decisive cells x 4 implementations:
    # under 11k, and the decisive cells within the last 2.5k, before the verdict, whatever cuts the top
    assert len(text) < 11000 and max(map(len, lines)) <= 120, (len(text), max(lines, key=len))
    assert "decisive cells, metrale-attn check" in text[-2800:] and "deepseek-v3 bf16 b64x4k" in text[-400:]
    assert re.search(r"deepseek-v3 bf16 b64x4k +8\.8s +- +8\.8 +unavai", text), text[-600:]
    assert lines[-1].startswith("OVERALL: ok; targets T1 PASS, T2 PASS, T3 PASS, C PASS")
    assert "old vs new kernels: mma over simt 2.00x min" in text and "L2 probe: ok" in text
    assert "mma self-test: ok" in text
    decisive = [job for job in sweep_plan.plan_jobs(sweep.parse_args([])) if job.tier.startswith("decisive")]
    for job in decisive:  # the configuration's first arm line: simt and mma in % of copy with [prediction], x2.00
        c = job.config
        label = f"{c.model} {c.kv_dtype} b{c.batch} {report._ctx(c.context)}"
        (line,) = [line for line in lines if line.startswith(f"  {label} ")]
        assert re.search(r" unp +\d+\.\d\[41\] +\d+\.\d\[100\] +2\.00x  sdpa\+g \d+\.\d  sdpa \d", line), line
    spk = [line for line in lines if re.match(r"^ {27}spk +\d+\.\d\[41\] +\d+\.\d\*\[100\] +2\.00x$", line)]
    assert len(spk) == len(decisive)
    assert sum(1 for line in lines if re.match(r"^ {27}pack ", line)) == 2  # 24/4/256, bf16 and fp8
    assert any(line.startswith("  llama-3-8b b16:") and "h4*" in line and "h8" not in line for line in lines)
    assert any(line.startswith("  llama-3-70b b64:") and "h4*" in line and "h8 " in line for line in lines)
    md = report.render_markdown(result)
    assert "| unpacked/simt us (% copy) | unpacked/mma us (% copy) | split-K/simt us (% copy) |" in md
    assert "| configuration | arm | simt us (% copy) | mma us (% copy) | mma / simt |" in md
    step = next(line for line in md.splitlines() if line.startswith("| llama-3-8b bf16 b64 4k | unpacked |"))
    assert step.endswith("| 2.00x |"), step  # 92 / 46 % of copy
    assert "llama-3-70b (64/8/128, group 8), mma kernels" in md


# -- the GPU sweep's control flow, on the CPU, with fakes (needs PyTorch) --------------------------------

FAKE_GPU_DRIVER = r"""
import contextlib, sys, time, types
import numpy as np, torch, ml_dtypes
sys.path.insert(0, sys.argv[1])
sys.modules["cupy"] = types.ModuleType("cupy")  # GpuSweep imports CuPy only to fail early
from benchmarks import baselines, sweep as bd
from metrale_attn.check import timing
from metrale_attn import DecodeAttention


class FakeTimer(timing.GpuTimer):  # GpuTimer without CuPy: wall clock, no streams, no graphs
    def __init__(self, **kw): pass
    def on_stream(self): return contextlib.nullcontext()
    def synchronize_device(self): pass
    def capture_cupy(self, fn): return fn
    def capture_torch(self, fn): return fn, fn()
    def measure(self, launch, mode="cuda-graph", note=""):
        samples = []
        for _ in range(3):
            t = time.perf_counter(); launch(); samples.append((time.perf_counter() - t) * 1e6)
        return timing._summarize(samples, mode, note)
    def host_overhead_us(self, call, iters=10):
        t = time.perf_counter()
        for _ in range(iters): call()
        return (time.perf_counter() - t) / iters * 1e6


def to_numpy(t):
    if t.dtype == torch.bfloat16: return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn: return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


class CpuBackedAttention:  # DecodeAttention on the CPU backend, taking and filling torch CPU tensors
    def __init__(self, *args, backend=None, **kwargs):
        self._real = DecodeAttention(*args, backend="cpu", **kwargs)
    def plan(self, n, q_len=1): return self._real.plan(n, q_len)
    config = property(lambda self: self._real.config)
    def target_line(self): return self._real.target_line()
    def run(self, q, k, v, block_tables=None, seq_lens=None, *, out, **kw):
        kw.update(block_tables=block_tables, seq_lens=seq_lens)
        o = self._real.run(*map(to_numpy, (q, k, v)),
                           **{n: to_numpy(x) if isinstance(x, torch.Tensor) else x for n, x in kw.items()})
        out.copy_(torch.from_numpy(o.view(np.int16)).view(torch.bfloat16))
        return out


timing.GpuTimer = FakeTimer
bd.DecodeAttention = CpuBackedAttention
pool_init = bd.GpuPool.__init__
bd.GpuPool.__init__ = lambda self, *a, **kw: pool_init(self, *a, **dict(kw, device="cpu"))
flex = baselines.prepare_flex_paged
baselines.prepare_flex_paged = lambda case: flex(case, compiled=False)
sys.exit(bd.main(sys.argv[2:]))
"""


@pytest.mark.slow  # ~30 s on two cores: .ci/run's slow step runs it
@pytest.mark.skipif(not HAVE_TORCH, reason="needs PyTorch (the GPU sweep's tensors are PyTorch tensors)")
def test_gpu_sweep_control_flow_with_fakes_on_the_cpu(tmp_path):
    """GpuSweep end to end with a wall-clock timer, CPU tensors and the CPU backend: groups, arms, the
    default's flag, the float64 check, baselines (ran / unavailable with reasons), caps and outputs."""
    driver = tmp_path / "driver.py"
    driver.write_text(FAKE_GPU_DRIVER)
    env_json = tmp_path / "env.json"
    env_json.write_text(json.dumps({"mode": "gpu", "device": {"name": "FAKE"}, "device_label": "FAKE",
                                    "copy_bandwidth": {"tb_per_s": 0.01, "method": "fake"}}))
    status = tmp_path / "fi.json"
    status.write_text(json.dumps({"specs": {}, "import_error": "not compiled in this test"}))
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(driver), REPO, "--env-json", str(env_json), "--out-dir", str(out),
         "--decisive", "llama-3-8b:1:40,qwen3.8-27b:1:40,llama-3-8b:2:40", "--decisive-dtypes", "bf16,fp8",
         "--hpc-batches", "none", "--features", "llama-3-8b:1:40", "--feature-window", "15", "--rest", "off",
         "--flex-batches", "1", "--host-overhead-iters", "2",
         "--flashinfer-status", str(status), "--kv-cap-gb", "0.0003"], cwd=REPO, capture_output=True, text=True,
        timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (name,) = [f for f in os.listdir(out) if f.endswith("_FAKE_bench.json")]
    result = json.loads((out / name).read_text())
    ours = [r for r in result["rows"] if r["impl"] == "metrale"]
    assert ours and all(r["check"] and r["check"]["status"] == "ok" for r in ours), [
        (r.get("arm_label"), r["status"], r["reason"]) for r in ours if not r["check"]]
    assert all(r["arm"] == "splitk" for r in ours if r["default"])  # hopper declares auto split-K
    assert {r["arm"] for r in ours if r["model"] == "qwen3.8-27b"} == {"unpacked", "splitk", "gqa_packed"}
    by_impl = {}
    for r in result["rows"]:
        by_impl.setdefault(r["impl"], set()).add(r["status"])
    assert by_impl["sdpa_gather"] == {"ok"} and by_impl["flashinfer"] == {"unavailable"}
    # Timed last: FlexAttention once per shape (bf16), FlashInfer on every measured configuration.
    late = [r for r in result["rows"] if r.get("phase") == "late"]
    assert result["rows"][-len(late):] == late
    assert sorted(r["model"] for r in late if r["impl"] == "flex_paged") == ["llama-3-8b", "qwen3.8-27b"]
    assert by_impl["flex_paged"] == {"ok"} and "one bf16 configuration per shape" in \
        result["baselines"]["flex_paged"]["reason"]
    assert len([r for r in late if r["impl"] == "flashinfer"]) == 5  # 3 bf16/fp8 b1 + fp8 b2 decisive; b2 bf16 skipped
    assert [s["batch"] for s in result["skipped"]] == [2] and "--kv-cap-gb" in result["skipped"][0]["reason"]
    assert result["host_overhead"] and not result["budget"]["stopped_early"]
    assert re.search(r"^\[bench \d+s\] late phase: flex_paged, flashinfer", done.stdout, re.M)
    # The features tier on the GPU path: every feature checked against the float64 reference with it.
    features = [r for r in result["rows"] if r.get("sweep") == "features"]
    assert [(r["kv_dtype"], r["feature"]) for r in features] == [("bf16", f) for f in sweep_plan.FEATURES] + [
        ("fp8", f) for f in sweep_plan.FP8_FEATURES]
    assert all(r["status"] == "ok" and r["check"]["status"] == "ok" for r in features), features
    assert features[0]["vs_plain"] == 1.0 and features[1]["kv_fraction"] == 16 / 40



def test_the_decode_loop_step_fails_when_a_correctness_run_fails_and_is_partial_when_a_timing_run_does():
    from benchmarks import decode_loop_check as dlc

    ok = lambda name, kind, **kw: dict(name=name, kind=kind, status="ok", **kw)  # noqa: E731
    rows = [ok("eager", "check"), ok("cuda-graph", "check"), ok("metrale b64", "time", step_ms=2.0),
            ok("sdpa b64", "time", step_ms=5.0)]
    assert dlc.verdict(rows) == ("ok", "eager ok; cuda-graph ok; step: ours 2.000 ms, SDPA 5.000 ms (2.50x)")
    assert dlc.verdict([dict(rows[0], status="FAIL")] + rows[1:])[0] == "FAIL"
    assert dlc.verdict(rows[:2] + [dict(rows[2], status="TIMEOUT")] + rows[3:])[0] == "PARTIAL"
    assert dlc.verdict(rows[:3])[0] == "PARTIAL" and dlc.verdict([])[0] == "FAIL"


def test_the_host_overhead_benchmark_runs_every_case(capsys):
    from benchmarks import host_overhead as bench

    assert bench.main(["--calls", "20"]) == 0
    printed = capsys.readouterr().out
    assert printed.count(" us per run") >= 2 and "numpy, same buffers" in printed


def test_the_csr_form_of_a_dense_table_lists_each_sequences_used_pages_in_order():
    tables = np.array([[7, 3, 9], [4, 0, 0], [5, 6, 0], [1, 2, 8]], np.int32)
    csr = sweep.csr_page_table(tables, np.array([33, 0, 16, 17], np.int32), page_size=16)
    assert csr["kv_indptr"].tolist() == [0, 3, 3, 4, 6]
    assert csr["kv_indices"].tolist() == [7, 3, 9, 5, 1, 2]
    assert csr["kv_last_page_len"].tolist() == [1, 0, 16, 1]
    assert all(a.dtype == np.int32 for a in csr.values())


def test_the_pdl_check_fails_when_the_two_launches_give_different_bytes(tmp_path, monkeypatch):
    from benchmarks import pdl_check

    monkeypatch.setattr(pdl_check, "CPU_CALLS", pdl_check.CPU_CALLS[:1])
    assert pdl_check.main(["--cpu", "--out", str(tmp_path / "same.json")]) == 0
    monkeypatch.setattr(pdl_check, "check", lambda call, backend, timer=None: {"call": str(call), "bytes_equal": False})
    assert pdl_check.main(["--cpu", "--out", str(tmp_path / "differ.json")]) == 1
    monkeypatch.setattr(pdl_check, "check", lambda call, backend, timer=None: 1 / 0)
    assert pdl_check.main(["--cpu", "--out", str(tmp_path / "error.json")]) == 1
    assert "ZeroDivisionError" in json.loads((tmp_path / "error.json").read_text())["rows"][0]["error"]


# -- the decisive step: metrale-attn check's report in the summary -------------------------------------


def _check_report(mma_status="ok", fault=None):
    layer = dict(name="llama-3-8b", num_q_heads=32, num_kv_heads=8, head_dim=128, window_left=-1,
                 logits_soft_cap=None, sinks=False)

    def timed(impl, pct, **kw):
        spec = dict(kind="time", impl=impl, layer=layer, kv_dtype="bf16", arm=None, batch=64, context=4096)
        return dict(impl=impl, cell=f"{impl} llama-3-8b 32/8/128 bf16 b64x4k", spec=spec, status="ok",
                    median_us=300.0 if pct else None, pct_of_copy=pct, **kw)

    timing = [timed("mma", 91.0 if mma_status == "ok" else None, arm_ran="splitk", heads_per_cta=4),
              timed("simt", 40.5), timed("sdpa", 30.2)]
    timing[0]["status"] = mma_status
    return dict(model="llama-3-8b", timed=True, timing_note=None, verdict="ok" if mma_status == "ok" else "FAIL",
                failures=[] if mma_status == "ok" else ["mma llama-3-8b 32/8/128 bf16 b64x4k: FAIL"],
                correctness=[], timing=timing, faults=[fault] if fault else [], device={"compute_capability": "90"})


def test_the_summary_shows_the_decisive_cells_with_the_call_models_prediction_beside_the_default_kernel():
    p = predictions.Predictions.load(os.path.join(BENCH, "model", "results", "sass_model.json"), "sm_90")
    lines = summary.check_lines(_check_report(), p)
    (row,) = [line for line in lines if line.strip().startswith("llama-3-8b bf16 b64x4k")]
    assert "91.0[98]" in row and "40.5" in row and "30.2" in row  # 97.8 MODELLED for this very call
    fault = dict(impl="simt", cell="simt llama-3-8b 32/8/128 bf16 b1x32k", error="cudaErrorIllegalAddress: ...")
    text = "\n".join(summary.check_lines(_check_report("FAIL", fault), p))
    assert "!" in text and "FAULT simt in simt llama-3-8b 32/8/128 bf16 b1x32k" in text and "verdict: FAIL" in text


def test_the_decisive_step_verdict_counts_each_implementation_and_names_the_first_failure(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(_check_report()))
    assert steps.check_verdict(0, str(path)) == ("ok", "rc=0 mma 1/1 timed; simt 1/1 timed; sdpa 1/1 timed")
    path.write_text(json.dumps(_check_report("FAIL")))
    status, detail = steps.check_verdict(1, str(path))
    assert status == "FAIL" and "first: mma llama-3-8b 32/8/128 bf16 b64x4k: FAIL" in detail
    assert steps.check_verdict(124, str(tmp_path / "none.json"))[0] == "TIMEOUT"
    assert steps.check_cells(_check_report()) == 2  # ours timed; the peer is not ours
