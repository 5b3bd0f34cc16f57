"""Targets, resolved target policies, launch plans and the plan CLI."""

import pathlib
import subprocess
import sys
from dataclasses import astuple

import pytest

from metrale_attn import policy
from metrale_attn.cli import MODELS, main
from metrale_attn.config import (IMPLS, ModelShape, configure, heads_per_cta_choices, resolve_heads_per_cta,
                                 resolve_impl)
from metrale_attn.plan import Workspace, WorkspaceTooSmall, heads_per_cta_for, make_plan, workspace_for
from metrale_attn.policy import SplitkPolicy
from metrale_attn.targets import TARGETS, detect_target, get_target, resolve_target_policy

from support.problems import layer_config

NO_ENV: dict = {}


def target_policy(name, **overrides):
    return resolve_target_policy(get_target(name), environ=overrides.pop("environ", NO_ENV), **overrides)


def test_the_four_targets_declare_their_sm_counts_architectures_and_policies():
    table = {t.name: (t.sm_count, t.arch, t.splitk_declared, t.gqa_pack_declared) for t in TARGETS.values()}
    assert {name: table[name] for name in ("hopper", "b200", "b300", "gb10")} == {
        "hopper": (132, "sm_90", "auto", False),
        "b200": (148, "sm_100", "auto", False),
        "b300": (148, "sm_103", "auto", False),
        "gb10": (48, "sm_121", None, False),
    }


def test_ampere_ada_and_consumer_blackwell_are_targets_with_their_shared_memory_and_fp8_conversion():
    table = {t.name: (t.sm_count, t.arch, t.splitk_declared, t.smem_per_block, t.converts_fp8)
             for t in TARGETS.values()}
    assert {name: table[name] for name in ("a100", "a10", "l40s", "rtx5090")} == {
        "a100": (108, "sm_80", "auto", 163 * 1024, False),
        "a10": (72, "sm_86", "auto", 99 * 1024, False),
        "l40s": (142, "sm_89", "auto", 99 * 1024, True),
        "rtx5090": (170, "sm_120", "auto", 99 * 1024, True),
    }
    assert len({t.compute_capability for t in TARGETS.values()}) == len(TARGETS)  # detection is one-to-one
    assert detect_target((8, 6), 84).name == "a10" and detect_target((12, 0), 188).sm_count == 188


def test_a_target_that_declares_no_policy_gets_legacy():
    assert target_policy("gb10").splitk == SplitkPolicy.LEGACY


def test_detection_maps_a_compute_capability_to_its_target_with_the_devices_sm_count():
    target = detect_target((9, 0), 114)
    assert (target.name, target.sm_count) == ("hopper", 114)
    assert detect_target((10, 3), 148).name == "b300"


def test_an_unknown_compute_capability_is_an_error_naming_the_known_targets_and_the_way_out():
    with pytest.raises(ValueError) as err:
        detect_target((7, 5), 40)
    message = str(err.value)
    assert "7.5" in message and "hopper" in message and "gb10" in message and "target=" in message


def test_an_unknown_target_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="hopper, b200, b300, gb10, a100, a10, l40s, rtx5090"):
        get_target("v100")


def test_the_target_line_says_the_policy_the_gate_and_the_sm_count():
    assert target_policy("b200").line() == (
        "target defaults (b200: B200): attn_decode_splitk=auto gqa_pack=off sm_count=148"
    )


def test_the_target_line_says_which_values_came_from_the_environment():
    env = {"METRALE_ATTN_DECODE_SPLITK": "4", "METRALE_ATTN_DECODE_GQA_PACK": "on"}
    d = target_policy("hopper", environ=env)
    assert (d.splitk, d.gqa_pack) == (SplitkPolicy.pinned(4), True)
    assert d.line().endswith(
        "attn_decode_splitk=4 gqa_pack=on sm_count=132 "
        "(attn_decode_splitk from environment, gqa_pack from environment)"
    )


def test_unparseable_environment_values_keep_the_declaration():
    env = {"METRALE_ATTN_DECODE_SPLITK": "lots", "METRALE_ATTN_DECODE_GQA_PACK": "perhaps"}
    d = target_policy("hopper", environ=env)
    assert (d.splitk, d.splitk_source, d.gqa_pack, d.gqa_pack_source) == (
        SplitkPolicy.AUTO, "declaration", False, "declaration")


def test_explicit_arguments_override_the_environment():
    env = {"METRALE_ATTN_DECODE_SPLITK": "4", "METRALE_ATTN_DECODE_GQA_PACK": "on"}
    d = target_policy("hopper", environ=env, splitk="legacy", gqa_pack=False)
    assert (d.splitk, d.gqa_pack, d.splitk_source, d.gqa_pack_source) == (
        SplitkPolicy.LEGACY, False, "argument", "argument")


def test_an_explicit_splitk_spelling_that_does_not_parse_is_an_error_not_ignored():
    with pytest.raises(ValueError, match="splitk"):
        target_policy("hopper", splitk="lots")


def test_the_process_environment_is_read_when_no_mapping_is_given(monkeypatch):
    monkeypatch.setenv("METRALE_ATTN_DECODE_SPLITK", "legacy")
    policy.gqa_pack_enabled.cache_clear()
    monkeypatch.setenv("METRALE_ATTN_DECODE_GQA_PACK", "yes")
    try:
        d = resolve_target_policy(get_target("hopper"))
        assert (d.splitk, d.gqa_pack) == (SplitkPolicy.LEGACY, True)
    finally:
        policy.gqa_pack_enabled.cache_clear()


def test_the_target_line_reports_the_gqa_pack_source_resolved_with_its_value(monkeypatch):
    """The gate is resolved once per process; its reported source must be that resolution's,
    not a fresh read of an environment that changed after first use."""
    monkeypatch.delenv("METRALE_ATTN_DECODE_GQA_PACK", raising=False)
    first = resolve_target_policy(get_target("hopper"))
    monkeypatch.setenv("METRALE_ATTN_DECODE_GQA_PACK", "on")
    later = resolve_target_policy(get_target("hopper"))
    assert (later.gqa_pack, later.gqa_pack_source) == (first.gqa_pack, first.gqa_pack_source) == (False, "declaration")
    assert later.line() == first.line() and "gqa_pack from" not in later.line()
    policy.gqa_pack_enabled.cache_clear()  # a new process: the environment is read again, value and source
    fresh = resolve_target_policy(get_target("hopper"))
    assert (fresh.gqa_pack, fresh.gqa_pack_source) == (True, "environment") and policy.gqa_pack_enabled() is True


# -- plans ------------------------------------------------------------------

QWEN = MODELS["qwen3.8-27b"]
LLAMA8 = MODELS["llama-3-8b"]
LLAMA70 = MODELS["llama-3-70b"]


@pytest.mark.parametrize(
    "target, shape, splits",
    [("hopper", QWEN, 11), ("b200", QWEN, 13), ("b300", QWEN, 13),
     ("hopper", LLAMA8, 9), ("b200", LLAMA8, 10), ("hopper", LLAMA70, 5), ("b300", LLAMA70, 5)],
)
def test_auto_plans_split_the_same_way_for_every_batch_with_exact_item_and_cta_counts(target, shape, splits):
    d = target_policy(target)
    for batch in (1, 8, 64, 256):
        for impl in IMPLS:
            plan = make_plan(layer_config(d, shape, max_batch=256, impl=impl), batch)
            hpc = plan.heads_per_cta
            assert plan.arm == "splitk" and plan.num_splits == splits
            assert hpc == 1 if impl == "simt" else shape.group_size % hpc == 0
            assert [g.grid for g in plan.launches] == [
                (shape.num_q_heads // hpc, splits, batch), (shape.num_q_heads, batch, 1)]
            assert plan.items == shape.num_q_heads // hpc * splits * batch
            sms = TARGETS[target].sm_count  # 8 or 6 warps: one persistent CTA an SM
            assert plan.ctas == (plan.items if impl == "simt" else min(plan.items, sms))
            assert plan.slots_used == batch * shape.num_q_heads * splits


def test_gb10_legacy_plans_move_with_the_batch():
    d = target_policy("gb10")
    rows = [(b, make_plan(layer_config(d, QWEN, max_batch=64, impl="simt"), b)) for b in (1, 2, 8)]
    assert [(b, p.arm, p.num_splits, p.items, p.ctas) for b, p in rows] == [
        (1, "splitk", 2, 48, 48), (2, "unpacked", 1, 48, 48), (8, "unpacked", 1, 192, 192)]
    # mma: the same split counts; grouped heads while the grid keeps 24 of 48 SMs busy.
    rows = [(b, make_plan(layer_config(d, QWEN, max_batch=64), b)) for b in (1, 2, 8)]
    assert [(b, p.arm, p.num_splits, p.heads_per_cta, p.items) for b, p in rows] == [
        (1, "splitk", 2, 2, 24), (2, "unpacked", 1, 2, 24), (8, "unpacked", 1, 6, 32)]


def test_legacy_reads_the_configured_reference_batch_when_it_is_larger():
    d = target_policy("gb10")
    assert make_plan(layer_config(d, QWEN, max_batch=64, max_decode_seqs=4), 1).num_splits == 1


def test_one_split_with_the_pack_on_and_a_fitting_shape_takes_the_packed_arm():
    d = target_policy("gb10", gqa_pack=True)
    for impl, kernel in (("simt", "simt_decode_gqa_packed"), ("mma", "decode_gqa_packed")):
        plan = make_plan(layer_config(d, QWEN, max_batch=64, impl=impl), 8)
        assert (plan.arm, plan.launches[0].kernel, plan.launches[0].grid, plan.items, plan.heads_per_cta) == (
            "gqa_packed", kernel, (4, 8, 1), 32, policy.DECODE_GQA_PACK_WIDTH)
        assert plan.items == plan.ctas == policy.gqa_pack_ctas(4, 8)


def test_the_packed_arm_is_never_used_under_split_k():
    d = target_policy("hopper", gqa_pack=True)
    assert make_plan(layer_config(d, QWEN, max_batch=64), 8).arm == "splitk"
    assert make_plan(layer_config(target_policy("hopper", gqa_pack=True, splitk="off"), QWEN, max_batch=64), 8).arm == "gqa_packed"


def test_a_pack_that_is_on_with_a_shape_that_does_not_fit_keeps_the_unpacked_kernel_and_says_why():
    plan = make_plan(layer_config(target_policy("hopper", gqa_pack=True, splitk="off"), LLAMA8, max_batch=64, impl="simt"), 8)
    assert plan.arm == "unpacked" and plan.launches[0].grid == (32, 8, 1)
    assert "does not fit" in plan.reason


def test_the_workspace_is_sized_once_for_max_batch():
    ws = workspace_for(target_policy("hopper"), QWEN, max_batch=256)
    assert (ws.slots, ws.slot_floats, ws.nbytes) == (256 * 24 * 11, 258, 256 * 24 * 11 * 258 * 4)
    assert workspace_for(target_policy("gb10"), QWEN, max_batch=256).slots == 48


def test_a_call_whose_geometry_exceeds_the_workspace_is_refused_naming_both_sizes():
    small = workspace_for(target_policy("hopper", splitk="legacy"), QWEN, max_batch=64)  # 132 slots
    with pytest.raises(WorkspaceTooSmall) as err:
        make_plan(layer_config(target_policy("hopper"), QWEN, max_batch=64), 2, workspace=small)
    message = str(err.value)
    assert "528 slots" in message and "132 slots" in message
    assert str(2 * 24 * 11 * 258 * 4) in message and str(132 * 258 * 4) in message


def test_a_batch_wider_than_max_batch_is_refused():
    with pytest.raises(ValueError, match="max_batch=8"):
        make_plan(layer_config(target_policy("hopper"), QWEN, max_batch=8), 9)


def test_an_empty_batch_plans_zero_items_and_zero_ctas():
    plan = make_plan(layer_config(target_policy("hopper"), QWEN, max_batch=8), 0)
    assert plan.items == plan.ctas == 0 and plan.slots_used == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(num_q_heads=25, num_kv_heads=4, head_dim=128), "multiple of num_kv_heads"),
     (dict(num_q_heads=24, num_kv_heads=4, head_dim=72), "head_dim"),
     (dict(num_q_heads=0, num_kv_heads=4, head_dim=128), "num_q_heads"),
     (dict(num_q_heads=24, num_kv_heads=-4, head_dim=128), "num_kv_heads")],
)
def test_a_bad_model_shape_is_refused_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelShape(**kwargs)


def test_workspace_bytes_are_slots_times_head_dim_plus_two_floats():
    assert Workspace(10, 128).nbytes == 10 * 130 * 4


# -- CLI --------------------------------------------------------------------


def test_the_plan_command_prints_the_target_line_and_one_row_per_batch_with_the_ctas_launched(capsys):
    assert main(["plan", "--target", "hopper", "--q-heads", "24", "--kv-heads", "4", "--head-dim", "256",
                 "--batch", "1,8,64", "--max-batch", "256"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "target defaults (hopper: H100/H200): attn_decode_splitk=auto gqa_pack=off sm_count=132"
    rows = [line.split() for line in out[4:]]
    assert [r[:4] for r in rows] == [["1", "splitk", "11", "3"], ["8", "splitk", "11", "6"], ["64", "splitk", "11", "6"]]
    assert out[3].split()[-5:] == ["items", "/SM", "CTAs", "ws", "bytes"]
    assert rows[0][-4:] == ["88", "0.67", "88", str(24 * 11 * 258 * 4)]
    assert rows[2][-4:-1] == ["2816", "21.33", "132"]  # 6 warps: one persistent CTA an SM


def test_the_plan_command_shows_the_simt_grids_and_a_heads_per_cta_override(capsys):
    assert main(["plan", "--model", "qwen3.8-27b", "--batch", "1", "--impl", "simt"]) == 0
    assert capsys.readouterr().out.splitlines()[4].split()[:6] == ["1", "splitk", "11", "1", "(24,11,1)", "+"]
    assert main(["plan", "--model", "qwen3.8-27b", "--batch", "1", "--heads-per-cta", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[4].split()[:5] == ["1", "splitk", "11", "2", "(12,11,1)"]
    assert main(["plan", "--model", "qwen3.8-27b", "--batch", "1", "--heads-per-cta", "4"]) == 2
    assert "heads_per_cta must divide the group size 6" in capsys.readouterr().err


def test_the_plan_command_takes_presets_and_overrides(capsys):
    assert main(["plan", "--model", "llama-3-70b", "--target", "b200", "--splitk", "off", "--batch", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "attn_decode_splitk=1" in out[0] and "from argument" in out[0]
    assert out[4].split()[:6] == ["2", "unpacked", "1", "1", "(64,2,1)", "128"]


def test_the_plan_command_reports_a_bad_request_as_an_error(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--batch", "9", "--max-batch", "8"]) == 2
    assert "max_batch=8" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--model", "llama-3-8b", "--max-batch", "0", "--head-dim", "0"], "--max-batch"),
        (["--model", "llama-3-8b", "--head-dim", "0"], "--head-dim"),
        (["--model", "llama-3-8b", "--q-heads", "0"], "--q-heads"),
        (["--q-heads", "8", "--kv-heads", "0", "--head-dim", "128"], "--kv-heads"),
        (["--model", "llama-3-8b", "--max-decode-seqs", "-1"], "--max-decode-seqs"),
    ],
)
def test_the_plan_command_refuses_zero_sizes_instead_of_taking_the_defaults(capsys, argv, flag):
    with pytest.raises(SystemExit) as done:
        main(["plan", *argv])
    assert done.value.code == 2
    assert f"argument {flag}: must be an int >=" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["--q-heads", "8", "--head-dim", "128"]])
def test_the_plan_command_without_a_shape_exits_2_naming_what_is_missing(capsys, argv):
    assert main(["plan", *argv]) == 2
    assert "give --model, --hf-config or all of --q-heads, --kv-heads, --head-dim" in capsys.readouterr().err


def test_the_plan_command_says_why_an_object_falls_back_to_simt(capsys):
    assert main(["plan", "--target", "a10", "--model", "llama-3-8b", "--kv-dtype", "fp8_e4m3", "--batch", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "; impl simt; " in out[1]
    assert out[2] == ("impl simt, not mma: the mma kernels read fp8 caches with PTX's fp8 cvt, which a10 (sm_86) "
                      "lacks (sm_89 and later have it)")
    assert main(["plan", "--target", "hopper", "--model", "llama-3-8b", "--kv-dtype", "fp8_e4m3", "--batch", "1"]) == 0
    assert "impl simt" not in capsys.readouterr().out


def test_the_plan_command_takes_a_config_and_plans_each_layer_kind_of_one_rank(capsys):
    config = pathlib.Path(__file__).parent / "hf_configs" / "gpt-oss-20b.json"
    assert main(["plan", "--hf-config", str(config), "--tp", "2", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "layer kinds: 12 sliding_attention (window_left 127, sinks), 12 full_attention (sinks)" in out
    assert "layer sliding_attention: q_heads=32 kv_heads=4 head_dim=64" in out
    assert "layer full_attention: q_heads=32 kv_heads=4 head_dim=64" in out


def test_the_plan_command_splits_a_presets_heads_over_the_ranks(capsys):
    assert main(["plan", "--model", "llama-3-70b", "--tp", "8", "--batch", "1"]) == 0
    assert "model: q_heads=8 kv_heads=1 head_dim=128" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--model", "llama-3-8b", "--q-heads", "8"], "--model gives the shape; drop --q-heads"),
    (["--model", "llama-3-8b", "--hf-config", "config.json"], "--model and --hf-config both describe the model"),
    (["--q-heads", "8", "--kv-heads", "8", "--head-dim", "128", "--tp", "2"],
     "--tensor-parallel-size splits the heads of --model or --hf-config"),
])
def test_the_plan_command_refuses_flags_that_do_not_describe_one_model_naming_them(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--model", "llama-3-8b,llama-3-70b"], "--model: the demo runs one model, got 2 (llama-3-8b, llama-3-70b)"),
    (["--tp", "2"], "--tensor-parallel-size splits the heads of --model; give --model too"),
    (["--model", "llama-3-9b"], "--model takes deepseek-v2-lite, deepseek-v3, gemma-4-26b-global, llama-3-70b, llama-3-8b, qwen3.8-27b, Q/KV/HEAD_DIM (32/8/128) or Q/KV/HEAD_DIM/V_HEAD_DIM"),
])
def test_the_demo_refuses_a_model_it_cannot_run_naming_the_flag_before_running(capsys, argv, message):
    assert main(["demo", "--backend", "cpu", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and not captured.out


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*576, 512.*has no mma kernel:RuntimeWarning")
def test_the_demo_runs_an_mla_preset_with_values_read_as_a_view_of_the_latent_cache(capsys):
    assert main(["demo", "--backend", "cpu", "--model", "deepseek-v2-lite"]) == 0
    out = capsys.readouterr().out
    assert "plan: impl=simt" in out and "PASS: within 1 ulp of the float64 reference" in out
    assert "k_scale" in out and out.split("k_scale ")[1].split(",")[0] == out.split("v_scale ")[1].split(")")[0]


def test_the_demo_takes_no_config_file_only_a_preset_or_a_shape():
    with pytest.raises(SystemExit):
        main(["demo", "--hf-config", "config.json"])


def test_the_demo_refuses_a_negative_seed_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as done:
        main(["demo", "--seed", "-1"])
    assert done.value.code == 2 and "argument --seed: must be an int >= 0" in capsys.readouterr().err


def test_python_dash_m_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "metrale_attn", "plan", "--model", "llama-3-8b", "--batch", "1"],
                          capture_output=True, text=True, check=True)
    assert done.stdout.startswith("target defaults (hopper")


# -- heads per CTA (the mma implementation) -------------------------------------------


@pytest.mark.parametrize("shape, batch, splits, expected", [
    (LLAMA8, 1, 9, 4), (LLAMA8, 64, 9, 4),
    (LLAMA70, 1, 5, 4), (LLAMA70, 2, 5, 8),
    (QWEN, 1, 11, 3), (QWEN, 2, 11, 6),
    (LLAMA8, 8, 1, 2), (LLAMA8, 9, 1, 4),
])
def test_heads_per_cta_is_the_largest_divisor_whose_grid_keeps_half_the_sms_busy(shape, batch, splits, expected):
    """The worked numbers of heads_per_cta_for's docstring (132 SMs: at least 66 CTAs)."""
    assert heads_per_cta_for(shape, batch, splits, 132) == expected


def test_heads_per_cta_falls_back_to_one_head_when_no_grouping_covers_the_device():
    assert heads_per_cta_for(ModelShape(8, 1, 128), 1, 1, 132) == 1


def test_heads_per_cta_choices_are_the_divisors_of_the_group_up_to_sixteen():
    assert heads_per_cta_choices(1) == (1,)
    assert heads_per_cta_choices(6) == (1, 2, 3, 6)
    assert heads_per_cta_choices(16) == (1, 2, 4, 8, 16)
    assert heads_per_cta_choices(32) == (1, 2, 4, 8, 16)
    assert heads_per_cta_choices(7) == (1, 7)
    assert heads_per_cta_choices(16, max_rows=8) == (1, 2, 4, 8) and heads_per_cta_choices(16, 4) == (1, 2, 4)


def test_at_head_dim_256_a_cta_holds_eight_rows_so_nothing_spills():
    shape = ModelShape(32, 2, 256)
    assert make_plan(layer_config(target_policy("hopper"), shape, max_batch=64), 64).heads_per_cta == 8
    with pytest.raises(ValueError, match="8 rows from head_dim 208 on"):
        configure(*astuple(shape)[:3], 16, q_dtype="bf16", kv_dtype="bf16", max_batch=64, target_policy=target_policy("hopper"),
                  heads_per_cta=16)


def test_the_split_count_and_the_workspace_never_read_heads_per_cta():
    d = target_policy("hopper")
    for batch in (1, 3, 64):
        plans = [make_plan(layer_config(d, LLAMA70, max_batch=64, heads_per_cta=h), batch) for h in heads_per_cta_choices(8)]
        assert {p.num_splits for p in plans} == {5}
        assert {p.slots_used for p in plans} == {batch * 64 * 5}
        assert [p.heads_per_cta for p in plans] == [1, 2, 4, 8]


def test_a_heads_per_cta_override_wins_over_the_rule_and_shows_in_the_reason():
    plan = make_plan(layer_config(target_policy("hopper"), LLAMA8, max_batch=8, heads_per_cta=1), 1)
    assert plan.heads_per_cta == 1 and plan.launches[0].grid == (32, 9, 1) and "override" in plan.reason
    assert "rule" in make_plan(layer_config(target_policy("hopper"), LLAMA8, max_batch=8), 1).reason


def test_sixteen_heads_per_cta_need_the_second_row_tile():
    shape = ModelShape(32, 2, 128)
    assert make_plan(layer_config(target_policy("hopper"), shape, max_batch=64), 64).heads_per_cta == 16
    assert make_plan(layer_config(target_policy("hopper"), shape, max_batch=64), 64).row_tiles == 2
    assert make_plan(layer_config(target_policy("hopper"), shape, max_batch=64, heads_per_cta=8), 64).row_tiles == 1


@pytest.mark.parametrize("value, env, match", [
    (3, None, "heads_per_cta must divide the group size 4"),
    (0, None, "one of 1, 2, 4"),
    (None, "3", "METRALE_ATTN_DECODE_HEADS_PER_CTA must divide"),
    (None, "two", "METRALE_ATTN_DECODE_HEADS_PER_CTA must be a positive decimal integer"),
])
def test_a_heads_per_cta_the_kernels_cannot_serve_is_refused_naming_where_it_came_from(value, env, match):
    with pytest.raises(ValueError, match=match):
        resolve_heads_per_cta(value, env, 4)


def test_heads_per_cta_from_the_argument_wins_over_the_environment():
    assert resolve_heads_per_cta(2, "4", 4) == 2
    assert resolve_heads_per_cta(None, " 4 ", 4) == 4
    assert resolve_heads_per_cta(None, "", 4) is None
    with pytest.raises(TypeError):
        resolve_heads_per_cta(True, None, 4)


def test_the_implementation_comes_from_the_argument_then_the_environment_then_mma():
    assert resolve_impl(None, None) == "mma"
    assert resolve_impl(None, " SIMT ") == "simt"
    assert resolve_impl("mma", "simt") == "mma"
    with pytest.raises(ValueError, match="METRALE_ATTN_DECODE_IMPL must be one of mma, simt"):
        resolve_impl(None, "tensor")
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve_impl("cuda", None)
