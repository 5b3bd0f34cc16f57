// Dynamic shared memory through DYNAMIC_SHARED, and the poisoning of shared memory.

// Reverses each block's slice through the dynamic shared buffer (blockDim.x floats).
extern "C" __global__ void reverse_block(const float* __restrict__ x, float* __restrict__ y) {
  DYNAMIC_SHARED(float, buf);
  const int t = threadIdx.x;
  const int base = blockIdx.x * blockDim.x;
  buf[t] = x[base + t];
  __syncthreads();
  y[base + t] = buf[blockDim.x - 1 - t];
}

// Reads the dynamic shared buffer without writing it: sees the poison (0xFF bytes).
extern "C" __global__ void read_dynamic_uninitialized(unsigned* out) {
  DYNAMIC_SHARED(unsigned, ubuf);  // not `buf`: on a GPU all DYNAMIC_SHARED names of a
                                   // source are one extern array, one type per name
  out[blockIdx.x * blockDim.x + threadIdx.x] = ubuf[threadIdx.x];
}

// Block 0 writes its static shared array; every block then reads it. Blocks other than
// 0 must see the poison, not block 0's values.
extern "C" __global__ void read_static_uninitialized(unsigned* out) {
  __shared__ unsigned s[32];
  if (blockIdx.x == 0) s[threadIdx.x] = threadIdx.x;
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = s[threadIdx.x];
}
