"""``metrale-attn check``: the package proves itself on a user's machine. On the CPU backend the
correctness half runs for real; stand-ins for the worker process (``tests/support/check_doubles.py``)
prove that a wrong kernel fails the check by name, that a sticky CUDA error costs one
implementation and not the run, and that the GPU timing half runs every step on a stand-in GPU.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from metrale_attn.check import CheckOptions, model_layers, run_check
from metrale_attn.check.cells import Cell, arms_for, parse_points, peer_refusal, plan_cells
from metrale_attn.cli import main
from metrale_attn.precompile import Layer

from support.optional import import_torch

DOUBLES = pathlib.Path(__file__).parent / "support" / "check_doubles.py"
TINY = Layer("tiny", 4, 1, 64)
"""The smallest layer kind the kernels serve (the sweep's CPU profile uses it too: its modules are cached)."""
TINY_CONFIG = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
               "hidden_size": 256, "num_hidden_layers": 2}


def _check(tmp_path, *, impls=("mma",), worker=None, **kw):
    options = CheckOptions((kw.pop("layer", TINY),), "tiny", tmp_path, impls=impls, backend="cpu", **kw,
                           **({"worker": worker} if worker else {}))
    lines = []
    code, result = run_check(options, say=lines.append)
    return code, result, "\n".join(lines)


def _double(mode: str, arg: str = "-") -> tuple[str, ...]:
    return (sys.executable, str(DOUBLES), mode, arg)


# -- what runs (pure) ---------------------------------------------------------------------


def test_ours_run_first_the_default_kernel_before_the_reference_and_correctness_before_timing():
    cells = plan_cells([TINY], ["bf16"], ["sdpa", "simt", "mma"], timed=True, points=((1, 64), (2, 64)))
    impls = list(dict.fromkeys(c.impl for c in cells))
    assert impls == ["mma", "simt", "sdpa"]
    mma = [c.kind for c in cells if c.impl == "mma"]
    assert mma == sorted(mma)  # "correct" before "time"
    assert not [c for c in cells if c.impl == "sdpa" and c.kind == "correct"]


def test_the_gqa_packed_arm_is_checked_exactly_where_the_policy_can_pack_the_layer():
    assert arms_for(Layer("q", 24, 4, 256)) == ("unpacked", "splitk", "gqa_packed")
    assert arms_for(Layer("l", 32, 8, 128)) == ("unpacked", "splitk")


def test_a_peer_is_not_timed_on_a_layer_with_features_it_would_compute_differently():
    windowed = Layer("sliding", 4, 1, 64, window_left=127)
    assert "window_left" in peer_refusal(Cell("time", "sdpa", windowed, "bf16", batch=1, context=64))
    assert peer_refusal(Cell("time", "mma", windowed, "bf16", batch=1, context=64)) is None
    assert peer_refusal(Cell("time", "sdpa", TINY, "bf16", batch=1, context=64)) is None


def test_timing_points_are_parsed_and_a_bad_one_is_refused_naming_the_flag():
    assert parse_points("64x4096, 1x32768") == ((64, 4096), (1, 32768))
    for bad in ("64", "0x4096", "ax1", ""):
        with pytest.raises(ValueError, match="--points"):
            parse_points(bad)


def test_a_check_refuses_counts_and_times_that_are_not_positive_naming_them(tmp_path):
    for bad in (dict(jobs=0), dict(jobs=True), dict(cap_s=0.0), dict(deadline_s=float("inf")), dict(check_seqs=1.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            CheckOptions((TINY,), "tiny", tmp_path, **bad)
    with pytest.raises(ValueError, match="--impl"):
        CheckOptions((TINY,), "tiny", tmp_path, impls=("mma", "triton"))


def test_a_model_is_named_by_a_preset_or_a_config_and_sharded_over_the_ranks(tmp_path):
    label, layers = model_layers(["llama-3-70b"], tensor_parallel=8)
    assert (layers[0].num_q_heads, layers[0].num_kv_heads, layers[0].head_dim) == (8, 1, 128) and "TP 8" in label
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_CONFIG))
    _, layers = model_layers(hf_config_path=str(config))
    assert [(x.num_q_heads, x.num_kv_heads, x.head_dim) for x in layers] == [(4, 1, 64)]
    with pytest.raises(ValueError, match="--model"):
        model_layers(["no-such-model"])
    with pytest.raises(ValueError, match="one of the two"):
        model_layers(["llama-3-8b"], hf_config_path=str(config))


# -- the correctness half, for real on the CPU backend -----------------------------------


def test_a_check_on_the_cpu_backend_checks_every_arm_writes_its_report_and_says_no_timing_was_taken(tmp_path):
    code, result, said = _check(tmp_path, kv_dtypes=("bf16", "fp8"))
    assert code == 0 and result["verdict"] == "ok", said
    cells = {(r["spec"]["kv_dtype"], r["spec"]["arm"]): r for r in result["correctness"]}
    assert set(cells) == {(kv, arm) for kv in ("bf16", "fp8") for arm in ("unpacked", "splitk")}
    assert all(r["status"] == "ok" and r["arm_ran"] == arm for (_, arm), r in cells.items())
    assert "no timing was taken" in result["timing_note"] and "no timing was taken" in said
    for name in ("report.json", "report.md", "report.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert json.loads((tmp_path / "report.json").read_text())["verdict"] == "ok"
    assert "VERDICT: ok" in said


def test_a_kernel_that_gets_one_output_element_wrong_fails_the_check_naming_the_spec_and_the_arm(tmp_path):
    code, result, said = _check(tmp_path, worker=_double("wrong", "mma"))
    assert code == 1 and result["verdict"] == "FAIL"
    assert any(f.startswith("mma tiny 4/1/64 bf16 unpacked: FAIL") for f in result["failures"]), result["failures"]
    assert any(f.startswith("mma tiny 4/1/64 bf16 splitk: FAIL") for f in result["failures"])
    assert "FAILED mma tiny 4/1/64 bf16 unpacked" in said and "VERDICT: FAIL" in said
    assert "1 of" in next(r["message"] for r in result["correctness"] if r["status"] == "FAIL")


def test_a_sticky_cuda_error_costs_its_implementation_only_and_names_the_kernel_and_the_cell(tmp_path):
    code, result, said = _check(tmp_path, impls=("mma", "simt"), worker=_double("sticky", "mma"))
    assert code == 1
    (fault,) = result["faults"]
    assert fault["impl"] == "mma" and fault["cell"] == "mma tiny 4/1/64 bf16 unpacked"
    assert "illegal memory access" in fault["error"]
    simt = [r for r in result["correctness"] if r["impl"] == "simt"]
    assert len(simt) == 2 and all(r["status"] == "ok" for r in simt)  # measured after the fault, fresh
    assert not [r for r in result["correctness"] if r["impl"] == "mma"]
    assert "FAULT mma in mma tiny 4/1/64 bf16 unpacked" in said


def test_a_device_that_serves_simt_for_mma_fails_the_check_as_a_fallback(tmp_path):
    code, result, said = _check(tmp_path, worker=_double("fallback"))
    assert code == 1 and {r["status"] for r in result["correctness"]} == {"FALLBACK"}
    assert "self-test" in result["correctness"][0]["message"] and "FALLBACK" in said


def test_a_worker_that_dies_or_passes_its_cap_is_a_fault_and_the_next_implementation_still_runs(tmp_path):
    dies = (sys.executable, "-c", "import os, sys; os._exit(9)")
    code, result, _ = _check(tmp_path / "dies", worker=dies)
    assert code == 1 and "exit 9" in result["faults"][0]["error"]
    hangs = (sys.executable, "-c", "import time; time.sleep(60)")
    code, result, _ = _check(tmp_path / "hangs", worker=hangs, cap_s=1.0)
    assert code == 1 and "cap of 1 s" in result["faults"][0]["error"]


@pytest.mark.slow  # CI's slow step runs it (the default run stays under 4 minutes)
def test_a_later_check_into_the_same_folder_adds_its_implementations_to_the_report(tmp_path):
    _check(tmp_path, impls=("mma",))
    code, result, _ = _check(tmp_path, impls=("simt",))
    assert code == 0 and {r["impl"] for r in result["correctness"]} == {"mma", "simt"}


# -- the GPU timing half, on a stand-in GPU --------------------------------------------------


@pytest.mark.slow  # CI's slow step runs it (the default run stays under 4 minutes)
def test_the_timing_half_checks_then_times_ours_and_sdpa_against_the_copy_bandwidth_on_a_stand_in_gpu(tmp_path):
    import_torch()
    code, result, said = _check(tmp_path, impls=("mma", "sdpa"), worker=_double("fake-gpu"), timed=True,
                                correctness=False, points=((2, 64), (1, 300)))
    assert code == 0, said
    rows = {(r["impl"], r["spec"]["batch"]): r for r in result["timing"]}
    assert set(rows) == {("mma", 2), ("mma", 1), ("sdpa", 2), ("sdpa", 1)}
    for r in rows.values():
        assert r["status"] == "ok" and r["pct_of_copy"] > 0 and r["check"]["status"] == "ok", r
    assert rows[("mma", 2)]["bytes_moved"] == 2 * 64 * 1 * 64 * 2 * 2 + 2 * 2 * 4 * 64 * 2
    assert result["timing_note"] is None and (tmp_path / "report.png").exists()
    assert "batch x context" in said and "% of the copy bandwidth" in said


@pytest.mark.slow  # CI's slow step runs it (the default run stays under 4 minutes)
def test_a_wrong_output_at_a_timing_point_is_not_timed_and_fails_the_check(tmp_path):
    import_torch()
    code, result, _ = _check(tmp_path, impls=("mma",), worker=_double("fake-gpu", "mma"), timed=True,
                             correctness=False, points=((2, 64),))
    (row,) = result["timing"]
    assert code == 1 and row["status"] == "FAIL" and row.get("median_us") is None


# -- the command line ---------------------------------------------------------------------------


def test_metrale_attn_check_with_a_config_writes_the_report_and_exits_zero_on_the_cpu(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "report"
    assert main(["check", "--hf-config", str(config), "--backend", "cpu", "--out", str(out), "--impl", "mma"]) == 0
    said = capsys.readouterr().out
    assert "VERDICT: ok" in said and "no timing was taken" in said
    assert {p.name for p in out.iterdir()} >= {"report.json", "report.md", "report.png"}


def test_metrale_attn_check_refuses_a_bad_argument_before_running_anything(tmp_path, capsys):
    assert main(["check", "--model", "llama-3-8b", "--kv-dtype", "fp4", "--backend", "cpu",
                 "--out", str(tmp_path)]) == 2
    assert "--kv-dtype" in capsys.readouterr().err and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_metrale_attn_check_on_llama_3_8b_passes_on_the_cpu_backend(tmp_path, capsys):
    assert main(["check", "--model", "llama-3-8b", "--backend", "cpu", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.png").exists() and "VERDICT: ok" in capsys.readouterr().out



@pytest.mark.slow  # CI's slow step runs it (the default run stays under 4 minutes)
def test_a_test_worker_that_meets_a_sticky_cuda_error_ends_and_xdist_names_the_test():
    """tests/conftest.py: the GPU tests' worker ends on a sticky error, so the failure is named once
    and the tests after it run on a fresh worker (the GPU check's verdict lists the crash)."""
    import subprocess

    from benchmarks.steps import pytest_verdict

    example = pathlib.Path(__file__).parent / "support" / "sticky_example.py"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "1", "-rfE",
                           "-m", "not slow", str(example)], capture_output=True, text=True, timeout=120,
                          cwd=pathlib.Path(__file__).parents[1])
    text = done.stdout + done.stderr
    assert "crashed while running" in text and "test_meets_a_sticky_cuda_error" in text, text
    assert "1 passed" in text
    status, detail = pytest_verdict(done.returncode, text, "gpu")
    assert status == "FAIL" and "a worker crashed: " in detail and "test_meets_a_sticky_cuda_error" in detail


@pytest.mark.slow
def test_the_kernels_a_check_needs_compile_in_parallel_processes_and_a_second_time_are_all_cached(tmp_path,
                                                                                                 monkeypatch):
    """NVRTC needs no GPU: the compile step (``--compile-only``) on a stand-in sm_90 device, into a fresh cache."""
    from metrale_attn.check import run

    monkeypatch.setenv("METRALE_ATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(run, "_device_arch", lambda: ("sm_90", 132))
    options = CheckOptions((TINY,), "tiny", tmp_path, impls=("mma", "simt"), jobs=2)
    plans = run.kernel_plans(options, "sm_90", 132)
    assert len(plans) == len({p.needed[0].name for p in plans}) >= 3
    said = []
    run.compile_kernels(options, say=said.append)
    assert said[-1].startswith(f"compiled {len(plans)} kernels (0 were cached, 0 failed)")
    run.compile_kernels(options, say=said.append)
    assert said[-1].startswith(f"compiled 0 kernels ({len(plans)} were cached, 0 failed)")
