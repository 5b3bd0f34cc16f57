"""Cost of the CUDA-on-CPU emulation of the PTX instructions in kernels_cu/pd_ptx.cuh.

Each kernel runs a loop of `reps` instructions per warp (mma.m16n8k16, ldmatrix.x4) or per
thread (cp.async.cg 16 bytes with a commit and, every 4 copies, a wait_group 0) in blocks of
128 threads. The cost of one instruction is the time over and above the same launch with
reps = 0 (fibers, barriers, stores), divided by the number of instructions: per warp-wide
instruction for mma and ldmatrix (32 lanes' switches and the completing step), per copy for
cp.async.

    python -m benchmarks.cuda_on_cpu_ptx_speed [--repeat N]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from cuda_on_cpu import compile_module
from metrale_attn.sources import inline

SOURCE = r'''
#include "pd_ptx.cuh"

extern "C" __global__ void __launch_bounds__(128) mma_loop(float* out, int reps) {
  unsigned a[4] = {0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u}, b[2] = {0x3c003c00u, 0x3c003c00u};
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int i = 0; i < reps; ++i) pd_mma_bf16_m16n8k16(acc, a, b, acc);
  out[blockIdx.x * 128 + threadIdx.x] = acc[0] + acc[1] + acc[2] + acc[3];
}

extern "C" __global__ void __launch_bounds__(128) ldmatrix_loop(unsigned* out, int reps) {
  __shared__ __align__(16) unsigned short rows[4 * 32 * 8];
  for (int i = threadIdx.x; i < 4 * 32 * 8; i += 128) rows[i] = (unsigned short)i;
  __syncthreads();
  unsigned x = 0;
  for (int i = 0; i < reps; ++i) {
    unsigned r[4];
    pd_ldmatrix_x4(r, &rows[8 * ((threadIdx.x + i) & 127)]);
    x ^= r[0] ^ r[1] ^ r[2] ^ r[3];
  }
  out[blockIdx.x * 128 + threadIdx.x] = x;
}

extern "C" __global__ void __launch_bounds__(128) cp_async_loop(const unsigned char* in, unsigned* out, int reps) {
  __shared__ __align__(16) unsigned char stage[4 * 128 * 16];
  const int t = threadIdx.x;
  for (int i = 0; i < reps; ++i) {
    pd_cp_async_cg_16(&stage[((i & 3) * 128 + t) * 16], in + (((blockIdx.x + i) & 63) * 128 + t) * 16, 16);
    pd_cp_async_commit();
    if ((i & 3) == 3) pd_cp_async_wait<0>();
  }
  pd_cp_async_wait_all();
  out[blockIdx.x * 128 + t] = stage[t * 16];
}
'''

GRID, BLOCK = 64, 128


def module():
    text = SOURCE.replace('#include "pd_ptx.cuh"', inline("pd_ptx.cuh") + '\n#line 3 "benchmarks/cuda_on_cpu_ptx_speed.cu"')
    return compile_module(text, name="cuda_on_cpu_ptx_speed")


def best_time(launch, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        launch()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(repeat: int, reps: int) -> dict[str, float]:
    """Seconds per emulated instruction: {"mma": ..., "ldmatrix_x4": ..., "cp_async": ...}."""
    mod = module()
    src = np.random.default_rng(0).integers(0, 256, 64 * 128 * 16, dtype=np.uint8)
    outf, outu = np.zeros(GRID * BLOCK, np.float32), np.zeros(GRID * BLOCK, np.uint32)
    cases = {  # name: (kernel, args for n repetitions, instructions per repetition)
        "mma": ("mma_loop", lambda n: (outf, np.int32(n)), GRID * BLOCK // 32),
        "ldmatrix_x4": ("ldmatrix_loop", lambda n: (outu, np.int32(n)), GRID * BLOCK // 32),
        "cp_async": ("cp_async_loop", lambda n: (src, outu, np.int32(n)), GRID * BLOCK),
    }
    cost = {}
    for name, (kernel, args, per_rep) in cases.items():
        def run(n, kernel=kernel, args=args):
            mod.launch(kernel, (GRID, 1, 1), (BLOCK, 1, 1), 0, args(n))

        base, full = best_time(lambda: run(0), repeat), best_time(lambda: run(reps), repeat)
        cost[name] = (full - base) / (reps * per_rep)
    return cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--reps", type=int, default=64)
    args = ap.parse_args()
    cost = measure(args.repeat, args.reps)
    print(f"{GRID} blocks x {BLOCK} threads, {args.reps} instructions per warp (mma, ldmatrix) or thread (cp.async):")
    print(f"  one emulated mma.m16n8k16 (a warp's):     {cost['mma'] * 1e6:7.2f} us")
    print(f"  one emulated ldmatrix.x4 (a warp's):      {cost['ldmatrix_x4'] * 1e6:7.2f} us")
    print(f"  one emulated cp.async 16 B (a thread's):  {cost['cp_async'] * 1e9:7.0f} ns (issue, commit, landing)")


if __name__ == "__main__":
    main()
