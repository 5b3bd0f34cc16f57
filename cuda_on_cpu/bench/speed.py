"""Speed of the CUDA-on-CPU backend: fiber switches, barriers and warp shuffles.

A grid of 1024 blocks x 128 threads; every block runs 10 __syncthreads and a
warp-shuffle reduction (5 __shfl_xor_sync per warp, twice). Prints the launch time with
the hand-written x86-64 context switch and with the ucontext fallback.

    python -m cuda_on_cpu.bench.speed [--repeat N]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from cuda_on_cpu import compile_module

SOURCE = r'''
#line 1 "cuda_on_cpu/bench/speed.cu"
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
  return v;
}

extern "C" __global__ void __launch_bounds__(128) bench(const float* __restrict__ x, float* __restrict__ out) {
  __shared__ float s_buf[128];
  __shared__ float s_warp[4];
  const int t = threadIdx.x;
  float v = x[blockIdx.x * 128 + t];
  // 8 barriers of shared-memory neighbour exchange...
  for (int round = 0; round < 4; ++round) {
    s_buf[t] = v;
    __syncthreads();
    v = 0.5f * (v + s_buf[(t + 1 + round) & 127]);
    __syncthreads();
  }
  // ...then a block reduction: shuffles, 2 more barriers.
  v = warp_sum(v);
  if ((t & 31) == 0) s_warp[t >> 5] = v;
  __syncthreads();
  if (t < 32) {
    float p = warp_sum(t < 4 ? s_warp[t] : 0.0f);
    if (t == 0) out[blockIdx.x] = p;
  }
  __syncthreads();
}
'''

GRID, BLOCK = 1024, 128


def measure(fiber: str, repeat: int) -> tuple[float, np.ndarray]:
    old = os.environ.get("METRALE_ATTN_CPU_FIBER")
    os.environ["METRALE_ATTN_CPU_FIBER"] = fiber
    try:
        mod = compile_module(SOURCE, name="cuda_on_cpu_speed")
    finally:
        if old is None:
            del os.environ["METRALE_ATTN_CPU_FIBER"]
        else:
            os.environ["METRALE_ATTN_CPU_FIBER"] = old
    x = np.random.default_rng(0).standard_normal(GRID * BLOCK).astype(np.float32)
    out = np.zeros(GRID, np.float32)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        mod.launch("bench", (GRID, 1, 1), (BLOCK, 1, 1), 0, (x, out))
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    threads = GRID * BLOCK
    results = {}
    for fiber in ("asm", "ucontext"):
        t, out = measure(fiber, args.repeat)
        results[fiber] = out
        print(f"{fiber:9s} switch: {t * 1e3:8.1f} ms per launch of {GRID} blocks x {BLOCK} threads "
              f"(10 __syncthreads + shuffle reduction per block), {t / threads * 1e9:6.0f} ns per CUDA thread")
    same = results["asm"].tobytes() == results["ucontext"].tobytes()
    print(f"identical results: {same}")


if __name__ == "__main__":
    main()
