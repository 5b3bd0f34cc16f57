"""``metrale-attn check``: the package proves itself on a user's machine. On the CPU backend the
correctness half runs for real; stand-ins for the worker process (``tests/support/check_doubles.py``)
prove that a wrong kernel fails the check by name, that a sticky CUDA error costs one
implementation and not the run, and that the GPU timing half runs every step on a stand-in GPU.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
from dataclasses import asdict

import pytest

from metrale_attn.check import CheckOptions, model_layers, run_check
from metrale_attn.check.cells import (Cell, Named, arms_for, cache_bytes_per_token, parse_cells, parse_points,
                                      peer_refusal, plan_cells)
from metrale_attn.cli import main
from metrale_attn.precompile import Layer, layer_shape

from support.backends import SpecRecorder
from support.optional import import_torch

DOUBLES = pathlib.Path(__file__).parent / "support" / "check_doubles.py"
TINY = Layer("tiny", 4, 1, 64)
"""The smallest layer kind the kernels serve (the sweep's CPU profile uses it too: its modules are cached)."""
MLA = Layer("mla", 4, 1, 576, v_head_dim=512, v_in_k=True)
"""MLA's absorbed shape at 4 q heads: V the first 512 dims of each 576-wide K row."""
WIDE = Layer("wide", 4, 2, 512)
"""Gemma 4's global head dim, 512, V a cache of its own, at 4 q heads over 2 KV heads."""
HF_CONFIGS = pathlib.Path(__file__).parent / "hf_configs"
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


def test_the_wide_presets_are_gemma_4s_global_layer_and_deepseeks_mla_and_a_shape_may_name_its_value_width():
    _, layers = model_layers(["gemma-4-26b-global", "deepseek-v3", "deepseek-v2-lite", "16/1/576/512"])
    got = [(x.num_q_heads, x.num_kv_heads, x.head_dim, x.v_head_dim, x.v_in_k) for x in layers]
    assert got == [(16, 2, 512, None, False), (128, 1, 576, 512, True), (16, 1, 576, 512, True),
                   (16, 1, 576, 512, True)]
    _, (rank,) = model_layers(["deepseek-v3"], tensor_parallel=8)  # the latent head is on every rank
    assert (rank.num_q_heads, rank.num_kv_heads, rank.v_head_dim) == (16, 1, 512)
    for bad in ("16/2/576/512", "16/1/576/500", "1/2/3/4/5"):
        with pytest.raises(ValueError, match="--model"):
            model_layers([bad])


def test_a_check_of_an_mla_layer_counts_the_latent_row_once_where_our_kernel_reads_v_from_ks_registers():
    assert cache_bytes_per_token(MLA, "bf16", "mma") == 576 * 2  # 1,152 B: V is K's first 512 dims, read once
    assert cache_bytes_per_token(MLA, "bf16", "simt") == 576 * 2
    assert cache_bytes_per_token(MLA, "bf16", "sdpa") == (576 + 512) * 2  # it gathers V on its own
    assert cache_bytes_per_token(MLA, "fp8", "mma") == 576 + 512  # the v_in_k kernels are bf16's: V read again
    assert cache_bytes_per_token(WIDE, "bf16", "mma") == 2 * (512 + 512) * 2  # two KV heads, V a cache apart
    assert cache_bytes_per_token(TINY, "fp8", "mma") == 64 * 2


def test_named_cells_join_the_grid_one_by_one_and_a_bad_one_is_refused_naming_cells():
    named = parse_cells("deepseek-v3:bf16:64x4096, gemma-4-26b-global:fp8:1x32768", tensor_parallel=8)
    assert [(n.layer.num_q_heads, n.layer.head_dim, n.kv_dtype, n.batch, n.context) for n in named] == \
        [(16, 576, "bf16", 64, 4096), (2, 512, "fp8", 1, 32768)]
    cells = plan_cells([TINY], ["bf16", "fp8"], ["sdpa"], timed=True, points=((1, 64), (2, 64)), named=named)
    assert len(cells) == 2 * 2 + 2  # the grid, then one timing cell each: no product with the grid
    assert [c.label for c in cells[-2:]] == ["sdpa deepseek-v3 16/1/576/512 bf16 b64x4k",
                                             "sdpa gemma-4-26b-global 2/1/512 fp8 b1x32k"]
    for bad in ("deepseek-v3:bf16", "deepseek-v3:fp4:1x64", "no-such-model:bf16:1x64", "deepseek-v3:bf16:0x64",
                "deepseek-v3:bf16:64", " , "):
        with pytest.raises(ValueError, match="--cells"):
            parse_cells(bad)


def test_a_layer_only_simt_serves_is_checked_once_under_mma_when_simt_is_asked_too():
    named = (Named(MLA, "bf16", 2, 64),)
    cells = plan_cells([TINY, WIDE], ["bf16"], ["mma", "simt", "sdpa"], timed=True, points=((1, 64),), named=named)
    by_impl = {impl: {c.label for c in cells if c.impl == impl} for impl in ("mma", "simt", "sdpa")}
    assert by_impl["simt"] == {"simt tiny 4/1/64 bf16 unpacked", "simt tiny 4/1/64 bf16 splitk",
                               "simt tiny 4/1/64 bf16 b1x64"}
    assert {"mma wide 4/2/512 bf16 splitk", "mma mla 4/1/576/512 bf16 unpacked", "mma mla 4/1/576/512 bf16 b2x64",
            "mma wide 4/2/512 bf16 b1x64"} <= by_impl["mma"]
    alone = plan_cells([WIDE], ["bf16"], ["simt"], timed=False)  # asked alone, simt runs them
    assert [c.label for c in alone] == ["simt wide 4/2/512 bf16 unpacked", "simt wide 4/2/512 bf16 splitk"]


def test_flashinfer_is_unavailable_at_head_dim_512_and_at_mla_saying_why_and_sdpa_is_not():
    for layer, why in ((WIDE, "head dims 64, 128, 256"), (MLA, "one head dim for K and V")):
        assert why in peer_refusal(Cell("time", "flashinfer", layer, "bf16", batch=1, context=64))
        assert peer_refusal(Cell("time", "sdpa", layer, "bf16", batch=1, context=64)) is None


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


def test_a_check_of_wide_layers_runs_the_simt_kernels_under_mma_within_the_bar_and_records_that_they_ran(tmp_path):
    code, result, said = _check(tmp_path, layer=WIDE, named=(Named(MLA, "bf16", 1, 64), Named(MLA, "fp8", 1, 64)))
    assert code == 0 and result["verdict"] == "ok", said
    rows = {(r["spec"]["layer"]["name"], r["spec"]["kv_dtype"], r["spec"]["arm"]): r for r in result["correctness"]}
    assert set(rows) == {(name, kv, arm) for name, kv in (("wide", "bf16"), ("mla", "bf16"), ("mla", "fp8"))
                         for arm in ("unpacked", "splitk")}
    for (name, kv, arm), r in rows.items():
        assert r["status"] == "ok" and r["arm_ran"] == arm and r["impl_ran"] == "simt", r
        assert "the simt kernels ran" in r["simt_by_shape"]
        assert r["outputs"] == 5 * 4 * 512  # out is v_head_dim wide
        assert r["v_read_from_k"] == (name == "mla" and kv == "bf16")
    assert "splitk (simt)" in (tmp_path / "report.md").read_text()


@pytest.mark.filterwarnings("ignore:.*has no mma kernel:RuntimeWarning")
def test_the_checks_count_of_v_read_from_k_is_the_binders_own_choice_of_kernel(tmp_path):
    """The bytes a check divides by follow ``binding.CallBinder._v_in_k``: the MLA cell whose result
    says V was read from K launched the ``_vink`` kernels, and no other did."""
    from metrale_attn.check.worker import Worker

    for kv in ("bf16", "fp8"):
        worker = Worker("mma", "cpu", str(tmp_path / f"events_{kv}.jsonl"))
        worker.backend = SpecRecorder()
        result = worker.correct(Cell("correct", "mma", MLA, kv, arm="unpacked"))
        launched = [name for name in worker.backend.specs if "merge" not in name]
        assert result["status"] == "ok" and launched, result
        assert all(name.endswith("_vink") == result["v_read_from_k"] for name in launched), launched
        assert result["v_read_from_k"] == (kv == "bf16")


@pytest.mark.parametrize("sm_scale", [1.0, 0.03])
def test_a_check_runs_a_layer_at_its_models_softmax_scale_in_the_kernel_and_the_reference_alike(tmp_path, monkeypatch,
                                                                                                 sm_scale):
    """A config's scale (Gemma 4's 1, DeepSeek's YaRN scale) reaches the ``DecodeAttention`` a cell
    builds, the float64 reference it is held to (a kernel at one scale against a reference at another
    fails the bar), the timing path's case, and the report's layer line."""
    from metrale_attn.check import data, report, worker as worker_module
    from metrale_attn.check.worker import Worker

    built = []

    class Recording(worker_module.DecodeAttention):
        def __init__(self, *args, **kwargs):
            built.append(kwargs.get("sm_scale"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(worker_module, "DecodeAttention", Recording)
    layer = Layer("scaled", 4, 1, 64, sm_scale=sm_scale)
    worker = Worker("mma", "cpu", str(tmp_path / "events.jsonl"))
    for arm in ("unpacked", "splitk"):
        result = worker.correct(Cell("correct", "mma", layer, "bf16", arm=arm))
        assert result["status"] == "ok", result
    assert built == [sm_scale, sm_scale]
    import_torch()
    pool = data.GpuPool(layer_shape(layer), "bf16", 16, 4, seed=1, device="cpu")
    assert pool.case(1, 20, sm_scale=layer.sm_scale).sm_scale == sm_scale
    assert pool.case(1, 20).sm_scale == 64 ** -0.5
    assert report._layer_text(asdict(layer)) == f"scaled 4/1/64 sm_scale {sm_scale:g}"
    assert report._layer_text(asdict(TINY)) == "tiny 4/1/64"


def test_sdpa_over_a_gathered_mla_cache_and_a_512_wide_one_matches_the_float64_reference_on_the_cpu():
    """The SDPA peer takes V narrower than K (MLA's view of the latent cache) and head dim 512 (its
    group folded into the query axis): CPU PyTorch, against the same float64 decode ours is held to."""
    import_torch()
    from metrale_attn.check import data, peers
    from metrale_attn.precompile import layer_shape

    for layer, kv in ((MLA, "bf16"), (MLA, "fp8"), (WIDE, "bf16")):
        pool = data.GpuPool(layer_shape(layer), kv, 16, 12, seed=1, device="cpu", v_in_k=layer.v_in_k)
        assert (pool.v.data_ptr() == pool.k.data_ptr()) == layer.v_in_k
        row = layer.head_dim + (0 if layer.v_in_k else layer.head_dim)  # MLA's pool is its one latent cache
        assert pool.nbytes == 12 * 16 * layer.num_kv_heads * row * (1 if kv == "fp8" else 2)
        case = pool.case(3, 50, layer.num_q_heads)
        assert peers.sdpa_folds_group(case)
        out = peers.prepare_sdpa_gather(case)()
        assert tuple(out.shape) == (3, layer.num_q_heads, layer.v_head_dim or layer.head_dim)
        check = data.check_gpu_output(case, out, [0, 2], {}, strict=False)
        assert check["status"] == "ok" and check["max_abs_err"] < 0.02, (layer, kv, check)


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


@pytest.mark.slow  # CI's slow step runs it (the default run stays under 4 minutes)
def test_the_timing_half_times_wide_layers_on_mma_as_simt_and_sdpa_and_finds_flashinfer_unavailable(tmp_path):
    import_torch()
    named = (Named(MLA, "bf16", 2, 64), Named(WIDE, "bf16", 1, 64))
    code, result, said = _check(tmp_path, layer=TINY, impls=("mma", "simt", "sdpa", "flashinfer"),
                                worker=_double("fake-gpu"), timed=True, correctness=False, points=((1, 64),),
                                named=named)
    assert code == 0, said
    rows = {(r["impl"], r["spec"]["layer"]["name"]): r for r in result["timing"]}
    assert ("simt", "mla") not in rows and ("simt", "wide") not in rows and ("simt", "tiny") in rows
    mla = rows[("mma", "mla")]
    assert mla["status"] == "ok" and mla["impl_ran"] == "simt" and mla["v_read_from_k"]
    assert mla["bytes_moved"] == 2 * 64 * 1152 + 2 * 4 * (576 + 512) * 2  # the latent row once; q in, out
    assert rows[("sdpa", "mla")]["bytes_moved"] == 2 * 64 * 2176 + 2 * 4 * (576 + 512) * 2
    assert rows[("mma", "mla")]["flops"] == 2 * 2 * 4 * 64 * (576 + 512)
    assert rows[("sdpa", "wide")]["status"] == "ok" and rows[("mma", "wide")]["impl_ran"] == "simt"
    for name in ("mla", "wide"):
        assert rows[("flashinfer", name)]["status"] == "unavailable"
    assert "(simt ran)" in said and "(simt ran)" in (tmp_path / "report.md").read_text()


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


def test_metrale_attn_check_takes_named_cells_alone_and_refuses_a_bad_one_naming_cells(tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["check", "--cells", "4/1/576/512:bf16:1x64", "--backend", "cpu", "--out", str(out),
                 "--impl", "mma"]) == 0
    said = capsys.readouterr().out
    assert "1 named cell(s), 2 cells" in said and "VERDICT: ok" in said and "simt ran" in said
    assert main(["check", "--cells", "deepseek-v3:bf16", "--backend", "cpu", "--out", str(tmp_path / "x")]) == 2
    assert "--cells" in capsys.readouterr().err and not (tmp_path / "x").exists()


@pytest.mark.parametrize("config, tp, shapes", [
    ("gemma-4-26b-a4b-it.json", 8, {"2/1/256", "2/1/512"}),  # sliding and global layers, one rank of 8
    ("deepseek-v3.json", 32, {"4/1/576/512"}),  # the latent head on every rank
])
def test_metrale_attn_check_runs_the_layers_of_the_gemma_4_and_deepseek_configs_on_the_cpu(tmp_path, capsys, config,
                                                                                            tp, shapes):
    out = tmp_path / "report"
    assert main(["check", "--hf-config", str(HF_CONFIGS / config), "--tp", str(tp), "--backend", "cpu", "--out",
                 str(out), "--impl", "mma"]) == 0, capsys.readouterr().out
    result = json.loads((out / "report.json").read_text())
    assert {r["cell"].split()[2] for r in result["correctness"]} == shapes
    assert all(r["status"] == "ok" for r in result["correctness"])
    # At the model's own scale: Gemma 4's logits unscaled, DeepSeek-V3's 1/sqrt(192) times YaRN's mscale^2.
    model_scale = 1.0 if "gemma" in config else 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2
    assert [layer["sm_scale"] for layer in result["layers"]] == pytest.approx([model_scale] * len(result["layers"]))


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
