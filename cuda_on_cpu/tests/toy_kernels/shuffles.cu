// Probes of every warp intrinsic: the tests compare them with a NumPy model of lanes.
#define FULL_MASK 0xffffffffu

// op: 0 idx, 1 up, 2 down, 3 xor. arg: srcLane / delta / laneMask. Whole warps only.
template <class T>
__device__ __forceinline__ T shuffle(int op, T v, int arg, int width) {
  if (op == 0) return __shfl_sync(FULL_MASK, v, arg, width);
  if (op == 1) return __shfl_up_sync(FULL_MASK, v, (unsigned)arg, width);
  if (op == 2) return __shfl_down_sync(FULL_MASK, v, (unsigned)arg, width);
  return __shfl_xor_sync(FULL_MASK, v, arg, width);
}

extern "C" __global__ void shfl_i32(const int* in, int* out, int op, int arg, int width) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = shuffle(op, in[i], arg, width);
}

extern "C" __global__ void shfl_u32(const unsigned* in, unsigned* out, int op, int arg, int width) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = shuffle(op, in[i], arg, width);
}

extern "C" __global__ void shfl_f32(const float* in, float* out, int op, int arg, int width) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = shuffle(op, in[i], arg, width);
}

extern "C" __global__ void shfl_i64(const long long* in, long long* out, int op, int arg, int width) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = shuffle(op, in[i], arg, width);
}

extern "C" __global__ void shfl_f64(const double* in, double* out, int op, int arg, int width) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = shuffle(op, in[i], arg, width);
}

// Per-lane source lanes: out[i] = in[src[i]] within the warp (srcLane may differ by lane).
extern "C" __global__ void shfl_per_lane_source(const int* in, const int* src, int* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = __shfl_sync(FULL_MASK, in[i], src[i]);
}

// ballot / any / all of pred[i] != 0, and __syncwarp between them.
extern "C" __global__ void vote(const int* pred, unsigned* ballot, int* any, int* all) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int p = pred[i];
  ballot[i] = __ballot_sync(FULL_MASK, p);
  __syncwarp();
  any[i] = __any_sync(FULL_MASK, p);
  all[i] = __all_sync(FULL_MASK, p);
}

// Two half-warps shuffle independently with their own masks (legal: disjoint masks).
extern "C" __global__ void half_warp_masks(const int* in, int* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int lane = threadIdx.x & 31;
  const unsigned mask = lane < 16 ? 0x0000ffffu : 0xffff0000u;
  out[i] = __shfl_xor_sync(mask, in[i], 1);
}

// Barrier votes: count / and / or of pred[i] != 0 over the block.
extern "C" __global__ void barrier_votes(const int* pred, int* count, int* all, int* any) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  count[i] = __syncthreads_count(pred[i]);
  all[i] = __syncthreads_and(pred[i]);
  any[i] = __syncthreads_or(pred[i]);
}
