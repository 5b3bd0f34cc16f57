// Each kernel misuses a barrier or a warp op; the runtime must report it, not hang.
#define FULL_MASK 0xffffffffu

// Thread `skip` returns early and never reaches the barrier.
extern "C" __global__ void barrier_skipped(float* out, int skip) {
  if ((int)threadIdx.x == skip) return;
  out[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] += 1.0f;
}

// Warp 0 and warp 1 wait at different __syncthreads.
extern "C" __global__ void barrier_mismatch(float* out) {
  if (threadIdx.x < 32) {
    out[threadIdx.x] = 1.0f;
    __syncthreads();
  } else {
    __syncthreads();
    out[threadIdx.x] = 2.0f;
  }
}

// Lane 7 exits before the shuffle that names it in the full mask.
extern "C" __global__ void shuffle_with_exited_lane(int* out) {
  if (threadIdx.x == 7) return;
  out[threadIdx.x] = __shfl_xor_sync(FULL_MASK, (int)threadIdx.x, 1);
}

// Lanes 0-15 shuffle, lanes 16-31 ballot, all with the full mask.
extern "C" __global__ void lanes_disagree(int* out) {
  if ((threadIdx.x & 31) < 16)
    out[threadIdx.x] = __shfl_down_sync(FULL_MASK, (int)threadIdx.x, 1);
  else
    out[threadIdx.x] = (int)__ballot_sync(FULL_MASK, 1);
}

// A warp op in a block of 48 threads: warp 1 is partial.
extern "C" __global__ void shuffle_in_partial_warp(int* out) {
  out[threadIdx.x] = __shfl_xor_sync(FULL_MASK, (int)threadIdx.x, 1);
}

// A mask that leaves out the calling lane.
extern "C" __global__ void mask_without_self(int* out) {
  out[threadIdx.x] = __shfl_sync(0x1u, (int)threadIdx.x, 0);
}

// Reads a lane outside the mask: undefined on a GPU, an error here.
extern "C" __global__ void shuffle_source_outside_mask(int* out) {
  const int lane = threadIdx.x & 31;
  const unsigned mask = lane < 16 ? 0x0000ffffu : 0xffff0000u;
  out[threadIdx.x] = __shfl_sync(mask, lane, 20);
}

extern "C" __global__ void traps(int* out) {
  if (threadIdx.x == 3) __trap();
  out[threadIdx.x] = 1;
}

// Every argument kind, for the argument checks.
extern "C" __global__ void takes_everything(const float* __restrict__ x, unsigned short* y, int n, unsigned u,
                                            long long ll, float f, const uint4* vec) {
  if (threadIdx.x == 0 && x != 0 && y != 0) y[0] = (unsigned short)(n + u + ll + (long long)f + (vec ? 1 : 0));
}
