// Unbounded recursion with a big frame: overflows the fiber stack.
__device__ __noinline__ float deep(volatile float* p, int n) {
  volatile float frame[512];
  frame[n & 511] = p[0] + (float)n;
  return deep(p, n + 1) + frame[(n * 7) & 511];
}

extern "C" __global__ void overflow_stack(float* out) {
  out[threadIdx.x] = deep(out, 0);
}
