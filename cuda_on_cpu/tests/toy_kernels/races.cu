// Thread-order probes.
#define FULL_MASK 0xffffffffu

// A planted shared-memory race in a block of 64 threads. After the barrier, warp 0 reads
// warp 1's slots while warp 1 overwrites them with its warp sum: no barrier orders the
// two. Warp 1 first spends five shuffle rounds, so under the default order (and under any
// per-round shuffle of threads) warp 0 always reads first; only a schedule that lets
// warp 1 run ahead through the whole phase exposes the race.
extern "C" __global__ void racy_overwrite(const float* __restrict__ in, float* __restrict__ out) {
  __shared__ float s[64];
  const int t = threadIdx.x;
  const int i = blockIdx.x * 64 + t;
  s[t] = in[i];
  __syncthreads();
  float v;
  if (t < 32) {
    v = s[t + 32];
  } else {
    float r = s[t];
    for (int off = 16; off > 0; off >>= 1) r += __shfl_xor_sync(FULL_MASK, r, off);
    s[t] = r;
    v = r;
  }
  out[i] = v;
}

// Records the order in which threads pass: racy by design (atomics on one counter).
extern "C" __global__ void arrival_order(unsigned* counter, unsigned* order) {
  order[blockIdx.x * blockDim.x + threadIdx.x] = atomicAdd(counter, 1u);
}
