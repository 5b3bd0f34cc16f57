"""One small decode per kernel arm and implementation, for compute-sanitizer (memcheck, racecheck, initcheck).

This script owns the cases ``gpu_check.sh`` runs under ``compute-sanitizer``: every
arm (unpacked, split-K + merge, GQA-packed) on each implementation (mma first: the
default, persistent CTAs with cp.async rings in shared memory; then simt) once per case below, at small shapes, each output checked
against the float64 reference. It exits 0 only if every output met the correctness bar; the sanitizer's own verdict is its ERROR SUMMARY.
A line says which implementation the plan ran (an mma request that fell back to simt
after a failed self-test says so).

Why the arrays look the way they do:

- CuPy's memory pool is switched off, so every array is its own ``cudaMalloc`` of
  its exact size and memcheck sees an access one element past any of them (the
  pool would hide it inside a larger block). The split-K workspace is allocated
  the same way, so a write past it is caught too.
- ``problems.make_problem`` shuffles pages and fills every block-table entry past a
  sequence's last page with ``GARBAGE_PAGE_ID`` (far outside the pool): a kernel
  that reads one more page than it needs reads far out of bounds.
- Lengths cover the edges: 0 (no token: zeros and lse -inf), 1, a partial page, a
  page boundary, several splits of ``PD_MIN_KV_PER_SPLIT``.
- ``out`` and ``lse`` are filled with NaN before the call, so an element the kernel
  never writes fails the check (and a read of uninitialized workspace shows in
  initcheck).

Usage: ``compute-sanitizer --tool memcheck python -m benchmarks.sanitize_cases``
(``--cpu`` runs the same cases on the CPU backend, for a dry run without a GPU).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from metrale_attn import DecodeAttention, problems, tolerance

from .impls import ARGUMENTS, IMPLS
from .sweep_plan import ARM_OPTIONS as ARMS

CASES = [
    # (kv dtype, layout, page size, head_dim for unpacked/split-K)
    ("bf16", "NHD", 16, 128),
    ("fp8", "HND", 7, 64),
]
SEQ_LENS = (0, 1, 17, 16 * 5, 700)


def heads(arm: str, head_dim: int) -> tuple[int, int, int]:
    """(q heads, kv heads, head dim): the GQA pack needs q = 6 x kv at head_dim 256."""
    return (12, 2, 256) if arm == "gqa_packed" else (8, 2, head_dim)


def run_case(arm: str, impl: str, kv: str, layout: str, page: int, head_dim: int, backend: str, seed: int) -> str:
    H, KV, D = heads(arm, head_dim)
    p = problems.make_problem(np.random.default_rng(seed), num_seqs=len(SEQ_LENS), num_q_heads=H, num_kv_heads=KV,
                              head_dim=D, page_size=page, seq_lens=list(SEQ_LENS), kv_dtype=kv, q_dtype="bf16",
                              layout=layout)
    attn = DecodeAttention(H, KV, D, page, q_dtype="bf16", kv_dtype=kv, kv_layout=layout, max_batch=len(SEQ_LENS),
                           backend=backend, **ARGUMENTS[impl], **ARMS[arm])
    plan = attn.plan(len(SEQ_LENS))
    if plan.arm != arm:
        raise AssertionError(f"forcing {arm} gave the {plan.arm} arm")
    shape_out, shape_lse = p.q.shape, p.q.shape[:2]
    if backend == "cpu":
        out = np.full(shape_out, np.nan, dtype=p.q.dtype)
        lse = np.full(shape_lse, np.nan, dtype=np.float32)
        attn.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, k_scale=p.k_scale, v_scale=p.v_scale,
                 out=out, lse=lse)
    else:
        import cupy

        dev = lambda a: cupy.asarray(a.view(np.uint8) if a.dtype.itemsize == 1 else a)
        out_d = cupy.asarray(np.full(shape_out, np.nan, dtype=p.q.dtype))  # poison built on the host
        lse_d = cupy.full(shape_lse, np.nan, dtype=np.float32)
        attn.run(dev(p.q), dev(p.k_cache), dev(p.v_cache), dev(p.block_tables), dev(p.seq_lens), k_scale=p.k_scale,
                 v_scale=p.v_scale, out=out_d, lse=lse_d)
        attn.backend.synchronize()
        out, lse = cupy.asnumpy(out_d), cupy.asnumpy(lse_d)
    ref_out, ref_lse = p.reference(return_lse=True)
    tolerance.assert_close_to_reference(out, ref_out, v_absmax=p.v_absmax())
    empty = p.seq_lens == 0
    if not np.all(np.isneginf(lse[empty])):
        raise AssertionError(f"lse of empty sequences should be -inf, got {lse[empty]}")
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=2e-6, atol=2e-6)
    return (f"{plan.impl} ({plan.heads_per_cta} head(s)/CTA), {plan.num_splits} split(s), grids "
            f"{[g.grid for g in plan.launches]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU backend (dry run, no sanitizer)")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--impls", default=",".join(reversed(IMPLS)), help="in this order (default: mma first)")
    args = parser.parse_args(argv)
    backend = "cpu" if args.cpu else "cupy"
    if not args.cpu:
        import cupy

        cupy.cuda.set_allocator(None)  # one exact-size cudaMalloc per array: memcheck sees every overrun
        cupy.cuda.set_pinned_memory_allocator(None)
    failures = 0
    for impl, arm in ((impl, arm) for impl in args.impls.split(",") for arm in args.arms.split(",")):
        for i, (kv, layout, page, head_dim) in enumerate(CASES):
            label = (f"{impl:<4} {arm:<10} kv={kv:<4} {layout} page={page:<2} hd={heads(arm, head_dim)[2]} "
                     f"lens={SEQ_LENS}")
            t0 = time.monotonic()
            try:
                detail = run_case(arm, impl, kv, layout, page, head_dim, backend, seed=i)
                print(f"ok    {label}  {detail}  ({time.monotonic() - t0:.1f} s)", flush=True)
            except Exception as err:
                failures += 1
                print(f"FAIL  {label}: {type(err).__name__}: {str(err)[:500]}", flush=True)
    print(f"sanitize_cases: {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
