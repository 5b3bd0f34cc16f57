// pd_convert.cuh: what every kernel of the package shares and needs no define for: the
// dtype codes, a few macros, and exact bf16 / fp16 / fp8-e4m3fn <-> fp32 conversions
// written as bit operations, so that the NVRTC build and the g++ CUDA-on-CPU build give
// identical bits.
//
// Defined here and read back by Python as plain `#define NAME <int>` lines: the dtype
// codes PD_DTYPE_*.

#ifndef PD_CONVERT_CUH
#define PD_CONVERT_CUH

#define PD_DTYPE_BF16 0
#define PD_DTYPE_FP16 1
#define PD_DTYPE_FP8_E4M3 2
#define PD_DTYPE_FP8_E5M2 3
#define PD_DTYPE_FP32 4

// `#pragma unroll` for the CUDA compilers only (g++ would warn about an unknown pragma;
// the CPU build gets the same semantics, unrolled or not).
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define PD_UNROLL _Pragma("unroll")
#else
#define PD_UNROLL
#endif

// __launch_bounds__(threads, min CTAs per SM) where the compiler knows it (the CPU shim
// may not define it). The min-CTA hint sets ptxas's register budget (65536 / (128 * n)).
#ifdef __launch_bounds__
#define PD_LAUNCH_BOUNDS(n, min_ctas) __launch_bounds__(n, min_ctas)
#else
#define PD_LAUNCH_BOUNDS(n, min_ctas)
#endif

#define PD_FULL_MASK 0xffffffffu
// ln 2 and log2(e) in double: the host's values (config.LN2, config.LOG2E), read back and
// checked by sources.source_constants. fp32 code takes (float)PD_LOG2E, the float the host's
// value rounds to.
#define PD_LN2 0.6931471805599453
#define PD_LOG2E 1.4426950408889634

__device__ __forceinline__ float pd_neg_inf() { return __int_as_float(0xff800000); }

// ---------------------------------------------------------------------------------
// Conversions (exact, bit operations only)
// ---------------------------------------------------------------------------------

// bf16 -> fp32: the bf16 bits are the top half of the fp32 bits (inf, NaN, denormals too).
__device__ __forceinline__ float pd_bf16_to_float(unsigned h) {
  return __uint_as_float((h & 0xffffu) << 16);
}

// fp16 -> fp32, exact for normals, subnormals, +-0, +-inf and NaN.
// Finite values: put the 15 magnitude bits where fp32 keeps exponent/mantissa
// (exponent bias 15 read as bias 127, a factor 2^-112) and multiply by 2^112. An fp16
// subnormal lands on an fp32 denormal with the same mantissa: the product is exact.
__device__ __forceinline__ float pd_fp16_to_float(unsigned h) {
  const unsigned sign = (h & 0x8000u) << 16;
  const unsigned mag = h & 0x7fffu;
  unsigned bits;
  if (mag >= 0x7c00u) {
    bits = 0x7f800000u | ((mag & 0x3ffu) << 13);  // inf (mantissa 0) or NaN (payload kept)
  } else {
    bits = __float_as_uint(__uint_as_float(mag << 13) * __uint_as_float(0x77800000u));  // * 2^112
  }
  return __uint_as_float(bits | sign);
}

// fp8 e4m3fn -> fp32, exact. e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits, no
// infinities, 0x7f / 0xff are NaN. Same trick as fp16: the 7 magnitude bits placed at
// fp32's exponent/mantissa boundary read as bias 127, times 2^120.
__device__ __forceinline__ float pd_fp8e4m3_to_float(unsigned x) {
  const unsigned sign = (x & 0x80u) << 24;
  const unsigned mag = x & 0x7fu;
  unsigned bits;
  if (mag == 0x7fu) {
    bits = 0x7fc00000u;  // NaN
  } else {
    bits = __float_as_uint(__uint_as_float(mag << 20) * __uint_as_float(0x7b800000u));  // * 2^120
  }
  return __uint_as_float(bits | sign);
}

// fp32 -> bf16, round to nearest even. NaN stays NaN (quieted), overflow rounds to inf
// exactly as RNE says (the carry runs into the exponent), denormals round like normals.
__device__ __forceinline__ unsigned pd_float_to_bf16(float f) {
  const unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x40u) & 0xffffu;
  return ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & 0xffffu;
}

// fp32 -> fp16, round to nearest even, with overflow to inf, fp16 subnormals and NaN.
__device__ __forceinline__ unsigned pd_float_to_fp16(float f) {
  const unsigned u = __float_as_uint(f);
  const unsigned sign = (u >> 16) & 0x8000u;
  const unsigned a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 (half-way past 65504): inf
  if (a >= 0x38800000u) {                       // >= 2^-14: normal fp16
    const unsigned r = a - 0x38000000u;         // rebias the exponent 127 -> 15
    return sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13);
  }
  // fp16 subnormal or zero: the result counts units of 2^-24. a = 1.m * 2^(e-127)
  // = M * 2^(e-150) with M the 24-bit significand, so units = M >> (126 - e).
  const unsigned e = a >> 23;
  if (e < 102u) return sign;  // < 2^-25: rounds to zero (exactly 2^-25 needs e = 102)
  const unsigned mant = (a & 0x7fffffu) | 0x800000u;
  const unsigned shift = 126u - e;  // 14 .. 24
  unsigned q = mant >> shift;
  const unsigned rem = mant & ((1u << shift) - 1u);
  const unsigned half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) q += 1u;  // may carry into 0x400: 2^-14
  return sign | q;
}

#endif  // PD_CONVERT_CUH
