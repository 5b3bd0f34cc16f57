"""The benchmark harness (benchmarks/) without a GPU: its CPU dry run end to end, and its
reporting (targets, markdown, plots, summary) on a synthetic GPU-shaped result.

The GPU run itself (``benchmarks/gpu_check.sh`` on a device) is not tested here; what
is tested is everything it is built from that runs on a CPU: the CPU-backend sweep
through the same code paths and output writers, the sanitizer cases' own checks on
the CPU backend, the pass/fail arithmetic of the targets, and the shell scripts'
syntax. Plots are checked only where matplotlib is installed (it is not a dependency).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks")
sys.path.insert(0, BENCH)

import bench_decode  # noqa: E402
import bench_report  # noqa: E402
import summarize  # noqa: E402

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
HAVE_TORCH = importlib.util.find_spec("torch") is not None
OUT_NAME = re.compile(r"^[A-Za-z0-9._-]+$")  # what a device run's $OUT may hold


def _python_env():
    env = dict(os.environ)
    env["PYTHON"] = sys.executable  # the interpreter running the tests, with the package installed
    return env


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_cpu_dry_run_writes_every_output(tmp_path):
    out = tmp_path / "out"
    env = _python_env()
    env["OUT"] = str(out)
    env["TMPDIR"] = str(tmp_path)
    done = subprocess.run(["bash", os.path.join(BENCH, "gpu_check.sh"), "--cpu"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    files = sorted(os.listdir(out))
    assert len(files) <= 8 and all(OUT_NAME.match(f) for f in files), files
    assert "summary.md" in files and "logs.tar.gz" in files
    (json_name,) = [f for f in files if f.endswith("_bench.json")]
    assert json_name.endswith("_cpu_bench.json")
    result = json.loads((out / json_name).read_text())
    assert result["mode"] == "cpu" and "not kernel performance" in result["timing_note"]
    ours = [r for r in result["rows"] if r["impl"] == "metrale"]
    assert {r["arm"] for r in ours} == {"unpacked", "splitk", "gqa_packed"}
    assert all(r["check"]["status"] == "ok" and r["median_us"] > 0 for r in ours)
    assert any(r["default"] for r in ours)
    assert {t["id"]: t["status"] for t in result["targets"]} == {"T1": "N/A", "T2": "N/A", "T3": "N/A", "C": "PASS"}
    assert all(b["status"] == "not run" for b in result["baselines"].values())
    md = (out / json_name.replace(".json", ".md")).read_text()
    assert "CPU backend simulator; not kernel performance" in md
    if HAVE_MPL:
        assert any(f.endswith("_bench.png") for f in files) and any(f.endswith("_arms.png") for f in files)
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = {os.path.basename(n) for n in tar.getnames()}
    assert {"steps.tsv", "env.json", "bench.log", "summary.txt"} <= names
    summary = (out / "summary.md").read_text()
    assert "environment" in summary and "benchmark" in summary and "CPU backend simulator" in summary
    # The short table is printed last.
    assert done.stdout.rstrip().splitlines()[-1].startswith("CPU backend simulator")


def test_sanitizer_cases_pass_on_the_cpu_backend():
    done = subprocess.run([sys.executable, os.path.join(BENCH, "sanitize_cases.py"), "--cpu"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("\nok ") + done.stdout.startswith("ok ") == 6
    assert "0 failure(s)" in done.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", ["gpu_check.sh", "fetch_wheels.sh"])
def test_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", os.path.join(BENCH, script)], check=True)


def test_bytes_per_call_count_k_and_v_q_and_out():
    shape = bench_decode.MODELS["qwen3.8-27b"]
    c = bench_decode.Config("qwen3.8-27b", shape, "bf16", batch=2, context=1024, page_size=16)
    kv = 2 * 1024 * 4 * 256 * 2 * 2  # seqs x tokens x kv_heads x head_dim x bf16 x (K, V)
    assert c.kv_bytes == kv
    assert c.bytes_moved == kv + 2 * (2 * 24 * 256 * 2)  # + q and out, bf16
    assert bench_decode.Config("x", shape, "fp8", 2, 1024, 16).kv_bytes == kv // 2


def test_arms_are_forced_only_where_the_shape_fits():
    MODELS = bench_decode.MODELS
    assert bench_decode.arms_for(MODELS["qwen3.8-27b"], ["unpacked", "splitk", "gqa_packed"]) == [
        "unpacked", "splitk", "gqa_packed"]
    assert bench_decode.arms_for(MODELS["llama-3-8b"], ["unpacked", "splitk", "gqa_packed"]) == ["unpacked", "splitk"]
    assert bench_decode.arm_options("splitk:4") == dict(splitk="4", gqa_pack=False)
    assert bench_decode.arm_options("unpacked") == dict(splitk="off", gqa_pack=False)
    assert [m for m, _ in bench_decode.parse_models("llama-3-70b,6/1/256")] == ["llama-3-70b", "6/1/256"]


# -- reporting on a synthetic GPU-shaped result -------------------------------------------------------


def synthetic_result(copy: float = 4.0) -> dict:
    """A GPU-shaped result: two configurations, ours at a given % of copy, and two baselines."""
    shape = bench_decode.MODELS["llama-3-8b"]
    rows = []

    def ours(batch, context, arm, us, default):
        c = bench_decode.Config("llama-3-8b", shape, "bf16", batch, context, 16)
        timing = bench_decode.Timing(us, us, us, 5, "cuda-graph")
        return bench_decode.make_row(c, "metrale", arm=arm, timing=timing, copy_tb_per_s=copy, status="ok",
                                     check={"status": "ok"}, default=default)

    def base(batch, context, name, us=None, reason=""):
        c = bench_decode.Config("llama-3-8b", shape, "bf16", batch, context, 16)
        timing = bench_decode.Timing(us, us, us, 5, "cuda-graph") if us else None
        return bench_decode.make_row(c, name, timing=timing, copy_tb_per_s=copy,
                                     status="ok" if us else "unavailable", reason=reason)

    for batch, context in ((1, 65536), (16, 4096), (64, 16384)):
        c = bench_decode.Config("llama-3-8b", shape, "bf16", batch, context, 16)
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
    bench_decode.summarize_baselines(result)
    return result


def test_targets_pass_and_fail_where_they_should():
    result = synthetic_result()
    targets = {t["id"]: t for t in bench_report.evaluate_targets(result)}
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
    t1 = {t["id"]: t for t in bench_report.evaluate_targets(slow)}["T1"]
    assert t1["status"] == "FAIL" and "b16" in " ".join(t1["failures"])


def test_markdown_names_baselines_that_did_not_run_and_why():
    result = synthetic_result()
    result["targets"] = bench_report.evaluate_targets(result)
    md = bench_report.render_markdown(result)
    assert "FlexAttention**: did not run" in md and "compile budget of 60 s spent" in md
    assert "| 64 | 16k |" in md and "T3 misses" in md
    assert result["baselines"]["flashinfer"]["ran"] == 3


def test_outputs_and_summary_from_a_synthetic_result(tmp_path):
    result = synthetic_result()
    result["targets"] = bench_report.evaluate_targets(result)
    paths = bench_report.write_outputs(result, str(tmp_path))
    names = {os.path.basename(p) for p in paths}
    expected = {"2026-11-30_H200_bench.json", "2026-11-30_H200_bench.md"}
    if HAVE_MPL:
        expected |= {"2026-11-30_H200_arms.png", "2026-11-30_H200_bench.png"}
    assert names == expected
    json.loads((tmp_path / "2026-11-30_H200_bench.json").read_text())
    steps = [dict(name="gpu_tests", status="ok", seconds="80", detail="252 passed")]
    md, text = summarize.render(steps, {}, result, "300")
    assert "gpu_tests" in text and "T1     PASS" in text and "% of copy" in text
    assert "vs fastest baseline" in text and md.startswith("# metrale-attn gpu_check")


# -- the GPU sweep's control flow, on the CPU, with fakes (needs PyTorch) --------------------------------

FAKE_GPU_DRIVER = r"""
import contextlib, sys, time, types
import numpy as np, torch, ml_dtypes
sys.path.insert(0, sys.argv[1])
sys.modules["cupy"] = types.ModuleType("cupy")  # GpuSweep imports CuPy only to fail early
import gpu_timing, bench_decode as bd, baselines
from metrale_attn import DecodeAttention


class FakeTimer:  # same interface as gpu_timing.GpuTimer; wall clock, no streams, no graphs
    def __init__(self, **kw): pass
    def on_stream(self): return contextlib.nullcontext()
    def synchronize_device(self): pass
    def capture_cupy(self, fn): return fn
    def capture_torch(self, fn): return fn, fn()
    def measure(self, launch, mode="cuda-graph", note=""):
        samples = []
        for _ in range(3):
            t = time.perf_counter(); launch(); samples.append((time.perf_counter() - t) * 1e6)
        return gpu_timing._summarize(samples, mode, note)
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
    def plan(self, n): return self._real.plan(n)
    def target_line(self): return self._real.target_line()
    def run(self, q, k, v, bt, sl, *, k_scale, v_scale, out):
        o = self._real.run(*map(to_numpy, (q, k, v, bt, sl)), k_scale=k_scale, v_scale=v_scale)
        out.copy_(torch.from_numpy(o.view(np.int16)).view(torch.bfloat16))
        return out


gpu_timing.GpuTimer = FakeTimer
bd.DecodeAttention = CpuBackedAttention
pool_init = bd.GpuPool.__init__
bd.GpuPool.__init__ = lambda self, *a, **kw: pool_init(self, *a, **dict(kw, device="cpu"))
flex = baselines.prepare_flex_paged
baselines.prepare_flex_paged = lambda case: flex(case, compiled=False)
sys.exit(bd.main(sys.argv[2:]))
"""


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
    status.write_text(json.dumps({"variants": {}, "import_error": "not compiled in this test"}))
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(driver), BENCH, "--env-json", str(env_json), "--out-dir", str(out),
         "--models", "qwen3.8-27b,llama-3-8b", "--kv-dtypes", "bf16,fp8", "--batches", "1,2", "--contexts", "40",
         "--flex-batches", "1", "--host-overhead-iters", "2", "--flashinfer-status", str(status),
         "--kv-cap-gb", "0.0003"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (name,) = [f for f in os.listdir(out) if f.endswith("_FAKE_bench.json")]
    result = json.loads((out / name).read_text())
    ours = [r for r in result["rows"] if r["impl"] == "metrale"]
    assert ours and all(r["check"]["status"] == "ok" for r in ours)
    assert all(r["arm"] == "splitk" for r in ours if r["default"])  # hopper declares auto split-K
    assert {r["arm"] for r in ours if r["model"] == "qwen3.8-27b"} == {"unpacked", "splitk", "gqa_packed"}
    by_impl = {}
    for r in result["rows"]:
        by_impl.setdefault(r["impl"], set()).add(r["status"])
    assert by_impl["sdpa_gather"] == {"ok"} and by_impl["flashinfer"] == {"unavailable"}
    assert "ok" in by_impl["flex_paged"] and "unavailable" in by_impl["flex_paged"]  # fp8 and batch 2: why not
    assert result["skipped"] and all("--kv-cap-gb" in s["reason"] for s in result["skipped"])  # bf16 at batch 2
    assert result["host_overhead"] and not result["budget"]["stopped_early"]

