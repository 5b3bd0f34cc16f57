// Planted out-of-bounds reads, for AddressSanitizer mode.

// Reads x[threadIdx.x + shift]: past the end of x for the last threads when shift > 0.
extern "C" __global__ void read_past_input(const float* __restrict__ x, float* __restrict__ out, int shift) {
  out[threadIdx.x] = x[threadIdx.x + shift];
}

// Reads s[threadIdx.x + shift] of a static shared array of blockDim.x floats.
extern "C" __global__ void read_past_shared(float* __restrict__ out, int shift) {
  __shared__ float s[64];
  s[threadIdx.x] = (float)threadIdx.x;
  __syncthreads();
  out[threadIdx.x] = s[threadIdx.x + shift];
}

// Reads buf[threadIdx.x + shift] of the dynamic shared buffer (blockDim.x floats).
extern "C" __global__ void read_past_dynamic(float* __restrict__ out, int shift) {
  DYNAMIC_SHARED(float, buf);
  buf[threadIdx.x] = (float)threadIdx.x;
  __syncthreads();
  out[threadIdx.x] = buf[threadIdx.x + shift];
}
