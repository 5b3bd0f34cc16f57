"""benchmarks/model/call_model.py: the plan's grid on 132 SMs, the waves and fixed costs, the % of copy
and its losses; the shared-memory fit per target; the report reproducing its committed JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from benchmarks.model import call_model as cm
from benchmarks.model import sass_model as sr
from benchmarks.model import warp_chain as wc
from benchmarks.model.model_assumptions import a, cycles_of_ns

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
COMMITTED = os.path.join(REPO, "benchmarks", "model", "results", "sass_model.json")


def test_llama3_8b_at_batch_1_x_32k_is_72_ctas_of_3641_tokens_and_at_batch_64_x_4k_17_waves_of_456():
    one = cm.Call(32, 8, 128, "bf16", 1, 32768)
    plan = cm.plan_for(one)
    # auto: ceil(2 x 132 / 32) = 9 splits; h = 4 (8 KV heads x 9 splits = 72 >= 66 CTAs)
    assert (plan.arm, plan.num_splits, plan.heads_per_cta, plan.launches[0].grid) == ("splitk", 9, 4, (8, 9, 1))
    assert cm.variant_for(one, plan).name == "decode_splitk_qbf16_kvbf16_hd128_r8"
    assert cm.split_range(32768, 0, 9) == (0, 3641) and cm.split_range(32768, 8, 9) == (29128, 32768)
    # 3641 tokens from position 0: tiles 0..227 of 16, warp w takes k = w mod 4: 57 each; split 1 starts
    # mid-tile (3641 = 227 x 16 + 9) and spans 229 tiles: one warp takes 58
    assert cm.warp_tiles(0, 3641, 16, 4) == [57, 57, 57, 57]
    assert cm.warp_tiles(3641, 7282, 16, 4) == [57, 57, 57, 58]
    assert cm.warp_tiles(5, 5, 16, 4) == [0, 0, 0, 0]
    batch = cm.Call(32, 8, 128, "bf16", 64, 4096)
    plan = cm.plan_for(batch)
    assert plan.launches[0].items == 8 * 9 * 64 == 4608 and plan.launches[1].items == 32 * 64
    assert cm.split_range(4096, 0, 9) == (0, 456)  # ceil(4096 / 9) = 456 >= 256
    assert plan.launches[0].items / (132 * 2) == pytest.approx(17.45, abs=0.01)  # waves at 2 CTAs per SM
    # 64/8/128 at batch 1: 5 splits; h = 8 gives 40 CTAs, so h = 4 (80): each row read by 2 CTAs
    assert cm.plan_for(cm.Call(64, 8, 128, "bf16", 1, 32768)).heads_per_cta == 4


def test_a_block_table_sector_is_missed_once_per_round_of_warps_that_reads_it():
    assert cm.bt_miss_probability(16, 16, 4) == 0.5   # 4 entries of 4 B a round: a 32-byte sector in 2 rounds
    assert cm.bt_miss_probability(32, 16, 4) == 1.0   # 32-token tiles on 16-token pages: 8 entries a round
    assert cm.bt_miss_probability(16, 16, 8) == 1.0
    assert cm.bt_miss_probability(16, 256, 4) == 0.5  # one entry a tile however large the page


def fake_kernel(chain_cycles: float, issue: float = 10.0, ctas_per_sm: int = 2) -> cm.KernelTiming:
    chain = wc.Chain(chain_cycles, int(issue), {}, {}, {})
    chains = {(ns, bt): chain for ns in (a("latency_short_ns"), a("latency_long_ns")) for bt in ("l2", "dram")}
    return cm.KernelTiming("fake", 16, 8192, 4, ctas_per_sm, "shared memory", 0, 4, chains, 0, 0)


def test_one_partial_wave_takes_a_launch_the_slowest_cta_and_the_merge():
    call = cm.Call(32, 8, 128, "bf16", 1, 32768)
    plan = cm.plan_for(call)
    k = cm.with_rows(fake_kernel(100_000.0), plan)  # so slow that HBM never binds
    p = cm.simulate(call, plan, k, lockstep=True)
    assert (p.ctas, p.tiles_per_warp) == (72, 58) and p.waves == pytest.approx(72 / 264)
    # every CTA starts at once on an idle memory system: 3 DRAM round trips at the short latency
    prologue = 3 * cycles_of_ns(a("latency_short_ns")) + a("bar_sync")
    epilogue = 2 * a("bar_sync") + 4 * 128 / 128 * (a("lat_shared") + a("lat_xu") + 2 * a("lat_alu"))
    kernel = prologue + 58 * 100_000.0 + epilogue
    total = a("launch") + kernel + p.merge
    assert p.epilogue == pytest.approx(epilogue)
    assert p.time_us == pytest.approx(total / (a("clock_ghz") * 1e3), rel=1e-9)
    cap = a("hbm_copy_tb_s") * 1e12 / (a("clock_ghz") * 1e9)
    assert p.pct == pytest.approx(100 * call.kv_bytes / cap / total, rel=1e-9)
    # every point lost is accounted for, and 60 of 132 SMs idle is most of it
    assert sum(p.losses.values()) == pytest.approx(100 - p.pct, abs=0.05)
    assert p.losses["grid fill"] > p.losses["fixed costs"] and p.binding in ("grid fill", "chain latency")


def test_a_fast_kernel_at_a_large_batch_is_held_to_the_copy_bandwidth_and_loses_only_fixed_costs():
    call = cm.Call(32, 8, 128, "bf16", 64, 4096)
    plan = cm.plan_for(call)
    p = cm.simulate(call, plan, cm.with_rows(fake_kernel(500.0), plan))  # 8 warps x 8 KiB / 500 cycles: 4x the share
    assert 85 < p.pct < 100
    assert sum(p.losses.values()) == pytest.approx(100 - p.pct, abs=0.05)
    assert p.losses["chain latency"] == pytest.approx(0, abs=0.5) and p.losses["issue"] == pytest.approx(0, abs=0.5)
    slow = cm.simulate(call, plan, cm.with_rows(fake_kernel(5000.0), plan))
    assert slow.pct < p.pct and slow.binding == "chain latency"


def test_the_warps_of_a_cta_share_the_four_schedulers_so_at_the_issue_bound_eight_warps_are_no_faster_than_four():
    assert [float(wc.warps_per_scheduler(1, w)) for w in (2, 4, 6, 8)] == [1.0, 1.0, 2.0, 2.0]
    assert float(wc.warps_per_scheduler(2, 4)) == 2.0
    call = cm.Call(32, 8, 128, "bf16", 1, 32768)
    plan = cm.plan_for(call)

    def issue_bound(warps: int) -> float:  # a chain of 100 cycles, 1,000 instructions a tile
        k = replace(fake_kernel(100.0, issue=1000.0, ctas_per_sm=1), warps_per_cta=warps)
        return cm.simulate(call, plan, cm.with_rows(k, plan), lockstep=True).time_us

    # 8 warps take half the tiles each, but two share a scheduler: the CTA issues as fast as with 4
    # (counted as if each warp had its own scheduler, 8 warps would halve the body's time)
    four, eight = issue_bound(4), issue_bound(8)
    assert eight == pytest.approx(four, rel=0.02)


def test_a_dependent_merge_launches_during_the_last_items_and_waits_only_for_the_grids_end():
    assert cm.dependent_launch_gap(released=0.0, ended=10_000.0) == a("pdl_wait")
    # released late: what is left of the launch after the grid's end
    assert cm.dependent_launch_gap(released=9_500.0, ended=10_000.0) == 9_500.0 + a("launch") - 10_000.0
    call = cm.Call(32, 8, 128, "bf16", 1, 32768)
    plan = cm.plan_for(call)
    k = cm.with_rows(fake_kernel(2000.0), plan)
    plain = cm.simulate(call, plan, k, lockstep=True)
    dependent = cm.simulate(call, plan, replace(k, levers=cm.Levers(dependent_merge=True)), lockstep=True)
    assert plain.merge - dependent.merge == pytest.approx(a("launch") - a("pdl_wait"))


def test_every_mma_variant_sized_for_its_target_fits_a_block_on_every_architecture():
    fit = sr.smem_fit()
    assert set(fit) == {"sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_103", "sm_120", "sm_121"}
    assert all(not f["do_not_fit"] for f in fit.values())  # the tiling follows the limit
    assert fit["sm_80"]["limit_bytes"] == 163 * 1024


def test_the_levers_name_what_they_change_and_today_changes_nothing():
    assert cm.LEVERS[0] == cm.Levers() and cm.LEVERS[0].rewrite([]) == ([], {})
    names = [lv.name for lv in cm.LEVERS]
    assert len(set(names)) == len(names) and names[-1] == "all of the above"


# -------------------------------------------------------------------------------------
# The real kernels
# -------------------------------------------------------------------------------------

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (cupy) is not installed")
NVDISASM = sr.find_nvdisasm()
needs_nvdisasm = pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)")


@needs_nvdisasm
def test_the_report_reproduces_its_committed_json_for_llama3_8b_bf16(tmp_path):
    with open(COMMITTED) as f:
        committed = json.load(f)
    if committed.get("toolchain") != sr.toolchain(NVDISASM):
        pytest.skip(f"the committed report came from {committed.get('toolchain')}, this is {sr.toolchain(NVDISASM)}")
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.model.sass_model", "--json", str(out), "--specs",
         "decode_splitk_qbf16_kvbf16_hd128_r8", "--shapes", "32/8/128", "--kv-dtypes", "bf16", "--levers", "none"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "NVDISASM": NVDISASM})
    assert done.returncode == 0, done.stdout + done.stderr
    fresh = json.loads(out.read_text())
    assert "MODELLED" in done.stdout and "Predicted % of H200 copy bandwidth" in done.stdout

    def key(r):
        return r["spec"], r["q_heads"], r["kv_heads"], r["kv_dtype"]

    old_rows = {key(r): r for r in committed["rows"]}
    for r in fresh["rows"]:
        old = old_rows[key(r)]
        for field in ("instr_per_kib", "chain_cycles_per_tile", "chain_cycles_bt_dram", "issue_cycles_per_tile",
                      "ctas_per_sm", "registers", "ceiling_pct"):
            assert r[field] == pytest.approx(old[field], rel=1e-6), field
    old_calls = {(c["call"], c["lever"]): c for c in committed["calls"]}
    assert len(fresh["calls"]) == 3
    for c in fresh["calls"]:
        old = old_calls[(c["call"], c["lever"])]
        for field in ("predicted_pct", "predicted_pct_lockstep", "time_us", "ctas", "binding", "chain_cycles_per_tile"):
            assert c[field] == (pytest.approx(old[field], rel=1e-6) if isinstance(old[field], float) else old[field])


def test_a_measured_call_gets_the_call_models_prediction_where_the_report_predicted_that_call(tmp_path):
    from benchmarks.model import predictions

    row = dict(impl="mma", arm="splitk", q_heads=32, kv_heads=8, head_dim=128, q_dtype="bf16", kv_dtype="fp8_e4m3",
               arch="sm_90", heads_per_cta=4, instr_per_kib=86.0, kib_in_flight_per_sm=128.0, registers=128,
               spill_bytes=0, ceiling_pct=100.0, binding="hbm")
    call = {**row, "batch": 1, "context": 32768, "lever": "today", "predicted_pct": 40.0, "binding": "grid fill"}
    other = {**call, "lever": "persistent CTAs", "predicted_pct": 41.0}
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"format": "sass_model/2", "rows": [row], "calls": [other, call]}))
    p = predictions.Predictions.load(str(path), "sm_90")
    key = dict(impl="mma", arm="splitk", q_heads=32, kv_heads=8, head_dim=128, q_dtype="bf16", kv_dtype="fp8",
               heads_per_cta=4)
    found = p.lookup(**key, batch=1, context=32768)
    assert found["ceiling_pct"] == 100.0 and found["predicted_pct"] == 40.0
    assert found["predicted_binding"] == "grid fill"
    assert "predicted_pct" not in p.lookup(**key)  # no call asked for: the spec's row alone
    assert "predicted_pct" not in p.lookup(**key, batch=64, context=4096)  # a call the report did not model
    assert predictions.call_ratio(30.0, found) == pytest.approx(0.75)
    # the committed report predicts the decisive calls the sweep measures on the default plan
    committed = predictions.Predictions.load(COMMITTED, "sm_90")
    for batch, context, kv in ((64, 4096, "bf16"), (1, 32768, "fp8")):
        plan = cm.plan_for(cm.Call(32, 8, 128, kv, batch, context))
        got = committed.lookup(impl=plan.impl, arm=plan.arm, q_heads=32, kv_heads=8, head_dim=128, q_dtype="bf16",
                               kv_dtype=kv, heads_per_cta=plan.heads_per_cta, batch=batch, context=context)
        assert got and 0 < got["predicted_pct"] <= 100 and got["predicted_binding"]


def test_a_later_item_with_its_first_stages_in_flight_waits_only_what_the_round_trip_outlasts_the_epilogue_by():
    """The mma kernel's lever 5 (``ahead_prologue_cycles``): the entries and q from L2, a barrier and
    the item's own instructions always; the first stage's DRAM round trip only past the
    epilogue, the q staging, the barrier and those instructions; with P < S - 1 stages in
    flight, tile P's round trip past the P tiles computed before it too."""
    k = replace(fake_kernel(300.0), stages=3, prologue_instructions=900, item_prologue_instructions=400,
                levers=cm.Levers(warm_next=True, next_in_flight=2))
    fixed = 2 * a("lat_l2_hit") + a("bar_sync") + 400
    covered = a("lat_l2_hit") + a("bar_sync") + 400
    assert cm.ahead_prologue_cycles(k, 3000.0, 1000.0) == pytest.approx(fixed + 3000.0 - 1000.0 - covered)
    assert cm.ahead_prologue_cycles(k, 500.0, 1000.0) == pytest.approx(fixed)  # hidden
    short = replace(k, levers=cm.Levers(warm_next=True, next_in_flight=1))
    first = 3000.0 - 1000.0 - covered
    assert cm.ahead_prologue_cycles(short, 3000.0, 1000.0) == pytest.approx(fixed + first + (3000.0 - first - 300.0))
    # one barrier fewer in the epilogue: each warp publishes into its own ring
    assert cm.epilogue_cycles(replace(k, rows=8), 128) == pytest.approx(cm.epilogue_cycles(replace(
        k, rows=8, levers=cm.Levers()), 128) - a("bar_sync"))


def test_the_merge_has_a_thread_per_output_dim_so_head_dim_256_waits_for_the_workspace_once_not_twice():
    from metrale_attn.sources import merge_threads, source_constants

    assert source_constants().merge_threads == 256  # PD_MERGE_THREADS, the launch bounds
    assert [merge_threads(d) for d in (64, 80, 128, 144, 256)] == [64, 96, 128, 160, 256]
    call = cm.Call(24, 4, 256, "fp8", 16, 4096)
    plan = cm.plan_for(call)
    one_round = 2 * a("lat_l2_hit") + a("lat_xu") + plan.num_splits * a("lat_alu")
    # a 128-thread CTA's thread took two dims in turn: two rounds; now one, or the workspace stream
    assert one_round <= cm.merge_cycles(call, plan, 0.5) - a("launch") < 2 * one_round
