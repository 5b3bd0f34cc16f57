// pd_ptx.cuh: the PTX-level instructions the kernels use, one function per instruction.
//
// This is the only file in kernels_cu/ that contains `asm`. Under NVRTC each function is
// one inline PTX instruction; with __CUDA_ON_CPU__ (the CUDA-on-CPU shim) it is an exact
// emulation, so a kernel line reads the same on both backends. Sections cited are PTX ISA
// 9.1. Targets: sm_90, sm_100, sm_120 (the fp8 conversions need sm_89 or later).
//
// Pointers are generic pointers: `smem_*` / `row` into shared memory (a __shared__ array or
// the DYNAMIC_SHARED buffer), `gmem_src` into global memory.
//
// Warp-collective functions (pd_ldmatrix_*, pd_movmatrix_trans, pd_mma_*) are .sync.aligned:
// all 32 lanes of the warp must call the same function at the same line, in a block whose
// size is a multiple of 32. The shim reports a lane that exits, waits at a barrier or calls
// anything else, naming the kernel, block, thread and the kernel line of the call (the line
// that calls the pd_* function, so keep them out of helper functions that hide the line).
//
// What the shim does, in short (details in cuda_on_cpu/cuda_on_cpu.h):
//   * cp.async is deferred: the source is read and the destination filled with 0xFF at
//     issue; the bytes land at the wait_group that covers the copy's group (under the seeded
//     thread orders possibly earlier). __syncthreads does not land copies. A missing or
//     too-short wait reads 0xFF bytes (or a stage whose older copy landed late).
//   * ldmatrix rows must be 16-byte aligned and inside the block's shared memory.
//   * mma sums c + a[m][0]*b[0][n] + ... + a[m][15]*b[15][n] in that order in fp32 (round to
//     nearest, subnormals kept): exact products, but a tensor core may round the sum
//     differently, so nothing downstream of an MMA may require CPU == GPU bytes.
//   * cvt / prmt are bit-exact; NaN results are canonical: 0x7fff (f16, bf16), 0x7fffffff (f32).
#ifndef PD_PTX_CUH
#define PD_PTX_CUH

#ifdef __CUDA_ON_CPU__
// Trailing hidden parameters: the caller's file and line, for the shim's error messages
// (PD_PTX_SITE defaults them at the call; PD_PTX_SITE_ARGS / PD_PTX_AT pass them on).
#define PD_PTX_SITE , COCPU_CALLER_SITE
#define PD_PTX_SITE_ONLY COCPU_CALLER_SITE
#define PD_PTX_SITE_ARGS , const char *cocpu_file, int cocpu_line
#define PD_PTX_AT , cocpu_file, cocpu_line
#else
#define PD_PTX_SITE
#define PD_PTX_SITE_ONLY
#define PD_PTX_SITE_ARGS
#define PD_PTX_AT
// A shared-memory address as the .shared state space sees it (32 bits).
__device__ __forceinline__ unsigned pd_smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
#endif

// ---------------------------------------------------------------------------------------
// Asynchronous copies global -> shared (§9.7.9.25.3). Writes land only after a
// cp.async.wait_group / wait_all covering their group; src_bytes < size zero-fills the rest
// (src_bytes = 0 reads nothing). Destinations must be aligned to the copy size.
// ---------------------------------------------------------------------------------------

// The one body of the five copies below: cp.async.{ca,cg}.shared.global [dst+OFFSET], [src],
// SIZE, src_bytes (§9.7.9.25.3.1); .ca caches at all levels, .cg in L2 only (.cg: SIZE 16
// only). OFFSET, a byte count, is the instruction's immediate (pd_cp_async_cg_16_at).
template <int SIZE, bool CA, int OFFSET = 0>
__device__ __forceinline__ void pd_cp_async_sized(void* smem_dst, const void* gmem_src,
                                                  unsigned src_bytes PD_PTX_SITE_ARGS) {
  static_assert(SIZE == 4 || SIZE == 8 || SIZE == 16, "cp.async copies 4, 8 or 16 bytes");
  static_assert(CA || SIZE == 16, "cp.async.cg copies 16 bytes");
  static_assert(OFFSET >= 0 && OFFSET % SIZE == 0, "the offset keeps the copy aligned");
#ifdef __CUDA_ON_CPU__
  cocpu_cp_async(static_cast<unsigned char*>(smem_dst) + OFFSET, gmem_src, SIZE, src_bytes, CA, cocpu_file,
                 cocpu_line);
#else
  if constexpr (CA)
    asm volatile("cp.async.ca.shared.global [%0+%4], [%1], %2, %3;\n" ::"r"(pd_smem_addr(smem_dst)),
                 "l"(gmem_src), "n"(SIZE), "r"(src_bytes), "n"(OFFSET)
                 : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0+%3], [%1], 16, %2;\n" ::"r"(pd_smem_addr(smem_dst)),
                 "l"(gmem_src), "r"(src_bytes), "n"(OFFSET)
                 : "memory");
#endif
}

// cp.async.cg.shared.global [dst], [src], 16, src_bytes;  (§9.7.9.25.3.1; L2 only)
__device__ __forceinline__ void pd_cp_async_cg_16(void* smem_dst, const void* gmem_src,
                                                  unsigned src_bytes PD_PTX_SITE) {
  pd_cp_async_sized<16, false>(smem_dst, gmem_src, src_bytes PD_PTX_AT);
}

// cp.async.cg.shared.global [base+OFFSET], [src], 16, src_bytes;  (§9.7.9.25.3.1; L2 only)
// The destination as a register plus an immediate: the copies of one lane's rows share
// the register and ptxas takes each row's offset into the instruction, with no add.
template <int OFFSET>
__device__ __forceinline__ void pd_cp_async_cg_16_at(void* smem_base, const void* gmem_src,
                                                     unsigned src_bytes PD_PTX_SITE) {
  pd_cp_async_sized<16, false, OFFSET>(smem_base, gmem_src, src_bytes PD_PTX_AT);
}

// cp.async.ca.shared.global [dst], [src], 4, src_bytes;  (§9.7.9.25.3.1; L1 and L2)
__device__ __forceinline__ void pd_cp_async_ca_4(void* smem_dst, const void* gmem_src,
                                                 unsigned src_bytes PD_PTX_SITE) {
  pd_cp_async_sized<4, true>(smem_dst, gmem_src, src_bytes PD_PTX_AT);
}

// cp.async.ca.shared.global [dst], [src], 8, src_bytes;  (§9.7.9.25.3.1)
__device__ __forceinline__ void pd_cp_async_ca_8(void* smem_dst, const void* gmem_src,
                                                 unsigned src_bytes PD_PTX_SITE) {
  pd_cp_async_sized<8, true>(smem_dst, gmem_src, src_bytes PD_PTX_AT);
}

// cp.async.ca.shared.global [dst], [src], 16, src_bytes;  (§9.7.9.25.3.1)
__device__ __forceinline__ void pd_cp_async_ca_16(void* smem_dst, const void* gmem_src,
                                                  unsigned src_bytes PD_PTX_SITE) {
  pd_cp_async_sized<16, true>(smem_dst, gmem_src, src_bytes PD_PTX_AT);
}

// prefetch.global.L2 [gmem_src];  (PTX ISA, "prefetch, prefetchu") brings the line holding gmem_src into L2: a
// hint, no result, no ordering. The shim reads one byte of it (so a prefetch outside every
// allocation shows there as a bad read) and otherwise does nothing.
__device__ __forceinline__ void pd_prefetch_l2(const void* gmem_src PD_PTX_SITE) {
#ifdef __CUDA_ON_CPU__
  (void)cocpu_file, (void)cocpu_line;
  (void)*(const volatile unsigned char*)gmem_src;
#else
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(gmem_src));
#endif
}

// cp.async.commit_group;  (§9.7.9.25.3.2) closes this thread's open group of copies.
__device__ __forceinline__ void pd_cp_async_commit(PD_PTX_SITE_ONLY) {
#ifdef __CUDA_ON_CPU__
  (void)cocpu_file, (void)cocpu_line;
  cocpu_cp_async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// cp.async.wait_group N;  (§9.7.9.25.3.3) waits until at most the N newest committed groups
// of this thread are pending (copies not yet committed are not waited for).
template <int N>
__device__ __forceinline__ void pd_cp_async_wait(PD_PTX_SITE_ONLY) {
  static_assert(N >= 0 && N <= 7, "pd_cp_async_wait<N>: N must be 0..7");
#ifdef __CUDA_ON_CPU__
  (void)cocpu_file, (void)cocpu_line;
  cocpu_cp_async_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// cp.async.wait_all;  (§9.7.9.25.3.3) = commit_group, then wait_group 0.
__device__ __forceinline__ void pd_cp_async_wait_all(PD_PTX_SITE_ONLY) {
#ifdef __CUDA_ON_CPU__
  (void)cocpu_file, (void)cocpu_line;
  cocpu_cp_async_wait(-1);
#else
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------------------
// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16 r, [row];  (§9.7.14.5.15)
// Lane l passes the address of row (l % 8) of matrix (l / 8): 16 bytes, 16-byte aligned, in
// shared memory (lanes beyond the matrices used pass anything). r[k] receives matrix k's
// fragment: lane i gets row i/4, columns 2(i%4) (low half) and 2(i%4)+1 (high half);
// .trans: rows 2(i%4) and 2(i%4)+1 of column i/4.
// ---------------------------------------------------------------------------------------
#ifdef __CUDA_ON_CPU__
#define PD_LDMATRIX(N, TRANS, PTX, OUTS)                                                    \
  cocpu_ldmatrix_args args{row, r};                                                        \
  cocpu_matrix_op(COCPU_OP_LDMATRIX, N | (TRANS ? COCPU_LDMATRIX_TRANS : 0), &args,        \
                  cocpu_file, cocpu_line);
#else
#define PD_LDMATRIX(N, TRANS, PTX, OUTS) \
  asm volatile(PTX : OUTS : "r"(pd_smem_addr(row)) : "memory");
#endif

__device__ __forceinline__ void pd_ldmatrix_x1(unsigned (&r)[1], const void* row PD_PTX_SITE) {
  PD_LDMATRIX(1, 0, "ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n", "=r"(r[0]))
}
__device__ __forceinline__ void pd_ldmatrix_x1_trans(unsigned (&r)[1], const void* row PD_PTX_SITE) {
  PD_LDMATRIX(1, 1, "ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n", "=r"(r[0]))
}
#define PD_LDMATRIX_OUTS2 "=r"(r[0]), "=r"(r[1])
__device__ __forceinline__ void pd_ldmatrix_x2(unsigned (&r)[2], const void* row PD_PTX_SITE) {
  PD_LDMATRIX(2, 0, "ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n", PD_LDMATRIX_OUTS2)
}
__device__ __forceinline__ void pd_ldmatrix_x2_trans(unsigned (&r)[2], const void* row PD_PTX_SITE) {
  PD_LDMATRIX(2, 1, "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n",
              PD_LDMATRIX_OUTS2)
}
#define PD_LDMATRIX_OUTS4 "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
__device__ __forceinline__ void pd_ldmatrix_x4(unsigned (&r)[4], const void* row PD_PTX_SITE) {
  PD_LDMATRIX(4, 0, "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n",
              PD_LDMATRIX_OUTS4)
}
__device__ __forceinline__ void pd_ldmatrix_x4_trans(unsigned (&r)[4], const void* row PD_PTX_SITE) {
  PD_LDMATRIX(4, 1, "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n",
              PD_LDMATRIX_OUTS4)
}
#undef PD_LDMATRIX_OUTS2
#undef PD_LDMATRIX_OUTS4
#undef PD_LDMATRIX

// movmatrix.sync.aligned.m8n8.trans.b16 d, a;  (§9.7.14.5.17) a holds this lane's fragment of
// an 8x8 b16 matrix (the ldmatrix layout); d receives the same lane's fragment of its
// transpose.
__device__ __forceinline__ unsigned pd_movmatrix_trans(unsigned a PD_PTX_SITE) {
#ifdef __CUDA_ON_CPU__
  cocpu_movmatrix_args args{a, 0u};
  cocpu_matrix_op(COCPU_OP_MOVMATRIX, 0, &args, cocpu_file, cocpu_line);
  return args.d;
#else
  unsigned d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
  return d;
#endif
}

// ---------------------------------------------------------------------------------------
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 d, a, b, c;
// (§9.7.14.5.14; fragments §9.7.14.5.8, g = lane >> 2, t = lane % 4)
//   A 16x16 row-major: a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..2t+1], a[2] = A[g][2t+8..2t+9],
//                      a[3] = A[g+8][2t+8..2t+9]  (lower column in the low half)
//   B 16x8 ("col"):    b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]
//   C, D 16x8 f32:     c[0..1] = C[g][2t..2t+1], c[2..3] = C[g+8][2t..2t+1]
// d may be the same array as c.
// ---------------------------------------------------------------------------------------
#ifdef __CUDA_ON_CPU__
#define PD_MMA(VARIANT, PTX)                                          \
  cocpu_mma_args args{a, b, c, d};                                    \
  cocpu_matrix_op(COCPU_OP_MMA, VARIANT, &args, cocpu_file, cocpu_line);
#else
#define PD_MMA(VARIANT, PTX)                                                                 \
  asm volatile(PTX " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n" \
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                               \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),            \
                 "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#endif

__device__ __forceinline__ void pd_mma_bf16_m16n8k16(float (&d)[4], const unsigned (&a)[4],
                                                     const unsigned (&b)[2],
                                                     const float (&c)[4] PD_PTX_SITE) {
  PD_MMA(COCPU_MMA_BF16, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
}
__device__ __forceinline__ void pd_mma_f16_m16n8k16(float (&d)[4], const unsigned (&a)[4],
                                                    const unsigned (&b)[2],
                                                    const float (&c)[4] PD_PTX_SITE) {
  PD_MMA(COCPU_MMA_F16, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32")
}
#undef PD_MMA

// ---------------------------------------------------------------------------------------
// Conversions (§9.7.9.21 cvt) and byte permutes (§9.7.9.7 prmt): pure register operations,
// so plain (non-volatile) asm that the compiler may schedule, share or drop.
// ---------------------------------------------------------------------------------------

// cvt.rn.f16x2.e4m3x2 d, a;  the fp8 byte a[15:8] -> d[31:16], a[7:0] -> d[15:0]; exact.
// NaN (0x7f / 0xff) -> 0x7fff.
__device__ __forceinline__ unsigned pd_cvt_f16x2_e4m3x2(unsigned short a) {
#ifdef __CUDA_ON_CPU__
  return cocpu_e4m3_to_f16(a >> 8) << 16 | cocpu_e4m3_to_f16(a & 0xffu);
#else
  unsigned d;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(d) : "h"(a));
  return d;
#endif
}

// cvt.rn.f16x2.e5m2x2 d, a;  as above for e5m2 (an f16's top byte); NaN -> 0x7fff.
__device__ __forceinline__ unsigned pd_cvt_f16x2_e5m2x2(unsigned short a) {
#ifdef __CUDA_ON_CPU__
  return cocpu_e5m2_to_f16(a >> 8) << 16 | cocpu_e5m2_to_f16(a & 0xffu);
#else
  unsigned d;
  asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(d) : "h"(a));
  return d;
#endif
}

// mov.b32 {lo, hi}, w; cvt.rn.f16x2.e4m3x2 d, hi;  (§9.7.9.21) the high half of w: the fp8
// bytes w[31:24] -> d[31:16], w[23:16] -> d[15:0]; exact; NaN -> 0x7fff. ptxas reads the half
// with an operand selector (F2FP ... R.H1) where `w >> 16` costs a shift per conversion.
__device__ __forceinline__ unsigned pd_cvt_f16x2_e4m3x2_hi(unsigned w) {
#ifdef __CUDA_ON_CPU__
  return pd_cvt_f16x2_e4m3x2((unsigned short)(w >> 16));  // the pair conversion of the high half
#else
  unsigned d;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}\n" : "=r"(d) : "r"(w));
  return d;
#endif
}

// cvt.rn.f16x2.e5m2x2 d, hi;  as pd_cvt_f16x2_e4m3x2_hi for e5m2; NaN -> 0x7fff.
__device__ __forceinline__ unsigned pd_cvt_f16x2_e5m2x2_hi(unsigned w) {
#ifdef __CUDA_ON_CPU__
  return pd_cvt_f16x2_e5m2x2((unsigned short)(w >> 16));  // the pair conversion of the high half
#else
  unsigned d;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e5m2x2 %0, hi;\n}\n" : "=r"(d) : "r"(w));
  return d;
#endif
}

// cvt.rn.bf16x2.f32 d, hi, lo;  round to nearest even, hi -> d[31:16]; NaN -> 0x7fff.
__device__ __forceinline__ unsigned pd_cvt_bf16x2_f32(float hi, float lo) {
#ifdef __CUDA_ON_CPU__
  return cocpu_f32_to_bf16_rn(hi) << 16 | cocpu_f32_to_bf16_rn(lo);
#else
  unsigned d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#endif
}

// cvt.rn.f16x2.f32 d, hi, lo;  round to nearest even, subnormals kept, overflow to inf,
// hi -> d[31:16]; NaN -> 0x7fff.
__device__ __forceinline__ unsigned pd_cvt_f16x2_f32(float hi, float lo) {
#ifdef __CUDA_ON_CPU__
  return cocpu_f32_to_f16_rn(hi) << 16 | cocpu_f32_to_f16_rn(lo);
#else
  unsigned d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#endif
}

// cvt.f32.f16 d, h;  exact (subnormals too); NaN -> 0x7fffffff.
__device__ __forceinline__ float pd_cvt_f32_f16(unsigned short h) {
#ifdef __CUDA_ON_CPU__
  return __uint_as_float(cocpu_f16_to_f32_bits(h));
#else
  float d;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(d) : "h"(h));
  return d;
#endif
}

// prmt.b32 d, a, b, sel;  (default mode) byte i of d = byte (sel >> 4i) & 7 of {b, a}
// (a = bytes 0-3), or that byte's sign replicated when bit 3 of the nibble is set.
__device__ __forceinline__ unsigned pd_prmt(unsigned a, unsigned b, unsigned sel) {
#ifdef __CUDA_ON_CPU__
  return cocpu_prmt(a, b, sel);
#else
  unsigned d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
#endif
}

// ---------------------------------------------------------------------------------------
// Programmatic dependent launch (griddepcontrol, PTX ISA 7.8, sm_90 and later). A grid
// launched as the programmatic dependent of the grid before it in its stream (the host's
// Launch.dependent) may start before that grid ends: once every CTA of that grid has
// released its dependents or exited. Below sm_90 neither instruction exists and the host
// never launches a dependent, so both are empty there. The shim runs launches one after
// another: nothing starts early, nothing is left to wait for, and empty is exact.
// ---------------------------------------------------------------------------------------

// griddepcontrol.launch_dependents;  this CTA no longer holds back the grid's dependents
// (the first call of a CTA counts; later ones do nothing). Says nothing about this grid's
// memory: a dependent reads it only after pd_wait_prior_grids.
__device__ __forceinline__ void pd_release_dependents() {
#if !defined(__CUDA_ON_CPU__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// griddepcontrol.wait;  the calling thread waits until every prerequisite grid has
// completed and its memory operations are visible to this grid (returns at once in a grid
// launched without a prerequisite).
__device__ __forceinline__ void pd_wait_prior_grids() {
#if !defined(__CUDA_ON_CPU__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

#undef PD_PTX_SITE
#undef PD_PTX_SITE_ONLY
#undef PD_PTX_SITE_ARGS
#undef PD_PTX_AT
#endif  // PD_PTX_CUH
