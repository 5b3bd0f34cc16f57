"""benchmarks/model/sass_model.py: the static SASS model, without a GPU.

The CFG machinery is checked on small hand-written listings (nested loops, a divergent
fallback, a rare detour, two memory waits); the real report runs on one spec end to
end and on one spec per arm to check its loop bytes against the kernel sources.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import pytest

from benchmarks.model import sass_model as sr
from benchmarks.model.sass import _width_bytes, never_executes
from benchmarks.model.hot_loop import hot_loop
from metrale_attn.backends import cubin
from metrale_attn.kernels import KernelSpec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# -------------------------------------------------------------------------------------
# The CFG and the model on hand-written SASS
# -------------------------------------------------------------------------------------

LISTING = """
        .section        .text.toy,"ax",@progbits
toy:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   MOV R9, RZ ;
.L_x_outer:
        /*0020*/                   IADD3 R9, R9, 0x1, RZ ;
.L_x_inner:
        /*0030*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;
        /*0040*/                   LDG.E.128.CONSTANT R12, desc[UR4][R2.64+0x200] ;
        /*0050*/                   BRA.DIV UR6, `(.L_x_stub) ;
.L_x_back:
        /*0060*/                   SHFL.BFLY PT, R8, R1, 0x1, 0x1f ;
        /*0070*/                   FFMA R1, R4, R5, R1 ;
        /*0080*/                   LDG.E.128.CONSTANT R20, desc[UR4][R2.64+0x400] ;
        /*0090*/                   FFMA R1, R12, R20, R1 ;
        /*00a0*/               @!P1 BRA `(.L_x_common) ;
        /*00b0*/                   FSEL R1, R1, -INF, P2 ;
        /*00c0*/                   FSEL R1, R1, -INF, P2 ;
        /*00d0*/                   FSEL R1, R1, -INF, P2 ;
.L_x_common:
        /*00e0*/                   MUFU.EX2 R1, R1 ;
        /*00f0*/               @P0 BRA `(.L_x_inner) ;
        /*0100*/                   ISETP.GE.AND P3, PT, R9, 0x10, PT ;
        /*0110*/              @!P3 BRA `(.L_x_outer) ;
        /*0120*/                   EXIT ;
.L_x_stub:
        /*0130*/                   WARPSYNC.ALL ;
        /*0140*/                   SHFL.BFLY PT, R8, R1, 0x1, 0x1f ;
        /*0150*/                   BRA `(.L_x_back) ;
.L_x_pad:
        /*0160*/                   BRA `(.L_x_pad) ;
"""


def toy():
    (name, (instrs, labels)), = sr.parse_functions(LISTING).items()
    assert name == "toy"
    return instrs, labels


def test_the_hot_loop_is_the_innermost_loop_with_the_loads_and_skips_cold_code():
    instrs, labels = toy()
    hot = sr.find_hot_path(instrs, labels)
    assert hot is not None
    addrs = [i.addr for i in hot.instrs]
    # The inner loop (0x30..0xf0), not the outer one or the padding self-loop; the
    # BRA.DIV fallback (0x130..) and the three-FSEL detour are off the steady-state path.
    assert addrs[0] == 0x30 and addrs[-1] == 0xF0
    assert 0x130 not in addrs and 0xB0 not in addrs
    assert len(hot.instrs) == 10 and hot.body_instructions == 13


def test_two_memory_waits_and_the_bytes_in_flight_at_the_first():
    instrs, labels = toy()
    flight = sr.loads_in_flight(sr.find_hot_path(instrs, labels).instrs)
    # 2 loads (1 KiB per warp) before FFMA reads R4; the third load waits alone.
    assert flight.bytes_at_first_wait == 2 * 512
    assert flight.waits == 2 and flight.bytes_per_iter == 3 * 512
    assert flight.mean_bytes == 3 * 512 / 2


def test_instruction_categories_pipes_and_operands():
    ins = sr.Instr(0, None, "LDG.E.128.CONSTANT", "R40, desc[UR8][R40.64]")
    assert sr.category(ins) == "ldg" and sr.global_load_bytes(ins) == 512
    assert sr.registers(ins) == [{40, 41, 42, 43}, {40, 41}]
    assert sr.category(sr.Instr(0, None, "IMAD.WIDE.U32", "R20, R2, UR22, R20")) == "int"
    assert set(sr.pipe_cost(sr.Instr(0, None, "IMAD.U32", "R45, R40, 0x10000, RZ"))) == {"issue", "fma", "imad"}
    assert set(sr.pipe_cost(sr.Instr(0, None, "LOP3.LUT", "R4, R4, 0xff, RZ, 0xc0, !PT"))) == {"issue", "alu"}
    assert set(sr.pipe_cost(sr.Instr(0, None, "MUFU.EX2", "R1, R1"))) == {"issue", "xu"}
    assert sr.shared_bytes(sr.Instr(0, None, "LDSM.16.M88.4", "R8, [R2]")) == 512
    assert sr.tensor_fmas(sr.Instr(0, None, "HMMA.16816.F32.BF16", "R4, R8, R12, R4")) == 16 * 8 * 16
    assert sr.category(sr.Instr(0, None, "UIADD3", "UR4, UR4, 0x1, URZ")) == "uniform"


def test_occupancy_follows_registers_and_shared_memory():
    assert sr.occupancy(83, 2336, 4) == (5, "registers")  # 88 regs x 32 = 2816 per warp: 5 per sub-partition
    assert sr.occupancy(117, 2336, 4) == (4, "registers")
    assert sr.occupancy(32, 100 * 1024, 4) == (2, "shared memory")
    assert sr.occupancy(16, 0, 4)[0] == 16  # 2048 threads / 128


def test_every_assumption_names_its_source_and_the_table_prints():
    assert all(x.source and x.unit for x in sr.ASSUMPTIONS.values())
    for key in ("sm_count", "clock_ghz", "hbm_copy_tb_s", "l2_tb_s", "latency_short_ns", "latency_long_ns",
                "lat_alu", "lat_xu", "lat_hmma", "lat_shared", "lat_mio", "lat_l2_hit", "launch", "bt_sector_bytes"):
        assert key in sr.ASSUMPTIONS
    assert "gpu-l2-cache/h200.txt" in sr.ASSUMPTIONS["l2_tb_s"].source
    done = subprocess.run([sys.executable, "-m", "benchmarks.model.sass_model", "--assumptions"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "| `l2_tb_s` | 9.8 |" in done.stdout


def test_nvdisasm_is_found_from_the_environment_first(monkeypatch, tmp_path):
    fake = tmp_path / "nvdisasm"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("NVDISASM", str(fake))
    assert sr.find_nvdisasm() == str(fake)


def test_the_default_set_is_every_arm_of_the_three_shapes():
    chosen = sr.select([], sr.DEFAULT_SHAPES, sr.DEFAULT_KV, sr.DEFAULT_Q)
    arms = {(v.arm, shape) for v, shape in chosen}
    assert len(chosen) == 28 and {v.kv_dtype for v, _ in chosen} == {"bf16", "fp8"}
    assert {v.impl for v, _ in chosen} == {"mma", "simt"} and all(v.row_tiles == 1 for v, _ in chosen)
    assert ("gqa_packed", (24, 4, 256)) in arms and ("gqa_packed", (32, 8, 128)) not in arms
    assert all((family, shape) in arms for family in ("unpacked", "splitk") for shape in sr.DEFAULT_SHAPES)


# -------------------------------------------------------------------------------------
# The real kernels
# -------------------------------------------------------------------------------------

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (cupy) is not installed")
NVDISASM = sr.find_nvdisasm()
needs_nvdisasm = pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)")


@functools.lru_cache(maxsize=None)
def sm90_facts(spec):
    """The sm_90 report facts of ``spec``, built once for the tests of this file that read them."""
    return sr.analyse(spec, "sm_90", NVDISASM, build=nvrtc_build(spec, "sm_90"))


def nvrtc_build(spec, arch: str):
    """``(cubin, ptxas -v log)`` of ``spec`` for ``arch`` through the backend's own NVRTC path, as
    the report compiles it."""
    from metrale_attn.backends.cupy_backend import nvrtc_compile

    return nvrtc_compile(spec, arch, ptxas_verbose=True)


@needs_nvdisasm
@pytest.mark.parametrize("spec", [KernelSpec("unpacked", 64, "fp16", "bf16", "simt"),
                                     KernelSpec("splitk", 128, "bf16", "fp8", "simt"),
                                     KernelSpec("unpacked", 256, "bf16", "fp16", "simt"),
                                     KernelSpec("gqa_packed", 256, "bf16", "bf16", "simt"),
                                     KernelSpec("gqa_packed", 256, "fp16", "fp8", "simt"),
                                     KernelSpec("unpacked", 64, "fp16", "bf16"), KernelSpec("splitk", 128, "bf16", "fp8"),
                                     KernelSpec("gqa_packed", 256, "fp16", "fp8")], ids=lambda v: v.name)
def test_the_loop_the_report_finds_loads_the_bytes_the_source_declares(spec):
    facts = sm90_facts(spec)
    assert facts.hot is not None
    assert facts.warp_iters_per_sass_iter == 1
    assert facts.sass_kv_bytes_per_iter == hot_loop(spec).kv_bytes_per_warp_iter
    vector_loads = [i for i in facts.hot.instrs if sr.global_load_bytes(i) and sr._width_bytes(i) >= 8]
    if spec.impl == "simt":  # every K and V load of the tile is on the path: 2 per UNROLL step
        assert len(vector_loads) == 2 * 4
    else:  # one 16-byte cp.async per lane per K and per V row chunk of the stage
        row_bytes = spec.head_dim * (1 if spec.kv_dtype == "fp8" else 2)
        assert [i.base for i in vector_loads] == ["LDGSTS"] * (2 * spec.tiling.tile_tokens * row_bytes // 16 // 32)


@pytest.mark.slow  # ~7 s on two cores: .ci/run's slow step runs it
@needs_nvdisasm
def test_the_report_on_one_variant_writes_the_interface(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.model.sass_model", "--json", str(out), "--arch", "sm_90",
         "--specs", "simt_decode_unpacked_qbf16_kvbf16_hd128", "--shapes", "32/8/128", "--calls", "none"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "NVDISASM": NVDISASM})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "NOT measured" in done.stdout and "| unpacked | 32/8/128 | bf16 | sm_90 | 1 |" in done.stdout
    report = json.loads(out.read_text())
    assert report["format"] == "sass_model/2" and report["modelled"] and report["calls"] == []
    assert set(report["smem_fit"]) >= {"sm_90", "sm_120"} and "lat_hmma" in report["assumptions"]
    (r,) = report["rows"]
    for key in ("arm", "q_heads", "kv_heads", "head_dim", "q_dtype", "kv_dtype", "arch", "heads_per_cta",
                "instr_per_kib", "kib_in_flight_per_sm", "registers", "spill_bytes", "ceiling_pct", "binding", "mix"):
        assert key in r, key
    assert (r["arm"], r["q_heads"], r["kv_heads"], r["head_dim"], r["q_dtype"], r["kv_dtype"], r["arch"],
            r["heads_per_cta"]) == ("unpacked", 32, 8, 128, "bf16", "bf16", "sm_90", 1)
    assert r["loop_found"] and r["loop_bytes_match"]
    # Sane numbers: 50-400 instructions per KiB a CTA reads, times the 4 CTAs of a group.
    assert 50 < r["instr_per_kib_per_cta"] < 400
    assert r["instr_per_kib"] == pytest.approx(4 * r["instr_per_kib_per_cta"])
    assert sum(r["mix"].values()) == r["loop"]["hot_path_instructions"]
    assert r["mix"]["ldg"] >= 8 and r["mix"]["fp32"] > 0 and r["mix"]["shfl"] > 0
    cubin_bytes, log = nvrtc_build(KernelSpec("unpacked", 128, "bf16", "bf16", "simt"), "sm_90")
    assert r["registers"] == sr.ptxas_resources(log, "simt_decode_unpacked")["registers"]
    assert r["registers"] == cubin.kernel_register_counts(cubin_bytes)["simt_decode_unpacked"]
    assert r["spill_bytes"] == 0 and r["stack_frame_bytes"] == 0
    assert 1 <= r["ctas_per_sm"] <= 16 and r["warps_per_sm"] == 4 * r["ctas_per_sm"]
    assert 1 < r["kib_in_flight_per_sm"] < 200 and r["memory_waits_per_iter"] >= 1
    assert 0 < r["ceiling_pct"] <= 100 and r["binding"] in r["ceilings"]
    assert r["ceiling_pct"] == min(r["ceilings"].values())
    assert r["ceilings"]["l2"] == pytest.approx(100 * 9.8 / 4.3 / 4)
    # the per-tile chain: plain loads, so the chain waits for DRAM; no lane-divergent block left out
    assert r["loop"]["hot_path_instructions"] >= r["loop"]["fewest_path_instructions"]
    assert r["chain_cycles_per_tile"] > r["issue_cycles_per_tile"] and r["chain_stalls_per_tile"]["memory"] > 0
    assert r["launch_bounds"] == [128, 4] and r["warps_per_scheduler"] == r["ctas_per_sm"]


def _copy_batches(instrs) -> list[int]:
    """The K/V copies (16-byte cp.async) of a hot loop in groups that no executed shared
    load separates: one group per batch of row offsets (or entries) a lane reads at once."""
    groups, open_group = [], 0
    for ins in instrs:
        if never_executes(ins):
            continue
        if ins.base == "LDGSTS" and _width_bytes(ins) == 16:
            open_group += 1
        elif ins.base == "LDS" and open_group:
            groups.append(open_group)
            open_group = 0
    return groups + ([open_group] if open_group else [])


@needs_nvdisasm
@pytest.mark.parametrize("spec, rows_per_lane", [
    (KernelSpec("splitk", 256, "bf16", "bf16"), 8),  # 6 warps, the offsets table: 16 lanes a row, 16 tokens
    (KernelSpec("splitk", 128, "bf16", "fp8"), 4),   # 8 warps, the offsets table: 4 lanes a row, 32 tokens
    (KernelSpec("splitk", 128, "bf16", "bf16"), 4),  # 8 warps, each lane's own entries (PD_LANE_OFFSETS)
], ids=lambda v: getattr(v, "name", str(v)))
def test_a_lane_reads_its_rows_offsets_in_batches_of_eight_before_it_issues_their_copies(spec, rows_per_lane):
    # One register quad reused row after row made every copy wait a shared-memory round trip
    # for its own row's offsets: a group of copies per row. Now one group per 8 rows.
    facts = sm90_facts(spec)
    groups = _copy_batches(facts.hot.instrs)
    assert sum(groups) == 2 * 2 * rows_per_lane  # K and V, two chunks of each row
    assert len(groups) <= max(1, rows_per_lane // 8), groups


@needs_nvdisasm
@pytest.mark.parametrize("spec, rows_per_lane, loads", [
    (KernelSpec("splitk", 128, "bf16", "fp8"), 4, "LDS.128"),  # a row's (K, V) offsets from the table
    (KernelSpec("splitk", 128, "bf16", "bf16"), 4, "LDS"),     # a row's staged block-table entry
], ids=lambda v: getattr(v, "name", str(v)))
def test_a_lane_copies_two_adjacent_chunks_of_each_row_and_reads_its_address_once(spec, rows_per_lane, loads):
    # CH = 2: a row's address is read (and formed) once for two copies, the second 16 bytes
    # on both sides as immediates; with one chunk a lane it copied twice the rows
    facts = sm90_facts(spec)
    executed = [i for i in facts.hot.instrs if not never_executes(i)]
    assert sum(1 for i in executed if i.opcode == loads) == rows_per_lane
    copies = [i for i in executed if i.base == "LDGSTS" and _width_bytes(i) == 16]
    assert sum(1 for i in copies if i.operands.rstrip().split(",")[1].strip().endswith(".64+0x10]")) == len(copies) // 2


@needs_nvdisasm
@pytest.mark.parametrize("spec", [KernelSpec("splitk", 256, "bf16", "bf16"), KernelSpec("splitk", 128, "bf16", "fp8"),
                                  KernelSpec("splitk", 128, "bf16", "bf16")], ids=lambda v: v.name)
def test_a_lanes_copies_of_a_tile_share_one_destination_register_and_their_offsets_are_immediates(spec):
    # pd_cp_async_cg_16_at: each row's destination was a register of its own, two adds apart
    facts = sm90_facts(spec)
    copies = [i for i in facts.hot.instrs if i.base == "LDGSTS" and _width_bytes(i) == 16 and not never_executes(i)]
    bases = {re.match(r"\[(R\d+)", i.operands).group(1) for i in copies}
    assert len(bases) == 1, [i.operands for i in copies]
    assert len({i.operands.split("]")[0] for i in copies}) == len(copies)  # every row and K/V its own offset


@pytest.mark.slow  # four builds, ~7 s on two cores: .ci/run's slow step runs it
@needs_nvdisasm
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_at_eight_warps_q_is_read_from_shared_memory_once_an_item_not_once_a_tile(kv_dtype):
    # hd128 at 8 rows: q's B operands are 16 registers a thread (Q_IN_REGS); the 4-warp tiling
    # of a 99 KiB target reads them in the loop, one ldmatrix.x4 per 32 dims
    eight = KernelSpec("splitk", 128, "bf16", kv_dtype)
    four = KernelSpec("splitk", 128, "bf16", kv_dtype, smem_limit=101376)
    assert (eight.tiling.warps, four.tiling.warps) == (8, 4)

    def ldmatrix(spec):
        return sum(1 for i in sm90_facts(spec).hot.instrs if i.base == "LDSM" and not never_executes(i))

    assert ldmatrix(four) - ldmatrix(eight) == 128 // 32
