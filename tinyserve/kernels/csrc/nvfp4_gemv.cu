// NVFP4 W4A16 GEMV for one row of activations (decode): y = x @ dequantize(W).T.
//
// A decode GEMV of a few MB is short enough that its time is the DRAM latency and the tail
// more than the bytes, so every CTA requests all of its weight bytes before it does anything
// else: a warp owns R whole rows, lane L the 16-byte pieces L, L + 32, ... of each row (32
// codes, 2 blocks of 16), held in registers until decoded. The grid is one wave (the launcher
// picks R), so the DRAM stream starts at once on every SM and the decode overlaps it.
//
// Numerics (the "h2" decode of the Triton kernels, with a scale per block of x): the CTA
// converts x to fp16 once, each block of 16 inputs scaled by the power of two 2^e that puts
// its max|x| in [2^14, 2^15) (bf16/fp16 values stay exact); an E2M1 code becomes the fp16
// value code * 2^-14 with two shifts and two masks (the E2M1 and fp16 formats share their
// subnormal structure, so the 3 magnitude bits placed at fp16 bits 9..11 are exactly that),
// and each lane sums a block's 16 products in fp16 (8 per half of a packed pair: |sum| <= 96),
// then in fp32 with the block's E4M3 scale and 2^-e. A block holding inf or NaN gives the
// reference's inf / NaN. Under TINYSERVE_CUDA_EMU the fp16 operations are emulated on the CPU.
#include <cuda_runtime.h>
#include <stdint.h>

#include "dependent_launch.cuh"

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kInputsPerPiece = 32 * 32;  // K covered by one 16-byte piece per lane

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
inline uint32_t pack_h2(float lo, float hi) { return f2h(lo) | (uint32_t)f2h(hi) << 16; }
inline float half_lo(uint32_t h) { return h2f(h & 0xFFFF); }
inline float half_hi(uint32_t h) { return h2f(h >> 16); }
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
__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
__device__ __forceinline__ float half_lo(uint32_t h) {
  float f;
  asm("{.reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.f32.f16 %0, lo;}" : "=f"(f) : "r"(h));
  return f;
}
__device__ __forceinline__ float half_hi(uint32_t h) {
  float f;
  asm("{.reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.f32.f16 %0, hi;}" : "=f"(f) : "r"(h));
  return f;
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
  return half_lo(acc) + half_hi(acc);
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
  lo = half_lo(h);
  hi = half_hi(h);
#else
  lo = e4m3_value(s);
  hi = e4m3_value(s >> 8);
#endif
}

// The 16-bit input and output formats.
struct Bf16 {
  __device__ __forceinline__ static float value(uint32_t bits) {
    return __uint_as_float(bits << 16);
  }
  __device__ __forceinline__ static uint16_t bits(float v) {  // round to nearest even
    const uint32_t u = __float_as_uint(v);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
};
struct Fp16 {
  __device__ __forceinline__ static float value(uint32_t bits) { return half_lo(bits); }
  __device__ __forceinline__ static uint16_t bits(float v) {
    return (uint16_t)(pack_h2(v, 0.0f) & 0xFFFF);
  }
};

// x (K inputs of format T) -> shared memory: per group g of
// 8 inputs, the fp16 pairs (0,4) (1,5) (2,6) (3,7) scaled by 2^e of their block, stored at
// xh[(g % 4) * (K / 32) + g / 4] (a lane's 4 groups of one piece hit 4 distinct rows of
// conflict-free reads); per block b, 2^-e at xf[b].
template <typename T, int K>
__device__ __forceinline__ void stage_x(const uint16_t* __restrict__ x, uint4* xh, float* xf) {
  for (int g = threadIdx.x; g < K / 8; g += kThreads) {  // every active warp is full
    const uint4 raw = *reinterpret_cast<const uint4*>(x + 8 * g);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    float v[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = T::value(words[i] & 0xFFFF);
      v[2 * i + 1] = T::value(words[i] >> 16);
    }
    // max|v| as fp32 bits (a NaN counts as inf: fmaxf would drop it), then over the block
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) m = max(m, min(__float_as_uint(v[i]) & 0x7FFFFFFFu, 0x7F800000u));
    m = max(m, __shfl_xor_sync(0xffffffffu, m, 1));  // the other half of the block
    // floor(log2 max) from the exponent bits; e puts max in [2^14, 2^15), clamped so that
    // 2^e and 2^-e are normal (an inf / NaN block: x * 2^-113 keeps inf and NaN)
    const int e = max(-113, min(126, 14 - ((int)(m >> 23) - 127)));
    const float up = __uint_as_float((uint32_t)(e + 127) << 23);
    uint4 h;
    h.x = pack_h2(v[0] * up, v[4] * up);
    h.y = pack_h2(v[1] * up, v[5] * up);
    h.z = pack_h2(v[2] * up, v[6] * up);
    h.w = pack_h2(v[3] * up, v[7] * up);
    xh[(g & 3) * (K / 32) + (g >> 2)] = h;
    if ((g & 1) == 0) xf[g >> 1] = __uint_as_float((uint32_t)(127 - e) << 23);  // 2^-e
  }
}

// One CTA: kWarps x R rows starting at blockIdx.x * kWarps * R; K = P * 1024.
template <typename T, int P, int R>
__global__ void __launch_bounds__(kThreads, 2)
nvfp4_gemv_one_row(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                   const uint16_t* __restrict__ x, uint16_t* __restrict__ out, float factor,
                   int n) {
  constexpr int K = P * kInputsPerPiece;
  static_assert(P * R <= 8, "at most 8 pieces of weights per lane (40 registers)");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row0 = (blockIdx.x * kWarps + warp) * R;

  // 1. Every weight byte of the warp's rows, requested before anything else. Rows past N
  //    load row N - 1 again and are never stored.
  uint4 c[R][P];
  uint32_t s[R][P];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const size_t row = (size_t)min(row0 + r, n - 1);
    const uint4* cr = reinterpret_cast<const uint4*>(codes + row * (K / 2));
    const uint16_t* sr = reinterpret_cast<const uint16_t*>(scales + row * (K / 16));
#pragma unroll
    for (int p = 0; p < P; ++p) c[r][p] = load_stream(cr + lane + 32 * p);
#pragma unroll
    for (int p = 0; p < P; ++p) s[r][p] = sr[lane + 32 * p];
  }
  // As a dependent launch: the weights are in flight, x may be the kernel before's output.
  wait_for_prior_grid();
  allow_dependent_launch();

  // 2. x, once per CTA, while the weights are in flight.
  __shared__ uint4 xh[K / 8];
  __shared__ float xf[K / 16];
  stage_x<T, K>(x, xh, xf);
  __syncthreads();

  // 3. Each lane's x: piece q = lane + 32 p covers inputs [32 q, 32 q + 32), blocks 2q, 2q+1.
  uint4 xr[P][4];
  float xs[P][2];
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int q = lane + 32 * p;
#pragma unroll
    for (int i = 0; i < 4; ++i) xr[p][i] = xh[i * (K / 32) + q];
    xs[p][0] = xf[2 * q];
    xs[p][1] = xf[2 * q + 1];
  }

  // 4. Decode and dot, one row at a time (its loads waited for in order).
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    acc[r] = 0.0f;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const float b0 = block_dot(c[r][p].x, c[r][p].y, xr[p][0], xr[p][1]);
      const float b1 = block_dot(c[r][p].z, c[r][p].w, xr[p][2], xr[p][3]);
      float s0, s1;
      e4m3_pair(s[r][p], s0, s1);
      acc[r] = fmaf(b0, s0 * xs[p][0], acc[r]);
      acc[r] = fmaf(b1, s1 * xs[p][1], acc[r]);
    }
  }

  // 5. Sum over the warp: halve the rows a lane carries while they remain (lanes with bit
  //    `off` set keep the upper half), then a plain butterfly; lane r * 32 / R stores row r.
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
          acc[i] = keep + __shfl_xor_sync(0xffffffffu, give, off);
        }
      }
    } else {
      acc[0] += __shfl_xor_sync(0xffffffffu, acc[0], off);
    }
  }
  // lane L now holds row L / (32 / R) in acc[0]; 2^14: the decoded codes are code * 2^-14
  const int row = row0 + lane / (32 / R);
  if (lane % (32 / R) == 0 && row < n) out[row] = T::bits(acc[0] * (factor * 0x1p14f));
}

struct Args {
  const uint8_t* codes;
  const uint8_t* scales;
  const uint16_t* x;
  uint16_t* out;
  float factor;
  int n;
  bool dependent;  // a programmatic dependent launch
  cudaStream_t stream;
};

template <typename T, int P, int R>
int launch(const Args& a) {
  const int rows = kWarps * R;
  const cudaLaunchConfig_t cfg = {dim3((a.n + rows - 1) / rows), dim3(kThreads), 0, a.stream,
                                  dependent_launch_attr(), a.dependent ? 1u : 0u};
  return (int)cudaLaunchKernelEx(&cfg, nvfp4_gemv_one_row<T, P, R>, a.codes, a.scales, a.x,
                                 a.out, a.factor, a.n);
}

template <typename T, int P>
int launch_rows(int r, const Args& a) {
  switch (r) {
    case 1: return launch<T, P, 1>(a);
    case 2:
      if constexpr (P <= 4) return launch<T, P, 2>(a);
      return 2;
    case 4:
      if constexpr (P <= 2) return launch<T, P, 4>(a);
      return 2;
    default: return 2;
  }
}

}  // namespace

extern "C" {

// y[n] = factor * sum_k x[k] * E2M1(codes[n, k]) * E4M3(scales[n, k / 16]) for one row of x.
// codes uint8 [n, k/2] and scales uint8 [n, k/16] contiguous, 16- and 2-byte aligned; x and
// y 16-bit (dtype 1 bf16, 2 fp16), x 16-byte aligned; k in {1024, 2048, 4096}; rows_per_warp
// in {1, 2, 4} with rows_per_warp * k <= 8192; dependent != 0: a programmatic dependent
// launch (sm_90; reads x only after the kernel before has finished). Returns 0, a CUDA error,
// or 2 for arguments outside these.
int tinyserve_nvfp4_gemv(const void* codes, const void* scales, const void* x, void* out,
                         float factor, int n, int k, int dtype, int rows_per_warp,
                         int dependent, cudaStream_t stream) {
  const Args a = {static_cast<const uint8_t*>(codes), static_cast<const uint8_t*>(scales),
                  static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), factor, n,
                  dependent != 0, stream};
  const int r = rows_per_warp;
  if (n <= 0 || (dtype != 1 && dtype != 2) || r * k > 8192) return 2;
  if (dtype == 1) {
    if (k == 1024) return launch_rows<Bf16, 1>(r, a);
    if (k == 2048) return launch_rows<Bf16, 2>(r, a);
    if (k == 4096) return launch_rows<Bf16, 4>(r, a);
  } else {
    if (k == 1024) return launch_rows<Fp16, 1>(r, a);
    if (k == 2048) return launch_rows<Fp16, 2>(r, a);
    if (k == 4096) return launch_rows<Fp16, 4>(r, a);
  }
  return 2;
}

}  // extern "C"
