"""Static SASS report: what each kernel spec's steady-state loop costs, and the
share of the H200's copy bandwidth that cost leaves room for. EVERY FIGURE IS MODELLED
from the compiler's output and the assumption table below; nothing here is measured.

For each spec and model shape the report

1. compiles the spec with the backend's own NVRTC path
   (``cupy_backend.nvrtc_compile``, ptxas ``-v``) and disassembles the cubin with
   ``nvdisasm`` (PyPI ``nvidia-cuda-nvdisasm``; see ``find_nvdisasm``);
2. finds the hot loop from the control-flow graph: basic blocks from labels and
   branches, dominators, back edges, natural loops; the innermost loop that holds
   global loads (K/V) is the hot loop. Its steady-state iteration is the path from
   the loop header to a latch that executes every block holding a global load
   (steady state: all tokens valid) and, among those, the fewest instructions: it
   skips what a converged warp never runs (``BRA.DIV`` fallbacks) and rare detours
   (the fp8/fp16 inf/NaN fix-ups);
3. counts that path's warp instructions per KiB of UNIQUE K/V (the K+V bytes of one KV
   head counted once: ``G / heads_per_cta`` CTAs read each row, so a CTA's count is
   multiplied by that), its instruction mix and the cost on each pipe;
4. reads registers, spills and stack frame from ptxas's ``-v`` log, shared memory
   (static from ptxas, dynamic from the spec), and computes CTAs and warps per SM;
5. models the loads in flight: plain loads are in flight from issue to the first
   instruction that touches their destination registers (the scoreboard wait); the
   bytes outstanding at those waits, per SM at that occupancy, go into Little's law.
   A spec that declares a ``cp.async``/TMA ring (``HotLoop.pipeline_stages``,
   ``stage_bytes``) has ``(stages - 1) * stage_bytes`` per CTA in flight instead;
6. turns each resource into a ceiling in % of the copy bandwidth: issue, every pipe,
   shared-memory bandwidth, L2 bandwidth shared by the CTAs that read each row, and
   bytes in flight at two latencies. The lowest is ``ceiling_pct``, its name ``binding``.

What the model needs beyond the SASS is a spec's ``HotLoop`` (``hot_loop.py``, computed
from the spec's public fields and source text): the kernel holding the loop, heads per
CTA, warps per CTA, tokens and K+V bytes one warp iteration consumes, pipeline stages and
stage bytes, dynamic shared memory.

Usage: ``python -m benchmarks.sass_model [--json PATH] [--arch sm_90 [sm_100]]
[--specs NAME_OR_ARM ...] [--shapes 32/8/128 ...] [--kv-dtypes bf16 fp8]``.
The markdown table goes to stdout; ``--json`` writes the rows (a list of dicts).
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from metrale_attn import dtypes
from metrale_attn.kernels import KernelSpec, all_specs
from metrale_attn.config import max_rows_per_cta

from .hot_loop import hot_loop

# ======================================================================================
# THE ASSUMPTIONS: every number the model uses, with its source. H200 SXM, sm_90.
# ======================================================================================


@dataclass(frozen=True)
class Assumption:
    value: float
    unit: str
    source: str


_GUIDE_THROUGHPUT = ("CUDA C++ Programming Guide, 'Arithmetic Instructions', table 'Throughput of Native "
                     "Arithmetic Instructions', compute capability 9.0")
_GUIDE_LIMITS = "CUDA C++ Programming Guide, 'Technical Specifications per Compute Capability', 9.0"

ASSUMPTIONS: dict[str, Assumption] = {
    "sm_count": Assumption(132, "SMs", "H200 SXM datasheet (the H100 SXM5 die, 132 SMs); KINDS.md: PyTorch "
                           "reported 132 multiprocessors on this workplace's H200; metrale_attn.targets 'hopper'"),
    "clock_ghz": Assumption(1.98, "GHz", "H100/H200 SXM maximum boost clock 1980 MHz (NVIDIA datasheet); "
                            "KINDS.md read 1980 MHz on the H200 under load (2026-10-28)"),
    "hbm_copy_tb_s": Assumption(4.3, "TB/s", "device-to-device copy, bytes read + written, measured on this "
                                "workplace's H200 (KINDS.md, 2026-10-28 and 2026-11-04); datasheet peak 4.8"),
    "l2_tb_s": Assumption(9.8, "TB/s", "gpu-benches (te42kyfo/gpu-benches) gpu-l2-cache/h200.txt: 9.7-9.9 TB/s "
                          "for 13-34 MB data sets that stay in L2"),
    "latency_short_ns": Assumption(500, "ns", "DRAM load latency, lightly loaded: gpu-benches gpu-latency/"
                                   "h100_pcie.txt reads ~650 cycles at 1.755 GHz (~370 ns) unloaded; plus queueing"),
    "latency_long_ns": Assumption(800, "ns", "DRAM load latency near the bandwidth limit (docs/architecture.md's "
                                  "~800 ns; loaded latency is not in the public benches: to be measured)"),
    "issue_per_clk": Assumption(4, "warp instr/clk/SM", "4 SM sub-partitions (warp schedulers), one warp "
                                "instruction each per clock (CUDA C++ Programming Guide, 'Hardware "
                                "Multithreading'; NVIDIA H100 Tensor Core GPU Architecture whitepaper)"),
    "fma_lanes": Assumption(128, "lanes/clk/SM", f"32-bit fp add/multiply/fma: 128 results per clock ({_GUIDE_THROUGHPUT}); "
                            "IMAD and fp16x2 math issue to the same FMA pipe (Nsight Compute pipe 'fma')"),
    "imad_lanes": Assumption(64, "lanes/clk/SM", f"32-bit integer multiply/multiply-add: 64 ({_GUIDE_THROUGHPUT}); "
                             "only the FMA pipe's heavy half runs IMAD (Nsight Compute 'fmaheavy')"),
    "alu_lanes": Assumption(64, "lanes/clk/SM", f"32-bit integer add, shift, compare/min/max, bitwise: 64 "
                            f"({_GUIDE_THROUGHPUT}); float compare/select/min-max, moves and F2FP (packed "
                            "fp32->16-bit) assumed on the same ALU pipe (Nsight Compute pipe 'alu')"),
    "xu_lanes": Assumption(16, "lanes/clk/SM", f"MUFU (rcp, rsqrt, log2, exp2, sin, cos): 16; 'all other type "
                           f"conversions': 16; popc/clz: 16 ({_GUIDE_THROUGHPUT}); one shared XU pipe (Nsight "
                           "Compute pipe 'xu': transcendentals and conversions)"),
    "shfl_lanes": Assumption(32, "lanes/clk/SM", f"warp shuffle: 32 ({_GUIDE_THROUGHPUT})"),
    "hmma_fma_per_clk": Assumption(1024, "bf16 FMA/clk/SM", "mma.sync (HMMA): half the dense wgmma peak; a lead, "
                                   "not a measurement (Luo et al., 'Dissecting the NVIDIA Hopper Architecture "
                                   "through Microbenchmarking', arXiv:2501.12084, find mma.sync well below wgmma)"),
    "gmma_fma_per_clk": Assumption(2048, "bf16 FMA/clk/SM", "wgmma (HGMMA): dense bf16 989 TFLOP/s over 132 SMs "
                                   "at 1.83 GHz (H100/H200 SXM datasheet)"),
    "shared_bytes_per_clk": Assumption(128, "B/clk/SM", "32 banks x 4 bytes per clock (CUDA C++ Programming "
                                       "Guide, 'Shared Memory', compute capability 9.0)"),
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
}
"""One table for the whole model (H200, sm_90). ``--arch sm_100`` reports real sm_100
SASS, registers and occupancy, but its ceilings still use this H200 table."""


def a(name: str) -> float:
    return ASSUMPTIONS[name].value


# ======================================================================================
# nvdisasm
# ======================================================================================


def find_nvdisasm() -> str | None:
    """The ``nvdisasm`` binary: ``$NVDISASM``, else the PyPI wheel's copy
    (``nvidia/cu13/bin/nvdisasm`` or ``nvidia/cuda_nvdisasm/bin/nvdisasm`` under any
    ``sys.path`` entry), else ``PATH``, else ``$CUDA_HOME``/``/usr/local/cuda``."""
    env = os.environ.get("NVDISASM")
    if env:
        return env if os.access(env, os.X_OK) else None
    patterns = ("nvidia/cu*/bin/nvdisasm", "nvidia/cuda_nvdisasm/bin/nvdisasm")
    for entry in sys.path:
        for pattern in patterns:
            for found in sorted(glob.glob(os.path.join(entry or ".", pattern)), reverse=True):
                if os.access(found, os.X_OK):
                    return found
    found = shutil.which("nvdisasm")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(os.path.join(root, "bin", "nvdisasm"), os.X_OK):
            return os.path.join(root, "bin", "nvdisasm")
    return None


def disassemble(cubin: bytes, nvdisasm: str) -> str:
    """``nvdisasm -c -ndf`` of the cubin (code sections only; our own CFG, not its dataflow)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        done = subprocess.run([nvdisasm, "-c", "-ndf", path], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"nvdisasm failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


# ======================================================================================
# SASS: instructions, basic blocks, loops
# ======================================================================================

_SECTION = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)")
_LABEL = re.compile(r"^\s*([.$A-Za-z_][\w.$]*):\s*$")
_INSTR = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+(.*?)\s*;")
_TARGET = re.compile(r"`\(([^)]+)\)")
_GPR = re.compile(r"(?<![\w.])R(\d+)(\.64)?\b")


@dataclass
class Instr:
    addr: int
    pred: str | None  # "@P0", "@!P1", ...
    opcode: str  # "LDG.E.128.CONSTANT"
    operands: str

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def suffixes(self) -> list[str]:
        return self.opcode.split(".")[1:]

    @property
    def target(self) -> str | None:
        found = _TARGET.search(self.operands)
        return found.group(1) if found else None

    def __str__(self) -> str:
        return f"/*{self.addr:04x}*/ {self.pred + ' ' if self.pred else ''}{self.opcode} {self.operands}"


def parse_functions(sass: str) -> dict[str, tuple[list[Instr], dict[str, int]]]:
    """``{kernel: (instructions, {label: index of the instruction it names})}``."""
    functions: dict[str, tuple[list[Instr], dict[str, int]]] = {}
    instrs: list[Instr] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        section = _SECTION.match(line)
        if section:
            instrs, labels = [], {}
            functions[section.group(1)] = (instrs, labels)
            continue
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(instrs)
            continue
        found = _INSTR.match(line)
        if found:
            body = found.group(2).strip().strip("{}").strip()
            pred = None
            if body.startswith("@"):
                pred, body = body.split(None, 1)
            opcode, _, operands = body.partition(" ")
            instrs.append(Instr(int(found.group(1), 16), pred, opcode, operands.strip()))
    return functions


@dataclass
class Block:
    index: int
    start: int  # first instruction index
    end: int  # one past the last
    succs: list[tuple[int, str]] = field(default_factory=list)  # (block, "fall" | "taken" | "div")
    preds: list[int] = field(default_factory=list)


def _is_conditional(instr: Instr) -> bool:
    return (instr.pred not in (None, "@PT")) or "DIV" in instr.suffixes


def build_cfg(instrs: list[Instr], labels: dict[str, int]) -> list[Block]:
    """Basic blocks and their edges. ``BRA.DIV`` (taken only by a diverged warp) is a
    conditional edge of kind ``div``; ``CALL`` falls through (callees are not followed);
    ``EXIT``/``RET`` end a path unless predicated; indirect branches end it too."""
    leaders = {0}
    for i, ins in enumerate(instrs):
        if ins.base in ("BRA", "JMP", "BRX", "JMX", "EXIT", "RET", "KILL", "BPT"):
            leaders.add(i + 1)
            if ins.target in labels:
                leaders.add(labels[ins.target])
    leaders = sorted(x for x in leaders if x < len(instrs))
    block_of = {start: b for b, start in enumerate(leaders)}
    blocks = [Block(b, start, leaders[b + 1] if b + 1 < len(leaders) else len(instrs))
              for b, start in enumerate(leaders)]
    for block in blocks:
        last = instrs[block.end - 1]
        fall = block_of.get(block.end)
        if last.base in ("BRA", "JMP") and last.target in labels:
            kind = "div" if "DIV" in last.suffixes else "taken"
            if _is_conditional(last) and fall is not None:
                block.succs.append((fall, "fall"))
            block.succs.append((block_of[labels[last.target]], kind))
        elif last.base in ("BRA", "JMP", "BRX", "JMX", "EXIT", "RET", "KILL", "BPT"):
            if _is_conditional(last) and last.base in ("EXIT", "RET") and fall is not None:
                block.succs.append((fall, "fall"))
        elif fall is not None:
            block.succs.append((fall, "fall"))
    for block in blocks:
        for succ, _ in block.succs:
            blocks[succ].preds.append(block.index)
    return blocks


def reverse_postorder(start: int, succs) -> list[int]:
    """The nodes reachable from ``start`` in reverse DFS postorder (a topological order
    when ``succs`` has no cycles); ``succs(node)`` lists a node's successors."""
    order, seen, stack = [], {start}, [(start, iter(succs(start)))]
    while stack:
        node, pending = stack[-1]
        nxt = next((v for v in pending if v not in seen), None)
        if nxt is None:
            order.append(node)
            stack.pop()
        else:
            seen.add(nxt)
            stack.append((nxt, iter(succs(nxt))))
    return order[::-1]


def dominators(blocks: list[Block], entry: int = 0) -> dict[int, set[int]]:
    """``{block: blocks dominating it}`` over the blocks reachable from ``entry``."""
    rpo = reverse_postorder(entry, lambda b: [s for s, _ in blocks[b].succs])
    dom = {b: set(rpo) for b in rpo}
    dom[entry] = {entry}
    changed = True
    while changed:
        changed = False
        for b in rpo[1:]:
            preds = [p for p in blocks[b].preds if p in dom]
            new = set.intersection(*(dom[p] for p in preds)) | {b} if preds else {b}
            if new != dom[b]:
                dom[b], changed = new, True
    return dom


@dataclass
class Loop:
    header: int
    body: set[int]
    latches: set[int]


def natural_loops(blocks: list[Block], dom: dict[int, set[int]]) -> list[Loop]:
    """One loop per header: the union of the natural loops of its back edges."""
    loops: dict[int, Loop] = {}
    for u in dom:
        for h, _ in blocks[u].succs:
            if h in dom[u]:  # back edge u -> h
                loop = loops.setdefault(h, Loop(h, {h}, set()))
                loop.latches.add(u)
                stack = [u]
                while stack:
                    x = stack.pop()
                    if x not in loop.body:
                        loop.body.add(x)
                        stack.extend(p for p in blocks[x].preds if p in dom)
    return list(loops.values())


# ======================================================================================
# What an instruction is and costs
# ======================================================================================

_MIX = {
    "ldg": ("LDG", "LDGSTS", "LD", "UTMALDG", "UBLKCP"),
    "lds": ("LDS", "LDSM"),
    "sts": ("STS", "STSM"),
    "stg": ("STG", "ST", "RED", "REDG", "ATOM", "ATOMG", "UTMASTG"),
    "local": ("LDL", "STL"),
    "hmma": ("HMMA", "IMMA", "DMMA", "BMMA", "HGMMA", "QGMMA", "IGMMA", "BGMMA"),
    "fp32": ("FFMA", "FMUL", "FADD", "FFMA2", "FMUL2", "FADD2"),
    "fp32_cmp": ("FMNMX", "FSEL", "FSETP", "FSET", "FCHK"),
    "fp16": ("HFMA2", "HADD2", "HMUL2", "HMNMX2", "HSETP2", "HSET2"),
    "mufu": ("MUFU",),
    "int": ("IMAD", "IMUL", "IDP", "IADD3", "IADD", "VIADD", "LOP3", "LOP", "SHF", "SHL", "SHR", "LEA", "ISETP",
            "IABS", "SEL", "IMNMX", "VIMNMX", "PRMT", "BMSK", "SGXT", "P2R", "R2P", "PLOP3", "VOTE", "FLO", "POPC",
            "BREV"),
    "move": ("MOV", "CS2R", "S2R"),
    "cvt": ("F2F", "F2FP", "I2F", "F2I", "I2I", "FRND", "I2FP", "F2IP", "I2IP"),
    "shfl": ("SHFL",),
    "branch": ("BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BSSY", "BSYNC", "WARPSYNC", "BREAK", "BPT",
               "KILL", "YIELD"),
    "sync": ("BAR", "SYNCS", "DEPBAR", "LDGDEPBAR", "MEMBAR", "FENCE", "ERRBAR", "CCTL", "WARPGROUP", "ARRIVES"),
}
MIX_KEYS = (*_MIX, "uniform", "other")
_CATEGORY = {op: cat for cat, ops in _MIX.items() for op in ops}


def category(ins: Instr) -> str:
    """Mix category: global loads (incl. LDGSTS/TMA), LDS/LDSM, HMMA, FFMA/FMUL/FADD, MUFU,
    integer, conversions, SHFL, branches, ...; uniform-datapath ``U*`` ops apart."""
    cat = _CATEGORY.get(ins.base)
    if cat:
        return cat
    if ins.base.startswith("U") or ins.base in ("R2UR", "S2UR"):
        return "uniform"
    return "other"


_ALU_OPS = set(_MIX["fp32_cmp"]) | set(_MIX["int"]) - {"IMAD", "IMUL", "IDP", "FLO", "POPC", "BREV"} | {
    "MOV", "CS2R", "F2FP", "HMNMX2", "HSETP2", "HSET2"}
_FMA_OPS = set(_MIX["fp32"]) | {"HFMA2", "HADD2", "HMUL2", "IMAD", "IMUL", "IDP"}
_XU_OPS = set(_MIX["mufu"]) | set(_MIX["cvt"]) - {"F2FP"} | {"FLO", "POPC", "BREV"}

PIPES = {
    # name: (the assumption giving its capacity per SM per clock, what runs on it)
    "issue": ("issue_per_clk", "warp instructions: every instruction"),
    "fma": ("fma_lanes", "FMA pipe: FFMA/FMUL/FADD, fp16x2, IMAD"),
    "imad": ("imad_lanes", "IMAD/IMUL (the FMA pipe's heavy half)"),
    "alu": ("alu_lanes", "ALU: integer add/logic/shift/compare, float compare/select/min-max, moves, F2FP"),
    "xu": ("xu_lanes", "XU: MUFU and conversions"),
    "shfl": ("shfl_lanes", "warp shuffles"),
    "tensor": ("hmma_fma_per_clk", "tensor cores (mma.sync; wgmma at its own rate)"),
    "shared": ("shared_bytes_per_clk", "shared-memory bandwidth: LDS/LDSM/STS/LDGSTS bytes"),
}


def _width_bytes(ins: Instr) -> int:
    """Bytes per lane of a memory instruction, from its suffixes."""
    for s in ins.suffixes:
        if s in ("128", "64", "32"):
            return int(s) // 8
        if s in ("U8", "S8"):
            return 1
        if s in ("U16", "S16"):
            return 2
    return 4


def global_load_bytes(ins: Instr) -> int:
    """Bytes one warp instruction requests from global memory (32 lanes; TMA/bulk copies
    name no size in SASS and count 0 here: such kernels declare their stage bytes)."""
    if ins.base in ("LDG", "LDGSTS", "LD"):
        return _width_bytes(ins) * 32
    return 0


def shared_bytes(ins: Instr) -> int:
    """Bytes one warp instruction moves through shared memory."""
    if ins.base == "LDSM" or ins.base == "STSM":
        count = next((int(s) for s in ins.suffixes if s in ("1", "2", "4")), 1)
        return 128 * count  # .x1/.x2/.x4: one 8x8 matrix of 16-bit values = 128 bytes each
    if ins.base in ("LDS", "STS", "LDGSTS"):
        return _width_bytes(ins) * 32
    return 0


def tensor_fmas(ins: Instr) -> float:
    """bf16-equivalent FMAs of one warp's tensor instruction, in units of the
    ``hmma_fma_per_clk`` rate (wgmma scaled to its own rate)."""
    if category(ins) != "hmma":
        return 0.0
    shape = next((s for s in ins.suffixes if re.fullmatch(r"\d+x\d+x\d+|(16|8)8(4|8|16|32|64|128|256)", s)), None)
    if shape is None:
        fmas = 16 * 8 * 16  # unknown shape: m16n8k16
    elif "x" in shape:  # wgmma m x n x k for the warpgroup, issued by each of its 4 warps, at its own rate
        m, n, k = (int(x) for x in shape.split("x"))
        fmas = m * n * k / 4 * a("hmma_fma_per_clk") / a("gmma_fma_per_clk")
    else:  # mma.sync: "16816" = m16 n8 k16, "1688", "884", "16832"
        m = 16 if shape.startswith("16") else 8
        fmas = m * 8 * int(shape[len(str(m)) + 1:])
    eight_bit = any(s in ("S8", "U8", "E4M3", "E5M2") for s in ins.suffixes)
    return fmas / 2 if eight_bit else fmas  # 8-bit types: twice the rate per FMA


def pipe_cost(ins: Instr) -> dict[str, float]:
    """Clocks of one SM each pipe spends on one warp instruction."""
    cost = {"issue": 1 / a("issue_per_clk")}
    if ins.base in _FMA_OPS:
        cost["fma"] = 32 / a("fma_lanes")
    if ins.base in ("IMAD", "IMUL", "IDP"):
        cost["imad"] = 32 / a("imad_lanes")
    if ins.base in _ALU_OPS:
        cost["alu"] = 32 / a("alu_lanes")
    if ins.base in _XU_OPS:
        cost["xu"] = 32 / a("xu_lanes")
    if ins.base == "SHFL":
        cost["shfl"] = 32 / a("shfl_lanes")
    if category(ins) == "hmma":
        cost["tensor"] = tensor_fmas(ins) / a("hmma_fma_per_clk")
    if shared_bytes(ins):
        cost["shared"] = shared_bytes(ins) / a("shared_bytes_per_clk")
    return cost


def _register_span(ins: Instr, operand_index: int) -> int:
    """32-bit registers an operand of ``ins`` spans beyond what its text says."""
    if category(ins) == "hmma":
        return 4  # fragments: over-approximated, so a consumer is never missed
    if ins.base in ("LDG", "LDS", "LDL", "LD") and operand_index == 0:
        return max(1, _width_bytes(ins) // 4)
    if ins.base == "LDSM" and operand_index == 0:
        return shared_bytes(ins) // 128
    if ins.base in ("STG", "STS", "STL", "ST") and operand_index > 0:
        return max(1, _width_bytes(ins) // 4)
    if "WIDE" in ins.suffixes or ins.base.startswith("D"):
        return 2
    return 1


def registers(ins: Instr) -> list[set[int]]:
    """The general registers each comma-separated operand of ``ins`` names."""
    spans = []
    for k, operand in enumerate(ins.operands.split(",")):
        regs = set()
        for found in _GPR.finditer(operand):
            n = 2 if found.group(2) else _register_span(ins, k)
            regs.update(range(int(found.group(1)), int(found.group(1)) + n))
        spans.append(regs)
    return spans


# ======================================================================================
# The hot loop and its steady-state path
# ======================================================================================


@dataclass
class HotPath:
    loop: Loop
    blocks: list[int]  # in path order, header first
    instrs: list[Instr]
    body_instructions: int  # every block a converged warp can run in the loop


def find_hot_path(instrs: list[Instr], labels: dict[str, int]) -> HotPath | None:
    blocks = build_cfg(instrs, labels)
    dom = dominators(blocks)
    loads = {b.index: sum(category(instrs[i]) == "ldg" for i in range(b.start, b.end)) for b in blocks}
    load_bytes = {b.index: sum(global_load_bytes(instrs[i]) for i in range(b.start, b.end)) for b in blocks}
    candidates = [lp for lp in natural_loops(blocks, dom) if any(loads[b] for b in lp.body)]
    innermost = [lp for lp in candidates if not any(o.body < lp.body for o in candidates)]
    if not innermost:
        return None
    loop = max(innermost, key=lambda lp: (sum(load_bytes[b] for b in lp.body), len(lp.body)))

    def dag_succs(u: int):  # inside the loop, no back edges (this loop's or inner ones'), no BRA.DIV
        return [v for v, kind in blocks[u].succs
                if v in loop.body and kind != "div" and v != loop.header and v not in dom[u]]

    order = reverse_postorder(loop.header, dag_succs)  # what a converged warp reaches, topologically
    size = {b: blocks[b].end - blocks[b].start for b in order}
    # Best path to each block: most global loads executed, then fewest instructions.
    best = {loop.header: ((loads[loop.header], -size[loop.header]), None)}
    for u in order:
        if u not in best:
            continue
        (n_loads, neg_size), _ = best[u]
        for v in dag_succs(u):
            score = (n_loads + loads[v], neg_size - size[v])
            if v not in best or score > best[v][0]:
                best[v] = (score, u)
    latches = [u for u in loop.latches if u in best and any(v == loop.header and k != "div"
                                                              for v, k in blocks[u].succs)]
    if not latches:
        return None
    node = max(latches, key=lambda u: best[u][0])
    path = []
    while node is not None:
        path.append(node)
        node = best[node][1]
    path.reverse()
    return HotPath(loop, path, [instrs[i] for b in path for i in range(blocks[b].start, blocks[b].end)],
                   sum(size.values()))


@dataclass
class InFlight:
    bytes_at_first_wait: int  # per warp: outstanding global-load bytes when the warp first waits
    waits: int  # scoreboard waits on global loads per iteration
    bytes_per_iter: int  # global-load bytes one iteration issues

    @property
    def mean_bytes(self) -> float:
        """Outstanding bytes averaged over the iteration's waits: with every wait costing
        one latency, the warp moves ``bytes_per_iter`` per ``waits`` latencies."""
        return self.bytes_per_iter / self.waits if self.waits else float(self.bytes_per_iter)


def loads_in_flight(path: list[Instr]) -> InFlight:
    """Scoreboard model of plain loads over two iterations of the path (the second is
    the steady state): a load is in flight from issue until an instruction reads or
    writes one of its destination registers; at that wait every load issued before
    is taken as arrived (they were issued close together)."""
    outstanding: list[tuple[set[int], int]] = []
    first_wait, waits = None, 0
    for iteration in (0, 1):
        for ins in path:
            spans = registers(ins)
            touched = set().union(*spans) if spans else set()
            if any(regs & touched for regs, _ in outstanding):
                if iteration == 1:
                    waits += 1
                    if first_wait is None:
                        first_wait = sum(b for _, b in outstanding)
                outstanding = []
            if global_load_bytes(ins):
                dest = spans[0] if ins.base != "LDGSTS" else set()  # LDGSTS writes shared memory
                outstanding.append((dest, global_load_bytes(ins)))
    per_iter = sum(global_load_bytes(ins) for ins in path)
    return InFlight(first_wait if first_wait is not None else per_iter, waits, per_iter)


# ======================================================================================
# ptxas resources and occupancy
# ======================================================================================


def ptxas_resources(log: str, kernel: str) -> dict[str, int]:
    """Registers, stack frame, spill stores/loads and static shared memory of ``kernel``
    from NVRTC's ``--ptxas-options=-v`` log."""
    part = log.split(f"Compiling entry function '{kernel}'", 1)
    if len(part) != 2:
        raise RuntimeError(f"ptxas log has no entry for {kernel}:\n{log}")
    text = part[1].split("Compiling entry function", 1)[0]
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    regs = re.search(r"Used (\d+) registers", text)
    smem = re.search(r"(\d+) bytes smem", text)
    if not (frame and regs):
        raise RuntimeError(f"cannot read ptxas resources of {kernel}:\n{text}")
    return {"registers": int(regs.group(1)), "stack_frame_bytes": int(frame.group(1)),
            "spill_store_bytes": int(frame.group(2)), "spill_load_bytes": int(frame.group(3)),
            "static_smem_bytes": int(smem.group(1)) if smem else 0}


def occupancy(registers: int, smem_bytes: int, warps_per_cta: int) -> tuple[int, str]:
    """``(CTAs per SM, what limits it)`` at sm_90's limits (assumption table)."""
    unit = a("reg_alloc_unit")
    regs_per_warp = math.ceil(max(registers, 1) * 32 / unit) * unit
    warps_by_regs = int(a("regs_per_sm") / 4 // regs_per_warp) * 4  # each sub-partition holds a quarter
    smem_cta = math.ceil((smem_bytes + a("smem_reserved_per_cta")) / a("smem_alloc_unit")) * a("smem_alloc_unit")
    limits = {
        "registers": warps_by_regs // warps_per_cta,
        "shared memory": int(a("smem_per_sm") // smem_cta),
        "threads": int(a("max_threads_per_sm") // (32 * warps_per_cta)),
        "warps": int(a("max_warps_per_sm") // warps_per_cta),
        "CTAs": int(a("max_ctas_per_sm")),
    }
    limiter = min(limits, key=limits.get)
    return limits[limiter], limiter


# ======================================================================================
# One spec's SASS facts, then one row per model shape
# ======================================================================================


@dataclass
class SpecFacts:
    spec: KernelSpec
    arch: str
    resources: dict[str, int]
    hot: HotPath | None
    in_flight: InFlight | None
    ctas_per_sm: int
    occupancy_limiter: str
    sass_kv_bytes_per_iter: int  # vector global-load bytes on the hot path (0 when SASS names none)
    warp_iters_per_sass_iter: int


def analyse(spec: KernelSpec, arch: str, nvdisasm: str, build: tuple[bytes, str] | None = None) -> SpecFacts:
    """Compile (or take ``build`` = ``(cubin, ptxas -v log)``), disassemble, find the hot loop."""
    if build is None:
        from metrale_attn.backends.cupy_backend import nvrtc_compile

        build = nvrtc_compile(spec, arch, ptxas_verbose=True)
    cubin, log = build
    loop = hot_loop(spec)
    functions = parse_functions(disassemble(cubin, nvdisasm))
    if loop.kernel not in functions:
        raise RuntimeError(f"{loop.kernel} not in the disassembly of {spec.name} ({', '.join(functions)})")
    hot = find_hot_path(*functions[loop.kernel])
    resources = ptxas_resources(log, loop.kernel)
    ctas, limiter = occupancy(resources["registers"], resources["static_smem_bytes"] + loop.dynamic_smem_bytes,
                              loop.warps_per_cta)
    in_flight = loads_in_flight(hot.instrs) if hot else None
    vector_bytes = sum(global_load_bytes(i) for i in hot.instrs if _width_bytes(i) >= 8 or i.base == "LDGSTS") \
        if hot else 0
    iters = max(1, round(vector_bytes / loop.kv_bytes_per_warp_iter)) if vector_bytes else 1
    return SpecFacts(spec, arch, resources, hot, in_flight, ctas, limiter, vector_bytes, iters)


KV_SPELLING = {"bf16": "bf16", "fp16": "fp16", "fp8": "fp8_e4m3"}


def heads_per_cta(loop, group: int) -> int:
    """Heads per CTA on a shape: the spec's own, or for a grouped (mma) spec the
    largest divisor of the group it can hold (the budgets are stated at that value)."""
    if not loop.grouped:
        return loop.heads_per_cta
    return max(h for h in range(1, loop.heads_per_cta + 1) if group % h == 0)


def row(facts: SpecFacts, q_heads: int, kv_heads: int) -> dict:
    """One report row: the spec's SASS facts scaled to a model shape, and the model."""
    v, loop, hot = facts.spec, hot_loop(facts.spec), facts.hot
    group = q_heads // kv_heads
    hpc = heads_per_cta(loop, group)
    readers = group / hpc  # CTAs reading each K/V row
    res = facts.resources
    base = {
        "arm": v.arm, "impl": v.impl, "spec": v.name, "kernel": loop.kernel, "arch": facts.arch,
        "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": v.head_dim,
        "q_dtype": v.q_dtype, "kv_dtype": KV_SPELLING[v.kv_dtype],
        "heads_per_cta": hpc, "group_size": group, "ctas_per_kv_row": readers,
        "registers": res["registers"], "spill_bytes": res["spill_store_bytes"] + res["spill_load_bytes"],
        "stack_frame_bytes": res["stack_frame_bytes"], "static_smem_bytes": res["static_smem_bytes"],
        "dynamic_smem_bytes": loop.dynamic_smem_bytes, "ctas_per_sm": facts.ctas_per_sm,
        "warps_per_sm": facts.ctas_per_sm * loop.warps_per_cta, "occupancy_limiter": facts.occupancy_limiter,
        "tokens_per_warp_iter": loop.tokens_per_warp_iter, "kv_bytes_per_warp_iter": loop.kv_bytes_per_warp_iter,
        "model": "H200 (sm_90 assumption table)" if facts.arch == "sm_90" else
                 f"H200 assumption table applied to {facts.arch} SASS (not a model of that GPU)",
        "modelled": True,
    }
    if hot is None:
        return {**base, "loop_found": False, "instr_per_kib": None, "kib_in_flight_per_sm": None,
                "ceiling_pct": None, "binding": "no hot loop found", "mix": {}, "ceilings": {}}
    kv_bytes = loop.kv_bytes_per_warp_iter * facts.warp_iters_per_sass_iter  # per SASS iteration, one warp
    unique_kib = kv_bytes / 1024 / readers  # unique K/V per warp iteration
    mix = {k: 0 for k in MIX_KEYS}
    cost: dict[str, float] = {p: 0.0 for p in PIPES}
    for ins in hot.instrs:
        mix[category(ins)] += 1
        for pipe, clocks in pipe_cost(ins).items():
            cost[pipe] += clocks
    warps = base["warps_per_sm"]
    if loop.pipeline_stages:
        per_warp = (loop.pipeline_stages - 1) * loop.stage_bytes / loop.warps_per_cta
        first, mean, waits = per_warp, per_warp, None
    else:
        first, mean, waits = facts.in_flight.bytes_at_first_wait, facts.in_flight.mean_bytes, facts.in_flight.waits
    unique_in_flight_per_sm = mean * warps / readers  # what HBM sees: one reader per row misses
    # Ceilings, in % of the copy bandwidth.
    sms, clock, hbm = a("sm_count"), a("clock_ghz") * 1e9, a("hbm_copy_tb_s") * 1e12
    need = hbm / sms / clock  # unique bytes per SM per clock at copy speed
    ceilings = {pipe: 100 * (unique_kib * 1024 / clocks) / need for pipe, clocks in cost.items() if clocks > 0}
    ceilings["l2"] = 100 * a("l2_tb_s") / a("hbm_copy_tb_s") / readers
    for name in ("latency_short_ns", "latency_long_ns"):
        ns = a(name)
        ceilings[f"latency_{ns:.0f}ns"] = 100 * unique_in_flight_per_sm * sms / (ns * 1e-9) / hbm
    ceilings["hbm"] = 100.0
    binding = min(ceilings, key=ceilings.get)
    return {
        **base,
        "loop_found": True,
        "loop": {"header": f"{hot.instrs[0].addr:#06x}", "latch": f"{hot.instrs[-1].addr:#06x}",
                 "blocks_on_path": len(hot.blocks), "blocks_in_loop": len(hot.loop.body),
                 "hot_path_instructions": len(hot.instrs), "converged_body_instructions": hot.body_instructions,
                 "warp_iters_per_sass_iter": facts.warp_iters_per_sass_iter},
        "sass_kv_load_bytes_per_iter": facts.sass_kv_bytes_per_iter,
        "loop_bytes_match": facts.sass_kv_bytes_per_iter in (0, kv_bytes),
        "instr_per_kib": len(hot.instrs) / unique_kib,
        "instr_per_kib_per_cta": len(hot.instrs) / (kv_bytes / 1024),
        "mix": mix,
        "mix_per_kib": {k: n / unique_kib for k, n in mix.items() if n},
        "memory_waits_per_iter": waits,
        "kib_in_flight_per_warp": first / 1024,
        "kib_in_flight_per_sm": first * warps / 1024,
        "kib_in_flight_mean_per_sm": mean * warps / 1024,
        "kib_unique_in_flight_per_sm": unique_in_flight_per_sm / 1024,
        "ceilings": ceilings,
        "ceiling_pct": ceilings[binding],
        "binding": binding,
    }


# ======================================================================================
# The default set, markdown, command line
# ======================================================================================

DEFAULT_SHAPES = ((32, 8, 128), (64, 8, 128), (24, 4, 256))
"""Llama-3-8B, Llama-3-70B, and the 24/4/256 shape (``qwen3.8-27b`` in the CLI)."""
DEFAULT_KV = ("bf16", "fp8")
DEFAULT_Q = ("bf16",)


def serves(spec: KernelSpec, q_heads: int, kv_heads: int, head_dim: int) -> bool:
    """A spec serves a shape at its head dim when its heads per CTA divide the group;
    a grouped (mma) spec when it is the smallest whose capacity holds the group's
    largest choice (one row tile for groups up to 8, two above)."""
    loop, group = hot_loop(spec), q_heads // kv_heads
    if spec.head_dim != head_dim:
        return False
    if not loop.grouped:
        return group % loop.heads_per_cta == 0
    best = max(h for h in range(1, max_rows_per_cta(head_dim) + 1) if group % h == 0)
    return (best > 8) == (loop.heads_per_cta > 8)


def select(patterns, shapes, kv_dtypes, q_dtypes) -> list[tuple[KernelSpec, tuple[int, int, int]]]:
    chosen = []
    for shape in shapes:
        for v in all_specs():
            if v.kv_dtype not in kv_dtypes or v.q_dtype not in q_dtypes or not serves(v, *shape):
                continue
            if v.features and not (patterns and any(fnmatch.fnmatch(v.name, p) for p in patterns)):
                continue
            if patterns and not any(fnmatch.fnmatch(v.name, p) or fnmatch.fnmatch(v.arm, p) for p in patterns):
                continue
            chosen.append((v, shape))
    return chosen


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0f}"


def markdown(rows: list[dict]) -> str:
    lines = [
        "Static SASS model (NOT measured): H200 assumption table in benchmarks/sass_model.py; "
        "% of the 4.3 TB/s copy bandwidth",
        "",
        "| arm | q/kv/D | KV | arch | heads/CTA | instr/KiB unique | regs | spill B | CTAs/SM | KiB in flight/SM "
        "(first wait / mean / unique) | waits/iter | issue % | tightest pipe % | L2 % | 500 ns % | 800 ns % "
        "| ceiling % | binding |",
        "|" + "---|" * 18,
    ]
    for r in rows:
        if not r["loop_found"]:
            lines.append(f"| {r['arm']} | {r['q_heads']}/{r['kv_heads']}/{r['head_dim']} | {r['kv_dtype']} | "
                         f"{r['arch']} | {r['heads_per_cta']} | no hot loop found |" + " |" * 12)
            continue
        c = r["ceilings"]
        pipes = {k: c[k] for k in PIPES if k in c and k != "issue"}
        pipe = min(pipes, key=pipes.get) if pipes else None
        lines.append(
            f"| {r['arm']} | {r['q_heads']}/{r['kv_heads']}/{r['head_dim']} | {r['kv_dtype']} | {r['arch']} | "
            f"{r['heads_per_cta']} | {r['instr_per_kib']:.0f} | {r['registers']} | {r['spill_bytes']} | "
            f"{r['ctas_per_sm']} ({r['occupancy_limiter']}) | {r['kib_in_flight_per_sm']:.1f} / "
            f"{r['kib_in_flight_mean_per_sm']:.1f} / {r['kib_unique_in_flight_per_sm']:.1f} | "
            f"{r['memory_waits_per_iter'] if r['memory_waits_per_iter'] is not None else '-'} | "
            f"{_pct(c.get('issue'))} | {pipe} {_pct(pipes.get(pipe))} | {_pct(c['l2'])} | "
            f"{_pct(c['latency_500ns'])} | {_pct(c['latency_800ns'])} | **{r['ceiling_pct']:.0f}** | {r['binding']} |")
    shown = [k for k in MIX_KEYS if any(r.get("mix", {}).get(k) for r in rows)]
    lines += ["", "Hot-path instruction mix per warp iteration (instructions; tokens and K+V bytes per iteration):",
              "", "| spec | tokens | K+V B | path / body instr | " + " | ".join(shown) + " |",
              "|" + "---|" * (4 + len(shown))]
    seen = set()
    for r in rows:
        if not r["loop_found"] or (r["spec"], r["arch"]) in seen:
            continue
        seen.add((r["spec"], r["arch"]))
        lp = r["loop"]
        lines.append(f"| {r['spec']} ({r['arch']}) | {r['tokens_per_warp_iter'] * lp['warp_iters_per_sass_iter']} "
                     f"| {r['kv_bytes_per_warp_iter'] * lp['warp_iters_per_sass_iter']} | "
                     f"{lp['hot_path_instructions']} / {lp['converged_body_instructions']} | "
                     + " | ".join(str(r["mix"][k]) for k in shown) + " |")
    return "\n".join(lines) + "\n"


def assumptions_markdown() -> str:
    lines = ["| assumption | value | unit | source |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {x.value:g} | {x.unit} | {x.source} |" for k, x in ASSUMPTIONS.items()]
    return "\n".join(lines) + "\n"


def _shape(text: str) -> tuple[int, int, int]:
    q, kv, d = (int(x) for x in text.split("/"))
    return q, kv, d


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write the rows (a list of dicts) here")
    p.add_argument("--arch", nargs="+", default=["sm_90"], help="NVRTC architectures (default sm_90; sm_100 too)")
    p.add_argument("--specs", nargs="+", default=[], metavar="NAME",
                   help="spec names or arms, shell patterns allowed (default: all)")
    p.add_argument("--shapes", nargs="+", type=_shape, default=list(DEFAULT_SHAPES), metavar="Q/KV/D",
                   help="model shapes q_heads/kv_heads/head_dim (default 32/8/128 64/8/128 24/4/256)")
    p.add_argument("--kv-dtypes", nargs="+", default=list(DEFAULT_KV), choices=dtypes.KV_DTYPES)
    p.add_argument("--q-dtypes", nargs="+", default=list(DEFAULT_Q), choices=dtypes.Q_DTYPES)
    p.add_argument("--assumptions", action="store_true", help="print the assumption table and exit")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.assumptions:
        print(assumptions_markdown(), end="")
        return 0
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        print("nvdisasm not found: pip install nvidia-cuda-nvdisasm (or set NVDISASM)", file=sys.stderr)
        return 2
    chosen = select(args.specs, args.shapes, args.kv_dtypes, args.q_dtypes)
    if not chosen:
        print("no spec matches", file=sys.stderr)
        return 2
    facts: dict[tuple[str, str], SpecFacts] = {}
    rows = []
    for arch in args.arch:
        for spec, (q_heads, kv_heads, _) in chosen:
            key = (spec.name, arch)
            if key not in facts:
                facts[key] = analyse(spec, arch, nvdisasm)
            rows.append(row(facts[key], q_heads, kv_heads))
    print(markdown(rows), end="")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["loop_found"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
