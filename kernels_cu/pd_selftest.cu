// pd_selftest.cu: a known-answer test of the PTX instructions the "mma" kernels rely on,
// run once per device before the first mma kernel is trusted (backends/selftest.py
// computes the expected values on the host and falls back to the simt kernels, with a
// warning naming what disagreed, if the device does not give them).
//
// One warp (grid 1, block 32). Inputs: two 16x16 b16 matrices (small integers as bf16,
// resp. fp16, so every MMA sum is exact on any hardware), 256 bytes (every e4m3 value).
// Each lane writes SELFTEST_WORDS words and SELFTEST_FLOATS floats:
//   words  0..3  ldmatrix.x4 of the bf16 matrix's four 8x8 quadrants (rows 0-7|8-15 x
//                cols 0-7|8-15 in that order: exactly an m16n8k16 A fragment)
//   words  4..7  the same with .trans
//   word   8     movmatrix.trans of word 0
//   words  9..12 cvt.rn.f16x2.e4m3x2 of this lane's bytes 8l..8l+7, as 4 pairs
//   word  13     prmt.b32(word 0, word 1, 0x3120 + lane)    (lane varies the selector)
//   word  14     the lane & 3'th word of a 16-byte cp.async of the bytes with src-size 7
//   word  15     cvt.rn.bf16x2.f32 of (float)lane * 1.00390625f, -(float)lane / 3.0f
//   word  16     cvt.rn.f16x2.f32 of the same two floats
//   words 17..18 cvt.rn.f16x2.e4m3x2 of the high half of this lane's 32-bit words of bytes
//                8l..8l+3, 8l+4..8l+7 (the kernels' fp8_hi): equal to words 10 and 12
//   floats 0..3  mma bf16: D = A B with A the bf16 matrix, B = its rows 0-7 transposed
//   floats 4..7  mma f16: the same with the fp16 matrix
//   float  8     cvt.f32.f16 of the fp16 matrix's element lane
#include "pd_ptx.cuh"

#define SELFTEST_WORDS 19
#define SELFTEST_FLOATS 9

extern "C" __global__ void pd_selftest(const unsigned short* __restrict__ mat_bf16,
                                       const unsigned short* __restrict__ mat_f16,
                                       const unsigned char* __restrict__ bytes, unsigned* __restrict__ words,
                                       float* __restrict__ floats) {
  __shared__ __align__(16) unsigned short s_bf16[16 * 16];
  __shared__ __align__(16) unsigned short s_f16[16 * 16];
  __shared__ __align__(16) unsigned char s_bytes[16];
  const int lane = threadIdx.x;

  pd_cp_async_cg_16(s_bf16 + lane * 8, mat_bf16 + lane * 8, 16u);
  pd_cp_async_cg_16(s_f16 + lane * 8, mat_f16 + lane * 8, 16u);
  if (lane == 0) pd_cp_async_cg_16(s_bytes, bytes, 7u);
  pd_cp_async_commit();
  pd_cp_async_wait<0>();
  __syncwarp();

  unsigned* w = words + lane * SELFTEST_WORDS;
  float* f = floats + lane * SELFTEST_FLOATS;
  const int row = (lane & 7) + 8 * ((lane >> 3) & 1), col = 8 * (lane >> 4);
  unsigned a[4], t[4], h[4];
  pd_ldmatrix_x4(a, s_bf16 + row * 16 + col);
  pd_ldmatrix_x4_trans(t, s_bf16 + row * 16 + col);
  pd_ldmatrix_x4(h, s_f16 + row * 16 + col);
  for (int k = 0; k < 4; ++k) {
    w[k] = a[k];
    w[4 + k] = t[k];
  }
  w[8] = pd_movmatrix_trans(a[0]);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  // No fp8 cvt before sm_89; the mma kernels read no fp8 cache there (kernels.mma_refusal).
  for (int k = 0; k < 4; ++k) w[9 + k] = 0u;
  w[17] = w[18] = 0u;
#else
  for (int k = 0; k < 4; ++k)
    w[9 + k] = pd_cvt_f16x2_e4m3x2((unsigned short)(bytes[lane * 8 + 2 * k] | (bytes[lane * 8 + 2 * k + 1] << 8)));
  for (int k = 0; k < 2; ++k) {
    const int at = lane * 8 + 4 * k;
    w[17 + k] = pd_cvt_f16x2_e4m3x2_hi((unsigned)bytes[at] | (unsigned)bytes[at + 1] << 8 |
                                       (unsigned)bytes[at + 2] << 16 | (unsigned)bytes[at + 3] << 24);
  }
#endif
  w[13] = pd_prmt(a[0], a[1], 0x3120u + (unsigned)lane);
  w[14] = reinterpret_cast<const unsigned*>(s_bytes)[lane & 3];
  const float x = (float)lane * 1.00390625f, y = -(float)lane / 3.0f;
  w[15] = pd_cvt_bf16x2_f32(x, y);
  w[16] = pd_cvt_f16x2_f32(x, y);

  const float zero[4] = {0.f, 0.f, 0.f, 0.f};
  float d[4];
  const unsigned b_bf16[2] = {a[0], a[2]};  // B[k][n] = A[n][k] for n < 8
  pd_mma_bf16_m16n8k16(d, a, b_bf16, zero);
  for (int k = 0; k < 4; ++k) f[k] = d[k];
  const unsigned b_f16[2] = {h[0], h[2]};
  pd_mma_f16_m16n8k16(d, h, b_f16, zero);
  for (int k = 0; k < 4; ++k) f[4 + k] = d[k];
  f[8] = pd_cvt_f32_f16(mat_f16[lane]);
}
