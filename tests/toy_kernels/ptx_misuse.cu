// Planted misuse of the warp-collective instructions of kernels_cu/pd_ptx.cuh: the shim must
// report each one (a GPU hangs, faults or computes garbage), naming the line of the call.
#include "pd_ptx.cuh"

__device__ __forceinline__ void zero_mma_operands(unsigned (&a)[4], unsigned (&b)[2], float (&c)[4]) {
  for (int i = 0; i < 4; ++i) a[i] = 0u, c[i] = 0.0f;
  b[0] = b[1] = 0u;
}

// Lanes 0-15 and 16-31 reach two different mma instructions.
extern "C" __global__ void mma_divergent(float* out) {
  unsigned a[4], b[2];
  float c[4], d[4];
  zero_mma_operands(a, b, c);
  if ((threadIdx.x & 31) < 16) pd_mma_bf16_m16n8k16(d, a, b, c);  // first half
  else pd_mma_bf16_m16n8k16(d, a, b, c);                           // second half
  out[threadIdx.x] = d[0];
}

// Half the warp runs the bf16 MMA, half the f16 one, on one line.
extern "C" __global__ void mma_mixed_types(float* out) {
  unsigned a[4], b[2];
  float c[4], d[4];
  zero_mma_operands(a, b, c);
  if ((threadIdx.x & 31) < 16) pd_mma_bf16_m16n8k16(d, a, b, c); else pd_mma_f16_m16n8k16(d, a, b, c);
  out[threadIdx.x] = d[0];
}

// Lane 3 goes to the barrier while the rest of the warp waits at the MMA.
extern "C" __global__ void mma_beside_barrier(float* out) {
  unsigned a[4], b[2];
  float c[4], d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  zero_mma_operands(a, b, c);
  if (threadIdx.x != 3) pd_mma_bf16_m16n8k16(d, a, b, c);
  __syncthreads();
  out[threadIdx.x] = d[0];
}

// An MMA in a block of 48 threads (warp 1 is partial).
extern "C" __global__ void mma_partial_warp(float* out) {
  unsigned a[4], b[2];
  float c[4], d[4];
  zero_mma_operands(a, b, c);
  pd_mma_f16_m16n8k16(d, a, b, c);
  out[threadIdx.x] = d[0];
}

// Lane 5 skips the ldmatrix and exits.
extern "C" __global__ void ldmatrix_skipped(unsigned* out) {
  __shared__ __align__(16) unsigned short rows[32 * 8];
  for (int i = threadIdx.x; i < 32 * 8; i += 32) rows[i] = (unsigned short)i;
  __syncthreads();
  if (threadIdx.x == 5) return;
  unsigned r[4];
  pd_ldmatrix_x4(r, &rows[8 * threadIdx.x]);
  out[threadIdx.x] = r[0];
}

// Half the warp loads x4, half x4.trans, on one line.
extern "C" __global__ void ldmatrix_mixed(unsigned* out) {
  __shared__ __align__(16) unsigned short rows[32 * 8];
  for (int i = threadIdx.x; i < 32 * 8; i += 32) rows[i] = (unsigned short)i;
  __syncthreads();
  unsigned r[4];
  if (threadIdx.x < 16) pd_ldmatrix_x4(r, &rows[8 * threadIdx.x]); else pd_ldmatrix_x4_trans(r, &rows[8 * threadIdx.x]);
  out[threadIdx.x] = r[0];
}

// Bad row addresses from lane 9: mode 1 misaligned by 8 bytes, 2 (16-byte aligned) global
// memory, 3 the 16 bytes just past the dynamic buffer (32 rows); mode 4: lanes beyond the
// x2's matrices pass garbage, which is fine.
extern "C" __global__ void ldmatrix_bad_row(const unsigned short* global, unsigned* out, int mode) {
  DYNAMIC_SHARED(unsigned short, rows);
  for (int i = threadIdx.x; i < 32 * 8; i += 32) rows[i] = (unsigned short)i;
  __syncthreads();
  const unsigned short* row = &rows[8 * threadIdx.x];
  if (threadIdx.x == 9 && mode == 1) row += 4;
  if (threadIdx.x == 9 && mode == 2) row = (const unsigned short*)(((unsigned long long)global + 15ull) & ~15ull);
  if (threadIdx.x == 9 && mode == 3) row = &rows[8 * 32];
  if (threadIdx.x >= 16 && mode == 4) row = global + 3;
  unsigned r[2];
  pd_ldmatrix_x2(r, row);
  out[threadIdx.x] = r[0];
}
