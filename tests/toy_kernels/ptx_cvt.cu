// Elementwise probes of the conversion and byte-permute instructions of
// kernels_cu/pd_ptx.cuh (grid-stride loops over n elements).
#include "pd_ptx.cuh"

#define FOR_EACH(i, n) \
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += gridDim.x * blockDim.x)

extern "C" __global__ void cvt_f16x2_e4m3x2(const unsigned short* in, unsigned* out, int n) {
  FOR_EACH(i, n) out[i] = pd_cvt_f16x2_e4m3x2(in[i]);
}

extern "C" __global__ void cvt_f16x2_e5m2x2(const unsigned short* in, unsigned* out, int n) {
  FOR_EACH(i, n) out[i] = pd_cvt_f16x2_e5m2x2(in[i]);
}

// The high half of each 32-bit word (the kernels' fp8_hi: no shift, an operand selector).
extern "C" __global__ void cvt_f16x2_e4m3x2_hi(const unsigned* in, unsigned* out, int n) {
  FOR_EACH(i, n) out[i] = pd_cvt_f16x2_e4m3x2_hi(in[i]);
}

extern "C" __global__ void cvt_f16x2_e5m2x2_hi(const unsigned* in, unsigned* out, int n) {
  FOR_EACH(i, n) out[i] = pd_cvt_f16x2_e5m2x2_hi(in[i]);
}

extern "C" __global__ void cvt_bf16x2_f32(const float* hi, const float* lo, unsigned* out, int n) {
  FOR_EACH(i, n) out[i] = pd_cvt_bf16x2_f32(hi[i], lo[i]);
}

extern "C" __global__ void cvt_f16x2_f32(const float* hi, const float* lo, unsigned* out, int n) {
  FOR_EACH(i, n) out[i] = pd_cvt_f16x2_f32(hi[i], lo[i]);
}

// Stores the bits (an fp32 NaN must reach the host unchanged).
extern "C" __global__ void cvt_f32_f16(const unsigned short* in, unsigned* out, int n) {
  FOR_EACH(i, n) out[i] = __float_as_uint(pd_cvt_f32_f16(in[i]));
}

extern "C" __global__ void prmt(const unsigned* a, const unsigned* b, const unsigned* sel, unsigned* out, int n) {
  FOR_EACH(i, n) out[i] = pd_prmt(a[i], b[i], sel[i]);
}
