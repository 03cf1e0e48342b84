// NVFP4 decode building blocks of the CUDA kernels (nvfp4_gemv.cu, nvfp4_moe.cu).
//
// Layout: a lane's unit of a weight row is a 16-byte piece (32 E2M1 codes, 2 blocks of 16
// inputs, 2 E4M3 scale bytes). Inputs (x, or the MoE intermediate) are staged in shared
// memory once per CTA as fp16 pairs, each block of 16 scaled by the power of two 2^e that
// puts its max|x| in [2^14, 2^15) (bf16/fp16 values stay exact).
//
// Numerics ("h2": packed fp16x2 products, with a scale per block of inputs): an E2M1
// code becomes the fp16 value code * 2^-14 with two bit-selects and a mask (the E2M1 and fp16
// formats share their subnormal structure, so the 3 magnitude bits placed at fp16 bits 9..11
// are exactly that); each lane sums a block's 16 products in fp16 (8 per half of a packed
// pair: |sum| <= 96), then in fp32 with the block's E4M3 scale and 2^-e. A block holding inf
// or NaN gives the reference's inf / NaN. Under TINYSERVE_CUDA_EMU the fp16 operations are
// emulated on the CPU.
#pragma once

#include "prelude.cuh"

namespace nvfp4 {

constexpr int kWarps = 8;  // warps per CTA of every NVFP4 kernel
constexpr int kThreads = kWarps * 32;
constexpr unsigned kFull = 0xffffffffu;

// ---- fp16 bit-pattern helpers (a uint32_t holds a packed pair: low half first) -----------

#ifdef TINYSERVE_CUDA_EMU
inline float h2f(uint16_t h) { _Float16 f; std::memcpy(&f, &h, 2); return (float)f; }
inline uint16_t f2h(double v) { _Float16 f = (_Float16)v; uint16_t h; std::memcpy(&h, &f, 2); return h; }
inline uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
  auto one = [](uint16_t x, uint16_t y, uint16_t z) {  // a single rounding, like fma.rn
    return f2h((double)h2f(x) * (double)h2f(y) + (double)h2f(z));
  };
  return one(a, b, c) | (uint32_t)one(a >> 16, b >> 16, c >> 16) << 16;
}
inline uint4 load_stream(const uint4* p) { return *p; }
inline uint32_t bit_select(uint32_t a, uint32_t b, uint32_t mask) {
  return (a & mask) | (b & ~mask);
}
#else
__device__ __forceinline__ uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
// (a & mask) | (b & ~mask) as one instruction (left to itself, nvcc splits the constant masks
// of a bit-select over two).
__device__ __forceinline__ uint32_t bit_select(uint32_t a, uint32_t b, uint32_t mask) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(d) : "r"(a), "r"(b), "r"(mask));
  return d;
}
// Weights are read once per call: bypass L1.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
#endif

// The 8 E2M1 codes of a word (code i in bits 4i..4i+3) as 4 fp16 pairs, pair j = codes j and
// j + 4, each code * 2^-14: magnitude bits at 9..11 and the sign at 15 of each half. Two
// bit-selects spread the codes (magnitudes one bit up, signs four bits up: the even codes'
// `even` has codes 2 and 6 in place and codes 0 and 4 one byte below; the odd codes' `odd`
// has codes 3 and 7 in place, 1 and 5 one byte below), then one mask (and a shift) per pair:
// 11 integer operations per 8 codes.
__device__ __forceinline__ void e2m1_pairs(uint32_t w, uint32_t& p0, uint32_t& p1,
                                           uint32_t& p2, uint32_t& p3) {
  constexpr uint32_t kFields = 0x8E008E00u;  // sign and magnitude bits of both halves
  constexpr uint32_t kMag = 0x0E0E0E0Eu;     // where `even` / `odd` take magnitudes
  const uint32_t even = bit_select(w << 1, w << 4, kMag);
  const uint32_t odd = bit_select(w >> 3, w, kMag);
  p0 = (even << 8) & kFields;
  p1 = (odd << 8) & kFields;
  p2 = even & kFields;
  p3 = odd & kFields;
}

// The 16 products of one block (two code words, the matching x pairs) summed: fp16, then fp32.
__device__ __forceinline__ float block_dot(uint32_t w0, uint32_t w1, uint4 x0, uint4 x1) {
  uint32_t a0, a1, a2, a3, b0, b1, b2, b3;
  e2m1_pairs(w0, a0, a1, a2, a3);
  e2m1_pairs(w1, b0, b1, b2, b3);
  uint32_t acc = hfma2(a0, x0.x, 0u);
  acc = hfma2(a1, x0.y, acc);
  acc = hfma2(a2, x0.z, acc);
  acc = hfma2(a3, x0.w, acc);
  acc = hfma2(b0, x1.x, acc);
  acc = hfma2(b1, x1.y, acc);
  acc = hfma2(b2, x1.z, acc);
  acc = hfma2(b3, x1.w, acc);
  return ts::half_lo(acc) + ts::half_hi(acc);
}

// An E4M3 byte (bits 0..7 of `b`) as fp32: the fp32 bits of value * 2^-120 (subnormals
// included), times 2^120.
__device__ __forceinline__ float e4m3_value(uint32_t b) {
  const uint32_t bits = ((b & 0x80u) << 24) | ((b & 0x7Fu) << 20);
  return __uint_as_float(bits) * 0x1p120f;
}

// The two E4M3 bytes in bits 0..15 of `s` as fp32 (one conversion instruction from sm_89).
__device__ __forceinline__ void e4m3_pair(uint32_t s, float& lo, float& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t h;
  asm("{.reg .b16 t;\n cvt.u16.u32 t, %1;\n cvt.rn.f16x2.e4m3x2 %0, t;}" : "=r"(h) : "r"(s));
  lo = ts::half_lo(h);
  hi = ts::half_hi(h);
#else
  lo = e4m3_value(s);
  hi = e4m3_value(s >> 8);
#endif
}

template <typename T>
__device__ __forceinline__ void load8_16bit(const void* in, int g, float (&v)[8]) {
  const uint4 raw = reinterpret_cast<const uint4*>(in)[g];
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = T::value(words[i] & 0xFFFF);
    v[2 * i + 1] = T::value(words[i] >> 16);
  }
}

// The input and output formats: `load8` reads inputs 8g..8g+7, `bits` rounds an output.
struct Bf16 {
  __device__ __forceinline__ static float value(uint32_t bits) {
    return __uint_as_float(bits << 16);
  }
  __device__ __forceinline__ static void load8(const void* in, int g, float (&v)[8]) {
    load8_16bit<Bf16>(in, g, v);
  }
  __device__ __forceinline__ static uint16_t bits(float v) {  // round to nearest even
    const uint32_t u = __float_as_uint(v);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
};
struct Fp16 {
  __device__ __forceinline__ static float value(uint32_t bits) { return ts::half_lo(bits); }
  __device__ __forceinline__ static void load8(const void* in, int g, float (&v)[8]) {
    load8_16bit<Fp16>(in, g, v);
  }
  __device__ __forceinline__ static uint16_t bits(float v) {
    return (uint16_t)(ts::pack_half2(v, 0.0f) & 0xFFFF);
  }
};

struct F32 {  // input only: the MoE intermediate
  __device__ __forceinline__ static void load8(const void* in, int g, float (&v)[8]) {
    const float4* p = reinterpret_cast<const float4*>(in) + 2 * g;
    const float4 a = p[0], b = p[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  }
};

// `count` inputs of format T (vectors of V inputs each; V % 32 == 0; count <= ITERS * 8 *
// kThreads) -> shared memory. Per group g of 8 inputs of vector v (group i within it) the
// fp16 pairs (0,4) (1,5) (2,6) (3,7) scaled by 2^e of their block, at xh[v * V/8 + (i % 4) *
// V/32 + i / 4]: a lane's piece q of a vector is xh[v * V/8 + k * V/32 + q], k < 4 (4
// conflict-free reads); per block b, 2^-e at xf[b]. A thread's ITERS groups are all loaded
// before any is converted (one round trip). Every thread of the CTA must call it (warp
// shuffles).
template <typename T, int V, int ITERS>
__device__ __forceinline__ void stage_inputs(const void* __restrict__ in, int count, uint4* xh,
                                             float* xf) {
  const int groups = count / 8;
  float v[ITERS][8];
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int g = it * kThreads + threadIdx.x;
#pragma unroll
    for (int i = 0; i < 8; ++i) v[it][i] = 0.0f;
    if (g < groups) T::load8(in, g, v[it]);
  }
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int g = it * kThreads + threadIdx.x;
    // max|v| as fp32 bits (a NaN counts as inf: fmaxf would drop it), then over the block
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      m = max(m, min(__float_as_uint(v[it][i]) & 0x7FFFFFFFu, 0x7F800000u));
    }
    m = max(m, __shfl_xor_sync(kFull, m, 1));  // the other half of the block
    // floor(log2 max) from the exponent bits; e puts max in [2^14, 2^15), clamped so that
    // 2^e and 2^-e are normal (an inf / NaN block: x * 2^-113 keeps inf and NaN)
    const int e = max(-113, min(126, 14 - ((int)(m >> 23) - 127)));
    const float up = __uint_as_float((uint32_t)(e + 127) << 23);
    if (g < groups) {
      uint4 h;
      h.x = ts::pack_half2(v[it][0] * up, v[it][4] * up);
      h.y = ts::pack_half2(v[it][1] * up, v[it][5] * up);
      h.z = ts::pack_half2(v[it][2] * up, v[it][6] * up);
      h.w = ts::pack_half2(v[it][3] * up, v[it][7] * up);
      const int vec = g / (V / 8), i = g % (V / 8);
      xh[vec * (V / 8) + (i & 3) * (V / 32) + (i >> 2)] = h;
      if ((g & 1) == 0) xf[g >> 1] = __uint_as_float((uint32_t)(127 - e) << 23);  // 2^-e
    }
  }
}

// The ITERS of stage_inputs for at most `count` inputs.
__host__ __device__ constexpr int stage_iters(int count) {
  return (count / 8 + kThreads - 1) / kThreads;
}

// A lane's staged inputs for piece q of vector v (see stage_inputs).
struct InputPiece {
  uint4 x[4];
  float scale[2];  // 2^-e of its two blocks
};

template <int V>
__device__ __forceinline__ InputPiece input_piece(const uint4* xh, const float* xf, int v,
                                                  int q) {
  InputPiece p;
#pragma unroll
  for (int k = 0; k < 4; ++k) p.x[k] = xh[v * (V / 8) + k * (V / 32) + q];
  p.scale[0] = xf[v * (V / 16) + 2 * q];
  p.scale[1] = xf[v * (V / 16) + 2 * q + 1];
  return p;
}

// acc + the dot of one piece of codes `c` (scale bytes in bits 0..15 of `s`) with the inputs,
// in units of 2^-14 (the decoded codes' scale); `factor` multiplies both blocks' scales.
__device__ __forceinline__ float piece_dot(uint4 c, uint32_t s, const InputPiece& in,
                                           float factor, float acc) {
  const float b0 = block_dot(c.x, c.y, in.x[0], in.x[1]);
  const float b1 = block_dot(c.z, c.w, in.x[2], in.x[3]);
  float s0, s1;
  e4m3_pair(s, s0, s1);
  acc = fmaf(b0, s0 * (in.scale[0] * factor), acc);
  return fmaf(b1, s1 * (in.scale[1] * factor), acc);
}

constexpr int kInputsPerPiece = 32 * 32;  // a row's inputs covered by one piece per lane

// The pieces lane, lane + 32, ... of R weight rows of P * 1024 inputs each (row r at codes +
// rows[r] * K/2 and scales + rows[r] * K/16): codes and scale pairs, all requested at once.
template <int P, int R>
struct WarpRows {
  uint4 codes[R][P];
  uint32_t scales[R][P];
};

template <int P, int R>
__device__ __forceinline__ WarpRows<P, R> load_warp_rows(const uint8_t* codes,
                                                         const uint8_t* scales,
                                                         const int (&rows)[R]) {
  constexpr int K = P * kInputsPerPiece;
  const int lane = threadIdx.x & 31;
  WarpRows<P, R> w;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const uint4* cr = reinterpret_cast<const uint4*>(codes + (size_t)rows[r] * (K / 2));
    const uint16_t* sr =
        reinterpret_cast<const uint16_t*>(scales + (size_t)rows[r] * (K / 16));
#pragma unroll
    for (int p = 0; p < P; ++p) w.codes[r][p] = load_stream(cr + lane + 32 * p);
#pragma unroll
    for (int p = 0; p < P; ++p) w.scales[r][p] = sr[lane + 32 * p];
  }
  return w;
}

// This lane's part of the R dots of `w` with the staged inputs (one vector of P * 1024), in
// units of 2^-14, one row at a time (its loads waited for in order); `warp_sum_rows` adds
// the lanes.
template <int P, int R>
__device__ __forceinline__ void dot_warp_rows(const WarpRows<P, R>& w, const uint4* xh,
                                              const float* xf, float (&acc)[R]) {
  constexpr int K = P * kInputsPerPiece;
  const int lane = threadIdx.x & 31;
  InputPiece xp[P];
#pragma unroll
  for (int p = 0; p < P; ++p) xp[p] = input_piece<K>(xh, xf, 0, lane + 32 * p);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    acc[r] = 0.0f;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      acc[r] = piece_dot(w.codes[r][p], w.scales[r][p], xp[p], 1.0f, acc[r]);
    }
  }
}

// The sums over the warp of R per-lane rows (R in 1, 2, 4): halve the rows a lane carries
// while they remain (lanes with bit `off` set keep the upper half), then a plain butterfly.
// Returns lane L's row L / (32 / R) (every lane of that group holds it).
template <int R>
__device__ __forceinline__ float warp_sum_rows(float (&acc)[R]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int off = 16, rows = R; off > 0; off >>= 1) {
    if (rows > 1) {
      const bool upper = lane & off;
      rows >>= 1;
#pragma unroll
      for (int i = 0; i < R / 2; ++i) {
        if (i < rows) {
          const float give = upper ? acc[i] : acc[i + rows];
          const float keep = upper ? acc[i + rows] : acc[i];
          acc[i] = keep + __shfl_xor_sync(kFull, give, off);
        }
      }
    } else {
      acc[0] += __shfl_xor_sync(kFull, acc[0], off);
    }
  }
  return acc[0];
}

}  // namespace nvfp4
