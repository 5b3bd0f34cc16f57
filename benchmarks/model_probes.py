"""Small device probes of the three inputs on which two static models of the default kernel disagree.

Both models (ours, ``sass_model.py``, and an independent one) read the same SASS and disagree
by up to 17 points of copy bandwidth on the batch-1 cells and 6-9 on fp8 at batch 64/16, from
three inputs. Each probe measures one of them on the device, and the result goes into
``benchmarks/NOTES.md`` beside both models' values:

1. ``chain``: the cycles one warp takes per tile with all 8 warps of a CTA on the SM's 4
   schedulers (bf16 hd128: 1,072 in ours, ~1,408 in the other; fp8 hd128: 1,266 vs ~1,763).
   One CTA alone on the device (one KV head, one sequence, ``splitk="off"``, every q head of
   the group in the CTA: one work item, so the persistent grid is one CTA), timed at several
   context lengths; the slope of time over tokens is the body's rate, and a warp tile is
   ``warps x tile_tokens`` tokens of that rate (tile ``k`` goes to warp ``k mod W``).
2. ``fixed``: the same fit's intercept, the per-item prologue and epilogue with the launch, in
   cycles, against the model's prologue + epilogue + launch for that spec (it charges a warp
   instruction of a prologue or epilogue 1 cycle; the other model ~2.5).
3. ``cvt``: the throughput of the fp8-to-f16x2 conversion the fp8 tiles run, through the same
   intrinsics (``pd_cvt_f16x2_e4m3x2`` and its ``_hi`` form in ``kernels_cu/pd_ptx.cuh``), in
   results per clock per SM (ours assumes the ALU pipe's 64; at a quarter rate, 16, fp8 falls
   near 50% of copy).

Cycles are at the SM clock the device reports (``clock_khz``; ``--clock-ghz`` overrides) and at
the model's assumed 1.98 GHz, both written. On the CPU backend (``--cpu``) every probe runs its
control flow on the simulator and says that its numbers are not a GPU's.

Usage: ``python -m benchmarks.model_probes --out probes.json [--cpu]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable, Optional

import numpy as np

from metrale_attn import DecodeAttention, kernels, sources

from .model.model_assumptions import a

CHAIN_SHAPES = (("bf16", 8, 128), ("fp8", 8, 128), ("bf16", 6, 256))
"""(KV dtype, q heads of the one KV head, head dim): the two hd128 tiles the models disagree on
(group 8, Llama-3-70B's), and the hd256 tile of the 24/4/256 shape (6 warps)."""
CONTEXTS = (4096, 8192, 16384, 32768)
CPU_CONTEXTS = (64, 128, 256)
CVT_SOURCE = r'''
#include "pd_ptx.cuh"
// Each thread converts WORDS independent words, both halves, ITERS times, feeding each result back
// so no conversion can be hoisted or dropped; the xor costs one LOP3 a word an iteration.
#define WORDS 8
extern "C" __global__ void cvt_throughput(unsigned* out, unsigned seed, int iters) {
  unsigned w[WORDS];
#pragma unroll
  for (int i = 0; i < WORDS; ++i) w[i] = seed * (threadIdx.x + 1) + 0x01010101u * i;
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < WORDS; ++i)
      w[i] = pd_cvt_f16x2_e4m3x2_hi(w[i]) ^ pd_cvt_f16x2_e4m3x2((unsigned short)w[i]);
  }
  unsigned acc = 0;
#pragma unroll
  for (int i = 0; i < WORDS; ++i) acc ^= w[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
'''
CVT_WORDS = 8
CVT_PER_WORD = 2  # the low and the high pair


def fit_line(xs, ys) -> tuple[float, float]:
    """Least squares ``y = intercept + slope x``: (intercept, slope)."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(intercept), float(slope)


def chain_probe(kv: str, group: int, head_dim: int, contexts, time_call: Callable, make_case: Callable,
                backend=None) -> dict:
    """One CTA's time at each of ``contexts``; the slope as cycles per warp tile, the intercept as the
    per-item fixed cost (see the module's docstring). ``time_call(attn, case)`` gives microseconds;
    ``make_case(context)`` the tensors of one sequence."""
    attn = DecodeAttention(group, 1, head_dim, 16, q_dtype="bfloat16",
                           kv_dtype="fp8_e4m3" if kv == "fp8" else "bfloat16", max_batch=1, splitk="off",
                           gqa_pack=False, heads_per_cta=group, backend=backend)
    plan = attn.plan(1)
    (spec,) = [s for s in kernels.specs_for(attn.config).values() if s.tiling is not None][:1] or [None]
    if plan.items != 1 or spec is None:
        return dict(status="skipped", detail=f"the plan is not one mma CTA ({plan.items} items, impl {plan.impl})")
    times = [time_call(attn, make_case(t)) for t in contexts]
    intercept_us, slope_us = fit_line(contexts, times)
    tile = spec.tiling.warps * spec.tiling.tile_tokens  # tokens a round of warp tiles covers
    return dict(status="ok", spec=spec.name, warps=spec.tiling.warps, tile_tokens=spec.tiling.tile_tokens,
                contexts=list(contexts), times_us=[round(t, 3) for t in times],
                ns_per_token=round(slope_us * 1e3, 4), ns_per_warp_tile=round(slope_us * 1e3 * tile, 2),
                fixed_us=round(intercept_us, 3))


def cvt_probe(run: Callable[[int, int], float], sm_count: int, blocks_per_sm: int = 8, threads: int = 256,
              iters: int = 4096) -> dict:
    """Conversions per second of ``cvt_throughput`` over every SM; ``run(blocks, iters)`` gives the
    kernel's microseconds (the fixed cost removed by a second, shorter launch)."""
    blocks = sm_count * blocks_per_sm
    long_us, short_us = run(blocks, iters), run(blocks, iters // 4)
    body_us = max(long_us - short_us, 1e-9)
    conversions = blocks * threads * CVT_WORDS * CVT_PER_WORD * (iters - iters // 4)
    return dict(status="ok", blocks=blocks, threads=threads, iters=iters, long_us=round(long_us, 3),
                short_us=round(short_us, 3), per_us_per_sm=conversions / body_us / sm_count)


def with_cycles(result: dict, clock_ghz: Optional[float]) -> dict:
    """``result`` with its times as cycles at the device's clock and at the model's."""
    model_ghz = a("clock_ghz")
    for ghz, suffix in ((clock_ghz, "device_clock"), (model_ghz, "model_clock")):
        if not ghz:
            continue
        for probe in result["chain"]:
            if probe.get("status") == "ok":
                probe[f"cycles_per_warp_tile_{suffix}"] = round(probe["ns_per_warp_tile"] * ghz, 1)
                probe[f"fixed_cycles_{suffix}"] = round(probe["fixed_us"] * 1e3 * ghz, 0)
        cvt = result.get("cvt") or {}
        if cvt.get("status") == "ok":
            cvt[f"per_clock_per_sm_{suffix}"] = round(cvt["per_us_per_sm"] / (ghz * 1e3), 2)
    result["clock_ghz"] = {"device": clock_ghz, "model": model_ghz}
    return result


# -- the device --------------------------------------------------------------------------------------


def _gpu(contexts) -> dict:
    import cupy
    import torch

    from metrale_attn.check.data import GpuPool
    from metrale_attn.check.timing import GpuTimer
    from metrale_attn.config import ModelShape

    timer = GpuTimer()
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    sm_count = int(props["multiProcessorCount"])
    try:
        clock_ghz = cupy.cuda.runtime.deviceGetAttribute(13, dev.id) / 1e6  # cudaDevAttrClockRate, kHz
    except Exception:  # noqa: BLE001 - dropped from some CUDA versions: the model's clock only
        clock_ghz = None
    chain = []
    for kv, group, head_dim in CHAIN_SHAPES:
        pool = GpuPool(ModelShape(group, 1, head_dim), kv, 16, -(-max(contexts) // 16), seed=0)

        def time_call(attn, case):
            out = torch.empty_like(case.q)
            call = lambda: attn.run(case.q, case.k_pool, case.v_pool, case.block_tables, case.seq_lens,  # noqa: E731
                                    k_scale=case.k_scale, v_scale=case.v_scale, out=out)
            return timer.measure(timer.capture_poisoned(call, out)).median_us

        chain.append(dict(kv=kv, group=group, head_dim=head_dim,
                          **chain_probe(kv, group, head_dim, contexts, time_call,
                                        lambda t, pool=pool, group=group: pool.case(1, t, group))))
    module = cupy.RawModule(code=sources.inline("probe.cu", CVT_SOURCE), options=("--std=c++17",))
    kernel = module.get_function("cvt_throughput")
    out = cupy.empty(sm_count * 8 * 256, dtype=cupy.uint32)

    def run(blocks: int, iters: int) -> float:
        launch = lambda: kernel((blocks,), (256,), (out, np.uint32(7), np.int32(iters)))  # noqa: E731
        return timer.measure(launch, mode="eager").median_us

    return dict(device=props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
                sm_count=sm_count, clock=clock_ghz, chain=chain, cvt=cvt_probe(run, sm_count))


def _cpu(contexts) -> dict:
    from metrale_attn import problems
    from metrale_attn.check.timing import time_host

    chain = []
    for kv, group, head_dim in CHAIN_SHAPES[:1]:
        def make_case(t, kv=kv, group=group, head_dim=head_dim):
            return problems.make_problem(np.random.default_rng(t), num_seqs=1, num_q_heads=group, num_kv_heads=1,
                                         head_dim=head_dim, page_size=16, seq_lens=[t], kv_dtype=kv, q_dtype="bf16")

        def time_call(attn, p):
            return time_host(lambda: attn.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens,
                                              k_scale=p.k_scale, v_scale=p.v_scale), max_iters=3).median_us

        chain.append(dict(kv=kv, group=group, head_dim=head_dim,
                          **chain_probe(kv, group, head_dim, contexts, time_call, make_case, backend="cpu")))
    from cuda_on_cpu import compile_module

    module = compile_module(sources.inline("probe.cu", CVT_SOURCE), name="cvt_throughput")
    out = np.zeros(2 * 32, dtype=np.uint32)

    def run(blocks: int, iters: int) -> float:
        t0 = time.perf_counter()
        module.launch("cvt_throughput", (blocks, 1, 1), (32, 1, 1), 0, (out, np.uint32(7), np.int32(iters)))
        return (time.perf_counter() - t0) * 1e6

    cvt = cvt_probe(run, 1, blocks_per_sm=2, threads=32, iters=16)
    return dict(device="CPU backend simulator (not a GPU: no number here is a GPU's)", sm_count=1, clock=None,
                chain=chain, cvt=cvt)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cpu", action="store_true", help="the control flow on the CPU backend (no GPU figure)")
    parser.add_argument("--clock-ghz", type=float, help="the SM clock to turn times into cycles (default: the "
                        "device's reported clock)")
    args = parser.parse_args(argv)
    raw = _cpu(CPU_CONTEXTS) if args.cpu else _gpu(CONTEXTS)
    result = with_cycles(dict(raw, status="ok", mode="cpu" if args.cpu else "gpu"), args.clock_ghz or raw["clock"])
    lines = [f"model probes on {result['device']}:"]
    for c in result["chain"]:
        if c.get("status") == "ok":
            lines.append(f"  chain {c['kv']} G{c['group']} hd{c['head_dim']} ({c['spec']}, {c['warps']} warps x "
                         f"{c['tile_tokens']} tokens): {c['ns_per_warp_tile']} ns a warp tile "
                         f"({c.get('cycles_per_warp_tile_model_clock')} cycles at the model's clock), fixed "
                         f"{c['fixed_us']} us")
        else:
            lines.append(f"  chain {c['kv']} G{c['group']} hd{c['head_dim']}: {c.get('status')}: {c.get('detail')}")
    cvt = result["cvt"]
    lines.append(f"  cvt e4m3x2 -> f16x2: {cvt.get('per_clock_per_sm_model_clock')} results/clk/SM at the model's "
                 "clock (ours assumes 64, the other model 16)")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("\n".join(lines))
    detail = "; ".join(line.strip() for line in lines[1:])[:280]
    print(f"ok\t{detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
