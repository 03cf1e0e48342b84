// ISO3 paged decode attention on tensor cores (mma.sync m16n8k16, fp16 in, fp32 accumulate),
// in the rotated space (specs/iso_kv.md §6.5), split-K; the contract of
// iso.decode_attention_ref (launcher: kernels/iso/mma.py).
//
// Grid (splits, kv heads, batch), NW = 4 or 16 warps (the tile/merge buffer in dynamic
// shared memory). Every warp walks its own 16-token sub-tiles of the CTA's chunk
// (cp.async double buffer per warp, no CTA barrier in the loop) and keeps its own online
// softmax; the warps merge in shared memory at the end, the splits in a second
// kernel (decode_merge_cols_kernel, iso_split.cuh: grid over heads, sequences and column
// slices). The query is read in its own dtype (no cast launch before). The operand decoding
// and the MMA wrappers are in iso_mma_prims.cuh.
//
// Scores: S^T_b[t, h] = C_b[t, :] . Q_b[h, :] with the sub-tile's 16 tokens as the MMA's M
// rows, the G <= 8 query heads as N (the query is the B operand: one MMA per k-step, no zero
// rows), k = 16 packed values of block b; the fp16 norms scale S_b per (token, block).
// Values: O^T[d, h] += V^T[d, t] P^T[t, h], d as M (16 rows per tile), heads as N, 16 tokens
// as k; P^T (fp16, scaled by the V norm of its (token, block)) reaches the V MMA's B layout
// through movmatrix. The accumulator holds the rotated output. A sub-tile is staged as the
// aligned 16-byte chunks covering each row (needs 16-byte aligned caches and a slot stride
// that is a multiple of 4: the launcher checks), in buffer rows one 16-byte chunk longer than
// the rows need, which keeps the loop's fragment loads free of most bank conflicts.
#include "iso_common.cuh"
#include "iso_mma_prims.cuh"
#include "iso_split.cuh"

namespace iso {
namespace mma {

// Shared-memory layout of one CTA (host and device): per-warp double buffers of K and V rows
// during the loop, reused for the warp merge after it. The row stride is one 16-byte chunk
// longer than the rows need (D=256: 144 instead of 128 bytes, D=128: 80 instead of 64), so
// consecutive tokens' rows start 4 banks apart instead of on the same bank; the fragment
// loads of the loop (8 tokens x 4 words, 4 tokens x 8 words) then spread over the 32 banks.
template <int NB, int NW>
struct Layout {
  static constexpr int D = NB * kBlock;
  static constexpr int BB = Fmt<3>::kBytes;
  static constexpr int RB = NB * BB;
  // rows start at the source's address mod 16 (up to 14): RW16 bytes of aligned chunks
  static constexpr int RW16 = (RB + 14 + 15) / 16 * 16;
  // shared-memory row stride
  static constexpr int RS = RW16 + 16;
  static constexpr int kWarpBuf = 2 * 2 * kSub * RS;  // two buffers of K and V rows per warp
  static constexpr int kTileBytes = NW * kWarpBuf;
  static constexpr int kMergeBytes = NW * kRows * PaddedRows<D>::kFloats * 4;
  static constexpr int kRaw = kTileBytes > kMergeBytes ? kTileBytes : kMergeBytes;
  // the kernel's other static arrays (q_sm, off_sm, mis_sm, ml_sm, qf_sm)
  static constexpr int kOther = kRows * (D + 4) * 4 + NW * 2 * kSub * 8 +
                                NW * 2 * kSub + NW * kRows * 2 * 4 + NB * 4 * 32 * 16;
  // NOTE: the tile/merge buffer is static while the whole CTA fits the 48 KB of static shared
  // memory, else dynamic shared memory (16 warps; 4 warps at D=256: 36864 + 13824 bytes);
  // the launcher raises the kernel's limit.
  static constexpr bool kDynamic = NW > 4 || kRaw + kOther > 48 * 1024;
  static constexpr int kDynBytes = kDynamic ? kRaw : 0;
};

// CTAs per SM the register budget must allow: 8 warps per SM (the grids that run are one
// wave of at most 2-3 CTAs of 4 warps at batch 1, one CTA of 16 warps at batch 8). Bounded
// at 16 warps per SM instead, ptxas keeps the two blocks' score MMA chains and the value
// decoding in sequence, which is slower (docs/RESULTS.md).
__host__ __device__ constexpr int min_ctas_per_sm(int n_warps) {
  return n_warps >= 8 ? 1 : 8 / n_warps;
}

// NW warps split the CTA's tokens (warp w takes sub-tiles w, w + NW, ...), each with its own
// buffers and online softmax: more warps per CTA give more warps per SM at the same number of
// split partials.
template <int NB, int NW>
__global__ void __launch_bounds__(NW * 32, min_ctas_per_sm(NW))
    decode_mma_kernel(const void* __restrict__ q, int q_code,
                      const uint8_t* __restrict__ k_cache,
                      const uint8_t* __restrict__ v_cache, int64_t slot_stride,
                      const int32_t* __restrict__ page_table, int64_t pt_stride,
                      int pt_cols, const int32_t* __restrict__ seq_lens, int page_size,
                      int n_kv_heads, int group, int chunk, int n_splits, float scale_log2,
                      float* __restrict__ part_acc, float* __restrict__ part_ml) {
  using L = Layout<NB, NW>;
  constexpr int D = L::D;
  constexpr int BB = L::BB;
  constexpr int RB = L::RB;
  constexpr int RS = L::RS;
  constexpr int kWarpBuf = L::kWarpBuf;
  using Rows = PaddedRows<D>;

  // the tile/merge buffer: static up to 4 warps (16 unused bytes above), else dynamic
  __shared__ __align__(16) uint8_t raw_static[L::kDynamic ? 16 : L::kRaw];
  uint8_t* raw = raw_static;
  if constexpr (L::kDynamic) raw = dynamic_smem();
  __shared__ float q_sm[kRows][D + 4];
  __shared__ int64_t off_sm[NW][2][kSub];
  __shared__ uint8_t mis_sm[NW][2][kSub];  // a row's start in its buffer row
  __shared__ float ml_sm[NW][kRows][2];  // also two copies of the centroid table
  static_assert(sizeof(ml_sm) >= 2 * sizeof(Lut), "room for the table");
  // [block nb, word u, j / 2][lane]: (k-step 4u + j, 4u + j + 1) x (a0, a2) of lane's fragment
  __shared__ uint4 qf_sm[NB * 4][32];

  allow_dependent_launch();  // the split merge may be scheduled now; it waits for this grid
  // the quaternion of the lane's 4-D group (a constant table): the query groups a thread
  // rotates below are i mod D/4 with i = lane (mod 32), always group `lane` of its block
  const float4 quat = quat_row(threadIdx.x & 31);
  // launched as a programmatic dependent (pdl): nothing before this line reads what the
  // kernels before it write (query, lengths, page table, the new token's rows)
  wait_for_prior_grid();
  const int split = blockIdx.x;
  const int kvh = blockIdx.y;
  const int b = blockIdx.z;
  const int hq = n_kv_heads * group;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int t_begin = split * chunk;
  // length -> page table -> rows is the prologue's longest chain: lane < kSub requests the
  // page of its token in the warp's first sub-tile beside the length (any column of the
  // table's row; `stage` drops it past the sequence's end), the query's loads follow
  const int32_t* pt_row = page_table + (int64_t)b * pt_stride;
  const int t_first = t_begin + warp * kSub + lane;
  const int pg_first = t_first / page_size;
  int32_t page_next = lane < kSub && pg_first < pt_cols ? pt_row[pg_first] : 0;
  const int len = seq_lens[b];
  constexpr int kQGroups = kRows * D / 4;  // 4-value groups of the staged query
  constexpr int kQIters = (kQGroups + NW * 32 - 1) / (NW * 32);  // per thread
  // D = 128 with 16 warps: more threads than groups (threads past the end load nothing)
  constexpr bool kQWhole = kQGroups % (NW * 32) == 0;
  uint32_t qv[kQIters][4];  // the query's bits (load_q_bits)
#pragma unroll
  for (int it = 0; it < kQIters; ++it) {
    const int i = threadIdx.x + it * NW * 32;
    const int h = i / (D / 4);  // >= kRows > group past the end
    const int64_t qi = ((int64_t)b * hq + kvh * group + h) * D + 4 * (i - h * (D / 4));
#pragma unroll
    for (int j = 0; j < 4; ++j) qv[it][j] = h < group ? load_q_bits(q, qi + j, q_code) : 0u;
  }
  if (t_begin >= len) return;
  const int t_end = min(len, t_begin + chunk);
  const int gq = lane >> 2;  // MMA group: query head (scores), token (K), d row (V)
  const int tq = lane & 3;

  uint8_t* wbuf = raw + warp * kWarpBuf;
  constexpr int kStride = NW * kSub;  // tokens between a warp's sub-tiles
  // lane < kSub: page_next is the page of its token in the next sub-tile to stage, loaded one
  // sub-tile ahead, so `stage` does not wait on the page table. NOTE: kept as the table's
  // int32 until that next `stage`: widened where it is loaded, it made each stage wait for
  // the load it had just issued (a sign extension right behind it, before the copies).
  // The page index and row in the page of lane's token in the next sub-tile to stage,
  // advanced by kStride tokens per sub-tile without a division
  int pg_i = pg_first, pg_r = t_first - pg_first * page_size;
  const int pg_dq = kStride / page_size, pg_dr = kStride - pg_dq * page_size;
  // Each row is copied as the aligned 16-byte chunks that cover it (up to 7 for 100 bytes,
  // one lane each) into a buffer row of RS bytes, starting at the row's address mod 16
  // (mis_sm). The caches are 16-byte aligned (the launcher checks), so K and V rows share
  // that offset; the last chunk ends at the row's end rounded up to 16 bytes, inside the
  // (16-byte aligned) allocation.
  // chunks per row (the last 16 bytes of a buffer row stay unused), rows per pass
  constexpr int kCh = L::RW16 / 16, kTpi = 32 / kCh;
  static_assert(kSub % kTpi == 0, "whole passes");
  const int chunk_lo = 16 * (lane % kCh) - RB;    // lane's chunk is needed if mis > chunk_lo
  auto stage = [&](int t0, int buf) {  // warp-uniform: copy the K/V rows of a sub-tile
    if (lane < kSub) {
      const int t = t0 + lane;
      int64_t off = 0;
      if (t < t_end) off = ((int64_t)page_next * page_size + pg_r) * slot_stride + kvh * RB;
      off_sm[warp][buf][lane] = off;
      mis_sm[warp][buf][lane] = (uint8_t)(off & 15);
      pg_r += pg_dr;
      pg_i += pg_dq;
      if (pg_r >= page_size) {
        pg_r -= page_size;
        ++pg_i;
      }
      page_next = t + kStride < t_end ? pt_row[pg_i] : 0;
    }
    __syncwarp();
    const int n = min(kSub, t_end - t0);
    uint8_t* dst = wbuf + buf * 2 * kSub * RS + (lane / kCh) * RS + 16 * (lane % kCh);
#pragma unroll
    for (int j = 0; j < kSub / kTpi; ++j) {
      const int tok = j * kTpi + lane / kCh;
      const int64_t off = off_sm[warp][buf][tok];  // 0 past the sub-tile's end
      const int mis = (int)off & 15;
      const int64_t src = off - mis + 16 * (lane % kCh);
      if (tok < n && mis > chunk_lo) {
        copy_chunk16(dst + j * kTpi * RS, k_cache + src);
        copy_chunk16(dst + j * kTpi * RS + kSub * RS, v_cache + src);
      }
    }
    cp_async_commit();
  };
  // the first sub-tile's rows load while the query is staged
  int t0 = t_begin + warp * kSub;
  if (t0 < t_end) stage(t0, 0);

  if (threadIdx.x < 2) reinterpret_cast<Lut*>(&ml_sm[0][0][0])[threadIdx.x] = make_lut();
  // rotated query times scale * log2(e), fp32; rows >= group are zero
#pragma unroll
  for (int it = 0; it < kQIters; ++it) {
    const int i = threadIdx.x + it * NW * 32;
    if (!kQWhole && i >= kQGroups) break;
    const int h = i / (D / 4);
    const int g = i - h * (D / 4);
    float v4[4], r4[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) v4[j] = q_bits_to_float(qv[it][j], q_code);
    rotate_by(quat, false, v4, r4);  // g & 31 == lane
#pragma unroll
    for (int j = 0; j < 4; ++j) q_sm[h][q_col(4 * g + j)] = r4[j] * scale_log2;
  }
  __syncthreads();
  // Q fragments: k-step s = 4u + j of block b holds pairs 2j, 2j+1 of qs word 2tq + u
  auto q_frag = [&](int fl, int nb, int s, int x) {  // lane fl's register (s, x) of block nb
    const int e = nb * kBlock + 16 * (2 * (fl & 3) + (s >> 2)) + pair_first(2 * (s & 3) + x);
    return ts::pack_half2(q_sm[fl >> 2][q_col(e)], q_sm[fl >> 2][q_col(e + 2)]);
  };
  for (int i = threadIdx.x; i < NB * 4 * 32; i += NW * 32) {
    const int fl = i & 31, g = i >> 5;  // g = (nb * 2 + u) * 2 + j / 2
    const int nb = g >> 2, s0 = 4 * ((g >> 1) & 1) + 2 * (g & 1);
    qf_sm[g][fl] = make_uint4(q_frag(fl, nb, s0, 0), q_frag(fl, nb, s0, 1),
                              q_frag(fl, nb, s0 + 1, 0), q_frag(fl, nb, s0 + 1, 1));
  }
  __syncthreads();
  // NOTE: read back from shared memory at a lane-dependent address (two equal copies), the
  // table is a per-lane value to ptxas; as a constant, or loaded from one address, it is
  // warp-uniform and, with registers tight, kept in uniform registers and copied into a
  // vector register before every byte permute that reads it (one IMAD per PRMT).
  // ml_sm is written after the loop, behind a barrier.
  const Lut lut = reinterpret_cast<const Lut*>(&ml_sm[0][0][0])[lane & 1];

  float mr[2] = {-CUDART_INF_F, -CUDART_INF_F}, lr[2] = {0.0f, 0.0f};  // heads 2tq, 2tq + 1
  float acc[NB * 8][4];
#pragma unroll
  for (int i = 0; i < NB * 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

  for (int it = 0; t0 < t_end; t0 += kStride, ++it) {
    const int buf = it & 1;
    __syncwarp();  // every lane is done with the other buffer (sub-tile it - 1)
    if (t0 + kStride < t_end) {
      stage(t0 + kStride, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncwarp();
    const uint8_t* ks = wbuf + buf * 2 * kSub * RS;
    const uint8_t* vs = ks + kSub * RS;
    const int n = min(kSub, t_end - t0);
    auto row = [&](int tok) -> int {  // byte offset of a token's row in the K (V) buffer
      return tok * RS + mis_sm[warp][buf][tok];
    };
    // whether block nb's qs words are 4-byte aligned in the buffer: rows start at multiples
    // of 4 when RB is one (the slot stride is a multiple of 4), so blocks 1, 3, ...
    auto qs_a4 = [](int nb) { return RB % 4 == 0 && (nb * BB + 2) % 4 == 0; };

    const int rg0 = row(gq), rg1 = row(gq + 8);  // this lane's K tokens (scores, norms)
    // scores, tokens as M rows: S^T_b[tokens gq, gq + 8][heads 2tq, 2tq + 1] in sacc[nb]
    // (A = the decoded K pairs of two tokens, B = the query fragment: no zero rows)
    float sacc[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      sacc[nb][0] = sacc[nb][1] = sacc[nb][2] = sacc[nb][3] = 0.0f;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        // this word's 4 k-steps (the B operand), 16-byte loads the compiler may not hoist
        uint32_t qr[4][2];
        const uint4 lo = lds128(&qf_sm[(nb * 2 + u) * 2][lane]);
        const uint4 hi = lds128(&qf_sm[(nb * 2 + u) * 2 + 1][lane]);
        qr[0][0] = lo.x, qr[0][1] = lo.y, qr[1][0] = lo.z, qr[1][1] = lo.w;
        qr[2][0] = hi.x, qr[2][1] = hi.y, qr[3][0] = hi.z, qr[3][1] = hi.w;
        // the nibble words of tokens gq and gq + 8; k-step j decodes its 4 pairs just before
        // its MMA (few live registers: the centroid table stays in registers)
        uint32_t n0[2], n1[2];
        k_nibbles(ks + rg0 + nb * BB, 2 * tq + u, n0[0], n0[1], qs_a4(nb));
        k_nibbles(ks + rg1 + nb * BB, 2 * tq + u, n1[0], n1[1], qs_a4(nb));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int sh = 16 * (j & 1);
          uint32_t a0, a1, a2, a3;
          lookup4(lut, n0[j >> 1] >> sh, a0, a2);
          lookup4(lut, n1[j >> 1] >> sh, a1, a3);
          mma16816(sacc[nb], a0, a1, a2, a3, qr[j][0], qr[j][1]);
        }
      }
    }
    // sc[i]: token gq + 8 (i / 2), head 2tq + (i % 2); masked past the sub-tile's end
    const bool ok0 = gq < n, ok1 = gq + 8 < n;
    float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float vn[NB][2];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const float k0n = norm_at(ks + rg0 + nb * BB);
      const float k1n = norm_at(ks + rg1 + nb * BB);
      sc[0] += k0n * sacc[nb][0];
      sc[1] += k0n * sacc[nb][1];
      sc[2] += k1n * sacc[nb][2];
      sc[3] += k1n * sacc[nb][3];
      vn[nb][0] = ok0 ? norm_at(vs + rg0 + nb * BB) : 0.0f;
      vn[nb][1] = ok1 ? norm_at(vs + rg1 + nb * BB) : 0.0f;
    }
    if (!ok0) sc[0] = sc[1] = -CUDART_INF_F;
    if (!ok1) sc[2] = sc[3] = -CUDART_INF_F;
    float mt[2] = {fmaxf(sc[0], sc[2]), fmaxf(sc[1], sc[3])};
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {  // over the 8 lanes gq of a head pair
      mt[0] = fmaxf(mt[0], __shfl_xor_sync(0xffffffffu, mt[0], off));
      mt[1] = fmaxf(mt[1], __shfl_xor_sync(0xffffffffu, mt[1], off));
    }
    float alpha[2], p[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(mr[h], mt[h]);  // finite: token 0 of the sub-tile is valid
      alpha[h] = exp2f(mr[h] - m_new);
      mr[h] = m_new;
      p[h] = exp2f(sc[h] - m_new);
      p[h + 2] = exp2f(sc[h + 2] - m_new);
      lr[h] = lr[h] * alpha[h] + (p[h] + p[h + 2]);
    }
    // NOTE: unconditional (alpha = 1 leaves acc's bits as they are). Behind a branch on
    // whether any alpha != 1 (taken in most sub-tiles: a warp walks 4 of them at 1 / 32k),
    // the values' decoding below could not start during the softmax's shuffles and exp2s;
    // the 64 multiplies run on the otherwise idle FMA pipe.
#pragma unroll
    for (int i = 0; i < NB * 8; ++i) {
      acc[i][0] *= alpha[0];
      acc[i][1] *= alpha[1];
      acc[i][2] *= alpha[0];
      acc[i][3] *= alpha[1];
    }
    // V tokens 2tq, 2tq + 1, 2tq + 8, 2tq + 9
    const int ra = row(2 * tq), rb = row(2 * tq + 1);
    const int rc = row(2 * tq + 8), rd = row(2 * tq + 9);
    // values: P^T (tokens x heads, fp16 pairs, scaled by the V norm of (token, block))
    // transposed to the B fragment: head gq, tokens 2tq, 2tq + 1 (pb0) / + 8 (pb1)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const uint32_t pb0 = movm_trans(ts::pack_half2(p[0] * vn[nb][0], p[1] * vn[nb][0]));
      const uint32_t pb1 = movm_trans(ts::pack_half2(p[2] * vn[nb][1], p[3] * vn[nb][1]));
      uint32_t r01[16], r23[16];
      v_word(vs + ra + nb * BB, vs + rb + nb * BB, gq, lut, r01, qs_a4(nb));
      v_word(vs + rc + nb * BB, vs + rd + nb * BB, gq, lut, r23, qs_a4(nb));
#pragma unroll
      for (int k = 0; k < 8; ++k)
        mma16816(acc[8 * nb + k], r01[2 * k], r01[2 * k + 1], r23[2 * k], r23[2 * k + 1],
                 pb0, pb1);
    }
  }
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    lr[0] += __shfl_xor_sync(0xffffffffu, lr[0], off);
    lr[1] += __shfl_xor_sync(0xffffffffu, lr[1], off);
  }

  // merge the warps of this CTA; `raw` is reused
  __syncthreads();
  float* macc = reinterpret_cast<float*>(raw);  // [NW][kRows] rows, PaddedRows<D>
  // acc[i]: d = 128 (i / 8) + 16 gq + 2 (i % 8) (+1 for acc[i][2..3]), heads 2tq, 2tq+1
  float* m0 = macc + Rows::at(warp * kRows + 2 * tq, 16 * gq);
  float* m1 = m0 + Rows::kFloats;
#pragma unroll
  for (int i = 0; i < NB * 8; ++i) {
    const int c = Rows::at(0, (i >> 3) * kBlock + 2 * (i & 7));  // + 16 gq: in m0, m1
    m0[c] = acc[i][0];
    m1[c] = acc[i][1];
    m0[c + 1] = acc[i][2];
    m1[c + 1] = acc[i][3];
  }
  if (gq == 0) {
    ml_sm[warp][2 * tq][0] = mr[0];
    ml_sm[warp][2 * tq][1] = lr[0];
    ml_sm[warp][2 * tq + 1][0] = mr[1];
    ml_sm[warp][2 * tq + 1][1] = lr[1];
  }
  __syncthreads();
  merge_warp_partials<NW, D, Rows>(macc, &ml_sm[0][0][0], kRows, group,
                            (int64_t)b * hq + kvh * group, n_splits, split, part_acc, part_ml);
}

// The dynamic shared memory a CTA of decode_mma_kernel<NB, NW> needs (bytes; 0: none), read
// by the launcher (kernels/iso/mma.py) from the compiled module.
template <int NB, int NW>
__device__ const int kDynamicSmem = Layout<NB, NW>::kDynBytes;

}  // namespace mma
}  // namespace iso
