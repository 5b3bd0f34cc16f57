// Block sum of 128 floats per block: a warp-shuffle reduction, partial sums in static
// shared memory, several barriers. Race-free: identical bytes under every thread order.
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
  return v;
}

extern "C" __global__ void __launch_bounds__(128) block_sum(const float* __restrict__ x, float* __restrict__ out,
                                                            int n) {
  __shared__ float s_partial[4];
  __shared__ float s_total;
  const int t = threadIdx.x;
  const int i = blockIdx.x * blockDim.x + t;
  float v = i < n ? x[i] : 0.0f;
  v = warp_sum(v);
  if ((t & 31) == 0) s_partial[t >> 5] = v;
  __syncthreads();
  if (t < 32) {
    float p = t < 4 ? s_partial[t] : 0.0f;
    p = warp_sum(p);
    if (t == 0) s_total = p;
  }
  __syncthreads();
  // Every thread reads the total; the next barrier keeps the block together until all have.
  const float total = s_total;
  __syncthreads();
  if (t == 0) out[blockIdx.x] = total;
}
