// mma_attend.cuh: the core algorithm: q staged as MMA operands (stage_q), the operand
// builders (fp8 conversion, p split into parts), and attend: per warp, scores on tensor
// cores, the mask and the logits hooks, the online softmax and O += V^T P^T over the
// warp's tiles, leaving its State.

#ifndef PD_MMA_ATTEND_CUH
#define PD_MMA_ATTEND_CUH

#include "mma_features.cuh"
#include "mma_stream.cuh"

namespace pd_mma {

// -- Q staging -----------------------------------------------------------------------

// Stage the CTA's query rows (warp w converts rows w, w + W, ...; lane c holds dims
// 8c .. 8c + 7) and each row's score scale qk_scale * 2^-c_r. q_row(r) points at row r's
// D elements. Ends with __syncthreads(); every thread of the CTA calls it.
template <class QRow>
__device__ __forceinline__ void stage_q(unsigned char* smem, const QRow& q_row, int rows, float qk_scale) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  PD_UNROLL
  for (int k = 0; k < Q_ROWS_PER_WARP; ++k) {
    const int r = warp + k * W;
    if (ROWS % W != 0 && r >= ROWS) continue;  // 6 warps: the last round converts ROWS % W rows (warp-uniform)
    unsigned bits[8];
    float x[8];
    const bool mine = r < rows && lane < D / 8;  // dims >= D (and rows >= rows) are staged as zeros
    {
      unsigned w4[4] = {0u, 0u, 0u, 0u};
      if (mine) pd_load_words(q_row(r) + lane * 8, w4);
      PD_UNROLL
      for (int j = 0; j < 8; ++j) {
        bits[j] = (w4[j >> 1] >> ((j & 1) * 16)) & 0xffffu;
        x[j] = pd_q_to_float(bits[j]);
      }
    }
    float scale = qk_scale;
    if (Q_SCALED) {
      float amax = 0.f;
      PD_UNROLL
      for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(x[j]));
      PD_UNROLL
      for (int off = 16; off >= 1; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(PD_FULL_MASK, amax, off));
      // c = 14 - floor(log2 amax). bf16 has fp32's exponents, so c runs from -114 (inf/NaN,
      // e = 128) to 141: exponent field 0 (a row of zeros or bf16 subnormals, multiples of
      // 2^-133) reads as e = -127, and q 2^141 holds such a row exactly (fp16 integers
      // below 2^15). Neither 2^c nor 2^-c need be a normal float, so each is applied in two
      // steps, c1 = c clamped to [-100, 100] and then c2 = c - c1 in [-14, 41]: q's steps are
      // exact (scaling up, or down to where fp16 rounds to 0 anyway) and the scale's
      // intermediate lies between qk_scale and the final scale, so it is normal whenever
      // that is. A row with |c| <= 100 takes c2 = 0: the scale of a single 2^-c.
      const int e = (int)((__float_as_uint(amax) >> 23) & 0xffu) - 127;
      const int c = 14 - e;
      const int c1 = c < -100 ? -100 : (c > 100 ? 100 : c), c2 = c - c1;
      const float up1 = __uint_as_float((unsigned)(127 + c1) << 23), up2 = __uint_as_float((unsigned)(127 + c2) << 23);
      PD_UNROLL
      for (int j = 0; j < 8; ++j) bits[j] = pd_float_to_fp16(x[j] * up1 * up2);
      scale = qk_scale * __uint_as_float((unsigned)(127 - c1) << 23) * __uint_as_float((unsigned)(127 - c2) << 23);
      // A scale that underflowed to 0 (a zero row, or one whose logits are below 2^-110:
      // |q 2^c . k| < 2^39) would make a masked score -inf * 0 = NaN in attend. The least
      // denormal keeps it > 0, and logits that small weigh exactly 1 either way.
      scale = fmaxf(scale, __uint_as_float(1u));
    }
    if (lane == 0) reinterpret_cast<float*>(smem + SCALE_OFF)[r] = scale;
    PD_UNROLL
    for (int part = 0; part < QP; ++part) {
      unsigned v[8];
      PD_UNROLL
      for (int j = 0; j < 8; ++j) {
        if (QP == 2) {  // fp16 q for a bf16 MMA: hi = bf16(q), lo = bf16(q - hi), both exact
          const unsigned hi = pd_float_to_bf16(x[j]);
          v[j] = part == 0 ? hi : pd_float_to_bf16(x[j] - pd_bf16_to_float(hi));
        } else {
          v[j] = bits[j];
        }
      }
      if (lane < DP / 8) {
        unsigned char* row = smem + Q_OFF + (part * ROWS + r) * QS;
        PD_UNROLL
        for (int j = 0; j < 8; j += 2)
          *reinterpret_cast<unsigned*>(row + 2 * q_position(lane * 8 + j)) = v[j] | (v[j + 1] << 16);
      }
    }
  }
  __syncthreads();
}

// -- MMA operand builders -------------------------------------------------------------

__device__ __forceinline__ void mma(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  if (MMA_BF16)
    pd_mma_bf16_m16n8k16(acc, a, b, acc);
  else
    pd_mma_f16_m16n8k16(acc, a, b, acc);
}

// Two fp8 bytes (the low or high half of w) as an f16x2 pair.
__device__ __forceinline__ unsigned fp8_pair(unsigned short two) {
#if PD_KV_DTYPE == PD_DTYPE_FP8_E5M2
  return pd_cvt_f16x2_e5m2x2(two);
#else
  return pd_cvt_f16x2_e4m3x2(two);
#endif
}
__device__ __forceinline__ unsigned fp8_lo(unsigned w) { return fp8_pair((unsigned short)(w & 0xffffu)); }
__device__ __forceinline__ unsigned fp8_hi(unsigned w) {
#if PD_KV_DTYPE == PD_DTYPE_FP8_E5M2
  return pd_cvt_f16x2_e5m2x2_hi(w);
#else
  return pd_cvt_f16x2_e4m3x2_hi(w);
#endif
}

// The PP parts of four probabilities as B operands of the PV MMA: p[0..1] are token g,
// rows 2t, 2t+1 and p[2..3] token g + 8 (the S^T accumulator layout). Part k rounds
// what parts < k left (each residual exact in fp32); movmatrix turns each 8x8 (tokens x
// rows) b16 block into the B layout (k = tokens 2t, 2t+1, n = row g).
__device__ __forceinline__ void p_operands(const float (&p)[4], unsigned (&b)[PP][2]) {
  float r[4] = {p[0], p[1], p[2], p[3]};
  PD_UNROLL
  for (int part = 0; part < PP; ++part) {
    PD_UNROLL
    for (int h = 0; h < 2; ++h) {
      const unsigned v = MMA_BF16 ? pd_cvt_bf16x2_f32(r[2 * h + 1], r[2 * h]) : pd_cvt_f16x2_f32(r[2 * h + 1], r[2 * h]);
      b[part][h] = pd_movmatrix_trans(v);
      if (part + 1 < PP) {
        r[2 * h] -= MMA_BF16 ? __uint_as_float(v << 16) : pd_cvt_f32_f16((unsigned short)(v & 0xffffu));
        r[2 * h + 1] -= MMA_BF16 ? __uint_as_float(v & 0xffff0000u) : pd_cvt_f32_f16((unsigned short)(v >> 16));
      }
    }
  }
}

// -- the core --------------------------------------------------------------------------

// The per-warp state: for row tile nt and column j in {0, 1} (row nt * 8 + 2t + j,
// t = lane % 4): m (identical on the 8 lanes of a column), this lane's share of l, and
// O^T fragments o[dt][nt][4] (dims of 16-dim block dt, see out_dim).
struct State {
  float m[NT][2];
  float l[NT][2];
  float o[KD][NT][4];
};

// Dim of O^T fragment element e (0..3) of block dt held by lane (g, t): rows g and g + 8
// of the block. bf16/fp16 V: block rows are its 16 dims in order; fp8 V: the byte pairs
// of ldmatrix.trans put even dims on rows 0..7 and odd dims on rows 8..15.
__device__ __forceinline__ int out_dim(int dt, int g, int e) {
  const int upper = e >> 1;
  return FP8 ? dt * 16 + 2 * g + upper : dt * 16 + 8 * upper + g;
}


// Attend every row's keys and leave the warp state in `st`: the plain algorithm, the
// features entering through their hooks (f, MultiToken). `smem` is the launch's dynamic
// shared memory, Q staged (stage_q). PREFETCH > 0: the first PREFETCH of this warp's tiles
// are in flight already (issue_ahead), the prologue issues the rest.
__device__ __forceinline__ void attend(unsigned char* smem, const Rows& rw, const Features& f,
                                       const unsigned char* k_head, long long k_stride_page, long long k_stride_token,
                                       const unsigned char* v_head, long long v_stride_page,
                                       long long v_stride_token, const int* __restrict__ bt_row, int page_size,
                                       const Carry& carry, State& st) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const float neg_inf = pd_neg_inf();

  PD_UNROLL
  for (int nt = 0; nt < NT; ++nt)
    PD_UNROLL
    for (int j = 0; j < 2; ++j) {
      st.m[nt][j] = neg_inf;
      st.l[nt][j] = 0.f;
    }
  PD_UNROLL
  for (int dt = 0; dt < KD; ++dt)
    PD_UNROLL
    for (int nt = 0; nt < NT; ++nt)
      PD_UNROLL
      for (int e = 0; e < 4; ++e) st.o[dt][nt][e] = 0.f;

  float scale[NT][2];
  PD_UNROLL
  for (int nt = 0; nt < NT; ++nt)
    PD_UNROLL
    for (int j = 0; j < 2; ++j) scale[nt][j] = reinterpret_cast<const float*>(smem + SCALE_OFF)[nt * 8 + 2 * t + j];

  int lo, hi;  // the CTA's keys
  cta_range(rw, f.window, lo, hi);
  int col_lo[NT][2], col_hi[NT][2];  // multi_token: the keys each of this lane's columns sees
  if (MultiToken::on) MultiToken::logits_mask(rw, f, t, col_lo, col_hi);
  int first_tile, my_tiles;
  warp_tiles(lo, hi, first_tile, my_tiles);

  unsigned char* ring = smem + RING_OFF + warp * RING_BYTES;
  unsigned char* table = smem + TABLE_OFF + warp * TT * 16;

  constexpr int from = PREFETCH;  // tiles in flight already (issue_ahead)
  Stream s;
  const long long strides[4] = {k_stride_page, k_stride_token, v_stride_page, v_stride_token};
  open_stream(s, k_head, v_head, bt_row, page_size, lo, hi, first_tile, from, ring);
  start_entries(s, carry);

  PD_UNROLL
  for (int k = 0; k < S - 1; ++k)
    if (k >= from) issue_tile(s, strides, k < my_tiles, first_tile + k * W, ring + k * STAGE_BYTES, table, k);

  // ldmatrix row address of this lane within a tile: token ((lane >> 3) & 1) * 8 +
  // (lane & 7) of a 16-token block, 16-byte chunk lane >> 4 of a chunk pair.
  const int kv_lane = ((((lane >> 3) & 1) * 8) + (lane & 7)) * RS + (lane >> 4) * 16;
  const unsigned char* q_lane = smem + Q_OFF + (lane & 7) * QS + (lane >> 3) * 16;
  // Q_IN_REGS: q's B operands read once here, not once per 16 keys (each reading shared memory)
  unsigned q_frag[Q_IN_REGS ? KS / 2 : 1][QP][NT][4];
  PD_UNROLL
  for (int kk = 0; kk < (Q_IN_REGS ? KS / 2 : 0); ++kk)
    PD_UNROLL
    for (int part = 0; part < QP; ++part)
      PD_UNROLL
      for (int nt = 0; nt < NT; ++nt)
        pd_ldmatrix_x4(q_frag[kk][part][nt], q_lane + (part * ROWS + nt * 8) * QS + kk * 64);

  for (int k = 0; k < my_tiles; ++k) {
    pd_cp_async_wait<S - 2>();  // this lane's copies of tile k have landed; issue_tile's
                                // __syncwarp makes every lane's visible and frees the stage read last
    issue_tile(s, strides, k + S - 1 < my_tiles, first_tile + (k + S - 1) * W, ring + ((k + S - 1) % S) * STAGE_BYTES,
               table, (k + S - 1) % S);

    const unsigned char* kt = ring + (k % S) * STAGE_BYTES;
    const unsigned char* vt = kt + TILE_BYTES;
    const int base = (first_tile + k * W) * TT;  // absolute position of the tile's first key

    // -- scores S^T[token][row] = K Q^T, two 16-dim steps per ldmatrix.x4
    float sc[MT][NT][4];
    PD_UNROLL
    for (int mt = 0; mt < MT; ++mt)
      PD_UNROLL
      for (int nt = 0; nt < NT; ++nt)
        PD_UNROLL
        for (int e = 0; e < 4; ++e) sc[mt][nt][e] = 0.f;
    PD_UNROLL
    for (int kk = 0; kk < KS / 2; ++kk) {
      PD_UNROLL
      for (int mt = 0; mt < MT; ++mt) {
        unsigned a[2][4];
        if (FP8) {  // chunks 2kk, 2kk + 1 of 16 dims each: one step per chunk
          unsigned r[4];
          pd_ldmatrix_x4(r, kt + mt * 16 * RS + kk * 32 + kv_lane);
          PD_UNROLL
          for (int h = 0; h < 2; ++h) {
            if (2 * kk + h >= KD) continue;  // a padding step (compile time)
            a[h][0] = fp8_lo(r[2 * h]);
            a[h][1] = fp8_lo(r[2 * h + 1]);
            a[h][2] = fp8_hi(r[2 * h]);
            a[h][3] = fp8_hi(r[2 * h + 1]);
          }
        } else {  // chunks of 8 dims: two per step
          PD_UNROLL
          for (int h = 0; h < 2; ++h) {
            if (2 * kk + h >= KD) continue;
            unsigned r[4];
            pd_ldmatrix_x4(r, kt + mt * 16 * RS + (2 * kk + h) * 32 + kv_lane);
            a[h][0] = r[0];
            a[h][1] = r[1];
            a[h][2] = r[2];
            a[h][3] = r[3];
          }
        }
        // q's B operands of steps 2kk, 2kk + 1, one row tile and part at a time: from
        // q_frag (Q_IN_REGS), else re-read from shared memory every tile (few registers live)
        PD_UNROLL
        for (int part = 0; part < QP; ++part)
          PD_UNROLL
          for (int nt = 0; nt < NT; ++nt) {
            unsigned qb[4];  // [step 2kk: b0b1, b2b3, step 2kk + 1: b0b1, b2b3]
            if (Q_IN_REGS) {
              PD_UNROLL
              for (int e = 0; e < 4; ++e) qb[e] = q_frag[Q_IN_REGS ? kk : 0][part][nt][e];
            } else {
              pd_ldmatrix_x4(qb, q_lane + (part * ROWS + nt * 8) * QS + kk * 64);
            }
            PD_UNROLL
            for (int h = 0; h < 2; ++h) {
              if (2 * kk + h >= KD) continue;
              const unsigned b[2] = {qb[2 * h], qb[2 * h + 1]};
              mma(sc[mt][nt], a[h], b);
            }
          }
      }
    }

    // -- logits: keys a row does not see masked (-inf), the others transformed (soft_cap)
    PD_UNROLL
    for (int mt = 0; mt < MT; ++mt)
      PD_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int pos = base + mt * 16 + g + 8 * (e >> 1);
        PD_UNROLL
        for (int nt = 0; nt < NT; ++nt) {
          const bool sees = MultiToken::on ? pos >= col_lo[nt][e & 1] && pos < col_hi[nt][e & 1]  // its row's
                                           : pos >= lo && pos < hi;                               // the CTA's
          sc[mt][nt][e] = sees ? (SoftCap::on ? f.soft_cap.logits_transform(sc[mt][nt][e], scale[nt][e & 1]) : sc[mt][nt][e])
                               : neg_inf;
        }
      }

    // -- update m and l, rescale O by alpha = 2^(m_old - m_new)
    float alpha[NT][2];
    PD_UNROLL
    for (int nt = 0; nt < NT; ++nt)
      PD_UNROLL
      for (int j = 0; j < 2; ++j) {
        float mx = neg_inf;  // plain: of the raw scores (scale > 0 keeps their order); soft_cap: of x
        PD_UNROLL
        for (int mt = 0; mt < MT; ++mt) mx = fmaxf(mx, fmaxf(sc[mt][nt][j], sc[mt][nt][j + 2]));
        PD_UNROLL
        for (int off = 4; off <= 16; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(PD_FULL_MASK, mx, off));
        const float m_new = fmaxf(st.m[nt][j], SoftCap::on ? mx : mx * scale[nt][j]);  // log2 units
        // Nothing valid seen yet (m_new = -inf): subtract 0, so -inf - -inf = NaN never
        // happens; alpha and every p are then exp2f(-inf) = 0.
        const float ms = m_new == neg_inf ? 0.f : m_new;
        alpha[nt][j] = exp2f(st.m[nt][j] - ms);
        st.m[nt][j] = m_new;
        float lsum = 0.f;
        PD_UNROLL
        for (int mt = 0; mt < MT; ++mt)
          PD_UNROLL
          for (int e = j; e < 4; e += 2) {
            // p = 2^(x - ms); plain: x = scale * the raw score, folded into one fmaf
            const float p = SoftCap::on ? exp2f(sc[mt][nt][e] - ms) : exp2f(fmaf(sc[mt][nt][e], scale[nt][j], -ms));
            lsum += p;
            sc[mt][nt][e] = p * p_scale();  // exact (a power of two)
          }
        st.l[nt][j] = fmaf(st.l[nt][j], alpha[nt][j], lsum);
      }
    PD_UNROLL
    for (int dt = 0; dt < KD; ++dt)
      PD_UNROLL
      for (int nt = 0; nt < NT; ++nt)
        PD_UNROLL
        for (int e = 0; e < 4; ++e) st.o[dt][nt][e] *= alpha[nt][e & 1];

    // -- O^T[dim][row] += V^T P^T, one MMA per part of p
    PD_UNROLL
    for (int mt = 0; mt < MT; ++mt) {
      unsigned pb[NT][PP][2];
      PD_UNROLL
      for (int nt = 0; nt < NT; ++nt) p_operands(sc[mt][nt], pb[nt]);
      PD_UNROLL
      for (int dp = 0; dp < KS / 2; ++dp) {  // two 16-dim blocks per ldmatrix.x4.trans
        unsigned a[2][4];
        if (FP8) {  // one chunk per block; bytes (token 2t, 2t+1) x (dim 2g, 2g+1) per register
          unsigned r[4];
          pd_ldmatrix_x4_trans(r, vt + mt * 16 * RS + dp * 32 + kv_lane);
          PD_UNROLL
          for (int h = 0; h < 2; ++h) {
            if (2 * dp + h >= KD) continue;
            const unsigned lo8 = pd_prmt(r[2 * h], 0u, 0x3120u);      // tokens 0..7: (dim 2g | dim 2g + 1) pairs
            const unsigned hi8 = pd_prmt(r[2 * h + 1], 0u, 0x3120u);  // tokens 8..15
            a[h][0] = fp8_lo(lo8);
            a[h][1] = fp8_hi(lo8);
            a[h][2] = fp8_lo(hi8);
            a[h][3] = fp8_hi(hi8);
          }
        } else {  // two chunks of 8 dims per block
          PD_UNROLL
          for (int h = 0; h < 2; ++h) {
            if (2 * dp + h >= KD) continue;
            unsigned r[4];
            pd_ldmatrix_x4_trans(r, vt + mt * 16 * RS + (2 * (2 * dp + h)) * 16 + kv_lane);
            a[h][0] = r[0];
            a[h][1] = r[2];
            a[h][2] = r[1];
            a[h][3] = r[3];
          }
        }
        PD_UNROLL
        for (int h = 0; h < 2; ++h)
          PD_UNROLL
          for (int nt = 0; nt < NT; ++nt)
            PD_UNROLL
            for (int part = 0; part < PP; ++part)
              if (2 * dp + h < KD) mma(st.o[2 * dp + h][nt], a[h], pb[nt][part]);
      }
    }
  }
  pd_cp_async_wait_all();  // only empty groups can be left; the rings are reused next

  // This lane's share of l over the 8 lanes of its column (xor butterfly: every lane of
  // the column ends with the same bits).
  PD_UNROLL
  for (int nt = 0; nt < NT; ++nt)
    PD_UNROLL
    for (int j = 0; j < 2; ++j)
      PD_UNROLL
      for (int off = 4; off <= 16; off <<= 1) st.l[nt][j] += __shfl_xor_sync(PD_FULL_MASK, st.l[nt][j], off);
}

}  // namespace pd_mma

#endif  // PD_MMA_ATTEND_CUH
