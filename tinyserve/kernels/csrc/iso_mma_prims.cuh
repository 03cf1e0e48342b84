// Primitives of the ISO3 tensor-core decode kernel (iso_decode_mma.cu): the mma.sync,
// movmatrix and byte-permute wrappers (with their CPU emulation under TINYSERVE_CUDA_EMU),
// the centroid table, the unpacking of packed rows into fp16 MMA operands, and the layouts of
// the query and warp-merge buffers.
//
// Decoding a packed value costs ~2 instructions: a 32-bit qs word holds the 2 low index bits
// of 16 values, the matching signs halfword their high bits. Two masks split the word into
// "even" and "odd" nibble words (8 3-bit indices each, the high bits merged in from a Morton
// spread of the signs halfword), and each 16-bit half of a nibble word selects 4 centroid
// bytes at once with a byte permute (prmt) from an 8-entry table of the fp16 centroids' low
// bytes and one of their high bytes; two more permutes interleave those into 2 fp16 pairs.
// The contraction index of a dot product can be ordered freely, so the pairs go into the
// MMA operand registers in the order they come out (the query is permuted to match once).
#pragma once

#include "iso_common.cuh"

namespace iso {
namespace mma {

constexpr int kSub = 16;  // tokens per warp sub-tile
constexpr int kRows = 8;  // query heads per CTA (the score MMA's N columns)

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

// The CTA's dynamic shared memory (16-byte aligned).
#ifdef TINYSERVE_CUDA_EMU
inline uint8_t* dynamic_smem() { return emu::ctx.dyn; }
#else
__device__ __forceinline__ uint8_t* dynamic_smem() {
  extern __shared__ __align__(16) uint8_t dyn_smem[];
  return dyn_smem;
}
#endif

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

// Element i of a query in its dtype (0 fp32, 1 bf16, 2 fp16): its bits, zero-extended, and
// those bits as fp32 (`q_bits_to_float`). NOTE: two steps so that a kernel converts where it
// uses the value; converted at the load, the warp waited there for the query's loads before
// issuing any load after them.
__device__ __forceinline__ uint32_t load_q_bits(const void* q, int64_t i, int code) {
  if (code == 0) return static_cast<const uint32_t*>(q)[i];
  return static_cast<const uint16_t*>(q)[i];
}

__device__ __forceinline__ float q_bits_to_float(uint32_t bits, int code) {
  if (code == 1) return __uint_as_float(bits << 16);
  if (code == 2) return ts::f16_to_float((uint16_t)bits);
  return __uint_as_float(bits);
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
  return ts::f16_to_float(h);
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
#else
__device__ __forceinline__ uint32_t movm_trans(uint32_t x) {
  uint32_t r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
  return __byte_perm(a, b, s);
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
    const uint32_t h = ts::float_to_f16(kCent3[i]);
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

// bit i -> bit 2i (16 -> 32 bits); the first step (byte 1 to byte 2) as one byte permute
__device__ __forceinline__ uint32_t spread16(uint32_t x) {
  x = prmt(x, 0u, 0x4140u);
  x = (x | (x << 4)) & 0x0f0f0f0fu;
  x = (x | (x << 2)) & 0x33333333u;
  return (x | (x << 1)) & 0x55555555u;
}

// A qs word (low 2 bits of values f = 0..15 at bits 2f) and its signs halfword (bit f = high
// bit of value f) -> nibble words: e holds the 3-bit index of value 2k in nibble k, o of 2k+1.
__device__ __forceinline__ void nibbles(uint32_t w, uint32_t s16, uint32_t& e, uint32_t& o) {
  const uint32_t sp = spread16(s16);
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
  return ts::f16_to_float((uint16_t)ld16(p));
}

// The value order of one qs word as the K operand sees it: pair p holds values
// (pair_first(p), pair_first(p) + 2) of the word.
__host__ __device__ constexpr int pair_first(int p) { return 4 * (p & 3) + (p >> 2); }

// The nibble words of one token's K word w of a block (a4: blk + 2 is 4-byte aligned).
__device__ __forceinline__ void k_nibbles(const uint8_t* blk, int w, uint32_t& e, uint32_t& o,
                                          bool a4 = false) {
  nibbles(ld32q(blk + 2 + 4 * w, a4), ld16(blk + 34 + 2 * w), e, o);
}

// Two tokens' V word w of a block: r[f] = (value f of token a, value f of token b) in fp16.
__device__ __forceinline__ void v_word(const uint8_t* ba, const uint8_t* bb, int w,
                                       const Lut& t, uint32_t (&r)[16], bool a4 = false) {
  uint32_t ea, oa, eb, ob;
  nibbles(ld32q(ba + 2 + 4 * w, a4), ld16(ba + 34 + 2 * w), ea, oa);
  nibbles(ld32q(bb + 2 + 4 * w, a4), ld16(bb + 34 + 2 * w), eb, ob);
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

}  // namespace mma
}  // namespace iso
