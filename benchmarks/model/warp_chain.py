"""The per-tile dependency chain of one warp: an in-order scoreboard over the steady-state
iteration of a hot loop (``sass.find_hot_path``), giving the cycles one warp takes per tile
alone on its SM sub-partition; and the SASS rewrites that turn the kernel levers of issue 19
into computed predictions. EVERY FIGURE IS MODELLED from the SASS and the assumption table
(``model_assumptions``); nothing here is measured.

The scoreboard (``simulate``), per instruction in program order:

* it issues one cycle after the warp's previous instruction at the earliest (one warp
  instruction per clock per scheduler), and not before every register and predicate it
  reads is ready (the producer's issue + its latency: ``lat_alu``, ``lat_xu``, ``lat_hmma``,
  ``lat_shared``, ``lat_mio``, and for a plain global load the block-table latency the
  caller gives: an L2 hit or a DRAM miss), nor before its pipe is free (ALU and IMAD 2
  cycles a warp instruction, FMA 1, XU 8, the tensor core 8 per HMMA.16816, per
  sub-partition; shared memory and shuffles are SM-wide units, held bytes / 128 and
  lanes / 32 cycles);
* ``LDGSTS`` (cp.async) joins the open group and lands ``mem_latency`` cycles after it
  issues; ``LDGDEPBAR`` commits the group; ``DEPBAR.LE SB0, N`` waits until every group but
  the N newest has landed (the prologue's ``N + 1`` groups are issued at cycle 0);
* ``@!PT`` padding issues and does nothing; branches, ``BSSY``/``BSYNC``, ``NOP`` issue in
  one cycle. Not modelled: register-bank conflicts, write-after-read hazards, branch
  penalties, instruction-cache misses.

It runs ``ITERATIONS`` iterations (loop-carried registers, the ring's groups and the
block-table load issued one iteration ahead carry over) and reports the mean of the last
``MEASURED`` iterations: the steady-state cycles per tile of one warp, and what it waited
on (``stalls``: cycles the warp could not issue, by the kind of producer it waited for).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np

from .model_assumptions import a
from .sass import Instr, _names, access, category, global_load_bytes, never_executes, pipe_cost

ITERATIONS = 14
MEASURED = 6

_SMSP_PIPES = ("fma", "imad", "alu", "xu", "tensor")
"""Pipes each of the 4 sub-partitions has its own copy of (``sass.PIPES``); ``shared`` and
``shfl`` are SM-wide."""


@dataclass(frozen=True)
class Op:
    """One instruction as the scoreboard sees it."""

    text: str
    opcode: str
    dst: tuple[str, ...]
    src: tuple[str, ...]
    kind: str  # what a reader of its result waits for: alu, xu, hmma, shared, mio, global (a block-table
    # word), dram (a K/V vector load); "" when it writes nothing
    busy: tuple[tuple[str, float], ...]  # (resource, cycles it holds it); sub-partition pipes and SM-wide units
    role: str = ""  # cp_async | commit | wait | shared_store | shared_load | padding
    wait_groups: int = 0  # DEPBAR.LE SB0, N: N
    acc: tuple[str, ...] = ()  # an HMMA's accumulator input (C)


def warps_per_scheduler(ctas, warps_per_cta: int):
    """Warps on an SM's busiest sub-partition when ``ctas`` CTAs of ``warps_per_cta`` warps
    share it: the warps spread round-robin over the 4 schedulers, and a CTA's item ends with
    its slowest warp (tiles go to warps evenly), so the busiest scheduler sets the pace:
    ceil(ctas x W / 4) (8 warps: 2 per scheduler; 6: 2 on two of them)."""
    return np.ceil(np.asarray(ctas) * warps_per_cta / 4)


def latency_kind(ins: Instr) -> str:
    """The latency class of what ``ins`` writes (see the module docstring)."""
    cat = category(ins)
    if cat == "hmma":
        return "hmma"
    if ins.base in ("LDS", "LDSM"):
        return "shared"
    if ins.base in ("SHFL", "MOVM", "S2R", "LDC", "S2UR"):
        return "mio"
    if ins.base in ("LDG", "LD", "LDL"):
        return "dram" if global_load_bytes(ins) >= 8 * 32 else "global"  # K/V vectors; a block-table word
    if ins.base == "MUFU" or (cat == "cvt" and ins.base != "F2FP") or ins.base in ("FLO", "POPC", "BREV"):
        return "xu"
    return "alu"


def op_of(ins: Instr) -> Op:
    """The scoreboard's view of one instruction."""
    acc = access(ins)
    costs = pipe_cost(ins)
    busy = [(p, 4 * costs[p]) for p in _SMSP_PIPES if p in costs]  # SM clocks -> one sub-partition's
    busy += [(p, costs[p]) for p in ("shared", "shfl") if p in costs]
    role, wait = "", 0
    if never_executes(ins):
        return Op(str(ins), ins.opcode, (), (), "", (), "padding")
    if ins.base == "LDGSTS":
        role = "cp_async"
    elif ins.base == "LDGDEPBAR":
        role = "commit"
    elif ins.base == "DEPBAR":
        role = "wait"
        found = re.search(r"SB0\s*,\s*(0x[0-9a-fA-F]+|\d+)", ins.operands)
        wait = int(found.group(1), 0) if found else 0
    elif ins.base in ("STS", "STSM"):
        role = "shared_store"
    elif ins.base in ("LDS", "LDSM"):
        role = "shared_load"
    c_regs: tuple[str, ...] = ()
    operands = ins.operands.split(",")
    if category(ins) == "hmma" and len(operands) >= 4:
        c_regs = tuple(_names(ins, 3, operands[3].strip()))
    return Op(str(ins), ins.opcode, acc.dst, acc.src, latency_kind(ins) if acc.dst else "", tuple(busy), role, wait,
              c_regs)


def ops_of(instrs: list[Instr]) -> list[Op]:
    return [op_of(i) for i in instrs]


# ======================================================================================
# The scoreboard
# ======================================================================================


@dataclass(frozen=True)
class Latencies:
    """Cycles until a result is readable, by kind; ``mem`` for a cp.async to land, ``bt`` for
    the block-table load (an L2 hit or a DRAM miss)."""

    alu: float
    xu: float
    hmma: float
    shared: float
    mio: float
    mem: float
    bt: float

    @staticmethod
    def of(mem: float, bt: float, hmma: float | None = None) -> "Latencies":
        return Latencies(a("lat_alu"), a("lat_xu"), a("lat_hmma") if hmma is None else hmma, a("lat_shared"),
                         a("lat_mio"), mem, bt)

    def of_kind(self, kind: str) -> float:
        return self.bt if kind == "global" else self.mem if kind == "dram" else getattr(self, kind)


@dataclass
class Chain:
    """One warp's steady state: ``cycles`` per tile (iteration), the instructions it issues,
    the busiest sub-partition pipe, SM-wide unit cycles, and the stall cycles per tile by
    what the warp waited for (``memory``: a cp.async group at DEPBAR; ``block_table``: the
    block-table load; ``hmma``, ``shared``, ``mio``, ``xu``, ``alu``: a register result;
    ``pipe``: a busy pipe)."""

    cycles: float
    issued: int
    smsp_busy: dict[str, float]
    sm_busy: dict[str, float]
    stalls: dict[str, float] = field(default_factory=dict)

    @property
    def issue_bound(self) -> float:
        """Cycles per tile one warp needs of its sub-partition at full issue: its instructions
        or its busiest pipe, whichever is more."""
        return max([float(self.issued), *self.smsp_busy.values()])

    def per_warp_tile_cycles(self, warps_per_smsp: float) -> float:
        """Cycles per tile of each warp when ``warps_per_smsp`` such warps share a
        sub-partition (and 4x as many the SM): max(chain, W x issue, 4W x SM-wide units)."""
        w = max(warps_per_smsp, 1.0)
        return max(self.cycles, w * self.issue_bound, *(4 * w * v for v in self.sm_busy.values()))

    def binding(self, warps_per_smsp: float) -> str:
        """What sets ``per_warp_tile_cycles``: ``chain`` (one warp's latency chain), ``issue``
        (the sub-partition's issue slots or a pipe) or ``sm_units`` (shared memory, shuffles)."""
        w = max(warps_per_smsp, 1.0)
        sm = max([0.0, *(4 * w * v for v in self.sm_busy.values())])
        options = {"chain": self.cycles, "issue": w * self.issue_bound, "sm_units": sm}
        return max(options, key=options.get)


def simulate(ops: list[Op], lat: Latencies, iterations: int = ITERATIONS, measured: int = MEASURED) -> Chain:
    """Run the scoreboard over ``iterations`` iterations of ``ops`` (module docstring)."""
    ready: dict[str, tuple[float, str]] = {}
    free: dict[str, float] = {}
    first_wait = next((op.wait_groups for op in ops if op.role == "wait"), 0)
    groups: list[float] = [lat.mem] * (first_wait + 1)  # the prologue's S - 1 tiles, issued at cycle 0
    open_group: float | None = None
    last_store = -1.0
    t_prev = -1.0
    starts: list[float] = []
    stall_log: list[Counter] = []
    for _ in range(iterations):
        starts.append(t_prev + 1)
        stalls: Counter = Counter()
        for op in ops:
            earliest = t_prev + 1
            t, why = earliest, ""
            for s in op.src:
                r, kind = ready.get(s, (0.0, "alu"))
                if r > t:
                    t, why = r, {"global": "block_table", "dram": "memory"}.get(kind, kind)
            if op.role == "wait":
                keep = op.wait_groups
                landed = max(groups[:len(groups) - keep], default=0.0) if len(groups) > keep else 0.0
                if landed > t:
                    t, why = landed, "memory"
            for res, cycles in op.busy:
                if free.get(res, 0.0) > t:
                    t, why = free[res], "pipe"
            if t > earliest:
                stalls[why] += t - earliest
            for res, cycles in op.busy:
                free[res] = t + cycles
            if op.kind:
                done = t + lat.of_kind(op.kind)
                if op.role == "shared_load":  # the MIO queue is in order: after the warp's last shared store
                    done = max(done, last_store + lat.shared)
                for d in op.dst:
                    ready[d] = (done, op.kind)
            if op.role == "shared_store":
                last_store = t
            elif op.role == "cp_async":
                open_group = max(open_group or 0.0, t + lat.mem)
            elif op.role == "commit":
                groups.append(open_group if open_group is not None else t)
                open_group = None
            t_prev = t
        stall_log.append(stalls)
    starts.append(t_prev + 1)
    span = starts[-1] - starts[-1 - measured]
    mean_stalls: Counter = Counter()
    for c in stall_log[-measured:]:
        mean_stalls.update(c)
    issued = sum(1 for op in ops)
    smsp: Counter = Counter()
    sm: Counter = Counter()
    for op in ops:
        for res, cycles in op.busy:
            (smsp if res in _SMSP_PIPES else sm)[res] += cycles
    return Chain(span / measured, issued, dict(smsp), dict(sm), {k: v / measured for k, v in mean_stalls.items()})


# ======================================================================================
# Hypotheticals: SASS rewrites for the levers (what a kernel change would remove or split)
# ======================================================================================


def _is_move(op: Op) -> bool:
    """A plain register copy: ``MOV Rd, Rs`` or ``IMAD.MOV.U32 Rd, RZ, RZ, Rs``."""
    base = op.opcode.split(".")[0]
    moving = base == "MOV" or (base == "IMAD" and ".MOV" in op.opcode)
    return moving and len(op.dst) == 1 and len(op.src) == 1 and op.src[0].startswith("R")


def _alias_safe(ops: list[Op], i: int, dst: str, src: str) -> bool:
    """Whether every later read of ``dst`` (until ``dst`` is rewritten) may read ``src``
    instead: ``src`` is not rewritten before such a read, and ``dst`` is not read across the
    back edge before the next iteration rewrites it."""
    src_changed = False
    for op in ops[i + 1:]:
        if dst in op.src and src_changed:
            return False
        if dst in op.dst:
            return True
        if src in op.dst:
            src_changed = True
    for op in ops[:i]:
        if dst in op.src:
            return False
        if dst in op.dst:
            return True
    return True


def remove_with_alias(ops: list[Op], indices: set[int]) -> tuple[list[Op], int]:
    """Drop the single-source ops at ``indices`` (a move, a shift an operand selector could
    absorb), their readers reading the source instead, where ``_alias_safe`` allows."""
    out: list[Op] = []
    alias: dict[str, str] = {}
    removed = 0
    for i, op in enumerate(ops):
        op = replace(op, src=tuple(alias.get(s, s) for s in op.src), acc=tuple(alias.get(s, s) for s in op.acc))
        if i in indices and len(op.dst) == 1 and len(op.src) == 1 and _alias_safe(ops, i, op.dst[0], op.src[0]):
            alias = {k: v for k, v in alias.items() if op.dst[0] not in (k, v)}
            alias[op.dst[0]] = op.src[0]
            removed += 1
            continue
        for d in op.dst:  # a rewritten register ends every alias to or from it
            alias = {k: v for k, v in alias.items() if d not in (k, v)}
        out.append(op)
    return out, removed


def fragment_move_indices(ops: list[Op]) -> set[int]:
    """Register moves that copy an ``ldmatrix`` result (directly or through another such move)
    into another register: the PV A-fragment assembly ``{r0, r2, r1, r3}`` and its kin."""
    from_ldsm: set[str] = set()
    found: set[int] = set()
    for rnd in (0, 1):  # the first pass only learns what the previous iteration leaves
        for i, op in enumerate(ops):
            if _is_move(op) and op.src[0] in from_ldsm:
                from_ldsm.update(op.dst)
                if rnd:
                    found.add(i)
                continue
            from_ldsm.difference_update(op.dst)
            if op.opcode.startswith("LDSM"):
                from_ldsm.update(op.dst)
    return found


def without_fragment_moves(ops: list[Op]) -> tuple[list[Op], int]:
    """Lever 'V loaded by an ldmatrix lane mapping that yields the A fragment in register
    order': every move of an ``ldmatrix`` result dropped, its readers reading the
    ``ldmatrix`` registers directly."""
    return remove_with_alias(ops, fragment_move_indices(ops))


def _readers(ops: list[Op], i: int) -> list[Op]:
    """The ops that read what op ``i`` writes, before it is rewritten (this iteration, then
    across the back edge)."""
    reg, out = ops[i].dst[0], []
    for op in ops[i + 1:] + ops[:i]:
        if reg in op.src:
            out.append(op)
        if reg in op.dst:
            break
    return out


def without_fp8_high_half_shifts(ops: list[Op]) -> tuple[list[Op], int]:
    """Lever 'shorter fp8 conversion paths': each ``SHF.R.U32.HI Rd, RZ, 0x10, Rs`` whose result
    only ``F2FP.F16.E4M3.UNPACK_B`` reads (moving a word's high two fp8 bytes down) dropped,
    the unpack reading the high half of ``Rs`` through an operand selector."""
    shifts = {i for i, op in enumerate(ops) if op.opcode.startswith("SHF.R.U32.HI") and ", 0x10," in op.text
              and len(op.dst) == 1 and _readers(ops, i) and all("UNPACK" in r.opcode for r in _readers(ops, i))}
    return remove_with_alias(ops, shifts)


def split_accumulator_chains(ops: list[Op], chains: int) -> tuple[list[Op], int]:
    """Lever 'two or more independent QK accumulator chains': every chain of HMMAs that starts
    from a zero accumulator (C = RZ) and accumulates into the previous HMMA's result is dealt
    round-robin to ``chains`` accumulators, summed after the last HMMA by ``chains - 1``
    FADDs per accumulator register (a tree). Returns the ops and how many chains were split."""
    if chains < 2:
        return list(ops), 0
    starts = [i for i, op in enumerate(ops) if op.opcode.startswith("HMMA") and not op.acc]
    members: dict[int, list[int]] = {}
    for s in starts:
        chain, cur = [s], s
        for j in range(s + 1, len(ops)):
            op = ops[j]
            if op.opcode.startswith("HMMA") and op.acc and set(op.acc) == set(ops[cur].dst):
                chain.append(j)
                cur = j
            elif set(ops[cur].dst) & set(op.src) or set(ops[cur].dst) & set(op.dst):
                break
        if len(chain) >= 2 * chains:
            members[s] = chain
    if not members:
        return list(ops), 0
    out = list(ops)
    inserts: dict[int, list[Op]] = {}
    for n, (s, chain) in enumerate(members.items()):
        width = len(ops[chain[-1]].dst)
        virt = [[f"V{n}_{c}_{r}" for r in range(width)] for c in range(chains)]
        for pos, j in enumerate(chain):
            c = pos % chains
            op = ops[j]
            others = tuple(x for x in op.src if x not in op.acc)
            acc = tuple(virt[c]) if pos >= chains else ()
            out[j] = replace(op, dst=tuple(virt[c]), src=others + acc, acc=acc)
        final = ops[chain[-1]].dst
        adds, level = [], [list(v) for v in virt]
        while len(level) > 1:
            nxt = []
            for k in range(0, len(level), 2):
                if k + 1 == len(level):
                    nxt.append(level[k])
                    continue
                target = list(final) if len(level) == 2 else [f"{x}s" for x in level[k]]
                for r in range(width):
                    adds.append(Op(f"FADD {target[r]}, {level[k][r]}, {level[k + 1][r]} (hypothetical)", "FADD",
                                   (target[r],), (level[k][r], level[k + 1][r]), "alu",
                                   (("fma", 4 * pipe_cost(Instr(0, None, "FADD", ""))["fma"]),)))
                nxt.append(target)
            level = nxt
        inserts[chain[-1]] = adds
    result = []
    for i, op in enumerate(out):
        result.append(op)
        result.extend(inserts.get(i, []))
    return result, len(members)


def with_ring_depth(ops: list[Op], stages: int) -> list[Op]:
    """The loop with a ring of ``stages`` stages: its wait leaves ``stages - 2`` groups in flight."""
    return [replace(op, wait_groups=stages - 2) if op.role == "wait" else op for op in ops]


def block_table_in_shared(ops: list[Op]) -> tuple[list[Op], int]:
    """Lever 'the CTA's block-table slice staged in shared memory in the prologue': the loop's
    block-table loads (plain global loads) become shared-memory loads."""
    out, n = [], 0
    for op in ops:
        if op.kind == "global":
            out.append(replace(op, kind="shared", role="shared_load"))
            n += 1
        else:
            out.append(op)
    return out, n


def prefetch_distance(ops: list[Op]) -> int | None:
    """Instructions from the loop's block-table load to the first instruction that reads its
    result (across the back edge when the reader comes first): how far ahead the entry is
    fetched. None without such a load."""
    for i, op in enumerate(ops):
        if op.kind != "global":
            continue
        order = ops[i + 1:] + ops[:i + 1]
        for j, later in enumerate(order, start=1):
            if set(op.dst) & set(later.src):
                return j
    return None
