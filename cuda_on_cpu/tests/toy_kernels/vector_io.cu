// 16-byte and 8-byte vector loads and stores.

// y[i] = x[i] * 2 + 1 for float4 elements.
extern "C" __global__ void float4_axpb(const float4* __restrict__ x, float4* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    const float4 v = x[i];
    y[i] = make_float4(v.x * 2.0f + 1.0f, v.y * 2.0f + 1.0f, v.z * 2.0f + 1.0f, v.w * 2.0f + 1.0f);
  }
}

// Copies 16-bit elements (bf16 bits) as uint4 chunks of 8, swapping the two halves of each
// 32-bit word: reinterpret_cast'ed vector access, as the attention kernels do.
extern "C" __global__ void swap_halves_u16(const unsigned short* __restrict__ x, unsigned short* __restrict__ y,
                                           int nchunks) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < nchunks) {
    const uint4 w = *reinterpret_cast<const uint4*>(x + 8 * i);
    uint4 r;
    r.x = (w.x >> 16) | (w.x << 16);
    r.y = (w.y >> 16) | (w.y << 16);
    r.z = (w.z >> 16) | (w.z << 16);
    r.w = (w.w >> 16) | (w.w << 16);
    *reinterpret_cast<uint4*>(y + 8 * i) = r;
  }
}

// uint2 loads: y[i] = x[i].x + x[i].y as 64-bit sums.
extern "C" __global__ void uint2_sum(const uint2* __restrict__ x, unsigned long long* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = (unsigned long long)x[i].x + x[i].y;
}
