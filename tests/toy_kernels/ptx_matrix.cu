// Probes of the warp-collective matrix instructions of kernels_cu/pd_ptx.cuh (ldmatrix,
// movmatrix, mma.m16n8k16): the tests hold them against NumPy models of the PTX ISA's
// fragment layouts and CuTe's layout tables, and a tiled GEMM puts them together.
#include "pd_ptx.cuh"

// One m16n8k16 MMA per warp, every warp on the same problem. A [16][16] and B [16][8] are
// 16-bit bit patterns (bf16 or f16), row-major; C and D [16][8] fp32. Each lane gathers its
// fragments as the PTX ISA's formulas say (g = lane >> 2, t = lane % 4); warp w writes
// D + 128 w. in_place: the accumulator array is both c and d.
template <bool F16>
__device__ __forceinline__ void mma_one(const unsigned short* A, const unsigned short* B, const float* C,
                                        float* D, int in_place) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  unsigned a[4], b[2];
  for (int r = 0; r < 4; ++r) {  // a0..a7: register r holds elements 2r, 2r + 1
    const int row = g + 8 * (r & 1), col = 2 * t + 8 * (r >> 1);
    a[r] = A[row * 16 + col] | (unsigned)A[row * 16 + col + 1] << 16;
  }
  for (int r = 0; r < 2; ++r) {
    const int k = 2 * t + 8 * r;
    b[r] = B[k * 8 + g] | (unsigned)B[(k + 1) * 8 + g] << 16;
  }
  float c[4], d[4];
  for (int e = 0; e < 4; ++e) c[e] = C[(g + 8 * (e >> 1)) * 8 + 2 * t + (e & 1)];
  if (F16) {
    if (in_place) pd_mma_f16_m16n8k16(c, a, b, c);
    else pd_mma_f16_m16n8k16(d, a, b, c);
  } else {
    if (in_place) pd_mma_bf16_m16n8k16(c, a, b, c);
    else pd_mma_bf16_m16n8k16(d, a, b, c);
  }
  float* out = D + (threadIdx.x >> 5) * 128;
  for (int e = 0; e < 4; ++e) out[(g + 8 * (e >> 1)) * 8 + 2 * t + (e & 1)] = in_place ? c[e] : d[e];
}

extern "C" __global__ void mma_bf16(const unsigned short* A, const unsigned short* B, const float* C, float* D,
                                    int in_place) {
  mma_one<false>(A, B, C, D, in_place);
}

extern "C" __global__ void mma_f16(const unsigned short* A, const unsigned short* B, const float* C, float* D,
                                   int in_place) {
  mma_one<true>(A, B, C, D, in_place);
}

// The MMA on raw registers: lane i of warp w passes a[(32w + i) * 4 ..], b[.. * 2 ..],
// c[.. * 4 ..] and stores its d: the layout tests decide what the registers mean.
extern "C" __global__ void mma_regs(const unsigned* a, const unsigned* b, const float* c, float* d, int f16) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned ra[4] = {a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3]};
  const unsigned rb[2] = {b[2 * i], b[2 * i + 1]};
  const float rc[4] = {c[4 * i], c[4 * i + 1], c[4 * i + 2], c[4 * i + 3]};
  float rd[4];
  if (f16) pd_mma_f16_m16n8k16(rd, ra, rb, rc);
  else pd_mma_bf16_m16n8k16(rd, ra, rb, rc);
  for (int e = 0; e < 4; ++e) d[4 * i + e] = rd[e];
}

// ldmatrix from rows chosen per lane: rows [nrows][8] (16-bit elements) are staged in the
// dynamic shared buffer (nrows * 16 bytes), lane l passes the address of row row_of_lane[l];
// out[l * N + k] = r[k]. One warp.
template <int N, bool TRANS>
__device__ __forceinline__ void ldmatrix_probe(const unsigned short* rows, int nrows, const int* row_of_lane,
                                               unsigned* out) {
  DYNAMIC_SHARED(unsigned short, s);
  const int lane = threadIdx.x;
  for (int i = lane; i < nrows * 8; i += 32) s[i] = rows[i];
  __syncthreads();
  unsigned r[N];
  const unsigned short* row = s + 8 * row_of_lane[lane];
  if constexpr (N == 1) {
    if (TRANS) pd_ldmatrix_x1_trans(r, row);
    else pd_ldmatrix_x1(r, row);
  } else if constexpr (N == 2) {
    if (TRANS) pd_ldmatrix_x2_trans(r, row);
    else pd_ldmatrix_x2(r, row);
  } else {
    if (TRANS) pd_ldmatrix_x4_trans(r, row);
    else pd_ldmatrix_x4(r, row);
  }
  for (int k = 0; k < N; ++k) out[lane * N + k] = r[k];
}

#define LDMATRIX_PROBE(NAME, N, TRANS)                                                              \
  extern "C" __global__ void NAME(const unsigned short* rows, int nrows, const int* row_of_lane,   \
                                  unsigned* out) {                                                  \
    ldmatrix_probe<N, TRANS>(rows, nrows, row_of_lane, out);                                        \
  }
LDMATRIX_PROBE(ldmatrix_x1, 1, false)
LDMATRIX_PROBE(ldmatrix_x1_trans, 1, true)
LDMATRIX_PROBE(ldmatrix_x2, 2, false)
LDMATRIX_PROBE(ldmatrix_x2_trans, 2, true)
LDMATRIX_PROBE(ldmatrix_x4, 4, false)
LDMATRIX_PROBE(ldmatrix_x4_trans, 4, true)

// movmatrix.trans of each warp's 8x8 matrix: lane i passes in[32w + i], stores out[32w + i].
extern "C" __global__ void movmatrix(const unsigned* in, unsigned* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = pd_movmatrix_trans(in[i]);
}

// D = A B for 64x64 A (row-major) and B (row-major, [k][n]) of bf16 or f16 bits, fp32 D:
// cp.async stages both into static shared memory, then warp w computes rows 16w..16w+15
// with ldmatrix.x4 (A) and ldmatrix.x4.trans (B, two 8-column blocks at a time) feeding
// 8 m16n8k16 MMAs per 16-wide k step. One block of 128 threads.
template <bool F16>
__device__ __forceinline__ void gemm64(const unsigned short* A, const unsigned short* B, float* D) {
  __shared__ __align__(16) unsigned short sA[64 * 64];
  __shared__ __align__(16) unsigned short sB[64 * 64];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  for (int i = tid; i < 64 * 64 / 8; i += 128) {
    pd_cp_async_cg_16(&sA[8 * i], &A[8 * i], 16);
    pd_cp_async_cg_16(&sB[8 * i], &B[8 * i], 16);
  }
  pd_cp_async_commit();
  pd_cp_async_wait<0>();
  __syncthreads();
  float acc[8][4];
  for (int n = 0; n < 8; ++n)
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
  const int j = lane >> 3, r = lane & 7;  // this lane addresses row r of matrix j
  for (int k0 = 0; k0 < 64; k0 += 16) {
    unsigned a[4];
    pd_ldmatrix_x4(a, &sA[(16 * warp + r + 8 * (j & 1)) * 64 + k0 + 8 * (j >> 1)]);
    for (int n0 = 0; n0 < 64; n0 += 16) {
      unsigned bq[4];
      pd_ldmatrix_x4_trans(bq, &sB[(k0 + r + 8 * (j & 1)) * 64 + n0 + 8 * (j >> 1)]);
      const unsigned b0[2] = {bq[0], bq[1]}, b1[2] = {bq[2], bq[3]};
      if (F16) {
        pd_mma_f16_m16n8k16(acc[n0 / 8], a, b0, acc[n0 / 8]);
        pd_mma_f16_m16n8k16(acc[n0 / 8 + 1], a, b1, acc[n0 / 8 + 1]);
      } else {
        pd_mma_bf16_m16n8k16(acc[n0 / 8], a, b0, acc[n0 / 8]);
        pd_mma_bf16_m16n8k16(acc[n0 / 8 + 1], a, b1, acc[n0 / 8 + 1]);
      }
    }
  }
  for (int n = 0; n < 8; ++n)
    for (int e = 0; e < 4; ++e) D[(16 * warp + g + 8 * (e >> 1)) * 64 + 8 * n + 2 * t + (e & 1)] = acc[n][e];
}

extern "C" __global__ void __launch_bounds__(128) gemm64_bf16(const unsigned short* A, const unsigned short* B,
                                                              float* D) {
  gemm64<false>(A, B, D);
}

extern "C" __global__ void __launch_bounds__(128) gemm64_f16(const unsigned short* A, const unsigned short* B,
                                                             float* D) {
  gemm64<true>(A, B, D);
}
