// ISO3 paged decode attention on tensor cores (mma.sync m16n8k16, fp16 in, fp32 accumulate),
// in the rotated space (specs/iso_kv.md §6.5), split-K. Same contract as iso_decode.cu.
//
// Grid (splits, kv heads, batch), NW warps. Every warp walks its own 16-token sub-tiles of
// the CTA's chunk (cp.async double buffer per warp, no CTA barrier in the loop) and keeps its
// own online softmax; the warps merge in shared memory at the end, the splits in a second
// kernel (iso_split.cuh): decode_merge_cols_kernel (grid over heads, sequences and column
// slices), or the previous decode_merge_wide_kernel (one CTA per head and sequence), picked
// by the `merge` argument. The query is read in its own dtype (no cast launch before).
//
// Decoding a packed value costs ~2 instructions: a 32-bit qs word holds the 2 low index bits
// of 16 values, the matching signs halfword their high bits. Two masks split the word into
// "even" and "odd" nibble words (8 3-bit indices each, the high bits merged in from a Morton
// spread of the signs halfword), and each 16-bit half of a nibble word selects 4 centroid
// bytes at once with a byte permute (prmt) from an 8-entry table of the fp16 centroids' low
// bytes and one of their high bytes; two more permutes interleave those into 2 fp16 pairs.
// The contraction index of a dot product can be ordered freely, so the pairs go into the
// MMA operand registers in the order they come out (the query is permuted to match once).
//
// Scores: S_b[h, t] = Q_b[h, :] . C_b[t, :] with the G <= 8 query heads as the MMA's M rows
// (padded to 16), 8 tokens as N, k = 16 packed values of block b; the fp16 norms scale S_b per
// (token, block). Values: O^T[d, h] += V^T[d, t] P^T[t, h], d as M (16 rows per tile), heads
// as N, 16 tokens as k; P (fp16) is scaled by the V norm of its (token, block), and its
// fragment is the score accumulator's own layout. The accumulator holds the rotated output.
// That is loop 0 ("heads"). Loops 1 and 2 ("tokens", "tokens_wide") compute S^T = K Q^T
// instead: the sub-tile's 16 tokens are the M rows, the query the B operand (one MMA per
// k-step, no zero rows), and P^T reaches the V MMA's B layout through movmatrix; loop 2 also
// stages rows as 16-byte chunks. Same results up to fp32 summation order.
#include <math_constants.h>

#include <type_traits>

#include "iso_common.cuh"
#include "iso_split.cuh"

namespace iso {
namespace mma {

constexpr int kSub = 16;  // tokens per warp sub-tile
constexpr int kRows = 8;  // query heads per MMA (the real M rows)

// The warp-merge buffer's layout: one pad float after every 16 columns and a row stride of
// D + D/16 + 4 floats, so the 32 lanes of one accumulator store (lane (gq, tq): head 2tq
// (+1), d = 16 gq + c) hit 32 banks, and 32 consecutive d of one row (the merge's reads) at
// most 2 lanes per bank; plain rows of D floats put the 32 lanes of a store on 2 banks.
template <int D>
struct PaddedRows {
  static constexpr int kFloats = D + D / 16 + 4;
  __host__ __device__ static constexpr int at(int r, int d) { return r * kFloats + d + (d >> 4); }
};

// Column c of a staged query row: the query fragment loads (lane (gq, tq): row gq, c =
// 32 tq + const) hit 32 banks with the row stride D + 4 and the low 2 bits of c XOR c / 32.
__host__ __device__ constexpr int q_col(int c) { return c ^ ((c >> 5) & 3); }

// The query's MMA fragments (16 words per lane and 128-value block) are kept in shared memory
// and read per sub-tile with 16-byte loads the compiler may not hoist (true), or held in
// registers for the whole CTA (false: 32 more registers at head_dim 256; relax the launch
// bound of decode_mma_kernel to (NW * 32, 1) with it, or it spills).
constexpr bool kQFragsInSmem = true;

#ifdef TINYSERVE_CUDA_EMU
inline uint4 lds128(const uint4* p) { return *p; }
#else
__device__ __forceinline__ uint4 lds128(const uint4* p) {
  uint4 v;
  const unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(a));
  return v;
}
#endif

// Element i of a query in its dtype (0 fp32, 1 bf16, 2 fp16) as fp32.
__device__ __forceinline__ float load_q(const void* q, int64_t i, int code) {
  if (code == 1) return to_float(static_cast<const __nv_bfloat16*>(q)[i]);
  if (code == 2) return to_float(static_cast<const __half*>(q)[i]);
  return static_cast<const float*>(q)[i];
}

#ifdef TINYSERVE_CUDA_EMU
// CPU emulation (tests/kernels/test_iso_mma.py): the byte permute and the warp-wide MMA with
// the PTX fragment layouts, exchanged through a per-warp buffer.
inline uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
  const uint64_t src = (uint64_t)b << 32 | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t n = (s >> (4 * i)) & 7u;
    r |= (uint32_t)((src >> (8 * n)) & 0xffu) << (8 * i);
  }
  return r;
}
inline float half_at(uint32_t x, int hi) {
  uint16_t h = (uint16_t)(hi ? x >> 16 : x & 0xffffu);
  return __half2float(__ushort_as_half(h));
}
inline uint32_t pack_half2(float lo, float hi) {
  return (uint32_t)__half_as_ushort(__float2half_rn(lo)) |
         ((uint32_t)__half_as_ushort(__float2half_rn(hi)) << 16);
}
// d += A[16x16] B[16x8]; lane l = 4 * g + t holds A rows g, g+8 at columns 2t, 2t+1
// (a0, a1) and 2t+8, 2t+9 (a2, a3); B column g at rows 2t, 2t+1 (b0), 2t+8, 2t+9 (b1);
// D rows g, g+8 at columns 2t, 2t+1 (d0, d1 / d2, d3).
inline void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                     uint32_t b0, uint32_t b1) {
  static uint32_t abuf[32][32][4], bbuf[32][32][2];
  const int w = emu_warp(), l = emu_lane();
  abuf[w][l][0] = a0; abuf[w][l][1] = a1; abuf[w][l][2] = a2; abuf[w][l][3] = a3;
  bbuf[w][l][0] = b0; bbuf[w][l][1] = b1;
  __syncwarp();
  auto A = [&](int r, int k) {
    const int lane = 4 * (r & 7) + ((k & 7) >> 1);
    const int reg = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return half_at(abuf[w][lane][reg], k & 1);
  };
  auto B = [&](int k, int n) { return half_at(bbuf[w][4 * n + ((k & 7) >> 1)][k >= 8], k & 1); };
  const int g = l >> 2, t = l & 3;
  for (int i = 0; i < 4; ++i) {
    const int r = g + (i >= 2 ? 8 : 0), c = 2 * t + (i & 1);
    float s = d[i];
    for (int k = 0; k < 16; ++k) s += A(r, k) * B(k, c);
    d[i] = s;
  }
  __syncwarp();
}
// movmatrix.m8n8.trans.b16: lane 4r + c holds elements (r, 2c), (r, 2c + 1) of an 8x8 matrix of
// 16-bit values; afterwards the same elements of its transpose.
inline uint32_t movm_trans(uint32_t x) {
  static uint32_t buf[32][32];
  const int w = emu_warp(), l = emu_lane();
  buf[w][l] = x;
  __syncwarp();
  auto el = [&](int r, int c) { return (buf[w][4 * r + (c >> 1)] >> (16 * (c & 1))) & 0xffffu; };
  const uint32_t r = el(2 * (l & 3), l >> 2) | el(2 * (l & 3) + 1, l >> 2) << 16;
  __syncwarp();
  return r;
}
inline bool warp_any(bool p) {
  int v = p ? 1 : 0;
  for (int off = 16; off >= 1; off >>= 1) v |= __shfl_xor_sync(0xffffffffu, v, off);
  return v != 0;
}
#else
__device__ __forceinline__ bool warp_any(bool p) { return __any_sync(0xffffffffu, p); }
__device__ __forceinline__ uint32_t movm_trans(uint32_t x) {
  uint32_t r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
  return __byte_perm(a, b, s);
}
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#endif

// The 8 iso3 centroids as fp16: low bytes (l0: indices 0-3, l1: 4-7) and high bytes.
struct Lut {
  uint32_t l0, l1, h0, h1;
};

__device__ __forceinline__ Lut make_lut() {
  Lut t{0u, 0u, 0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t h = __half_as_ushort(__float2half_rn(kCent3[i]));
    const int sh = 8 * (i & 3);
    if (i < 4) {
      t.l0 |= (h & 0xffu) << sh;
      t.h0 |= (h >> 8) << sh;
    } else {
      t.l1 |= (h & 0xffu) << sh;
      t.h1 |= (h >> 8) << sh;
    }
  }
  return t;
}

// 4 indices (the low 4 nibbles of sel) -> 2 fp16 pairs: (v0, v1) and (v2, v3).
__device__ __forceinline__ void lookup4(const Lut& t, uint32_t sel, uint32_t& p01,
                                        uint32_t& p23) {
  const uint32_t lo = prmt(t.l0, t.l1, sel);
  const uint32_t hi = prmt(t.h0, t.h1, sel);
  p01 = prmt(lo, hi, 0x5140u);
  p23 = prmt(lo, hi, 0x7362u);
}

// bit i -> bit 2i (16 -> 32 bits); P: the first step (byte 1 to byte 2) as one byte permute
template <bool P = false>
__device__ __forceinline__ uint32_t spread16(uint32_t x) {
  x = P ? prmt(x, 0u, 0x4140u) : (x | (x << 8)) & 0x00ff00ffu;
  x = (x | (x << 4)) & 0x0f0f0f0fu;
  x = (x | (x << 2)) & 0x33333333u;
  return (x | (x << 1)) & 0x55555555u;
}

// A qs word (low 2 bits of values f = 0..15 at bits 2f) and its signs halfword (bit f = high
// bit of value f) -> nibble words: e holds the 3-bit index of value 2k in nibble k, o of 2k+1.
template <bool P = false>
__device__ __forceinline__ void nibbles(uint32_t w, uint32_t s16, uint32_t& e, uint32_t& o) {
  const uint32_t sp = spread16<P>(s16);
  e = (w & 0x33333333u) | ((sp << 2) & 0x44444444u);
  o = ((w >> 2) & 0x33333333u) | (sp & 0x44444444u);
}

__device__ __forceinline__ uint32_t ld16(const uint8_t* p) {
  return *reinterpret_cast<const uint16_t*>(p);
}
__device__ __forceinline__ uint32_t ld32(const uint8_t* p) {  // 2-byte aligned
  return ld16(p) | (ld16(p + 2) << 16);
}
// A qs word at p: 4-byte aligned when a4 (one load), else 2-byte aligned (two).
__device__ __forceinline__ uint32_t ld32q(const uint8_t* p, bool a4) {
  return a4 ? *reinterpret_cast<const uint32_t*>(p) : ld32(p);
}
// The fp16 block norm at p (2-byte aligned) as fp32 (one hardware conversion).
__device__ __forceinline__ float norm_at(const uint8_t* p) {
  return __half2float(__ushort_as_half((unsigned short)ld16(p)));
}

// The value order of one qs word as the K operand sees it: pair p holds values
// (pair_first(p), pair_first(p) + 2) of the word.
__host__ __device__ constexpr int pair_first(int p) { return 4 * (p & 3) + (p >> 2); }

// The nibble words of one token's K word w of a block (a4: blk + 2 is 4-byte aligned).
template <bool P = false>
__device__ __forceinline__ void k_nibbles(const uint8_t* blk, int w, uint32_t& e, uint32_t& o,
                                          bool a4 = false) {
  nibbles<P>(ld32q(blk + 2 + 4 * w, a4), ld16(blk + 34 + 2 * w), e, o);
}

// One token's K word w of a block: 8 fp16 pairs, pair p in kb[p].
__device__ __forceinline__ void k_word(const uint8_t* blk, int w, const Lut& t,
                                       uint32_t (&kb)[8]) {
  uint32_t e, o;
  k_nibbles(blk, w, e, o);
  lookup4(t, e, kb[0], kb[1]);
  lookup4(t, e >> 16, kb[2], kb[3]);
  lookup4(t, o, kb[4], kb[5]);
  lookup4(t, o >> 16, kb[6], kb[7]);
}

// Two tokens' V word w of a block: r[f] = (value f of token a, value f of token b) in fp16.
template <bool P = false>
__device__ __forceinline__ void v_word(const uint8_t* ba, const uint8_t* bb, int w,
                                       const Lut& t, uint32_t (&r)[16], bool a4 = false) {
  uint32_t ea, oa, eb, ob;
  nibbles<P>(ld32q(ba + 2 + 4 * w, a4), ld16(ba + 34 + 2 * w), ea, oa);
  nibbles<P>(ld32q(bb + 2 + 4 * w, a4), ld16(bb + 34 + 2 * w), eb, ob);
  const uint32_t s0 = (ea & 0x0f0f0f0fu) | ((eb << 4) & 0xf0f0f0f0u);  // values 0, 4, 8, 12
  const uint32_t s2 = ((ea >> 4) & 0x0f0f0f0fu) | (eb & 0xf0f0f0f0u);  // 2, 6, 10, 14
  const uint32_t s1 = (oa & 0x0f0f0f0fu) | ((ob << 4) & 0xf0f0f0f0u);  // 1, 5, 9, 13
  const uint32_t s3 = ((oa >> 4) & 0x0f0f0f0fu) | (ob & 0xf0f0f0f0u);  // 3, 7, 11, 15
  lookup4(t, s0, r[0], r[4]);
  lookup4(t, s0 >> 16, r[8], r[12]);
  lookup4(t, s2, r[2], r[6]);
  lookup4(t, s2 >> 16, r[10], r[14]);
  lookup4(t, s1, r[1], r[5]);
  lookup4(t, s1 >> 16, r[9], r[13]);
  lookup4(t, s3, r[3], r[7]);
  lookup4(t, s3 >> 16, r[11], r[15]);
}

// At least 16 warps per SM (<= 128 registers): sm_90 123 registers (LOOP 0; 127-128 for 1
// and 2), no spills, 4 CTAs of 4 warps per SM (7 of 2 warps: shared memory); without the
// bound ptxas takes 138 for LOOP 0 (3 CTAs).
// LOOP 0: the query heads as the score MMA's rows; 1: the sub-tile's tokens as its rows
// (KR); 2: KR with each sub-tile staged in 16-byte copies (WIDE, see `stage`).
template <int NB, int NW, int LOOP>
__global__ void __launch_bounds__(NW * 32, 16 / NW)
    decode_mma_kernel(const void* __restrict__ q, int q_code,
                      const uint8_t* __restrict__ k_cache,
                      const uint8_t* __restrict__ v_cache, int64_t slot_stride,
                      const int32_t* __restrict__ page_table, int64_t pt_stride,
                      const int32_t* __restrict__ seq_lens, int page_size, int n_kv_heads,
                      int group, int chunk, int n_splits, float scale_log2,
                      float* __restrict__ part_acc, float* __restrict__ part_ml) {
  constexpr int D = NB * kBlock;
  constexpr int BB = Fmt<3>::kBytes;
  constexpr int RB = NB * BB;
  using W = typename std::conditional<RB % 4 == 0, uint32_t, uint16_t>::type;
  constexpr int RW = RB / (int)sizeof(W);
  static_assert(RW <= 32, "one lane per word of a packed row");
  constexpr bool KR = LOOP >= 1, WIDE = LOOP == 2;
  // shared-memory row stride: WIDE rows start at the source's address mod 16 (up to 14)
  constexpr int RS = WIDE ? (RB + 14 + 15) / 16 * 16 : RB;
  constexpr int kWarpBuf = 2 * 2 * kSub * RS;  // two buffers of K and V rows per warp
  constexpr int kTileBytes = NW * kWarpBuf;
  using Rows = PaddedRows<D>;
  constexpr int kMergeBytes = NW * kRows * Rows::kFloats * 4;
  constexpr int kRaw = kTileBytes > kMergeBytes ? kTileBytes : kMergeBytes;

  __shared__ __align__(16) uint8_t raw[kRaw];
  __shared__ float q_sm[kRows][D + 4];
  __shared__ int64_t off_sm[NW][2][kSub];
  __shared__ uint8_t mis_sm[WIDE ? NW : 1][2][kSub];  // WIDE: a row's start in its buffer row
  __shared__ float ml_sm[NW][kRows][2];  // also two copies of the centroid table (KR)
  static_assert(sizeof(ml_sm) >= 2 * sizeof(Lut), "room for the table");
  // [block nb, word u, j / 2][lane]: (k-step 4u + j, 4u + j + 1) x (a0, a2) of lane's fragment
  __shared__ uint4 qf_sm[kQFragsInSmem ? NB * 4 : 1][32];

  const int split = blockIdx.x;
  const int kvh = blockIdx.y;
  const int b = blockIdx.z;
  const int hq = n_kv_heads * group;
  // the query loads go out first, beside the length's: neither waits on the other
  constexpr int kQIters = kRows * D / 4 / (NW * 32);  // 4-value groups per thread
  static_assert(kRows * D / 4 % (NW * 32) == 0, "whole query groups per thread");
  float qv[kQIters][4];
#pragma unroll
  for (int it = 0; it < kQIters; ++it) {
    const int i = threadIdx.x + it * NW * 32;
    const int h = i / (D / 4);
    const int64_t qi = ((int64_t)b * hq + kvh * group + h) * D + 4 * (i - h * (D / 4));
#pragma unroll
    for (int j = 0; j < 4; ++j) qv[it][j] = h < group ? load_q(q, qi + j, q_code) : 0.0f;
  }
  const int len = seq_lens[b];
  const int t_begin = split * chunk;
  if (t_begin >= len) return;
  const int t_end = min(len, t_begin + chunk);
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int gq = lane >> 2;  // MMA group: query head (scores), token (K), d row (V)
  const int tq = lane & 3;

  uint8_t* wbuf = raw + warp * kWarpBuf;
  constexpr int kStride = NW * kSub;  // tokens between a warp's sub-tiles
  // lane < kSub: the page of its token in the next sub-tile to stage, loaded one sub-tile
  // ahead, so `stage` does not wait on the page table
  auto page_of = [&](int t) -> int64_t {
    return t < t_end ? page_table[(int64_t)b * pt_stride + t / page_size] : 0;
  };
  int64_t page_next = 0;
  // WIDE: the page index and row in the page of lane's token in the next sub-tile to stage,
  // advanced by kStride tokens per sub-tile without a division
  int pg_i = 0, pg_r = 0, pg_dq = 0, pg_dr = 0;
  const int32_t* pt_row = page_table + (int64_t)b * pt_stride;
  if constexpr (WIDE) {
    const int t = t_begin + warp * kSub + lane;
    pg_i = t / page_size;
    pg_r = t - pg_i * page_size;
    pg_dq = kStride / page_size;
    pg_dr = kStride - pg_dq * page_size;
    if (lane < kSub && t < t_end) page_next = pt_row[pg_i];
  } else {
    page_next = lane < kSub ? page_of(t_begin + warp * kSub + lane) : 0;
  }
  // WIDE: each row is copied as the aligned 16-byte chunks that cover it (up to 7 for 100
  // bytes, one lane each: 8 copies per lane and sub-tile instead of 32 of 4 bytes) into a
  // buffer row of RS bytes, starting at the row's address mod 16 (mis_sm). The entry runs
  // WIDE only on 16-byte aligned caches, so K and V rows share that offset; the last chunk
  // ends at the row's end rounded up to 16 bytes, inside the (16-byte aligned) allocation.
  constexpr int kCh = RS / 16, kTpi = 32 / kCh;  // chunks per buffer row, rows per pass
  const int chunk_lo = 16 * (lane % kCh) - RB;    // lane's chunk is needed if mis > chunk_lo
  auto stage_wide = [&](int t0, int buf) {
    if (lane < kSub) {
      const int t = t0 + lane;
      int64_t off = 0;
      if (t < t_end) off = (int64_t)(page_next * page_size + pg_r) * slot_stride + kvh * RB;
      off_sm[warp][buf][lane] = off;
      mis_sm[WIDE ? warp : 0][buf][lane] = (uint8_t)(off & 15);
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
  auto stage = [&](int t0, int buf) {  // warp-uniform: copy the K/V rows of a sub-tile
    if constexpr (WIDE) {
      stage_wide(t0, buf);
      return;
    }
    if (lane < kSub) {
      const int t = t0 + lane;
      int64_t off = 0;
      if (t < t_end) off = (page_next * page_size + t % page_size) * slot_stride + kvh * RB;
      off_sm[warp][buf][lane] = off;
      page_next = page_of(t + kStride);
    }
    __syncwarp();
    const int n = min(kSub, t_end - t0);
    W* kd = reinterpret_cast<W*>(wbuf + buf * 2 * kSub * RB);
    W* vd = reinterpret_cast<W*>(wbuf + buf * 2 * kSub * RB + kSub * RB);
    if (lane < RW) {  // lane = word of the row: no division, one offset per token
#pragma unroll 4
      for (int tok = 0; tok < n; ++tok) {
        const int64_t off = off_sm[warp][buf][tok];
        copy_word(kd + tok * RW + lane, reinterpret_cast<const W*>(k_cache + off) + lane);
        copy_word(vd + tok * RW + lane, reinterpret_cast<const W*>(v_cache + off) + lane);
      }
    }
    cp_async_commit();
  };
  // the first sub-tile's rows load while the query is staged
  int t0 = t_begin + warp * kSub;
  if (t0 < t_end) stage(t0, 0);

  if (KR && threadIdx.x < 2) reinterpret_cast<Lut*>(&ml_sm[0][0][0])[threadIdx.x] = make_lut();
  // rotated query times scale * log2(e), fp32; rows >= group are zero
#pragma unroll
  for (int it = 0; it < kQIters; ++it) {
    const int i = threadIdx.x + it * NW * 32;
    const int h = i / (D / 4);
    const int g = i - h * (D / 4);
    float r4[4];
    rotate_fast(g & 31, false, qv[it], r4);
#pragma unroll
    for (int j = 0; j < 4; ++j) q_sm[h][q_col(4 * g + j)] = r4[j] * scale_log2;
  }
  __syncthreads();
  // Q fragments: k-step s = 4u + j of block b holds pairs 2j, 2j+1 of qs word 2tq + u
  auto q_frag = [&](int fl, int nb, int s, int x) {  // lane fl's register (s, x) of block nb
    const int e = nb * kBlock + 16 * (2 * (fl & 3) + (s >> 2)) + pair_first(2 * (s & 3) + x);
    return pack_half2(q_sm[fl >> 2][q_col(e)], q_sm[fl >> 2][q_col(e + 2)]);
  };
  uint32_t qa[kQFragsInSmem ? 1 : NB][8][2];
  if constexpr (kQFragsInSmem) {
    for (int i = threadIdx.x; i < NB * 4 * 32; i += NW * 32) {
      const int fl = i & 31, g = i >> 5;  // g = (nb * 2 + u) * 2 + j / 2
      const int nb = g >> 2, s0 = 4 * ((g >> 1) & 1) + 2 * (g & 1);
      qf_sm[g][fl] = make_uint4(q_frag(fl, nb, s0, 0), q_frag(fl, nb, s0, 1),
                                q_frag(fl, nb, s0 + 1, 0), q_frag(fl, nb, s0 + 1, 1));
    }
    __syncthreads();
  } else {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int s = 0; s < 8; ++s) {
#pragma unroll
        for (int x = 0; x < 2; ++x) qa[nb][s][x] = q_frag(lane, nb, s, x);
      }
    }
  }
  Lut lut = make_lut();
  if constexpr (KR) {
    // NOTE: read back from shared memory at a lane-dependent address (two equal copies),
    // the table is a per-lane value to ptxas; as a constant, or loaded from one address, it
    // is warp-uniform and, with registers tight, kept in uniform registers and copied into a
    // vector register before every byte permute that reads it (one IMAD per PRMT).
    // ml_sm is written after the loop, behind a barrier.
    lut = reinterpret_cast<const Lut*>(&ml_sm[0][0][0])[lane & 1];
  }

  float m_run = -CUDART_INF_F, l_run = 0.0f;  // head gq (heads as rows)
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
      if constexpr (WIDE) return tok * RS + mis_sm[WIDE ? warp : 0][buf][tok];
      return tok * RB;
    };
    // whether block nb's qs words are 4-byte aligned in the buffer: rows start at multiples
    // of 4 when RB is one (WIDE: the entry checks the slot stride), so blocks 1, 3, ...
    auto qs_a4 = [](int nb) { return RB % 4 == 0 && (nb * BB + 2) % 4 == 0; };

    if constexpr (KR) {
      const int rg0 = row(gq), rg1 = row(gq + 8);  // this lane's K tokens (scores, norms)
      // scores, tokens as M rows: S^T_b[tokens gq, gq + 8][heads 2tq, 2tq + 1] in sacc[nb]
      // (A = the decoded K pairs of two tokens, B = the query fragment: no zero rows)
      float sacc[NB][4];
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        sacc[nb][0] = sacc[nb][1] = sacc[nb][2] = sacc[nb][3] = 0.0f;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          uint32_t qr[4][2];  // this word's 4 k-steps (the B operand now)
          if constexpr (kQFragsInSmem) {
            const uint4 lo = lds128(&qf_sm[(nb * 2 + u) * 2][lane]);
            const uint4 hi = lds128(&qf_sm[(nb * 2 + u) * 2 + 1][lane]);
            qr[0][0] = lo.x, qr[0][1] = lo.y, qr[1][0] = lo.z, qr[1][1] = lo.w;
            qr[2][0] = hi.x, qr[2][1] = hi.y, qr[3][0] = hi.z, qr[3][1] = hi.w;
          } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              qr[j][0] = qa[nb][4 * u + j][0];
              qr[j][1] = qa[nb][4 * u + j][1];
            }
          }
          // the nibble words of tokens gq and gq + 8; k-step j decodes its 4 pairs just before
          // its MMA (few live registers: the centroid table stays in registers)
          uint32_t n0[2], n1[2];
          k_nibbles<true>(ks + rg0 + nb * BB, 2 * tq + u, n0[0], n0[1], qs_a4(nb));
          k_nibbles<true>(ks + rg1 + nb * BB, 2 * tq + u, n1[0], n1[1], qs_a4(nb));
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
      if (warp_any(alpha[0] != 1.0f || alpha[1] != 1.0f)) {  // the lane's own heads
#pragma unroll
        for (int i = 0; i < NB * 8; ++i) {
          acc[i][0] *= alpha[0];
          acc[i][1] *= alpha[1];
          acc[i][2] *= alpha[0];
          acc[i][3] *= alpha[1];
        }
      }
      // V tokens 2tq, 2tq + 1, 2tq + 8, 2tq + 9
      const int ra = row(2 * tq), rb = row(2 * tq + 1);
      const int rc = row(2 * tq + 8), rd = row(2 * tq + 9);
      // values: P^T (tokens x heads, fp16 pairs, scaled by the V norm of (token, block))
      // transposed to the B fragment: head gq, tokens 2tq, 2tq + 1 (pb0) / + 8 (pb1)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        const uint32_t pb0 = movm_trans(pack_half2(p[0] * vn[nb][0], p[1] * vn[nb][0]));
        const uint32_t pb1 = movm_trans(pack_half2(p[2] * vn[nb][1], p[3] * vn[nb][1]));
        uint32_t r01[16], r23[16];
        v_word<true>(vs + ra + nb * BB, vs + rb + nb * BB, gq, lut, r01, qs_a4(nb));
        v_word<true>(vs + rc + nb * BB, vs + rd + nb * BB, gq, lut, r23, qs_a4(nb));
#pragma unroll
        for (int k = 0; k < 8; ++k)
          mma16816(acc[8 * nb + k], r01[2 * k], r01[2 * k + 1], r23[2 * k], r23[2 * k + 1],
                   pb0, pb1);
      }
    } else {
      // scores: S_b[head gq][tokens 8 nt + 2 tq + {0, 1}] in sacc[b][nt][0..1]
      float sacc[NB][2][4];
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
          sacc[nb][nt][0] = sacc[nb][nt][1] = sacc[nb][nt][2] = sacc[nb][nt][3] = 0.0f;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          uint32_t qr[4][2];  // this word's 4 k-steps
          if constexpr (kQFragsInSmem) {
            const uint4 lo = lds128(&qf_sm[(nb * 2 + u) * 2][lane]);
            const uint4 hi = lds128(&qf_sm[(nb * 2 + u) * 2 + 1][lane]);
            qr[0][0] = lo.x, qr[0][1] = lo.y, qr[1][0] = lo.z, qr[1][1] = lo.w;
            qr[2][0] = hi.x, qr[2][1] = hi.y, qr[3][0] = hi.z, qr[3][1] = hi.w;
          } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              qr[j][0] = qa[nb][4 * u + j][0];
              qr[j][1] = qa[nb][4 * u + j][1];
            }
          }
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            uint32_t kb[8];
            k_word(ks + (8 * nt + gq) * RB + nb * BB, 2 * tq + u, lut, kb);
#pragma unroll
            for (int j = 0; j < 4; ++j)
              mma16816(sacc[nb][nt], qr[j][0], 0u, qr[j][1], 0u, kb[2 * j], kb[2 * j + 1]);
          }
        }
      }
      // this lane's tokens: 2tq, 2tq+1 (nt 0) and 2tq+8, 2tq+9 (nt 1)
      float sc[4];
      float mt = -CUDART_INF_F;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int ti = 8 * (i >> 1) + 2 * tq + (i & 1);
        float s = 0.0f;
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
          s += norm_at(ks + ti * RB + nb * BB) * sacc[nb][i >> 1][i & 1];
        sc[i] = ti < n ? s : -CUDART_INF_F;
        mt = fmaxf(mt, sc[i]);
      }
      mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
      mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
      const float m_new = fmaxf(m_run, mt);  // finite: token 0 of the sub-tile is valid
      const float alpha = exp2f(m_run - m_new);
      m_run = m_new;
      float p[4];
      float psum = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        p[i] = exp2f(sc[i] - m_new);
        psum += p[i];
      }
      l_run = l_run * alpha + psum;
      if (warp_any(alpha != 1.0f)) {  // warp-uniform; after the first tiles the max rarely moves
        const float a_lo = __shfl_sync(0xffffffffu, alpha, 8 * tq);      // head 2tq
        const float a_hi = __shfl_sync(0xffffffffu, alpha, 8 * tq + 4);  // head 2tq + 1
#pragma unroll
        for (int i = 0; i < NB * 8; ++i) {
          acc[i][0] *= a_lo;
          acc[i][1] *= a_hi;
          acc[i][2] *= a_lo;
          acc[i][3] *= a_hi;
        }
      }
      // values: tokens T0 = 2tq, T1 = 2tq+1, T2 = 2tq+8, T3 = 2tq+9; d rows from qs word gq
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        float pv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int ti = 8 * (i >> 1) + 2 * tq + (i & 1);
          pv[i] = ti < n ? p[i] * norm_at(vs + ti * RB + nb * BB) : 0.0f;
        }
        const uint32_t pb0 = pack_half2(pv[0], pv[1]);
        const uint32_t pb1 = pack_half2(pv[2], pv[3]);
        uint32_t r01[16], r23[16];
        v_word(vs + (2 * tq) * RB + nb * BB, vs + (2 * tq + 1) * RB + nb * BB, gq, lut, r01);
        v_word(vs + (2 * tq + 8) * RB + nb * BB, vs + (2 * tq + 9) * RB + nb * BB, gq, lut, r23);
#pragma unroll
        for (int k = 0; k < 8; ++k)
          mma16816(acc[8 * nb + k], r01[2 * k], r01[2 * k + 1], r23[2 * k], r23[2 * k + 1], pb0,
                   pb1);
      }
    }
  }
  if constexpr (KR) {
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      lr[0] += __shfl_xor_sync(0xffffffffu, lr[0], off);
      lr[1] += __shfl_xor_sync(0xffffffffu, lr[1], off);
    }
  } else {
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
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
  if (KR && gq == 0) {
    ml_sm[warp][2 * tq][0] = mr[0];
    ml_sm[warp][2 * tq][1] = lr[0];
    ml_sm[warp][2 * tq + 1][0] = mr[1];
    ml_sm[warp][2 * tq + 1][1] = lr[1];
  } else if (!KR && tq == 0) {
    ml_sm[warp][gq][0] = m_run;
    ml_sm[warp][gq][1] = l_run;
  }
  __syncthreads();
  merge_warp_partials<NW, D, Rows>(macc, &ml_sm[0][0][0], kRows, group,
                            (int64_t)b * hq + kvh * group, n_splits, split, part_acc, part_ml);
}

template <int NB, int NW, int LOOP>
void launch(const void* q, int qc, const uint8_t* kc, const uint8_t* vc, int64_t ss,
            const int32_t* pt, int64_t pts, const int32_t* lens, int batch, int ps, int hkv,
            int group, int chunk, int nsp, float sl2, float* pa, float* pm, cudaStream_t st) {
  const dim3 grid(nsp, hkv, batch);
  decode_mma_kernel<NB, NW, LOOP><<<grid, NW * 32, 0, st>>>(q, qc, kc, vc, ss, pt, pts, lens, ps,
                                                          hkv, group, chunk, nsp, sl2, pa, pm);
}

}  // namespace mma
}  // namespace iso

// Same arguments as tinyserve_iso_decode (iso3 only, GQA group <= 8, head_dim 128 or 256)
// except that q is read in its own dtype (q_dtype_code: 0 fp32, 1 bf16, 2 fp16), plus n_warps
// (2 or 4), merge (the split merge kernel: 1 decode_merge_cols_kernel, 0 the previous
// decode_merge_wide_kernel) and loop (the score MMA's rows: 0 the query heads, padded to 16,
// 1 the sub-tile's 16 tokens, 2 the tokens with 16-byte staging copies; 2 runs as 1 unless
// both caches are 16-byte aligned and the slot stride a multiple of 4). Returns 0, a CUDA
// error code, 2 (bad format/head_dim), 3 (bad GQA group), 4 (bad n_warps) or 5 (bad q dtype,
// merge or loop).
extern "C" int tinyserve_iso_decode_mma(const void* q, const void* k_cache, const void* v_cache,
                                        int64_t slot_stride, const int32_t* page_table,
                                        int64_t pt_stride, const int32_t* seq_lens, int batch,
                                        int n_q_heads, int n_kv_heads, int head_dim,
                                        int page_size, int chunk, int n_splits, float scale,
                                        int n_warps, float* part_acc, float* part_ml, void* out,
                                        int64_t out_stride_b, int dtype_code, int q_dtype_code,
                                        int merge, int loop, cudaStream_t stream) {
  using namespace iso;
  if (batch == 0) return 0;
  if (n_kv_heads <= 0 || n_q_heads % n_kv_heads != 0) return 3;
  const int group = n_q_heads / n_kv_heads;
  if (group < 1 || group > mma::kRows) return 3;
  if (head_dim != 128 && head_dim != 256) return 2;
  if (n_warps != 2 && n_warps != 4) return 4;
  if (q_dtype_code < 0 || q_dtype_code > 2 || merge < 0 || merge > 1) return 5;
  if (loop < 0 || loop > 2) return 5;
  if (loop == 2 && (((reinterpret_cast<uintptr_t>(k_cache) | reinterpret_cast<uintptr_t>(v_cache)) &
                     15u) != 0 || slot_stride % 4 != 0))
    loop = 1;
  const float sl2 = scale * 1.4426950408889634f;
  const auto* kc = static_cast<const uint8_t*>(k_cache);
  const auto* vc = static_cast<const uint8_t*>(v_cache);
#define ISO_MMA(NBV, NWV)                                                                     \
  (loop == 2 ? mma::launch<NBV, NWV, 2>                                                      \
   : loop == 1 ? mma::launch<NBV, NWV, 1> : mma::launch<NBV, NWV, 0>)(                        \
      q, q_dtype_code, kc, vc, slot_stride, page_table, pt_stride, seq_lens, batch, page_size, \
      n_kv_heads, group, chunk, n_splits, sl2, part_acc, part_ml, stream)
  if (head_dim == 256) {
    if (n_warps == 4) ISO_MMA(2, 4);
    else ISO_MMA(2, 2);
  } else {
    if (n_warps == 4) ISO_MMA(1, 4);
    else ISO_MMA(1, 2);
  }
#undef ISO_MMA
  if (merge == 1) {
    const dim3 grid(n_q_heads, batch, head_dim / kMergeCols);
    ISO_DISPATCH_DTYPE(dtype_code, T, {
      decode_merge_cols_kernel<T><<<grid, kMergeThreads, 0, stream>>>(
          part_acc, part_ml, seq_lens, chunk, n_splits, n_q_heads, head_dim,
          static_cast<T*>(out), out_stride_b);
    });
  } else {
    const dim3 grid(n_q_heads, batch);
    ISO_DISPATCH_DTYPE(dtype_code, T, {
      decode_merge_wide_kernel<T><<<grid, kWideMergeThreads, 0, stream>>>(
          part_acc, part_ml, seq_lens, chunk, n_splits, n_q_heads, head_dim,
          static_cast<T*>(out), out_stride_b);
    });
  }
  return (int)cudaGetLastError();
}

// How many CTAs of the decode kernel for (head_dim, n_warps, loop) one SM holds (registers
// and shared memory): the launcher sizes a one-wave grid from it. 0 on a bad argument or error.
extern "C" int tinyserve_iso_decode_mma_occupancy(int head_dim, int n_warps, int loop) {
  int n = 0;
  cudaError_t e = cudaErrorInvalidValue;
#define ISO_OCC(NBV, NWV, KRV)                                                         \
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(                                   \
      &n, iso::mma::decode_mma_kernel<NBV, NWV, KRV>, NWV * 32, 0)
#define ISO_OCC2(NBV, NWV)              \
  if (loop == 2) ISO_OCC(NBV, NWV, 2);  \
  else if (loop == 1) ISO_OCC(NBV, NWV, 1); \
  else if (loop == 0) ISO_OCC(NBV, NWV, 0)
  if (head_dim == 256 && n_warps == 4) ISO_OCC2(2, 4);
  if (head_dim == 256 && n_warps == 2) ISO_OCC2(2, 2);
  if (head_dim == 128 && n_warps == 4) ISO_OCC2(1, 4);
  if (head_dim == 128 && n_warps == 2) ISO_OCC2(1, 2);
#undef ISO_OCC2
#undef ISO_OCC
  return e == cudaSuccess ? n : 0;
}
