"""The static SASS model's assumption table: every clock, rate, latency, limit and cap the
model uses (``sass``, ``warp_chain``, ``call_model``, ``sass_model``), each with its source.
EVERY VALUE IS AN ASSUMPTION about an H200 SXM (sm_90); none was measured by this project's
model, and a GPU session that measures one should replace it here, with the date.

``python -m benchmarks.model.sass_model --assumptions`` prints the table. Latencies are in SM
clock cycles unless the unit says ns; an ns value becomes cycles at ``clock_ghz``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Assumption:
    value: float
    unit: str
    source: str


_GUIDE_THROUGHPUT = ("CUDA C++ Programming Guide, 'Arithmetic Instructions', table 'Throughput of Native "
                     "Arithmetic Instructions', compute capability 9.0")
_GUIDE_LIMITS = "CUDA C++ Programming Guide, 'Technical Specifications per Compute Capability', 9.0"
_ACCEL_SIM = ("Accel-Sim's H100 configuration (accel-sim/gpgpu-sim_distribution, "
              "configs/tested-cfgs/SM90_H100/gpgpusim.config")
_GPU_BENCHES_LAT = ("gpu-benches (te42kyfo/gpu-benches) gpu-latency/h100_pcie.txt: pointer chase on an H100 PCIe "
                    "at 1755 MHz")

ASSUMPTIONS: dict[str, Assumption] = {
    # -- the chip -------------------------------------------------------------------------
    "sm_count": Assumption(132, "SMs", "H200 SXM datasheet (the H100 SXM5 die, 132 SMs); KINDS.md: PyTorch "
                           "reported 132 multiprocessors on this workplace's H200; metrale_attn.targets 'hopper'"),
    "clock_ghz": Assumption(1.98, "GHz", "H100/H200 SXM maximum boost clock 1980 MHz (NVIDIA datasheet); "
                            "KINDS.md read 1980 MHz on the H200 under load (2026-10-28)"),
    "hbm_copy_tb_s": Assumption(4.3, "TB/s", "device-to-device copy, bytes read + written, measured on this "
                                "workplace's H200 (KINDS.md, 2026-10-28 and 2026-11-04); datasheet peak 4.8. "
                                "The call model caps the HBM bytes a call reads at this rate"),
    "l2_tb_s": Assumption(9.8, "TB/s", "gpu-benches (te42kyfo/gpu-benches) gpu-l2-cache/h200.txt: 9.7-9.9 TB/s "
                          "for 13-34 MB data sets that stay in L2"),
    "latency_short_ns": Assumption(500, "ns", "DRAM load latency, lightly loaded: gpu-benches gpu-latency/"
                                   "h100_pcie.txt reads ~650 cycles at 1.755 GHz (~370 ns) unloaded; plus queueing"),
    "latency_long_ns": Assumption(800, "ns", "DRAM load latency near the bandwidth limit (docs/architecture.md's "
                                  "~800 ns; loaded latency is not in the public benches: to be measured)"),
    # -- issue and pipes (per SM; a sub-partition has a quarter of each) --------------------
    "issue_per_clk": Assumption(4, "warp instr/clk/SM", "4 SM sub-partitions (warp schedulers), one warp "
                                "instruction each per clock (CUDA C++ Programming Guide, 'Hardware "
                                "Multithreading'; NVIDIA H100 Tensor Core GPU Architecture whitepaper)"),
    "fma_lanes": Assumption(128, "lanes/clk/SM", "32-bit fp add/multiply/fma: 128 results per clock "
                            f"({_GUIDE_THROUGHPUT}); IMAD and fp16x2 math issue to the same FMA pipe (Nsight "
                            "Compute pipe 'fma')"),
    "imad_lanes": Assumption(64, "lanes/clk/SM", f"32-bit integer multiply/multiply-add: 64 ({_GUIDE_THROUGHPUT}); "
                             "only the FMA pipe's heavy half runs IMAD (Nsight Compute 'fmaheavy')"),
    "alu_lanes": Assumption(64, "lanes/clk/SM", f"32-bit integer add, shift, compare/min/max, bitwise: 64 "
                            f"({_GUIDE_THROUGHPUT}); float compare/select/min-max, moves and F2FP (packed "
                            "fp32->16-bit, and the fp8->f16x2 unpack) assumed on the same ALU pipe (Nsight "
                            "Compute pipe 'alu'; the F2FP placement is not documented)"),
    "xu_lanes": Assumption(16, "lanes/clk/SM", f"MUFU (rcp, rsqrt, log2, exp2, sin, cos): 16; 'all other type "
                           f"conversions': 16; popc/clz: 16 ({_GUIDE_THROUGHPUT}); one shared XU pipe (Nsight "
                           "Compute pipe 'xu': transcendentals and conversions)"),
    "shfl_lanes": Assumption(32, "lanes/clk/SM", f"warp shuffle: 32 ({_GUIDE_THROUGHPUT})"),
    "hmma_fma_per_clk": Assumption(1024, "bf16 FMA/clk/SM", "mma.sync (HMMA): half the dense wgmma peak; a lead, "
                                   "not a measurement (Luo et al., 'Dissecting the NVIDIA Hopper Architecture "
                                   "through Microbenchmarking', arXiv:2501.12084, find mma.sync well below wgmma); "
                                   f"the same 8 cycles per HMMA.16816 per sub-partition as {_ACCEL_SIM}: "
                                   "-ptx_opcode_initiation_tensor 8)"),
    "gmma_fma_per_clk": Assumption(2048, "bf16 FMA/clk/SM", "wgmma (HGMMA): dense bf16 989 TFLOP/s over 132 SMs "
                                   "at 1.83 GHz (H100/H200 SXM datasheet)"),
    "shared_bytes_per_clk": Assumption(128, "B/clk/SM", "32 banks x 4 bytes per clock (CUDA C++ Programming "
                                       "Guide, 'Shared Memory', compute capability 9.0)"),
    # -- latencies of one warp's instructions (the per-tile chain, warp_chain.py) ------------
    "lat_alu": Assumption(4, "cycles", "fixed-latency ALU and FMA pipes (integer, fp32, moves, selects, F2FP): "
                          f"{_ACCEL_SIM}: -ptx_opcode_latency_int 4 and -ptx_opcode_latency_fp 4)"),
    "lat_xu": Assumption(23, "cycles", "MUFU and conversions on the XU pipe: "
                         f"{_ACCEL_SIM}: -ptx_opcode_latency_sfu 23)"),
    "lat_hmma": Assumption(24, "cycles", f"HMMA (mma.sync) result latency: {_ACCEL_SIM}: -ptx_opcode_latency_tesnor "
                           "24); a dependent accumulate waits this long. Not measured on Hopper by this project "
                           "(an sm_120 SASS study, florianmattana/sass-king pull request 32, times a chained ldmatrix "
                           "at ~33 cycles and calls it comparable to an MMA: --hmma-latency 33 shows that "
                           "sensitivity)"),
    "lat_shared": Assumption(29, "cycles", "LDS / LDSM (ldmatrix) result latency: "
                             f"{_ACCEL_SIM}: -gpgpu_smem_latency 29)"),
    "lat_mio": Assumption(29, "cycles", "SHFL, MOVM (movmatrix), S2R and LDC: variable-latency instructions served "
                          "by the same MIO path as shared memory, taken at lat_shared (an assumption: no public "
                          "per-instruction figure for sm_90)"),
    "lat_l2_hit": Assumption(370, "cycles", f"an L2 hit: {_GPU_BENCHES_LAT} reads ~265 cycles for the near L2 "
                             "partition and ~475 for the far one; their mean, cycles taken as clock-invariant"),
    "bar_sync": Assumption(20, "cycles", "a __syncthreads whose warps have all arrived (an assumption of the order "
                           "of one shared-memory access; unmeasured)"),
    "launch": Assumption(3000, "cycles", f"one kernel's start in a stream (graph replay) or after the kernel before "
                         f"it: {_ACCEL_SIM}: -gpgpu_kernel_launch_latency 3000), 1.5 us at 1.98 GHz"),
    "pdl_wait": Assumption(1000, "cycles", "programmatic dependent launch: from the attention grid's end to "
                           "griddepcontrol.wait returning in the merge's resident CTAs (the grid's completion and "
                           "memory flush signalled to the dependent), 0.5 us at 1.98 GHz. An assumption, not measured: "
                           "taken as a third of the launch gap it replaces; the GPU check times the merge both ways "
                           "(METRALE_ATTN_DECODE_PDL)"),
    "bt_sector_bytes": Assumption(32, "bytes", "an L2 sector: the first read of a 32-byte sector of the block table "
                                  "in a call misses to DRAM (the benchmark flushes L2 before every timed call, "
                                  "metrale_attn/check/timing.py); the warps of one CTA and the CTAs of the other KV heads "
                                  "reading the same sector at the same time all wait for that miss"),
    "prologue_spread": Assumption(1.0, "x half the DRAM latency range", "a CTA's prologue round trips take the DRAM "
                                  "latency of the moment plus up to +-(this x half the latency_short_ns to "
                                  "latency_long_ns range), +-150 ns (a fixed sequence over the CTAs): an assumption "
                                  "standing in for the variation that keeps co-resident CTAs out of lockstep on a real "
                                  "GPU; the report also gives every call without it (lockstep)"),
    "rare_path_probability": Assumption(0.0, "per iteration", "a data-dependent detour (the simt fp8/fp16 inf/NaN "
                                        "fix-ups) is taken with this probability: a KV cache holds no inf or NaN "
                                        "in normal serving"),
    # -- occupancy ---------------------------------------------------------------------------
    "regs_per_sm": Assumption(65536, "32-bit registers", _GUIDE_LIMITS),
    "reg_alloc_unit": Assumption(256, "registers per warp", "register allocation granularity per warp, each of "
                                 "the 4 sub-partitions holding a quarter of the file (CUDA Occupancy "
                                 "Calculator; Nsight Compute launch statistics)"),
    "max_threads_per_sm": Assumption(2048, "threads", _GUIDE_LIMITS),
    "max_warps_per_sm": Assumption(64, "warps", _GUIDE_LIMITS),
    "max_ctas_per_sm": Assumption(32, "CTAs", _GUIDE_LIMITS),
    "smem_per_sm": Assumption(233472, "bytes", f"228 KiB of shared memory per SM ({_GUIDE_LIMITS}); the "
                              "largest carveout is assumed"),
    "smem_reserved_per_cta": Assumption(1024, "bytes", "1 KiB reserved per CTA by the system "
                                        "(cudaDevAttrReservedSharedMemoryPerBlock on sm_80 and later)"),
    "smem_alloc_unit": Assumption(128, "bytes", "shared-memory allocation granularity (CUDA Occupancy Calculator)"),
    "smem_per_block_sm120": Assumption(101376, "bytes", "sm_120 (RTX 5090, RTX PRO 6000), which metrale_attn.targets "
                                       "does not list: 99 KiB per block, as its gb10 (sm_121) row (CUDA C++ "
                                       "Programming Guide, 'Technical Specifications per Compute Capability', 12.x)"),
}
"""One table for the whole model (H200, sm_90). ``--arch sm_100`` reports real sm_100 SASS,
registers and occupancy, but its ceilings still use this H200 table."""


def a(name: str) -> float:
    """The value of assumption ``name``."""
    return ASSUMPTIONS[name].value


def cycles_of_ns(ns: float) -> float:
    """Nanoseconds as SM clock cycles at ``clock_ghz``."""
    return ns * a("clock_ghz")


def assumptions_markdown() -> str:
    lines = ["| assumption | value | unit | source |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {x.value:g} | {x.unit} | {x.source} |" for k, x in ASSUMPTIONS.items()]
    return "\n".join(lines) + "\n"
