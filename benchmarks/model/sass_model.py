"""Static SASS report: what each kernel spec's steady-state loop costs, one warp's
per-tile chain, and each decisive call's predicted share of the H200's copy bandwidth with
the limit that binds it. EVERY FIGURE IS MODELLED from the compiler's output and the
assumption table (``model_assumptions``); nothing here is measured.

For each spec and model shape the report

1. compiles the spec with the backend's own NVRTC path
   (``cupy_backend.nvrtc_compile``, ptxas ``-v``) and disassembles the cubin with
   ``nvdisasm`` (PyPI ``nvidia-cuda-nvdisasm``; see ``find_nvdisasm``);
2. finds the hot loop from the control-flow graph (``sass``): basic blocks, dominators,
   natural loops; the innermost loop that holds global loads (K/V) is the hot loop. A tile
   (a steady-state iteration) counts every block a warp issues with all tokens valid: both
   sides of a lane-divergent branch, the load-keeping side of a warp-uniform one, the
   common side of a data-dependent one (its rare detour weighted by
   ``rare_path_probability``), never a ``BRA.DIV`` fallback (``STEADY_STATE_RULE``);
3. counts that tile's warp instructions per KiB of UNIQUE K/V (the K+V bytes of one KV
   head counted once: ``G / heads_per_cta`` CTAs read each row, so a CTA's count is
   multiplied by that), its instruction mix and the cost on each pipe;
4. reads registers, spills and stack frame from ptxas's ``-v`` log, shared memory
   (static from ptxas, dynamic from the spec) and the launch bounds, and computes CTAs
   and warps per SM (per scheduler: a CTA's 4 warps land one on each);
5. models the loads in flight (Little's law: plain loads from issue to their first use; a
   ``cp.async`` ring ``(stages - 1) * stage_bytes`` per CTA) and turns each resource into a
   ceiling in % of the copy bandwidth: issue, every pipe, shared memory, L2, bytes in
   flight at two latencies; the lowest is ``ceiling_pct``, its name ``binding``;
6. runs one warp's tile through a scoreboard (``warp_chain``): cycles per tile with the
   stated latencies, the block-table entry hitting L2 or missing to DRAM, and what it
   waited for;
7. for the decisive calls (every shape x KV dtype x batch 64 x 4k, 16 x 4k, 1 x 32k; q bf16)
   takes the plan ``DecodeAttention`` makes on hopper and puts its grid on 132 SMs
   (``call_model``): time per call, % of copy, the binding limit and the points lost to
   each limit; then the same for each lever of issue 19 (``call_model.LEVERS``);
8. checks every mma variant's shared memory against each target's per-block limit.

What the model needs beyond the SASS is a spec's ``HotLoop`` (``hot_loop.py``, computed
from the spec's public fields and source text): the kernel holding the loop, heads per
CTA, warps per CTA, tokens and K+V bytes one warp iteration consumes, pipeline stages and
stage bytes, dynamic shared memory.

Usage: ``python -m benchmarks.model.sass_model [--json PATH] [--arch sm_90 [sm_100]]
[--specs NAME_OR_ARM ...] [--shapes 32/8/128 ...] [--kv-dtypes bf16 fp8] [--calls decisive|none]
[--levers all|none] [--hmma-latency CYCLES]``. The markdown goes to stdout; ``--json`` writes
a dict: ``rows`` (one per spec x shape x arch, the fields ``predictions.py`` joins),
``calls`` (one per call x lever), ``smem_fit``, ``assumptions``, ``toolchain``.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field, replace

from metrale_attn import dtypes
from metrale_attn.kernels import KernelSpec, all_specs
from metrale_attn.sources import KernelSourceError
from metrale_attn.config import max_rows_per_cta
from metrale_attn.targets import TARGETS, get_target

from . import call_model
from .call_model import Call, KernelTiming, Levers, kernel_timing
from .hot_loop import arm_text, hot_loop, text_define
from .model_assumptions import ASSUMPTIONS, Assumption, a, assumptions_markdown  # noqa: F401 (the table's home)
from .sass import (  # noqa: F401 (re-exported: the report's tests and tools read them from here)
    MIX_KEYS, PIPES, Block, HotPath, InFlight, Instr, Loop, _width_bytes, build_cfg, category, disassemble,
    dominators, find_hot_path, find_nvdisasm, global_load_bytes, loads_in_flight, natural_loops, occupancy,
    parse_functions, pipe_cost, prologue_epilogue_instructions, ptxas_resources, registers, reverse_postorder,
    shared_bytes, tensor_fmas)
from .model_assumptions import cycles_of_ns
from .warp_chain import Latencies, fragment_move_indices, ops_of, prefetch_distance, warps_per_scheduler
from .warp_chain import simulate as simulate_chain


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
    prologue_instructions: int = 0
    epilogue_instructions: int = 0
    item_prologue_instructions: int = 0  # a persistent CTA's later item (from the item loop's top)
    launch_bounds: tuple[int, int] | None = None  # (max threads, min CTAs per SM) of the kernel
    timings: dict = field(default_factory=dict)  # Levers -> call_model.KernelTiming (None: does not fit)


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
    instrs, labels = functions[loop.kernel]
    hot = find_hot_path(instrs, labels)
    resources = ptxas_resources(log, loop.kernel)
    ctas, limiter = occupancy(resources["registers"], resources["static_smem_bytes"] + loop.dynamic_smem_bytes,
                              loop.warps_per_cta)
    in_flight = loads_in_flight(hot.instrs) if hot else None
    # K/V: vector loads and 16-byte cp.async (a 4-byte cp.async is a block-table entry, staged)
    vector_bytes = sum(global_load_bytes(i) for i in hot.instrs if _width_bytes(i) >= 8) if hot else 0
    iters = max(1, round(vector_bytes / loop.kv_bytes_per_warp_iter)) if vector_bytes else 1
    pro, epi, item_pro = prologue_epilogue_instructions(instrs, labels, hot) if hot else (0, 0, 0)
    return SpecFacts(spec, arch, resources, hot, in_flight, ctas, limiter, vector_bytes, iters, pro, epi,
                        item_pro, launch_bounds(spec, loop.kernel, loop.warps_per_cta))


def launch_bounds(spec: KernelSpec, kernel: str, warps: int) -> tuple[int, int] | None:
    """``(max threads, min CTAs per SM)`` of ``__launch_bounds__`` on ``kernel`` in the
    spec's source as its arm compiles it (``PD_LAUNCH_BOUNDS(threads, min)``; the kernel's
    name and the minimum may be names the source ``#define``s: the kernel written once for
    three arms is ``PD_ENTRY``), or None when it has none."""
    text = arm_text(spec.source())
    for found in re.finditer(r"PD_LAUNCH_BOUNDS\(\s*(\w+)\s*,\s*(\w+)\s*\)\s*(\w+)\s*\(", text):
        if text_define(text, found.group(3)) != kernel:
            continue
        threads, ctas = text_define(text, found.group(1)), text_define(text, found.group(2))
        if ctas is None or not ctas.isdigit():
            return None
        return (int(threads) if threads and threads.isdigit() else 32 * warps), int(ctas)
    return None


def timing(facts: SpecFacts, levers: Levers = Levers()) -> KernelTiming | None:
    """The call model's view of a spec (``call_model.kernel_timing``), memoized per lever;
    None for a spec without a loop or a ring, or a lever whose carve does not fit."""
    if levers not in facts.timings:
        v, loop, hot = facts.spec, hot_loop(facts.spec), facts.hot
        if hot is None or not v.tiling:
            facts.timings[levers] = None
        else:
            item = dtypes.NUMPY_DTYPES[v.kv_dtype].itemsize
            stage_pad = 2 * v.tiling.tile_tokens * (v.head_dim * item + 16)
            facts.timings[levers] = kernel_timing(
                v.name, hot.instrs, v.tiling.tile_tokens, loop.kv_bytes_per_warp_iter, loop.warps_per_cta,
                facts.resources["registers"], loop.dynamic_smem_bytes, facts.resources["static_smem_bytes"],
                v.tiling.stages, stage_pad, facts.prologue_instructions, facts.epilogue_instructions, levers,
                smem_limit=get_target("hopper").smem_per_block, item_prologue_instructions=facts.item_prologue_instructions)
    return facts.timings[levers]


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
                 "fewest_path_instructions": hot.fewest_path_instructions,
                 "rare_path_instructions": hot.rare_instructions,
                 "branches": dict(sorted(Counter(k for k in hot.branch_kinds.values()).items())),
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
        **tile_chain(facts),
    }


def tile_chain(facts: SpecFacts) -> dict:
    """One warp's per-tile chain (``warp_chain``) at ``latency_long_ns``: cycles with the
    block-table entry an L2 hit and a DRAM miss, issue cycles, stalls, the ldmatrix-fragment
    moves; and per SM at this occupancy (``ctas_per_sm`` warps per scheduler), with the
    entry missing as often as ``call_model.bt_miss_probability`` says at page size 16."""
    loop, hot = hot_loop(facts.spec), facts.hot
    k = timing(facts)
    long_ns = a("latency_long_ns")
    if k is not None:
        l2, dram = k.chains[(long_ns, "l2")], k.chains[(long_ns, "dram")]
    else:  # plain loads (simt): K/V and block-table loads wait their latency in the chain
        ops = ops_of(hot.instrs)
        mem = cycles_of_ns(long_ns)
        l2 = simulate_chain(ops, Latencies.of(mem, a("lat_l2_hit")))
        dram = simulate_chain(ops, Latencies.of(mem, mem))
    miss = call_model.bt_miss_probability(loop.tokens_per_warp_iter, call_model.PAGE_SIZE, loop.warps_per_cta)
    w = float(warps_per_scheduler(facts.ctas_per_sm, loop.warps_per_cta))
    per_warp = (1 - miss) * l2.per_warp_tile_cycles(w) + miss * dram.per_warp_tile_cycles(w)
    return {
        "chain_cycles_per_tile": round(l2.cycles, 1), "chain_cycles_bt_dram": round(dram.cycles, 1),
        "issue_cycles_per_tile": round(l2.issue_bound, 1), "instructions_per_tile": l2.issued,
        "chain_stalls_per_tile": {key: round(v, 1) for key, v in sorted(l2.stalls.items(), key=lambda x: -x[1])},
        "fragment_moves_per_tile": len(fragment_move_indices(ops_of(hot.instrs))),
        "bt_prefetch_distance_instructions": prefetch_distance(ops_of(hot.instrs)),
        "warps_per_scheduler": w, "launch_bounds": list(facts.launch_bounds) if facts.launch_bounds else None,
        "bt_miss_probability": miss, "cycles_per_tile_per_warp": round(per_warp, 1),
        "cycles_per_tile_per_sm": round(per_warp / (4 * w), 1), "tile_binding": l2.binding(w),
        "prologue_instructions": facts.prologue_instructions, "epilogue_instructions": facts.epilogue_instructions,
        "item_prologue_instructions": facts.item_prologue_instructions,
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


# ======================================================================================
# Calls: the decisive shapes under the plan, today's kernel and the levers
# ======================================================================================


def decisive_calls(shapes, kv_dtypes, q_dtype: str = "bf16") -> list[Call]:
    """Every shape x KV dtype x the issue's three columns (batch 64 x 4k, 16 x 4k, 1 x 32k)."""
    return [Call(q, kv, d, dt, batch, ctx, q_dtype) for q, kv, d in shapes for dt in kv_dtypes
            for batch, ctx in call_model.DECISIVE_BATCHES]


def predict_calls(calls: list[Call], facts_of, levers=(Levers(),)) -> list[dict]:
    """One row per call and lever (``call_model.simulate`` on the plan ``DecodeAttention``
    makes); ``facts_of(spec)`` gives the spec's ``SpecFacts`` (compiling it if
    needed). A lever whose carve does not fit gives a row with ``predicted_pct`` None."""
    out = []
    for call in calls:
        plan = call_model.plan_for(call)
        spec = call_model.variant_for(call, plan)
        facts = facts_of(spec)
        for lever in levers:
            if spec.impl == "mma":  # its merge is the attention grid's dependent; its CTAs are persistent:
                # the next item warmed, its first stages in flight
                lever = replace(lever, dependent_merge=True, warm_next=True, next_in_flight=spec.tiling.prefetch)
            k = timing(facts, lever)
            if k is None:
                out.append({"call": call.label(), "lever": lever.name, "spec": spec.name,
                            "batch": call.batch, "context": call.context, "predicted_pct": None,
                            "binding": "does not fit (shared memory)", "modelled": True})
                continue
            r = call_model.simulate(call, plan, call_model.with_rows(k, plan)).row()
            if lever.name == "today" and lever.hmma_latency is None:
                lock = call_model.simulate(call, plan, call_model.with_rows(k, plan), lockstep=True)
                r["predicted_pct_lockstep"] = round(lock.pct, 1)
            out.append({**r, "arch": facts.arch})
    return out


ISSUE_FIGURES = {  # issue 19, "Where the mma core stands": the independent model's central values
    (32, 8, 128): {(64, "bf16"): 94, (64, "fp8"): 79, (16, "bf16"): 79, (16, "fp8"): 62,
                   (1, "bf16"): 56, (1, "fp8"): 39},
    (64, 8, 128): {(64, "bf16"): 94, (64, "fp8"): 83, (16, "bf16"): 81, (16, "fp8"): 66,
                   (1, "bf16"): 34, (1, "fp8"): 24},
    (24, 4, 256): {(64, "bf16"): 84, (64, "fp8"): 81, (16, "bf16"): 70, (16, "fp8"): 67,
                   (1, "bf16"): 42, (1, "fp8"): 26},
}
"""The issue's independent figures, shown beside this model's for the cross-check (never used
by the model)."""


def calls_markdown(calls: list[dict]) -> str:
    """The predicted-% table (the issue's layout), then every call's detail."""
    today = [c for c in calls if c.get("lever") == "today" and c.get("predicted_pct") is not None]
    if not today:
        return ""
    shapes = list(dict.fromkeys((c["q_heads"], c["kv_heads"], c["head_dim"]) for c in today))
    by = {((c["q_heads"], c["kv_heads"], c["head_dim"]), c["batch"], c["kv_dtype"]): c for c in today}
    cols = list(dict.fromkeys((c["batch"], c["context"]) for c in today))
    lines = ["", "Predicted % of H200 copy bandwidth per call, today's kernel (MODELLED, not measured: "
             "`benchmarks/model/call_model.py`; the issue's independent model in brackets):", "",
             "| shape (q/kv/hd) | " + " | ".join(f"batch {b} x {ctx // 1024}k bf16 / fp8" for b, ctx in cols) +
             " | binding (bf16 / fp8 per column) |", "|---|" + "---|" * (len(cols) + 1)]
    for shape in shapes:
        cells, binds = [], []
        for b, _ in cols:
            pair, bind = [], []
            for kv in ("bf16", "fp8_e4m3"):
                c = by.get((shape, b, kv))
                ref = ISSUE_FIGURES.get(shape, {}).get((b, "fp8" if kv != "bf16" else "bf16"))
                pair.append("-" if c is None else f"{c['predicted_pct']:.0f}" + (f" [{ref}]" if ref else ""))
                bind.append("-" if c is None else c["binding"])
            cells.append(" / ".join(pair))
            binds.append(" / ".join(bind))
        lines.append(f"| {'/'.join(map(str, shape))} | " + " | ".join(cells) + " | " + "; ".join(binds) + " |")
    lines += ["", "Per call (cycles at 1.98 GHz; chain = one warp's cycles per tile at the call's HBM utilisation, "
              "block-table entry missing with probability p; T = each warp's cycles per tile at the CTAs per SM "
              "reached; % (no spread): every prologue at the same DRAM latency; losses in points of %):", "",
              "| call | spec | splits | h | CTAs | waves | tokens/CTA | tiles/warp | instr/tile | issue | chain "
              "(bt L2 / DRAM) | p | CTAs/SM | T | prologue | epilogue | merge | us | % (no spread) | binding | "
              "losses |", "|" + "---|" * 21]
    for c in today:
        losses = ", ".join(f"{k} {v:.0f}" for k, v in sorted(c["losses_pct"].items(), key=lambda x: -x[1]) if v >= 0.5)
        lines.append(
            f"| {c['call']} | {c['spec']} | {c['num_splits']} | {c['heads_per_cta']} | {c['ctas']} | "
            f"{c['waves']:.2f} | {c['tokens_per_cta']} | {c['tiles_per_warp']} | {c['instructions_per_tile']} | "
            f"{c['issue_cycles_per_tile']:.0f} | {c['chain_cycles_per_tile']:.0f} ({c['chain_cycles_bt_l2']:.0f} / "
            f"{c['chain_cycles_bt_dram']:.0f}) | {c['bt_miss_probability']:.2g} | {c['ctas_per_sm']} | "
            f"{c['per_warp_tile_cycles']:.0f} | {c['prologue_cycles']} | {c['epilogue_cycles']} | "
            f"{c['merge_cycles']} | "
            f"{c['time_us']:.1f} | **{c['predicted_pct']:.0f}** ({c.get('predicted_pct_lockstep', 0):.0f}) | "
            f"{c['binding']} | {losses} |")
    return "\n".join(lines) + "\n"


def levers_markdown(calls: list[dict]) -> str:
    """Each lever's predicted % per call and its change against today (points)."""
    levers = list(dict.fromkeys(c["lever"] for c in calls))
    if len(levers) < 2:
        return ""
    names = list(dict.fromkeys(c["call"] for c in calls))
    by = {(c["call"], c["lever"]): c for c in calls}
    lines = ["", "Levers of issue 19, computed (MODELLED): predicted % (change against today, points); the SASS "
             "rewrites keep ptxas's schedule, a recompiled kernel would be scheduled anew:", "",
             "| call | " + " | ".join(levers) + " |", "|---|" + "---|" * len(levers)]
    for name in names:
        base = by.get((name, "today"), {}).get("predicted_pct")
        cells = []
        for lever in levers:
            c = by.get((name, lever))
            pct = None if c is None else c.get("predicted_pct")
            if pct is None:
                cells.append("n/a" if c is None else "does not fit")
            elif lever == "today" or base is None:
                cells.append(f"{pct:.0f}")
            else:
                cells.append(f"{pct:.0f} ({pct - base:+.0f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ======================================================================================
# Shared memory per block on each target
# ======================================================================================


def smem_limits() -> dict[str, int]:
    """Dynamic shared memory one block may use, by architecture: the package's targets
    (``metrale_attn.targets``: sm_90, sm_100, sm_103, sm_121) and sm_120 (``smem_per_block_sm120``)."""
    limits = {t.arch: t.smem_per_block for t in TARGETS.values()}
    limits.setdefault("sm_120", int(a("smem_per_block_sm120")))
    return dict(sorted(limits.items()))


def smem_fit(specs=None, static_smem: dict[str, int] | None = None) -> dict:
    """Per architecture, which ``mma`` specs' shared memory (the launch's dynamic bytes plus
    the static bytes ptxas reported, where this run compiled the spec) fits a block, each spec
    sized for that architecture's limit (``KernelSpec.smem_limit``; a spec no tiling of which
    fits the limit counts with its sm_90 bytes)."""
    specs = [v for v in (specs or all_specs()) if v.impl == "mma"]
    static_smem = static_smem or {}
    out = {}
    for arch, limit in smem_limits().items():
        misfits = []
        for v in specs:
            sized = replace(v, smem_limit=limit)
            try:
                name, need = sized.name, sized.shared_bytes + static_smem.get(v.name, 0)
            except KernelSourceError:  # no tiling fits this limit
                name, need = v.name, v.shared_bytes + static_smem.get(v.name, 0)
            if need > limit:
                misfits.append({"spec": name, "bytes": need})
        out[arch] = {"limit_bytes": limit, "specs": len(specs), "fit": len(specs) - len(misfits),
                     "do_not_fit": misfits}
    return out


def smem_markdown(fit: dict) -> str:
    lines = ["", "Shared memory per block against each target's limit (every mma variant; dynamic + static bytes):",
             "", "| arch | limit (bytes) | fit | do not fit | largest that does not fit |", "|---|---|---|---|---|"]
    for arch, f in fit.items():
        worst = max(f["do_not_fit"], key=lambda m: m["bytes"], default=None)
        smallest = min(f["do_not_fit"], key=lambda m: m["bytes"], default=None)
        span = "-" if worst is None else f"{smallest['bytes']}-{worst['bytes']} B (e.g. {worst['spec']})"
        lines.append(f"| {arch} | {f['limit_bytes']} | {f['fit']} of {f['specs']} | {len(f['do_not_fit'])} | "
                     f"{span} |")
    return "\n".join(lines) + "\n"


# ======================================================================================
# Markdown, command line
# ======================================================================================

STEADY_STATE_RULE = (
    "A tile counts every instruction a warp issues in a steady-state iteration (all tokens valid): at a "
    "warp-uniform branch the side keeping the loads (the next tile exists), at a lane-divergent branch "
    "(lane < TT, a token against the CTA's range) BOTH sides, at a data-dependent branch (the simt inf/NaN "
    "test on K/V bytes) the common side, the rare detour weighted by rare_path_probability = 0; BRA.DIV "
    "fallbacks never (benchmarks/model/sass.py).")


def markdown(rows: list[dict], calls: list[dict] | None = None, fit: dict | None = None) -> str:
    """The whole report: the per-spec ceilings and mix, the per-tile chains, the calls, the
    levers, the shared-memory fit."""
    out = variant_markdown(rows) + chain_markdown(rows)
    if calls:
        out += calls_markdown(calls) + levers_markdown(calls)
    if fit:
        out += smem_markdown(fit)
    return out


def chain_markdown(rows: list[dict]) -> str:
    lines = ["", "Per-tile chain of one warp (MODELLED; latency_long_ns DRAM; " + STEADY_STATE_RULE + "):", "",
             "| spec (arch) | instr/tile (fewest path, rare) | divergent branches | chain cycles (bt L2 / DRAM) | "
             "issue cycles | top stalls | fragment moves | CTAs/SM (limiter) | warps/scheduler | launch bounds | "
             "cycles/tile/SM |", "|" + "---|" * 11]
    seen = set()
    for r in rows:
        if not r.get("loop_found") or (r["spec"], r["arch"]) in seen or "chain_cycles_per_tile" not in r:
            continue
        seen.add((r["spec"], r["arch"]))
        lp = r["loop"]
        stalls = ", ".join(f"{k} {v:.0f}" for k, v in list(r["chain_stalls_per_tile"].items())[:3])
        lb = r.get("launch_bounds")
        lines.append(
            f"| {r['spec']} ({r['arch']}) | {lp['hot_path_instructions']} ({lp['fewest_path_instructions']}, "
            f"{lp['rare_path_instructions']}) | {lp['branches'].get('lane', 0)} | {r['chain_cycles_per_tile']:.0f} / "
            f"{r['chain_cycles_bt_dram']:.0f} | {r['issue_cycles_per_tile']:.0f} | {stalls} | "
            f"{r['fragment_moves_per_tile']} | {r['ctas_per_sm']} ({r['occupancy_limiter']}) | "
            f"{r['warps_per_scheduler']:g} | {'-' if not lb else f'({lb[0]}, {lb[1]})'} | "
            f"{r['cycles_per_tile_per_sm']:.0f} |")
    return "\n".join(lines) + "\n"


def variant_markdown(rows: list[dict]) -> str:
    """The per-spec ceilings table and the hot path's instruction mix."""
    lines = [
        "Static SASS model (NOT measured): H200 assumption table in benchmarks/model/sass_model.py; "
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


def _shape(text: str) -> tuple[int, int, int]:
    q, kv, d = (int(x) for x in text.split("/"))
    return q, kv, d


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", metavar="PATH", help="write the report (rows, calls, levers, smem fit) here")
    p.add_argument("--arch", nargs="+", default=["sm_90"], help="NVRTC architectures (default sm_90; sm_100 too)")
    p.add_argument("--specs", nargs="+", default=[], metavar="NAME",
                   help="spec names or arms, shell patterns allowed (default: all)")
    p.add_argument("--shapes", nargs="+", type=_shape, default=list(DEFAULT_SHAPES), metavar="Q/KV/D",
                   help="model shapes q_heads/kv_heads/head_dim (default 32/8/128 64/8/128 24/4/256)")
    p.add_argument("--kv-dtypes", nargs="+", default=list(DEFAULT_KV), choices=dtypes.KV_DTYPES)
    p.add_argument("--q-dtypes", nargs="+", default=list(DEFAULT_Q), choices=dtypes.Q_DTYPES)
    p.add_argument("--calls", choices=("decisive", "none"), default="decisive",
                   help="predict the decisive calls (every shape x KV dtype x batch 64 x 4k, 16 x 4k, 1 x 32k) on "
                        "the plan's kernel (sm_90 only; default) or none")
    p.add_argument("--levers", choices=("all", "none"), default="all",
                   help="also compute every lever of issue 19 on those calls (default all)")
    p.add_argument("--hmma-latency", type=float, default=None, metavar="CYCLES",
                   help="a sensitivity: the calls with this HMMA latency instead of the table's lat_hmma")
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

    def facts_of(spec: KernelSpec, arch: str = "sm_90") -> SpecFacts:
        key = (spec.name, arch)
        if key not in facts:
            facts[key] = analyse(spec, arch, nvdisasm)
        return facts[key]

    rows = []
    for arch in args.arch:
        for spec, (q_heads, kv_heads, _) in chosen:
            rows.append(row(facts_of(spec, arch), q_heads, kv_heads))
    calls: list[dict] = []
    if args.calls == "decisive" and "sm_90" in args.arch:
        levers = (Levers(),) if args.levers == "none" else call_model.LEVERS
        if args.hmma_latency:
            levers = tuple(replace(lv, hmma_latency=args.hmma_latency) for lv in levers)
        calls = predict_calls(decisive_calls(args.shapes, args.kv_dtypes, args.q_dtypes[0]), facts_of, levers)
    fit = smem_fit(static_smem={name: f.resources["static_smem_bytes"] for (name, _), f in facts.items()})
    print(markdown(rows, calls, fit), end="")
    if args.json:
        report = {"format": "sass_model/2", "modelled": True, "toolchain": toolchain(nvdisasm),
                  "note": "Every figure is MODELLED from NVRTC's SASS and the assumption table; nothing is measured.",
                  "steady_state_rule": STEADY_STATE_RULE, "rows": rows, "calls": calls, "smem_fit": fit,
                  "assumptions": {k: {"value": x.value, "unit": x.unit, "source": x.source}
                                  for k, x in ASSUMPTIONS.items()}}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=_json_default)
    return 0 if all(r["loop_found"] for r in rows) else 1


def toolchain(nvdisasm: str) -> dict:
    """The NVRTC and nvdisasm versions the SASS came from (the committed JSON is reproducible
    with these only)."""
    out = {}
    try:
        from metrale_attn.backends import nvrtc

        out["nvrtc"] = ".".join(map(str, nvrtc.version()))
    except Exception as err:  # noqa: BLE001 (a report without the version is still a report)
        out["nvrtc"] = f"unknown ({type(err).__name__})"
    try:
        done = subprocess.run([nvdisasm, "--version"], capture_output=True, text=True, timeout=30)
        found = re.search(r"release ([\d.]+)", done.stdout)
        out["nvdisasm"] = found.group(1) if found else "unknown"
    except (OSError, subprocess.SubprocessError):
        out["nvdisasm"] = "unknown"
    return out


def _json_default(x):
    if hasattr(x, "item"):  # NumPy scalars
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


if __name__ == "__main__":
    sys.exit(main())
