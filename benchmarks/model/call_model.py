"""The call model: one decode call's time on an H200 from the plan's grid and the per-tile
chain of one warp (``warp_chain``), as % of copy bandwidth, with the binding limit named.
EVERY FIGURE IS MODELLED (SASS + ``model_assumptions``); nothing here is measured.

What it takes, per call (``Call``: shape, KV dtype, batch, context):

* the real plan: ``metrale_attn.plan.make_plan`` on a ``LayerConfig`` under the hopper
  target's ``auto`` policy (as ``DecodeAttention`` builds it: page size 16, q bf16), so the
  split count, ``heads_per_cta`` (the plan's rule) and the grid are the library's own;
* each CTA's token range (``split_range``, the rule of ``pd_splitk.cuh``), its tiles
  (absolute positions, tile ``k`` to warp ``k mod W``) and so the slowest warp's tile count;
* the kernel's timing (``KernelTiming``): the per-tile chain of one warp at two DRAM
  latencies, with the block-table entry hitting L2 or missing to DRAM; issue and pipe
  cycles per tile; CTAs per SM; per-CTA fixed costs (``prologue_cycles``,
  ``epilogue_cycles``).

The simulation (``simulate``) puts CTAs on 132 SMs in launch order (breadth-first: one per
SM, then a second, ...; a freed slot takes the next CTA), each going prologue -> body ->
epilogue. A CTA in its body advances one tile per warp every ``T(c)`` cycles, ``c`` being
the CTAs in their body on that SM: ``T(c) = max(chain, c x issue, 4c x SM-wide units)``
(``Chain.per_warp_tile_cycles``); the chain's DRAM latency moves from ``latency_short_ns``
to ``latency_long_ns`` with the HBM utilisation, and its block-table entry misses with the
probability ``bt_miss_probability``. If the bodies together ask HBM for more than
``hbm_copy_tb_s`` (unique bytes: the ``G / heads_per_cta`` CTAs reading a row share it
through L2) or L2 for more than ``l2_tb_s``, every body slows in proportion. The call's time
is one kernel launch + the attention kernel's span + (split-K) a launch and the merge. The %
is the KV bytes the call must read / that time / 4.3 TB/s.

The binding limit: at every interval of the simulation the HBM rate the SMs leave unused
(4.3 TB/s minus what they read) is charged to why each SM is short of its 1/132 share: no
CTA (``grid fill``), only CTAs in prologue or epilogue (``fixed costs``), or bodies slower
than the share, by what sets ``T(c)`` (``issue``; the chain, split by its stalls into
``memory-level parallelism`` (waiting for a cp.async stage), ``block-table latency`` and
``chain latency`` (everything else)). Launch and merge are ``launch + merge``. The loss that
costs the most points is the binding limit; under 5 points, ``bandwidth cap``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from metrale_attn import dtypes, policy
from metrale_attn.config import LayerConfig, ModelShape
from metrale_attn.kernels import KernelSpec
from metrale_attn.sources import merge_threads
from metrale_attn.plan import DecodePlan, make_plan
from metrale_attn.targets import get_target, resolve_target_policy

from . import warp_chain as wc
from .model_assumptions import a, cycles_of_ns
from .sass import occupancy

PAGE_SIZE = 16
"""The sweep's page size (``benchmarks/sweep_plan.py`` profiles)."""


@dataclass(frozen=True)
class Call:
    """One decode call: ``batch`` sequences of ``context`` tokens each, q bf16."""

    q_heads: int
    kv_heads: int
    head_dim: int
    kv_dtype: str  # "bf16" | "fp8" (e4m3) | "fp16"
    batch: int
    context: int
    q_dtype: str = "bf16"
    page_size: int = PAGE_SIZE

    @property
    def kv_bytes(self) -> int:
        """K + V bytes the call must read."""
        item = dtypes.NUMPY_DTYPES[self.kv_dtype].itemsize
        return self.batch * self.context * self.kv_heads * self.head_dim * item * 2

    def label(self) -> str:
        return f"{self.q_heads}/{self.kv_heads}/{self.head_dim} {self.kv_dtype} b{self.batch} x {self.context}"


DECISIVE_BATCHES = ((64, 4096), (16, 4096), (1, 32768))
"""The issue's three columns: batch 64 x 4k, batch 16 x 4k, batch 1 x 32k."""


def plan_for(call: Call, impl: str = "mma") -> DecodePlan:
    """The plan ``DecodeAttention`` makes for this call on the hopper target (its declared
    ``auto`` split policy, GQA pack off, no environment overrides)."""
    defaults = resolve_target_policy(get_target("hopper"), environ={})
    config = LayerConfig(ModelShape(call.q_heads, call.kv_heads, call.head_dim), call.page_size, call.q_dtype,
                         call.kv_dtype, max(call.batch, 1), defaults, impl=impl)
    return make_plan(config, call.batch)


def variant_for(call: Call, plan: DecodePlan) -> KernelSpec:
    """The spec the plan launches, on hopper."""
    return KernelSpec(plan.arm, call.head_dim, call.q_dtype, call.kv_dtype, plan.impl, plan.row_tiles)


def split_range(seq_len: int, split: int, num_splits: int) -> tuple[int, int]:
    """``pd_split_range`` (kernels_cu/pd_splitk.cuh): split ``split``'s keys ``[start, end)``."""
    chunk = max(-(-seq_len // num_splits), policy.PD_MIN_KV_PER_SPLIT)
    return min(split * chunk, seq_len), min((split + 1) * chunk, seq_len)


def warp_tiles(lo: int, hi: int, tile_tokens: int, warps: int) -> list[int]:
    """Tiles each warp of a CTA takes for keys ``[lo, hi)``: tiles are aligned to absolute
    positions (tile ``k`` covers ``[k TT, (k + 1) TT)``) and tile ``k`` goes to warp ``k mod W``
    (``attend`` in decode_core.cuh)."""
    if hi <= lo:
        return [0] * warps
    k0, k1 = lo // tile_tokens, -(-hi // tile_tokens)
    return [len(range(k0 + ((w - k0) % warps), k1, warps)) for w in range(warps)]


def bt_miss_probability(tile_tokens: int, page_size: int, warps: int) -> float:
    """The chance that a warp's block-table entry for its next tile lies in a 32-byte sector
    no earlier tile of this call read (``bt_sector_bytes``): the W warps of a CTA, in
    lockstep, read ``W x ceil(TT / page)`` consecutive 4-byte entries per round of tiles."""
    per_round = warps * max(1, -(-tile_tokens // page_size)) * 4
    return min(1.0, per_round / a("bt_sector_bytes"))


# ======================================================================================
# A kernel's timing: the chain at two latencies, the fixed costs per CTA
# ======================================================================================


@dataclass(frozen=True)
class Levers:
    """A hypothetical kernel (issue 19's levers), computed through the same model:
    ``warps_per_cta`` (W warps per CTA: each warp's ring as today, CTAs per SM from the new
    shared memory), ``no_fragment_moves`` (V by an ldmatrix mapping yielding the A fragment
    in register order), ``qk_chains`` (independent QK accumulator chains), ``bt_in_smem``
    (the CTA's block-table slice staged in shared memory in the prologue), ``persistent``
    (persistent CTAs in their idealised form: every round trip of a later item's prologue
    hidden behind the previous item),
    ``fp8_selectors`` (the fp8 unpack reads a word's high half directly: no shifts),
    ``hmma_latency`` (a sensitivity, not a lever); ``warm_next`` and ``next_in_flight`` are
    no levers but what the ``mma`` kernel does (set by ``sass_model`` for every mma spec):
    persistent CTAs that bring the next item's q rows and first block-table entries into L2
    (``warm_prologue_cycles``), and whose warps issue the next item's first
    ``next_in_flight`` stages (the spec's ``Tiling.prefetch``) before the epilogue
    (``ahead_prologue_cycles``); ``dependent_merge``, what every ``mma`` kernel does (set by
    ``sass_model``): the split-K merge launched as the attention grid's programmatic dependent
    (``dependent_launch_gap``)."""

    name: str = "today"
    warps_per_cta: int | None = None
    no_fragment_moves: bool = False
    qk_chains: int = 1
    bt_in_smem: bool = False
    persistent: bool = False
    fp8_selectors: bool = False
    hmma_latency: float | None = None
    warm_next: bool = False
    next_in_flight: int = 0
    dependent_merge: bool = False

    def rewrite(self, ops: list[wc.Op]) -> tuple[list[wc.Op], dict[str, int]]:
        """``ops`` with this hypothetical's SASS rewrites, and how many instructions each touched."""
        done: dict[str, int] = {}
        if self.no_fragment_moves:
            ops, done["fragment_moves_removed"] = wc.without_fragment_moves(ops)
        if self.fp8_selectors:
            ops, done["fp8_shifts_removed"] = wc.without_fp8_high_half_shifts(ops)
        if self.qk_chains > 1:
            ops, done["accumulator_chains_split"] = wc.split_accumulator_chains(ops, self.qk_chains)
        if self.bt_in_smem:
            ops, done["block_table_loads_to_shared"] = wc.block_table_in_shared(ops)
        return ops, done


LEVERS = (
    Levers("today"),
    Levers("8 warps per CTA", warps_per_cta=8),
    Levers("A fragment in register order", no_fragment_moves=True),
    Levers("2 QK accumulator chains", qk_chains=2),
    Levers("block table in shared memory", bt_in_smem=True),
    Levers("persistent CTAs", persistent=True),
    Levers("fp8 unpack without shifts", fp8_selectors=True),
    Levers("8 warps per CTA + persistent CTAs", warps_per_cta=8, persistent=True),
    Levers("all but 8 warps per CTA", no_fragment_moves=True, qk_chains=2, bt_in_smem=True, persistent=True,
           fp8_selectors=True),
    Levers("all of the above", warps_per_cta=8, no_fragment_moves=True, qk_chains=2, bt_in_smem=True,
           persistent=True, fp8_selectors=True),
)
"""The levers of issue 19 the report computes, each alone, then together."""


@dataclass
class KernelTiming:
    """What the call model needs of one spec: its tile, warps, occupancy, the chains and
    the fixed costs (cycles). ``chains[(latency_ns, bt)]`` for ``bt`` in ``l2``/``dram``."""

    name: str
    tile_tokens: int
    tile_bytes: int  # K + V of one warp's tile
    warps_per_cta: int
    ctas_per_sm: int
    occupancy_limiter: str
    dynamic_smem_bytes: int
    rows: int  # query rows a CTA holds (heads_per_cta x q_len) at this call; set per call
    chains: dict[tuple[float, str], wc.Chain]
    prologue_instructions: int
    epilogue_instructions: int
    levers: Levers = field(default_factory=Levers)
    rewrites: dict[str, int] = field(default_factory=dict)
    stages: int = 0  # each warp's ring
    item_prologue_instructions: int | None = None  # a persistent CTA's later item (None: prologue_instructions)

    @property
    def item_prologue(self) -> int:
        """Instructions of a later item's prologue (the mma kernel: from the item loop's top)."""
        return self.prologue_instructions if self.item_prologue_instructions is None else self.item_prologue_instructions

    @property
    def any_chain(self) -> wc.Chain:
        return next(iter(self.chains.values()))

    def chain_cycles(self, utilisation: float, bt_miss: float) -> float:
        """One warp's cycles per tile: DRAM latency interpolated by HBM utilisation between
        the short and long latencies, the block-table entry missing with ``bt_miss``."""
        lo, hi = a("latency_short_ns"), a("latency_long_ns")
        u = min(max(utilisation, 0.0), 1.0)

        def at(bt: str) -> float:
            return self.chains[(lo, bt)].cycles + u * (self.chains[(hi, bt)].cycles - self.chains[(lo, bt)].cycles)

        return (1 - bt_miss) * at("l2") + bt_miss * at("dram")

    def stall_shares(self, bt_miss: float) -> dict[str, float]:
        """Shares of one warp's tile time spent waiting for a cp.async stage (``memory``) and
        for the block-table entry (``block_table``), at the long latency, expected over misses."""
        hi = a("latency_long_ns")
        out = {}
        for key in ("memory", "block_table"):
            stall = (1 - bt_miss) * self.chains[(hi, "l2")].stalls.get(key, 0.0) + \
                bt_miss * self.chains[(hi, "dram")].stalls.get(key, 0.0)
            total = (1 - bt_miss) * self.chains[(hi, "l2")].cycles + bt_miss * self.chains[(hi, "dram")].cycles
            out[key] = stall / total if total else 0.0
        return out


def kernel_timing(name: str, hot_instrs, tile_tokens: int, tile_bytes: int, warps_per_cta: int,
                  registers: int, dynamic_smem: int, static_smem: int, stages: int, stage_bytes_per_warp: int,
                  prologue_instructions: int, epilogue_instructions: int, levers: Levers = Levers(),
                  item_prologue_instructions: int | None = None,
                  smem_limit: int = 227 * 1024) -> KernelTiming | None:
    """Simulate the chain of the (rewritten) hot loop at both DRAM latencies, with the
    block-table load an L2 hit or a DRAM miss, and size the CTAs per SM. For
    ``levers.warps_per_cta`` W the carve holds W warps' rings (``stage_bytes_per_warp`` a
    stage, padding included), with fewer stages (down to 2) where W rings of today's depth
    pass ``smem_limit``; None when not even 2 fit."""
    ops, rewrites = levers.rewrite(wc.ops_of(hot_instrs))
    warps = levers.warps_per_cta or warps_per_cta
    front = dynamic_smem - warps_per_cta * stages * stage_bytes_per_warp
    depth = next((s for s in range(stages, 1, -1) if front + warps * s * stage_bytes_per_warp <= smem_limit), None)
    if depth is None:
        return None
    if depth != stages:
        ops = wc.with_ring_depth(ops, depth)
        rewrites["ring_stages"] = depth
    smem = front + warps * depth * stage_bytes_per_warp
    ctas, limiter = occupancy(registers, smem + static_smem, warps)
    if ctas < 1:
        return None
    chains = {}
    for ns in (a("latency_short_ns"), a("latency_long_ns")):
        mem = cycles_of_ns(ns)
        for bt, bt_lat in (("l2", a("lat_l2_hit")), ("dram", mem)):
            if levers.bt_in_smem:
                bt_lat = a("lat_shared")
            chains[(ns, bt)] = wc.simulate(ops, wc.Latencies.of(mem, bt_lat, levers.hmma_latency))
    return KernelTiming(name, tile_tokens, tile_bytes, warps, ctas, limiter, smem, 0, chains,
                        prologue_instructions, epilogue_instructions, levers, rewrites, depth, item_prologue_instructions)


def prologue_cycles(k: KernelTiming, dram: float) -> float:
    """A CTA's fixed cost before its first tile computes: q's rows loaded (a DRAM round trip,
    the L2 having been flushed) and staged (a barrier), the first block-table entry (a DRAM
    round trip: it needs the CTA's key range), the first stage's copies (a DRAM round trip),
    and the prologue's instructions issued by one warp. The persistent-CTA lever hides the
    round trips behind the previous item (all but the first on a slot)."""
    return 3 * dram + a("bar_sync") + k.prologue_instructions


def warm_prologue_cycles(k: KernelTiming, dram: float) -> float:
    """The prologue of a persistent CTA's later item in the mma kernel (``Levers.warm_next``):
    its q rows and its first block-table entries were brought into L2 while the previous
    item streamed (decode_core.cuh, ``warm_item``), so those two round trips are L2 hits;
    the first stage's copies still wait on DRAM (their addresses need the entries)."""
    return dram + 2 * a("lat_l2_hit") + a("bar_sync") + k.item_prologue


def ahead_prologue_cycles(k: KernelTiming, dram: float, epilogue: float) -> float:
    """The prologue of a persistent CTA's later item in the mma kernel with its first P =
    ``Levers.next_in_flight`` stages issued before the previous item's epilogue (decode_core.cuh,
    ``issue_ahead``): each warp, its state published, loads the item's first block-table entries
    (L2 hits, ``warm_item``: the barrier waits for them) and issues its first P tiles, whose
    DRAM round trip then runs under the rest of the epilogue (``epilogue``), the item's q
    staging from L2 and its barrier, and the prologue's instructions; the first tile waits what
    the round trip outlasts them by. With P < S - 1 the prologue issues the rest, and tile P's
    round trip outlasts that wait and the P tiles computed before it by the rest of its wait."""
    covered = epilogue + a("lat_l2_hit") + a("bar_sync") + k.item_prologue
    first = max(0.0, dram - covered)
    short = k.levers.next_in_flight < k.stages - 1
    rest = max(0.0, dram - first - k.levers.next_in_flight * k.any_chain.cycles) if short else 0.0
    return 2 * a("lat_l2_hit") + a("bar_sync") + k.item_prologue + first + rest


def epilogue_cycles(k: KernelTiming, head_dim: int) -> float:
    """A CTA's fixed cost after its last tile: the warp states published (two barriers, one
    where each warp publishes into its own ring: ``Levers.next_in_flight``, the mma kernel; and
    the epilogue's instructions issued), then per output element a thread combines the W
    warp states (a shared load, exp2, the sums: ``lat_shared + lat_xu + 2 lat_alu``), for
    ``rows x D / threads`` elements in turn; the stores are not waited for."""
    per_thread = math.ceil(max(k.rows, 1) * head_dim / (32 * k.warps_per_cta))
    barriers = 1 if k.levers.next_in_flight else 2
    return barriers * a("bar_sync") + k.epilogue_instructions + per_thread * (
        a("lat_shared") + a("lat_xu") + 2 * a("lat_alu"))


def dependent_launch_gap(released: float, ended: float) -> float:
    """The gap between the attention grid's end (``ended``) and the merge's first CTAs at
    work when the merge is that grid's programmatic dependent: its launch (``launch``) starts
    once every CTA has released it, at the start of the grid's last item (``released``), and
    its CTAs, resident by then, wait on the device for the grid's end and its memory
    (``pdl_wait``): the later of the two."""
    return max(a("pdl_wait"), released + a("launch") - ended)


def merge_cycles(call: Call, plan: DecodePlan, utilisation_dram: float, launch: float | None = None) -> float:
    """The split-K merge: a launch after the attention kernel (``launch`` cycles: the
    ``launch`` assumption, or ``dependent_launch_gap`` for a dependent launch), then waves of merge CTAs
    (one per (head, row)) whose threads read every split's m (one L2 round trip: the
    workspace was just written), then l and o (another), exp2 and the sum; or the workspace
    bytes at L2 bandwidth and the output at HBM bandwidth, whichever is longer."""
    if plan.arm != "splitk":
        return 0.0
    ctas = plan.launches[1].items  # the merge: one CTA an item
    threads = merge_threads(call.head_dim)  # the binding's block: a thread per output dim
    per_sm = min(int(a("max_threads_per_sm")) // threads, int(a("max_ctas_per_sm")))  # ~40 registers, no shared
    waves = math.ceil(ctas / (a("sm_count") * per_sm))
    per_thread = math.ceil(call.head_dim / threads)
    chain = waves * per_thread * (2 * a("lat_l2_hit") + a("lat_xu") + plan.num_splits * a("lat_alu"))
    ws_bytes = ctas * plan.num_splits * (call.head_dim + 2) * 4
    out_bytes = ctas * call.head_dim * 2
    clock = a("clock_ghz") * 1e9
    stream = ws_bytes / (a("l2_tb_s") * 1e12) * clock + out_bytes / (a("hbm_copy_tb_s") * 1e12) * clock
    return (a("launch") if launch is None else launch) + max(chain, stream)


# ======================================================================================
# The grid on 132 SMs
# ======================================================================================

LOSSES = ("launch + merge", "fixed costs", "grid fill", "issue", "chain latency", "block-table latency",
          "memory-level parallelism")


@dataclass
class CallPrediction:
    """One call, modelled: time, % of copy, and where the rest went (points of %)."""

    call: Call
    plan: DecodePlan
    kernel: KernelTiming
    ctas: int
    waves: float
    tokens_per_cta: int
    tiles_per_warp: int  # the slowest warp of the largest CTA
    bt_miss: float
    chain_cycles: float  # one warp's cycles per tile at the call's mean HBM utilisation
    per_warp_tile_cycles: float  # at the occupancy the call reaches (busiest SM)
    prologue: float
    epilogue: float
    merge: float
    time_us: float
    pct: float
    losses: dict[str, float]
    binding: str
    body_binding: str

    def row(self) -> dict:
        k = self.kernel
        return {
            "call": self.call.label(), "q_heads": self.call.q_heads, "kv_heads": self.call.kv_heads,
            "head_dim": self.call.head_dim, "q_dtype": self.call.q_dtype,
            "kv_dtype": "fp8_e4m3" if self.call.kv_dtype == "fp8" else self.call.kv_dtype,
            "batch": self.call.batch, "context": self.call.context, "page_size": self.call.page_size,
            "lever": k.levers.name, "impl": self.plan.impl, "arm": self.plan.arm, "spec": k.name,
            "num_splits": self.plan.num_splits, "heads_per_cta": self.plan.heads_per_cta,
            "ctas": self.ctas, "waves": round(self.waves, 3), "tokens_per_cta": self.tokens_per_cta,
            "tiles_per_warp": self.tiles_per_warp, "warps_per_cta": k.warps_per_cta, "ctas_per_sm": k.ctas_per_sm,
            "occupancy_limiter": k.occupancy_limiter, "dynamic_smem_bytes": k.dynamic_smem_bytes,
            "chain_cycles_per_tile": round(self.chain_cycles, 1),
            "chain_cycles_bt_l2": round(k.chains[(a("latency_long_ns"), "l2")].cycles, 1),
            "chain_cycles_bt_dram": round(k.chains[(a("latency_long_ns"), "dram")].cycles, 1),
            "issue_cycles_per_tile": round(k.any_chain.issue_bound, 1),
            "instructions_per_tile": k.any_chain.issued,
            "per_warp_tile_cycles": round(self.per_warp_tile_cycles, 1), "bt_miss_probability": self.bt_miss,
            "prologue_cycles": round(self.prologue), "epilogue_cycles": round(self.epilogue),
            "merge_cycles": round(self.merge), "time_us": round(self.time_us, 3), "kv_bytes": self.call.kv_bytes,
            "predicted_pct": round(float(self.pct), 1), "binding": self.binding, "body_binding": self.body_binding,
            "losses_pct": {k2: round(float(v), 1) for k2, v in self.losses.items()}, "rewrites": dict(k.rewrites),
            "modelled": True,
        }


def _ctas(call: Call, plan: DecodePlan, k: KernelTiming) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per CTA in launch order: the slowest warp's tiles, the K+V bytes it reads, its tokens.
    Split-K grids are (heads / h, splits, sequences), x fastest; the others read every key."""
    row_bytes = call.head_dim * dtypes.NUMPY_DTYPES[call.kv_dtype].itemsize * 2
    if plan.arm == "splitk":
        x, splits, seqs = plan.launches[0].grid
        ranges = [split_range(call.context, s, splits) for s in range(splits)]
        order = np.tile(np.repeat(np.arange(splits), x), seqs)
    else:
        ranges, order = [(0, call.context)], np.zeros(plan.items, int)
    tiles = np.array([max(warp_tiles(lo, hi, k.tile_tokens, k.warps_per_cta)) for lo, hi in ranges], float)
    tokens = np.array([max(hi - lo, 0) for lo, hi in ranges], float)
    return tiles[order], tokens[order] * row_bytes, tokens[order]


def _spread(i: int) -> float:
    """A deterministic value in [-1, 1) for CTA ``i`` (the golden-ratio sequence): where in
    the DRAM latency range its prologue's round trips fall."""
    return 2 * ((i * 0.6180339887498949) % 1.0) - 1


QUANTUM = 128
"""Cycles the simulation advances at least per step: a phase that ends inside a step ends at
its exact time, the step's rest carried into its next phase."""


def simulate(call: Call, plan: DecodePlan, k: KernelTiming, lockstep: bool = False) -> CallPrediction:
    """The call on 132 SMs (module docstring). Each CTA's prologue round trips take the
    DRAM latency of the moment plus a spread (``prologue_spread`` of half the short-to-long
    latency range, ``_spread``): what keeps co-resident CTAs out of lockstep; ``lockstep``
    drops it (then the prologues of co-resident CTAs coincide)."""
    sms, slots_per_sm = int(a("sm_count")), k.ctas_per_sm
    clock = a("clock_ghz") * 1e9
    cap = a("hbm_copy_tb_s") * 1e12 / clock  # HBM bytes per cycle
    l2cap = a("l2_tb_s") * 1e12 / clock
    readers = call.q_heads // call.kv_heads / plan.heads_per_cta  # CTAs reading each K/V row
    bt_miss = bt_miss_probability(k.tile_tokens, call.page_size, k.warps_per_cta)
    tiles, nbytes, tokens = _ctas(call, plan, k)
    n = len(tiles)
    c1 = k.any_chain
    sm_unit = max(c1.sm_busy.values(), default=0.0)
    lo_ns, hi_ns = a("latency_short_ns"), a("latency_long_ns")
    shares = k.stall_shares(bt_miss)
    half_range = a("prologue_spread") * (cycles_of_ns(hi_ns) - cycles_of_ns(lo_ns)) / 2

    def dram(u: float) -> float:
        return cycles_of_ns(lo_ns + min(max(u, 0), 1) * (hi_ns - lo_ns))

    # Slots: SM s, level j -> slot j * sms + s (breadth-first fill).
    nslots = sms * slots_per_sm
    sm_of = np.arange(nslots) % sms
    cta = np.full(nslots, -1)
    phase = np.zeros(nslots, int)  # 0 prologue, 1 body, 2 epilogue
    left = np.zeros(nslots)
    per_tile = np.zeros(nslots)  # bytes per tile of the slot's CTA
    items_done = np.zeros(nslots, int)  # per slot, for the persistent lever
    u = 0.0  # the first wave's prologues run on an idle memory system
    epi = epilogue_cycles(k, call.head_dim)
    nxt = 0
    t = 0.0
    released = 0.0  # when the last item starts: every CTA has released the merge (dependent_launch_gap)

    def start(slot: int) -> None:
        nonlocal nxt, released
        cta[slot], phase[slot] = nxt, 0
        per_tile[slot] = nbytes[nxt] / max(tiles[nxt], 1)
        spread = 0.0 if lockstep else _spread(nxt) * half_range
        if k.levers.persistent and items_done[slot] > 0:  # its round trips overlapped with the previous item
            left[slot] = k.prologue_instructions + a("bar_sync")
        elif k.levers.next_in_flight and items_done[slot] > 0:  # the mma kernel: its first stages in flight
            left[slot] = ahead_prologue_cycles(k, dram(u) + spread, epi)
        elif k.levers.warm_next and items_done[slot] > 0:  # q and the entries in L2
            left[slot] = warm_prologue_cycles(k, dram(u) + spread)
        else:
            left[slot] = prologue_cycles(k, dram(u) + spread)
        nxt += 1
        if nxt == n:
            released = t

    def advance(slot: int, overshoot: float, body_rate: float) -> None:
        """Slot ``slot`` ended its phase ``overshoot`` cycles before the step's end."""
        while True:
            if phase[slot] == 0:
                phase[slot], left[slot] = 1, tiles[cta[slot]]
                rate = body_rate
            elif phase[slot] == 1:
                phase[slot], left[slot], rate = 2, epi, 1.0
            else:
                items_done[slot] += 1
                cta[slot] = -1
                if nxt >= n:
                    return
                start(slot)
                rate = 1.0
            if left[slot] > overshoot * rate:
                left[slot] -= overshoot * rate
                return
            overshoot -= left[slot] / rate if rate else 0.0

    for slot in range(nslots):
        if nxt < n:
            start(slot)
    loss = dict.fromkeys(LOSSES[1:], 0.0)
    t_peak_warp = 0.0
    u_weighted, body_time = 0.0, 0.0
    share = cap / sms
    while True:
        active = cta >= 0
        if not active.any():
            break
        body = active & (phase == 1)
        per_sm = np.bincount(sm_of[body], minlength=sms)
        c = per_sm[sm_of]
        chain = k.chain_cycles(u, bt_miss)
        # a warp's tile: its chain, or its scheduler's issue shared with the warps beside it, or
        # the SM-wide units shared with every warp of the SM
        T = np.maximum(np.maximum(chain, wc.warps_per_scheduler(c, k.warps_per_cta) * c1.issue_bound),
                       c * k.warps_per_cta * sm_unit)
        tile_rate = np.where(body, 1.0 / T, 0.0)  # tiles per cycle per warp at full speed
        bytes_rate = per_tile * tile_rate
        total = bytes_rate.sum()
        hbm = total / readers
        scale = min(1.0, cap / hbm if hbm else 1.0, l2cap / total if total else 1.0)
        u = min(1.0, hbm * scale / cap)
        rate = np.where(body, tile_rate * scale, 1.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            finish = np.where(active, left / rate, np.inf)
        dt = max(float(finish.min()), QUANTUM)
        # -- where the unused HBM rate goes in this step
        got = bytes_rate * scale / readers  # unique bytes per cycle per slot
        deficit = max(cap - got.sum(), 0.0)
        if deficit > 0:
            sm_got = np.bincount(sm_of, weights=got, minlength=sms)
            sm_body = per_sm > 0
            sm_any = np.bincount(sm_of[active], minlength=sms) > 0
            short = np.maximum(share - sm_got, 0.0)
            raw = {"grid fill": short[~sm_any].sum(), "fixed costs": short[sm_any & ~sm_body].sum()}
            body_short = short[sm_body].sum()
            why = c1.binding(float(per_sm.max() or 1)) if body.any() else "chain"
            if why == "chain":
                raw["memory-level parallelism"] = body_short * shares["memory"]
                raw["block-table latency"] = body_short * shares["block_table"]
                raw["chain latency"] = body_short * (1 - shares["memory"] - shares["block_table"])
            else:
                raw["issue"] = body_short
            weight = sum(raw.values())
            if weight:
                for key, v in raw.items():
                    loss[key] += v / weight * deficit * dt
        if body.any():
            t_peak_warp = max(t_peak_warp, float(T[body].max()))
            u_weighted += u * dt
            body_time += dt
        left = np.where(active, left - rate * dt, left)
        t += dt
        for slot in np.flatnonzero(active & (left <= 1e-9)):
            advance(int(slot), -left[slot] / rate[slot], float(tile_rate[slot] * scale) if body[slot] else
                    float(scale / max(chain, c1.issue_bound)))
    mean_u = u_weighted / body_time if body_time else 0.0
    dependent = k.levers.dependent_merge and plan.arm == "splitk"
    merge = merge_cycles(call, plan, mean_u, dependent_launch_gap(released, t) if dependent else None)
    launch = a("launch")
    total_cycles = launch + t + merge
    pct = 100.0 * call.kv_bytes / cap / total_cycles
    losses = {"launch + merge": 100.0 * (launch + merge) / total_cycles}
    for key, v in loss.items():
        losses[key] = 100.0 * v / cap / total_cycles
    worst = max(losses, key=losses.get)
    binding = worst if losses[worst] >= 5.0 else "bandwidth cap"
    busy = min(slots_per_sm, math.ceil(n / sms))  # CTAs of a busy SM; what sets T there, as in the loop
    paces = {"chain": c1.cycles, "issue": float(wc.warps_per_scheduler(busy, k.warps_per_cta)) * c1.issue_bound,
             "sm_units": busy * k.warps_per_cta * sm_unit}
    body_binding = max(paces, key=paces.get)
    return CallPrediction(call, plan, k, n, n / (sms * slots_per_sm), int(tokens.max()) if n else 0,
                          int(tiles.max()) if n else 0, bt_miss, k.chain_cycles(mean_u, bt_miss), t_peak_warp,
                          prologue_cycles(k, dram(mean_u)), epi, merge, total_cycles / clock * 1e6, pct, losses,
                          binding, body_binding)


def with_rows(k: KernelTiming, plan: DecodePlan) -> KernelTiming:
    """``k`` at the plan's query rows per CTA (the epilogue's share of elements)."""
    return replace(k, rows=plan.heads_per_cta * plan.q_len)
