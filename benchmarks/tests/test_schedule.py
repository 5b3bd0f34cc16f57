"""The GPU check's schedule (``benchmarks/schedule.py``): the decisive cells early and given the time
they need, every call within the device session, and ``gpu_check.sh`` following it step by step."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from benchmarks import schedule

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = open(os.path.join(BENCH, "gpu_check.sh")).read()


@pytest.mark.parametrize("profile", sorted(schedule.PROFILES))
def test_the_decisive_cells_start_within_a_minute_and_get_the_time_their_cells_need(profile):
    assert schedule.start_s(profile, "decisive") <= schedule.DECISIVE_START_S
    (decisive,) = [s for s in schedule.steps(profile) if s.name == "decisive"]
    assert decisive.cap_s >= schedule.decisive_need_s(profile) >= schedule.DECISIVE * schedule.CELL_S


def test_the_decisive_cells_are_every_shape_dtype_and_point_of_the_goals():
    assert schedule.DECISIVE == 18
    assert set(schedule.DECISIVE_POINTS) == {(64, 4096), (16, 4096), (1, 32768)}
    assert schedule.DECISIVE_IMPLS["full"][:2] == ("mma", "simt")  # the default kernel first, its reference beside


def test_the_decisive_tier_names_one_gemma_4_and_two_mla_cells_that_the_check_plans_as_the_schedule_counts():
    """Three named cells (not multiplied into models x KV x points), on the default kernel and SDPA only:
    the check's own plan of the decisive command holds exactly the cells ``decisive_need_s`` counts."""
    from metrale_attn.check.cells import parse_cells, plan_cells
    from metrale_attn.precompile import describe_model

    shapes = [(m, kv, p) for m, kv, p in schedule.DECISIVE_CELLS]
    assert shapes == [("gemma-4-26b-global", "bf16", (64, 4096)), ("deepseek-v2-lite", "bf16", (64, 4096)),
                      ("deepseek-v3", "bf16", (64, 4096))]
    shell = dict(line.split("=", 1) for line in schedule.shell("full").splitlines())
    named = parse_cells(shell["DECISIVE_CELLS"])
    assert [(n.layer.num_q_heads, n.layer.num_kv_heads, n.layer.head_dim, n.layer.v_head_dim) for n in named] == \
        [(16, 2, 512, None), (16, 1, 576, 512), (128, 1, 576, 512)]
    layers = describe_model(shell["DECISIVE_MODELS"].split(",")).layers
    for profile in schedule.PROFILES:
        cells = plan_cells(layers, schedule.DECISIVE_KV, schedule.DECISIVE_IMPLS[profile], timed=True,
                           correctness=profile == "full", points=schedule.DECISIVE_POINTS, named=named)
        wide = [c for c in cells if c.layer in {n.layer for n in named}]
        impls = schedule.DECISIVE_IMPLS[profile]
        assert {c.impl for c in wide} == set(impls) & set(schedule.DECISIVE_NAMED_IMPLS)  # never simt twice
        assert sum(c.kind == "time" for c in wide) == len(schedule.DECISIVE_CELLS) * len({c.impl for c in wide})
        assert sum(c.kind == "correct" for c in wide) == schedule.DECISIVE_NAMED_CORRECT_CELLS * (profile == "full")
        grid = [c for c in cells if c not in wide]
        assert sum(c.kind == "time" for c in grid) == schedule.DECISIVE * len(impls)
        assert sum(c.kind == "correct" for c in grid) == schedule.DECISIVE_CORRECT_CELLS * (profile == "full") * \
            len(set(impls) & {"mma", "simt"})


@pytest.mark.parametrize("profile", sorted(schedule.PROFILES))
def test_every_step_fits_the_deadline_and_the_deadline_the_call_with_a_margin(profile):
    assert schedule.CALL_TIMEOUT_S[profile] - schedule.DEADLINE_S[profile] >= 40
    assert schedule.sweep_budget_s(profile) >= 20, "the sweep is left no time"
    last = schedule.steps(profile)[-1]
    assert last.name == "summary"
    assert schedule.start_s(profile, "summary") + last.cap_s <= schedule.DEADLINE_S[profile]


def test_a_machine_start_the_full_call_and_the_rerun_fit_the_session_with_a_minute_to_spare():
    assert schedule.session_plan_s() <= schedule.SESSION_S - schedule.SPARE_S


def _script_step_order() -> list[str]:
    """The steps ``gpu_check.sh`` records, in the order its source records them first."""
    names = []
    for match in re.finditer(r'^\s*(?:step|STEPS=\S+ step) ("?[\w$]+"?) ', SCRIPT, re.M):
        name = match.group(1).strip('"')
        found = ["sanitize_memcheck", "sanitize_racecheck", "sanitize_initcheck"] if name == "sanitize_$tool" else [name]
        names += [n for n in found if n not in names]
    return names


@pytest.mark.parametrize("profile", sorted(schedule.PROFILES))
def test_gpu_check_runs_the_schedules_steps_in_the_schedules_order(profile):
    order = _script_step_order()
    planned = [s.name for s in schedule.steps(profile) if not s.background and s.name != "summary"]
    assert [n for n in order if n in planned] == planned


def test_gpu_check_reads_its_caps_and_cells_from_the_schedule():
    assert '"$PY" -m benchmarks.schedule shell --profile "$PROFILE"' in SCRIPT
    done = subprocess.run(["bash", "-c", 'eval "$("$0" -m benchmarks.schedule shell --profile full)"; '
                           'echo "$CAP_DECISIVE $DEADLINE_S_DEFAULT $DECISIVE_POINTS $DECISIVE_IMPLS"', sys.executable],
                          cwd=os.path.dirname(BENCH), capture_output=True, text=True, check=True)
    (decisive,) = [s for s in schedule.FULL if s.name == "decisive"]
    assert done.stdout.split() == [str(decisive.cap_s), str(schedule.DEADLINE_S["full"]),
                                   "64x4096,16x4096,1x32768", "mma,simt,sdpa"]
    # The named cells go to the decisive check, its compile and FlashInfer's turn (which reports them unavailable).
    assert SCRIPT.count('--cells "$DECISIVE_CELLS"') == 2 and '--cells "$DECISIVE_CELLS_CPU"' in SCRIPT
    for step in schedule.FULL + schedule.QUICK:
        if step.cap_s and not step.background and step.name not in ("summary", "sanitize_memcheck",
                                                                    "sanitize_racecheck", "sanitize_initcheck"):
            assert f"CAP_{step.name.upper()}" in SCRIPT, step.name


def test_the_benchmarks_readme_shows_the_schedule_as_it_is():
    readme = open(os.path.join(BENCH, "README.md")).read()
    for profile in schedule.PROFILES:
        assert schedule.table(profile) in readme, f"benchmarks/README.md: regenerate the {profile} table " \
            f"(python -m benchmarks.schedule table --profile {profile})"


def test_the_model_probes_run_their_control_flow_on_the_cpu_and_say_no_number_is_a_gpus(tmp_path):
    """model_probes.py: the one-CTA chain fit and the conversion toy through the kernels' intrinsic run on
    the simulator (the device gives the numbers); cycles are written at the model's clock."""
    import json

    out = tmp_path / "probes.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.model_probes", "--cpu", "--out", str(out)],
                          cwd=os.path.dirname(BENCH), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert "not a GPU" in result["device"] and result["clock_ghz"]["model"] == 1.98
    (chain,) = result["chain"]
    assert chain["status"] == "ok" and chain["warps"] * chain["tile_tokens"] > 0
    assert chain["cycles_per_warp_tile_model_clock"] > 0 and len(chain["times_us"]) == 3
    assert result["cvt"]["per_clock_per_sm_model_clock"] >= 0
    assert done.stdout.splitlines()[-1].startswith("ok\t")


def test_a_straight_line_is_fitted_exactly():
    from benchmarks.model_probes import fit_line

    assert fit_line([4096, 8192, 16384], [10 + 0.5 * t for t in (4096, 8192, 16384)]) == pytest.approx((10.0, 0.5))
