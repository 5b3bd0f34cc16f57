"""SASS as the static model reads it: ``nvdisasm`` text -> instructions, basic blocks,
dominators, natural loops; what each instruction is (mix category, pipes, registers and
predicates it reads and writes); which branches a warp takes on both sides (the uniformity
analysis); the steady-state iteration of the hot loop (every block a warp issues per tile);
loads in flight; ptxas resources and occupancy. EVERY FIGURE DERIVED HERE IS MODELLED.

What a steady-state iteration counts (``steady_state``, stated in the report): starting at the
hot loop's header, every block up to a latch that a warp issues when all of its tokens are
valid. At a conditional branch the predicate's uniformity decides (``branch_kinds``, a
forward dataflow over the function):

* **warp-uniform** (every lane of a warp agrees: kernel parameters, loop counters, the warp
  index ``tid >> 5``): one side, the one that keeps every global load of the iteration and,
  of those, the fewest instructions (the steady state: the next tile exists);
* **lane-divergent** (the predicate depends on the lane: ``lane < TT``, a token's position
  against the CTA's range): BOTH sides, as the warp issues each side for its own lanes;
* **data-dependent** (it depends on values loaded per lane, e.g. the simt fp8/fp16 inf/NaN
  test on K/V bytes): the shorter side; the longer side is a rare detour, weighted by
  ``rare_path_probability`` (0) and reported apart;
* ``BRA.DIV`` (taken only by a warp that is already diverged): never, the warp is converged.
"""

from __future__ import annotations

import glob
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from .model_assumptions import a

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
        return hmma_spans(ins)[min(operand_index, 3)]
    if ins.base in ("LDG", "LDS", "LDL", "LD", "LDC") and operand_index == 0:
        return max(1, _width_bytes(ins) // 4)
    if ins.base in ("LDSM", "MOVM") and operand_index == 0:
        return max(1, shared_bytes(ins) // 128)
    if ins.base in ("STG", "STS", "STL", "ST") and operand_index > 0:
        return max(1, _width_bytes(ins) // 4)
    if ins.base == "CS2R" and operand_index == 0:
        return 1 if "32" in ins.suffixes else 2
    if "WIDE" in ins.suffixes:  # IMAD.WIDE: a 64-bit result and addend, 32-bit factors
        return 2 if operand_index in (0, 3) else 1
    if ins.base.startswith("D"):
        return 2
    return 1


def hmma_spans(ins: Instr) -> tuple[int, int, int, int]:
    """Registers of an HMMA's D, A, B and C fragments: m16n8k16 takes A in 4 and B in 2
    registers (m16n8k8: 2 and 1); an fp32 accumulator is 4 registers, a 16-bit one 2."""
    shape = next((s for s in ins.suffixes if s.isdigit() and len(s) >= 3), "16816")
    small_k = shape in ("1688", "884")
    acc = 4 if ("F32" in ins.suffixes or "S32" in ins.suffixes or ins.base != "HMMA") else 2
    if ins.base == "HMMA" and ins.suffixes and ins.suffixes[1:2] == ["F16"]:
        acc = 2
    return (acc, 2 if small_k else 4, 1 if small_k else 2, acc)


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
# What an instruction reads and writes (registers, uniform registers, predicates)
# ======================================================================================

_PRED_OPERAND = re.compile(r"^(!?)(U?P[0-6T])$")
_TOKEN = re.compile(r"(?<![\w.])(U?R)(\d+|Z)(\.64)?\b|(?<![\w.])(!?)(U?P)([0-6T])\b")
_NO_DEST = {"ST", "STS", "STG", "STL", "STSM", "LDGSTS", "RED", "REDG", "BRA", "BRX", "JMP", "JMX", "CALL", "RET",
            "EXIT", "BSSY", "BSYNC", "WARPSYNC", "NOP", "DEPBAR", "LDGDEPBAR", "BAR", "MEMBAR", "FENCE", "ERRBAR",
            "CCTL", "YIELD", "BPT", "KILL", "BREAK", "ENDCOLLECTIVE", "ARRIVES", "UTMALDG", "UTMASTG", "UBLKCP"}


@dataclass(frozen=True)
class Access:
    """What one instruction reads (``src``, its guard predicate included) and writes
    (``dst``): ``R12`` (a general register), ``UR4``, ``P3``, ``UP0``; RZ, PT and their
    uniform twins are neither."""

    dst: tuple[str, ...]
    src: tuple[str, ...]


def _names(ins: Instr, k: int, operand: str) -> list[str]:
    out = []
    for found in _TOKEN.finditer(operand):
        if found.group(1):  # R / UR
            if found.group(2) == "Z":
                continue
            n = 2 if found.group(3) else (_register_span(ins, k) if found.group(1) == "R" else 1)
            out += [f"{found.group(1)}{int(found.group(2)) + j}" for j in range(n)]
        elif found.group(6) != "T":
            out.append(f"{found.group(5)}{found.group(6)}")
    return out


def dest_operands(ins: Instr, operands: list[str]) -> int:
    """How many leading operands of ``ins`` it writes: none for stores, branches and
    barriers; two for a predicate-first instruction (``ISETP P0, PT, ...``, ``LOP3 P0, RZ,
    ...``, ``SHFL PT, R27, ...``); else the first and any plain predicates right after it
    (``IADD3 R24, P1, ...``: the carry out)."""
    if ins.base in _NO_DEST or not operands or not operands[0]:
        return 0
    if _PRED_OPERAND.match(operands[0]):
        return 2
    n = 1
    while n < len(operands) and n < 3 and re.fullmatch(r"U?P[0-6T]", operands[n]):
        n += 1
    return n


def access(ins: Instr) -> Access:
    """The registers and predicates ``ins`` reads and writes (see ``Access``)."""
    operands = [o.strip() for o in ins.operands.split(",")] if ins.operands else []
    ndst = dest_operands(ins, operands)
    dst, src = [], []
    for k, operand in enumerate(operands):
        (dst if k < ndst else src).extend(_names(ins, k, operand))
    if ins.pred and ins.pred not in ("@PT", "@!PT"):
        src.append(ins.pred.lstrip("@!"))
    return Access(tuple(dict.fromkeys(dst)), tuple(dict.fromkeys(src)))


def never_executes(ins: Instr) -> bool:
    """``@!PT``: issued, never executed (ptxas's padding before ``LDGSTS``)."""
    return ins.pred == "@!PT"


# ======================================================================================
# Which branches diverge: a forward dataflow of lane-variance over the function
# ======================================================================================

LANE, DATA, TID = 1, 2, 4
"""Flags of a value: it varies across the lanes of a warp (``LANE``), it was loaded per lane
from memory (``DATA``), it is ``threadIdx.x`` itself (``TID``: ``tid >> 5`` and ``tid & ~31``
are warp-uniform)."""

_LOADS = {"LD", "LDG", "LDS", "LDL", "LDC", "ATOM", "ATOMG", "ATOMS"}


def _lane(flags: int) -> int:
    """``TID`` used in arithmetic is a lane-varying value."""
    return (flags & ~TID) | (LANE if flags & TID else 0)


def _immediate(text: str) -> int | None:
    try:
        return int(text, 0)
    except ValueError:
        return None


def value_flags(ins: Instr, acc: Access, state: dict[str, int]) -> int:
    """The flags of what ``ins`` writes, given the flags of what it reads (``state``)."""
    srcs = 0
    for s in acc.src:
        srcs |= state.get(s, 0)
    operands = [o.strip() for o in ins.operands.split(",")]
    if ins.base == "S2R":
        special = operands[-1]
        return TID if special == "SR_TID.X" else LANE if special == "SR_LANEID" else 0
    if srcs == TID:  # warp-uniform pieces of threadIdx.x
        if ins.base == "SHF" and "R" in ins.suffixes and "HI" in ins.suffixes:
            shift = _immediate(operands[2]) if len(operands) > 2 else None
            if shift is not None and shift >= 5:
                return 0
        if ins.base == "LOP3" and len(operands) >= 5 and operands[-2] == "0xc0":
            mask = _immediate(operands[2])
            if mask is not None and mask & 0x1F == 0:
                return 0
        if ins.base == "MOV" or (ins.base == "IMAD" and "MOV" in ins.suffixes):
            return TID
    if ins.base == "LDSM" or ins.base in _LOADS:
        return LANE | DATA if srcs & (LANE | TID) or ins.base == "LDSM" else 0
    return _lane(srcs)


def lane_flags(instrs: list[Instr], blocks: list["Block"], ignore: frozenset = frozenset()) -> list[dict[str, int]]:
    """Per block, the flags of every register and predicate at its END (a forward
    dataflow to a fixed point; a join takes the union; a predicated write keeps the old
    flags too). Edges ``(u, v)`` in ``ignore`` carry nothing (``steady_state``: the back
    edges of loops around the hot loop)."""
    out: list[dict[str, int]] = [dict() for _ in blocks]
    accesses = [access(i) for i in instrs]
    changed = True
    while changed:
        changed = False
        for block in blocks:
            state: dict[str, int] = {}
            for p in block.preds:
                if (p, block.index) in ignore:
                    continue
                for reg, flags in out[p].items():
                    state[reg] = state.get(reg, 0) | flags
            for i in range(block.start, block.end):
                ins, acc = instrs[i], accesses[i]
                if never_executes(ins) or not acc.dst:
                    continue
                flags = value_flags(ins, acc, state)
                for d in acc.dst:
                    state[d] = flags | (state.get(d, 0) if ins.pred else 0)
            if state != out[block.index]:
                out[block.index], changed = state, True
    return out


def branch_kinds(instrs: list[Instr], blocks: list["Block"], ignore: frozenset = frozenset()) -> dict[int, str]:
    """``{block: kind}`` for every block that ends in a conditional branch: ``div``
    (``BRA.DIV``), ``uniform``, ``lane`` (lane-divergent) or ``data`` (data-dependent);
    ``ignore``: edges that carry no flags (``lane_flags``)."""
    flags = lane_flags(instrs, blocks, ignore)
    kinds = {}
    for block in blocks:
        last = instrs[block.end - 1]
        if last.base not in ("BRA", "JMP") or not _is_conditional(last):
            continue
        if "DIV" in last.suffixes:
            kinds[block.index] = "div"
            continue
        state: dict[str, int] = {}
        for p in block.preds:
            if (p, block.index) in ignore:
                continue
            for reg, f in flags[p].items():
                state[reg] = state.get(reg, 0) | f
        for i in range(block.start, block.end - 1):
            acc = access(instrs[i])
            if not never_executes(instrs[i]):
                f = value_flags(instrs[i], acc, state)
                for d in acc.dst:
                    state[d] = f | (state.get(d, 0) if instrs[i].pred else 0)
        guard = state.get(last.pred.lstrip("@!"), 0)
        kinds[block.index] = "uniform" if not guard else "data" if guard & DATA else "lane"
    return kinds


# ======================================================================================
# The hot loop and its steady-state iteration
# ======================================================================================


@dataclass
class HotPath:
    loop: Loop
    blocks: list[int]  # every block a warp issues per iteration, header first, in program order
    instrs: list[Instr]
    body_instructions: int  # every block a converged warp can run in the loop
    rare_blocks: list[int] = field(default_factory=list)  # data-dependent detours (weighted by a probability)
    rare_instructions: int = 0
    fewest_path_instructions: int = 0  # the single fewest-instruction path (the report before 2026-12-02)
    branch_kinds: dict[int, str] = field(default_factory=dict)  # in-loop conditional branches by block


def find_hot_path(instrs: list[Instr], labels: dict[str, int]) -> HotPath | None:
    """The hot loop (the innermost natural loop holding global loads; of several, the one
    with the most load bytes) and its steady-state iteration (``steady_state``)."""
    blocks = build_cfg(instrs, labels)
    dom = dominators(blocks)
    loads = {b.index: sum(category(instrs[i]) == "ldg" for i in range(b.start, b.end)) for b in blocks}
    load_bytes = {b.index: sum(global_load_bytes(instrs[i]) for i in range(b.start, b.end)) for b in blocks}
    candidates = [lp for lp in natural_loops(blocks, dom) if any(loads[b] for b in lp.body)]
    innermost = [lp for lp in candidates if not any(o.body < lp.body for o in candidates)]
    if not innermost:
        return None
    loop = max(innermost, key=lambda lp: (sum(load_bytes[b] for b in lp.body), len(lp.body)))
    return steady_state(instrs, blocks, dom, loop, loads)


def steady_state(instrs: list[Instr], blocks: list[Block], dom, loop: Loop, loads: dict[int, int]) -> HotPath | None:
    """Every block a warp issues in one steady-state iteration of ``loop`` (the module's
    docstring states the rule), in program order; None when no latch is reachable."""
    # A loop around the hot loop (persistent CTAs' walk over work items, the mma kernel's) carries
    # only the item index into its next iteration, every other value being recomputed from it;
    # its back edges would join the previous item's lane-varying registers into a predicated
    # write's old flags (ptxas reuses registers), so they carry none here.
    outer = frozenset((u, lp.header) for lp in natural_loops(blocks, dom) if lp.body > loop.body for u in lp.latches)
    kinds = {b: k for b, k in branch_kinds(instrs, blocks, outer).items() if b in loop.body}
    size = {b: blocks[b].end - blocks[b].start for b in loop.body}
    END, EXIT = "end", "exit"
    memo: dict[int, tuple[frozenset, frozenset, bool]] = {}

    def targets(u: int) -> list:
        out = []
        for v, kind in blocks[u].succs:
            if kind == "div":
                continue
            out.append(END if v == loop.header else EXIT if v not in loop.body or v in dom[u] else v)
        return out

    def walk(t) -> tuple[frozenset, frozenset, bool]:
        if t == END:
            return frozenset(), frozenset(), True
        if t == EXIT:
            return frozenset(), frozenset(), False
        if t in memo:
            return memo[t]
        options = [walk(x) for x in targets(t)]
        valid = [o for o in options if o[2]]
        if not valid:
            result = (frozenset({t}), frozenset(), False)
        elif len(valid) == 1:
            result = (frozenset({t}) | valid[0][0], valid[0][1], True)
        else:
            kind = kinds.get(t, "uniform")
            cost = lambda o: (sum(loads[b] for b in o[0]), -sum(size[b] for b in o[0]))  # noqa: E731
            if kind == "lane":
                result = (frozenset({t}).union(*(o[0] for o in valid)), frozenset().union(*(o[1] for o in valid)),
                          True)
            elif kind == "data":
                common = max(valid, key=cost)
                rare = frozenset().union(*(o[0] | o[1] for o in valid)) - common[0]
                result = (frozenset({t}) | common[0], common[1] | rare, True)
            else:
                best = max(valid, key=cost)
                result = (frozenset({t}) | best[0], best[1], True)
        memo[t] = result
        return result

    executed, rare, ok = walk(loop.header)
    if not ok:
        return None
    order = [b for b in sorted(loop.body, key=lambda b: blocks[b].start) if b in executed]
    rare_order = [b for b in sorted(rare - executed, key=lambda b: blocks[b].start)]
    converged = reverse_postorder(loop.header, lambda u: [v for v, kind in blocks[u].succs if v in loop.body and
                                                          kind != "div" and v != loop.header and v not in dom[u]])
    return HotPath(loop, order, [instrs[i] for b in order for i in range(blocks[b].start, blocks[b].end)],
                   sum(size[b] for b in converged), rare_order, sum(size[b] for b in rare_order),
                   fewest_path_instructions(blocks, dom, loop, loads), kinds)


def fewest_path_instructions(blocks: list[Block], dom, loop: Loop, loads: dict[int, int]) -> int:
    """Instructions on the single header-to-latch path that executes the most global loads
    and, of those, the fewest instructions (what the report counted before 2026-12-02: it
    undercounts a tile by the lane-divergent blocks a warp also issues)."""

    def dag_succs(u: int):
        return [v for v, kind in blocks[u].succs
                if v in loop.body and kind != "div" and v != loop.header and v not in dom[u]]

    order = reverse_postorder(loop.header, dag_succs)
    size = {b: blocks[b].end - blocks[b].start for b in order}
    best = {loop.header: (loads[loop.header], -size[loop.header])}
    for u in order:
        if u not in best:
            continue
        for v in dag_succs(u):
            score = (best[u][0] + loads[v], best[u][1] - size[v])
            if v not in best or score > best[v]:
                best[v] = score
    latches = [u for u in loop.latches if u in best]
    return -max(best[u] for u in latches)[1] if latches else 0


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
# Around the hot loop: the prologue and the epilogue one warp issues
# ======================================================================================


def region_instructions(instrs: list[Instr], blocks: list[Block], dom, start: int, stop: set[int],
                        kinds: dict[int, str], within: set[int] | None = None) -> int:
    """Instructions one warp issues from block ``start`` until it reaches a block of ``stop``
    or an ``EXIT``, by the rule of ``steady_state`` (uniform and data-dependent: the side
    with the most global loads, then the fewest instructions; lane-divergent: both;
    ``BRA.DIV``: never); a loop met on the way counts once (its back edge ends the walk).
    ``within``: the blocks the walk may enter (None: all)."""
    memo: dict[int, tuple[frozenset, bool]] = {}
    size = {b.index: b.end - b.start for b in blocks}
    loads = {b.index: sum(category(instrs[i]) == "ldg" for i in range(b.start, b.end)) for b in blocks}

    def walk(u: int) -> tuple[frozenset, bool]:
        if u in stop:
            return frozenset(), True
        if u in memo:
            return memo[u]
        memo[u] = (frozenset({u}), True)  # a cycle through u ends here
        outs = []
        for v, kind in blocks[u].succs:
            if kind == "div" or (within is not None and v not in within and v not in stop):
                continue
            outs.append((frozenset(), True) if v in dom.get(u, set()) or v == u else walk(v))
        if not outs:
            result = (frozenset({u}), True)
        elif len(outs) == 1 or kinds.get(u) != "lane":
            best = min(outs, key=lambda o: (-sum(loads[b] for b in o[0]), sum(size[b] for b in o[0])))
            result = (frozenset({u}) | best[0], True)
        else:
            result = (frozenset({u}).union(*(o[0] for o in outs)), True)
        memo[u] = result
        return result

    return sum(size[b] for b in walk(start)[0])


def prologue_epilogue_instructions(instrs: list[Instr], labels: dict[str, int], hot: HotPath
                                   ) -> tuple[int, int, int]:
    """Instructions one warp issues before the hot loop (kernel entry to its header, on the
    paths that reach it without a back edge: a branch around the loop into what follows it, as
    a persistent kernel's warp without tiles takes, is no prologue) and after it (its exit to ``EXIT``), each loop on the
    way counted once; and a later item's prologue (a persistent kernel's: from the header of the
    smallest loop around the hot loop; the prologue where there is none)."""
    blocks = build_cfg(instrs, labels)
    dom = dominators(blocks)
    kinds = branch_kinds(instrs, blocks)
    preds: dict[int, list[int]] = {}  # forward edges only: a back edge (into a dominator) starts another item
    for b in blocks:
        for v, _ in b.succs:
            if v not in dom.get(b.index, set()):
                preds.setdefault(v, []).append(b.index)
    reach, todo = {hot.loop.header}, [hot.loop.header]
    while todo:
        for u in preds.get(todo.pop(), []):
            if u not in reach:
                reach.add(u)
                todo.append(u)
    prologue = region_instructions(instrs, blocks, dom, 0, {hot.loop.header}, kinds, reach)
    around = [lp for lp in natural_loops(blocks, dom) if hot.loop.header in lp.body and lp.header != hot.loop.header]
    outer = min(around, key=lambda lp: len(lp.body), default=None)
    item_prologue = prologue if outer is None else region_instructions(instrs, blocks, dom, outer.header,
                                                                       {hot.loop.header}, kinds, reach)
    exits = [v for u in hot.loop.body for v, kind in blocks[u].succs if v not in hot.loop.body and kind != "div"]
    epilogue = max((region_instructions(instrs, blocks, dom, e, set(), kinds) for e in exits), default=0)
    return prologue, epilogue, item_prologue
