"""benchmarks/model/sass.py's steady-state tile and benchmarks/model/warp_chain.py's per-tile chain, on
small hand-written SASS listings whose answers are worked out in the comments (no GPU, no
compiler)."""

from __future__ import annotations

import pytest

from benchmarks.model import sass
from benchmarks.model import warp_chain as wc
from benchmarks.model.model_assumptions import a


def listing(body: str, name: str = "toy") -> tuple[list[sass.Instr], dict[str, int]]:
    lines = [f"        .section        .text.{name},\"ax\",@progbits", f"{name}:"]
    addr = 0
    for line in body.strip().splitlines():
        line = line.strip()
        if line.endswith(":"):
            lines.append(line)
        else:
            lines.append(f"        /*{addr:04x}*/                   {line} ;")
            addr += 16
    (_, (instrs, labels)), = sass.parse_functions("\n".join(lines)).items()
    return instrs, labels


def loop_ops(body: str) -> list[wc.Op]:
    """The scoreboard's ops of a one-block loop (every instruction but the ``EXIT`` after it)."""
    instrs, _ = listing(body)
    return wc.ops_of([i for i in instrs if i.base != "EXIT"])


LAT = wc.Latencies.of(mem=1000.0, bt=a("lat_l2_hit"))


# -------------------------------------------------------------------------------------
# Which blocks a tile counts
# -------------------------------------------------------------------------------------

DIVERGENT = """
S2R R0, SR_TID.X
LOP3.LUT R1, R0, 0x1f, RZ, 0xc0, !PT
SHF.R.U32.HI R5, RZ, 0x5, R0
IMAD.WIDE R2, R1, 0x10, R6
ISETP.GT.U32.AND P1, PT, R1, 0xf, PT
ISETP.GE.AND P2, PT, R5, 0x2, PT
.L_x_loop:
LDG.E.128 R8, desc[UR4][R2.64]
@P1 BRA `(.L_x_skip1)
IADD3 R20, R20, 0x1, RZ
IADD3 R20, R20, 0x1, RZ
IADD3 R20, R20, 0x1, RZ
.L_x_skip1:
@P2 BRA `(.L_x_skip2)
IADD3 R21, R21, 0x1, RZ
IADD3 R21, R21, 0x1, RZ
IADD3 R21, R21, 0x1, RZ
IADD3 R21, R21, 0x1, RZ
IADD3 R21, R21, 0x1, RZ
.L_x_skip2:
FSETP.GT.AND P3, PT, R8, R9, PT
@!P3 BRA `(.L_x_skip3)
FMUL R8, R8, 0.5
FMUL R8, R8, 0.5
FMUL R8, R8, 0.5
FMUL R8, R8, 0.5
.L_x_skip3:
ISETP.GE.AND P0, PT, R22, 0x10, PT
@!P0 BRA `(.L_x_loop)
EXIT
"""


def test_a_tile_counts_both_sides_of_a_lane_divergent_branch_one_side_of_a_uniform_one_and_no_rare_detour():
    instrs, labels = listing(DIVERGENT)
    hot = sass.find_hot_path(instrs, labels)
    # lane < 16 (from threadIdx.x & 31): lane-divergent; warp >= 2 (threadIdx.x >> 5): uniform; a
    # comparison of loaded values at a per-lane address: data-dependent.
    assert sorted(hot.branch_kinds.values()) == ["data", "lane", "uniform", "uniform"]
    ops = [i.opcode for i in hot.instrs]
    # LDG + BRA + 3 IADD3 (the divergent side, counted) + BRA (the uniform side skipped: its 5
    # IADD3 are not) + FSETP + BRA (the 4 FMUL of the rare side not) + ISETP + BRA = 10
    assert len(hot.instrs) == 10 and ops.count("IADD3") == 3 and "FMUL" not in ops
    assert hot.rare_instructions == 4 and hot.rare_blocks
    # the path the report counted before: the fewest instructions, so the divergent side left out
    assert hot.fewest_path_instructions == 7


def test_the_lane_flags_make_tid_shifted_by_the_warp_size_uniform_and_loads_at_lane_addresses_data():
    instrs, _ = listing("S2R R0, SR_TID.X\nSHF.R.U32.HI R5, RZ, 0x5, R0\nLOP3.LUT R1, R0, 0x1f, RZ, 0xc0, !PT\n"
                        "LDS.128 R8, [R1]\nLDS R12, [R5]\nLDSM.16.M88.4 R16, [R5]")
    state: dict[str, int] = {}
    for ins in instrs:
        acc = sass.access(ins)
        for d in acc.dst:
            state[d] = sass.value_flags(ins, acc, state)
    assert state["R0"] == sass.TID and state["R5"] == 0 and state["R1"] == sass.LANE
    assert state["R8"] == sass.LANE | sass.DATA and state["R12"] == 0  # a uniform address: a broadcast
    assert state["R16"] == sass.LANE | sass.DATA  # ldmatrix hands each lane its own elements


def test_access_reads_fragments_predicates_and_wide_operands():
    acc = sass.access(sass.Instr(0, None, "HMMA.16816.F32.BF16", "R36, R32, R30, R36"))
    assert acc.dst == ("R36", "R37", "R38", "R39")
    assert acc.src == ("R32", "R33", "R34", "R35", "R30", "R31", "R36", "R37", "R38", "R39")
    assert sass.access(sass.Instr(0, None, "ISETP.GE.U32.OR", "P0, PT, R20, R115, !P0")) == \
        sass.Access(("P0",), ("R20", "R115", "P0"))
    assert sass.access(sass.Instr(0, None, "IADD3", "R24, P1, R20, R5, RZ")).dst == ("R24", "P1")
    assert sass.access(sass.Instr(0, "@!P0", "LDG.E.CONSTANT", "R126, desc[UR10][R28.64]")) == \
        sass.Access(("R126",), ("UR10", "R28", "R29", "P0"))
    assert sass.access(sass.Instr(0, None, "IMAD.WIDE.U32", "R20, R100, R28, R20")) == \
        sass.Access(("R20", "R21"), ("R100", "R28", "R20", "R21"))
    assert sass.access(sass.Instr(0, None, "LDGSTS.E.BYPASS.128", "[R35], desc[UR10][R24.64], P0")).dst == ()


# -------------------------------------------------------------------------------------
# The chain
# -------------------------------------------------------------------------------------


def test_the_chain_of_a_dependent_ldmatrix_mma_mma_add_loop_is_the_sum_of_its_latencies():
    ops = loop_ops("""
.L_x_loop:
LDSM.16.M88.4 R4, [R12]
HMMA.16816.F32.BF16 R16, R4, R6, RZ
HMMA.16816.F32.BF16 R16, R4, R6, R16
FADD R12, R16, R17
@P0 BRA `(.L_x_loop)
EXIT
""")
    chain = wc.simulate(ops, LAT)
    # LDSM (29) -> HMMA (24) -> HMMA (24) -> FADD (4) -> the next LDSM's address: the BRA issues in
    # the FADD's shadow, so one iteration is exactly the sum of the four latencies.
    expected = a("lat_shared") + 2 * a("lat_hmma") + a("lat_alu")
    assert chain.cycles == pytest.approx(expected)
    assert chain.issued == 5 and chain.issue_bound == pytest.approx(2 * 4 * 2048 / a("hmma_fma_per_clk"))
    # what the warp waited for: the ldmatrix once, each HMMA's result once, the add once
    assert chain.stalls["shared"] == pytest.approx(a("lat_shared") - 1)
    assert chain.stalls["hmma"] == pytest.approx(2 * (a("lat_hmma") - 1))
    # with W warps per scheduler: max(chain, W x issue)
    assert chain.per_warp_tile_cycles(1) == pytest.approx(expected)
    assert chain.per_warp_tile_cycles(8) == pytest.approx(8 * chain.issue_bound)


RING = """
.L_x_loop:
DEPBAR.LE SB0, 0x1
LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64]
LDGDEPBAR
IADD3 R10, R10, 0x1, RZ
IADD3 R10, R10, 0x1, RZ
IADD3 R10, R10, 0x1, RZ
@P0 BRA `(.L_x_loop)
EXIT
"""


def test_a_three_stage_ring_hides_the_memory_latency_until_two_tiles_are_shorter_than_it():
    ops = loop_ops(RING)
    # the adds: the first waits for the last of the previous iteration, which is 4 cycles but 4
    # issue slots (BRA, DEPBAR, LDGSTS, LDGDEPBAR) back: 4 + 4 + 5 cycles an iteration
    compute = 2 * a("lat_alu") + 5
    fast = wc.simulate(ops, wc.Latencies.of(mem=10.0, bt=0.0))
    assert fast.cycles == pytest.approx(compute) and "memory" not in fast.stalls
    # with S = 3 stages two tiles are in flight: a latency of 1000 cycles (from the copy's issue,
    # one cycle after the wait) costs (1000 + 1) / 2 a tile
    slow = wc.simulate(ops, wc.Latencies.of(mem=1000.0, bt=0.0))
    assert slow.cycles == pytest.approx(1001 / 2) and slow.stalls["memory"] > 0


def test_a_block_table_entry_loaded_one_tile_ahead_stalls_the_next_tile_by_what_its_latency_exceeds():
    ops = loop_ops("""
.L_x_loop:
IMAD.WIDE.U32 R20, R126, 0x100, RZ
LDG.E.CONSTANT R126, desc[UR4][R28.64]
IADD3 R10, R10, 0x1, RZ
IADD3 R10, R10, 0x1, RZ
@P0 BRA `(.L_x_loop)
EXIT
""")
    assert wc.prefetch_distance(ops) == 4  # the LDG, then 3 more, then the next iteration's IMAD
    hit = wc.simulate(ops, wc.Latencies.of(mem=1000.0, bt=4.0))
    miss = wc.simulate(ops, wc.Latencies.of(mem=1000.0, bt=1000.0))
    # the next IMAD waits the whole latency for the entry, and the LDG issues one cycle after it
    assert miss.cycles == pytest.approx(1000.0 + 1) and miss.stalls["block_table"] > 0
    assert hit.cycles < 20
    shared, n = wc.block_table_in_shared(ops)
    assert n == 1 and wc.simulate(shared, wc.Latencies.of(mem=1000.0, bt=1000.0)).cycles == \
        pytest.approx(a("lat_shared") + 1)


def test_the_moves_of_an_ldmatrix_fragment_are_dropped_with_their_readers_renamed():
    ops = loop_ops("""
.L_x_loop:
LDSM.16.M88.4 R4, [R12]
MOV R20, R4
IMAD.MOV.U32 R21, RZ, RZ, R6
IMAD.MOV.U32 R22, RZ, RZ, R5
MOV R23, R7
HMMA.16816.F32.BF16 R16, R20, R30, R16
@P0 BRA `(.L_x_loop)
EXIT
""")
    assert wc.fragment_move_indices(ops) == {1, 2, 3, 4}
    fewer, removed = wc.without_fragment_moves(ops)
    assert removed == 4 and len(fewer) == len(ops) - 4
    hmma = next(op for op in fewer if op.opcode.startswith("HMMA"))
    assert set(hmma.src) >= {"R4", "R6", "R5", "R7"} and not set(hmma.src) & {"R20", "R21", "R22", "R23"}
    # the HMMA now waits for the ldmatrix alone, not the ldmatrix and a move
    assert wc.simulate(fewer, LAT).issued == wc.simulate(ops, LAT).issued - 4


def test_two_accumulator_chains_halve_a_chain_of_dependent_mmas_plus_one_add():
    body = ".L_x_loop:\nHMMA.16816.F32.BF16 R16, R4, R6, RZ\n" + \
        "HMMA.16816.F32.BF16 R16, R4, R6, R16\n" * 7 + "FADD R12, R16, R17\n@P0 BRA `(.L_x_loop)\nEXIT"
    ops = loop_ops(body)
    one = wc.simulate(ops, LAT)
    # 8 dependent HMMAs, the add waiting for the last, the branch; the next iteration's first HMMA
    # needs nothing of this one
    assert one.cycles == pytest.approx(8 * a("lat_hmma") + 2)
    split, n = wc.split_accumulator_chains(ops, 2)
    assert n == 1 and sum(op.opcode == "FADD" for op in split) == 1 + 4  # the loop's add and 4 to sum
    two = wc.simulate(split, LAT)
    assert two.cycles < one.cycles * 0.75
    hmmas = [op for op in split if op.opcode.startswith("HMMA")]
    assert hmmas[0].acc == () and hmmas[1].acc == () and hmmas[2].acc == hmmas[0].dst  # two chains, interleaved
