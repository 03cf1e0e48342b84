// NVFP4 decode kernels (one token per row of x): the dense GEMV and the two launches of the
// MoE decode over expert slots. Plain CUDA, no torch headers, extern "C" launchers on the
// caller's stream (capturable in CUDA graphs). Layouts: `kernels/nvfp4.py` (weights) and
// `kernels/fused_moe.py` (slots); the torch references are in `kernels/nvfp4_ref.py` and
// `fused_moe.fused_moe_ref`.
//
// Decode. The integer pipe, not DRAM, bounded the arithmetic E2M1 decodes (2-4 integer
// instructions per code at half rate). Here one byte of two codes becomes one fp16x2 operand
// with one PRMT (the byte and the lane's offset packed into a shared-memory address) and one
// conflict-free LDS from a 256-entry table of exact E2M1 pairs that every lane owns a copy
// of (entry b at b * 256 bytes, lane L's word at + 4L: 64 KB per block, half of it used).
// The products are packed half2 FMAs against x in fp16, scaled per block of 16 inputs by a
// power of two so that max|x| * scale lies in [2^9, 2^10): each half of the fp16x2
// accumulator sums 8 products of at most 6 * 2^10, below the fp16 maximum. Each block's sum
// goes to fp32 times its E4M3 scale (exact fp32) and the inverse power of two.
//
// Work split. A warp owns whole rows; lane L holds inputs [L * K/32, (L + 1) * K/32) of
// every row (K/64 code bytes as 16-byte loads, K/512 scale bytes), so a row is one
// coalesced read and its dot one warp reduction. The warps loop over their rows with the
// next rows' loads in flight while this one's are decoded. K must be a multiple of 512.

#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kTableBytes = 256 * 256;
constexpr int kWarps = 8;  // warps per block
constexpr int kThreads = kWarps * 32;

// ---------------------------------------------------------------------------- small helpers

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float v) {
  return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }

// one element of a float tensor whose dtype is known only at run time (0 f32, 1 bf16, 2 f16)
__device__ __forceinline__ float load_any(const void* p, int dtype, int64_t i) {
  if (dtype == 1) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  if (dtype == 2) return __half2float(static_cast<const __half*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint2 ld_stream8(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
               : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// E2M1 code (4 bits) -> fp16 bits, exact
__device__ __forceinline__ uint32_t e2m1_half_bits(uint32_t c) {
  // fp16 high bytes of 0, 0.5, 1, 1.5 and 2, 3, 4, 6 (low bytes are zero)
  const uint32_t hi = __byte_perm(0x3E3C3800u, 0x46444240u, c & 7) & 0xFF;
  return (hi << 8) | ((c & 8) << 12);
}

// E4M3 bits -> fp32, exact; 0x7F / 0xFF are NaN (kernels/nvfp4_ref.e4m3_to_float)
__device__ __forceinline__ float e4m3_to_float(uint32_t b) {
  b &= 0xFF;
  float mag = __uint_as_float((b & 0x7F) << 20) * 0x1p120f;
  if ((b & 0x7F) == 0x7F) mag = __uint_as_float(0x7FC00000u);
  return (b & 0x80) ? -mag : mag;
}

// every lane's copy of the byte -> fp16x2 (low nibble, high nibble) table
__device__ __forceinline__ void fill_table(unsigned char* table) {
  const int lane = threadIdx.x & 31;
  uint32_t* words = reinterpret_cast<uint32_t*>(table);
  for (int b = threadIdx.x >> 5; b < 256; b += kWarps) {
    words[b * 64 + lane] = e2m1_half_bits(b & 15) | (e2m1_half_bits(b >> 4) << 16);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// 2^e as fp32 for integer e in [-126, 127]
__device__ __forceinline__ float exp2i(int e) { return __uint_as_float(uint32_t(e + 127) << 23); }

// ------------------------------------------------------------------- one lane's inputs: x

// A lane's 16 * BL inputs as fp16x2 pairs (inputs 2i, 2i + 1), each block of 16 scaled by
// a power of two (max|x| * scale in [2^9, 2^10)), and the blocks' inverse scales.
template <int BL>
struct XFrag {
  __align__(16) __half2 h[8 * BL];  // read and written as uint4 chunks too
  float inv[BL];

  __device__ __forceinline__ void set(const float (&v)[16 * BL]) {
#pragma unroll
    for (int q = 0; q < BL; ++q) {
      float m = 0.f;
#pragma unroll
      for (int i = 0; i < 16; ++i) m = fmaxf(m, fabsf(v[16 * q + i]));
      // m in [2^e, 2^(e+1)) -> scale 2^(9 - e); zeros, subnormals and inf/NaN clamp
      const int e = int((__float_as_uint(m) >> 23) & 0xFF) - 127;
      const int p = max(-120, min(120, 9 - e));
      const float s = exp2i(p);
      inv[q] = exp2i(-p);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        h[8 * q + i] = __floats2half2_rn(v[16 * q + 2 * i] * s, v[16 * q + 2 * i + 1] * s);
      }
    }
  }

  template <typename T>
  __device__ __forceinline__ void load(const T* x_lane) {  // 16 * BL contiguous inputs
    float v[16 * BL];
    constexpr int kVec = 16 / sizeof(T);
#pragma unroll
    for (int c = 0; c < 16 * BL / kVec; ++c) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x_lane + c * kVec);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < kVec; ++i) v[c * kVec + i] = to_float(e[i]);
    }
    set(v);
  }
};

// -------------------------------------------------------------- one lane's share of a row

template <int BL>
struct RowFrag {
  uint32_t w[2 * BL];  // 16 * BL codes, two per byte, low nibble first
  uint32_t s[(BL + 3) / 4];  // BL scale bytes

  __device__ __forceinline__ void load(const uint8_t* codes_lane, const uint8_t* scales_lane) {
    if constexpr (BL == 1) {
      const uint2 v = ld_stream8(codes_lane);
      w[0] = v.x;
      w[1] = v.y;
      s[0] = *scales_lane;
    } else {
#pragma unroll
      for (int c = 0; c < BL / 2; ++c) {
        const uint4 v = ld_stream16(codes_lane + 16 * c);
        w[4 * c] = v.x;
        w[4 * c + 1] = v.y;
        w[4 * c + 2] = v.z;
        w[4 * c + 3] = v.w;
      }
      if constexpr (BL == 2) {
        s[0] = *reinterpret_cast<const uint16_t*>(scales_lane);
      } else {
#pragma unroll
        for (int c = 0; c < BL / 4; ++c) s[c] = reinterpret_cast<const uint32_t*>(scales_lane)[c];
      }
    }
  }

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < 2 * BL; ++i) w[i] = 0;
#pragma unroll
    for (int i = 0; i < (BL + 3) / 4; ++i) s[i] = 0;
  }

  // this lane's part of dot(row, x), fp32, E2M1 * E4M3 units (no global scale)
  __device__ __forceinline__ float dot(const XFrag<BL>& x, const unsigned char* table,
                                       uint32_t lane4) const {
    float sum = 0.f;
#pragma unroll
    for (int q = 0; q < BL; ++q) {
      __half2 acc = __float2half2_rn(0.f);
#pragma unroll
      for (int i = 2 * q; i < 2 * q + 2; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          // address: byte j of the word in bits 8..15, the lane's word offset in bits 0..7
          const uint32_t off = __byte_perm(w[i], lane4, 0x5504u | (j << 4));
          const uint32_t t = *reinterpret_cast<const uint32_t*>(table + off);
          acc = __hfma2(*reinterpret_cast<const __half2*>(&t), x.h[4 * i + j], acc);
        }
      }
      const float2 f = __half22float2(acc);
      const float sc = e4m3_to_float(s[q / 4] >> (8 * (q % 4)));
      sum = fmaf(f.x + f.y, sc * x.inv[q], sum);
    }
    return sum;
  }
};

// ------------------------------------------------------------------------------ dense GEMV

// out[n] = global * sum_k x[k] * W[n, k] for n in [0, rows); W codes [rows, K/2], scales
// [rows, K/16]; R rows per warp and step, at least MINB blocks per SM (register cap).
template <typename T, int BL, int R, int MINB>
__global__ void __launch_bounds__(kThreads, MINB)
    gemv_kernel(const T* __restrict__ x, const uint8_t* __restrict__ codes,
                const uint8_t* __restrict__ scales, T* __restrict__ out, float global, int rows) {
  extern __shared__ __align__(16) unsigned char table[];
  constexpr int64_t kCodeRow = 256 * BL, kScaleRow = 32 * BL;  // bytes per row
  const int lane = threadIdx.x & 31;
  const int step = gridDim.x * kWarps * R;
  int r = (blockIdx.x * kWarps + (threadIdx.x >> 5)) * R;

  RowFrag<BL> cur[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    if (r + i < rows) {
      cur[i].load(codes + (r + i) * kCodeRow + lane * 8 * BL,
                  scales + (r + i) * kScaleRow + lane * BL);
    } else {
      cur[i].zero();
    }
  }
  fill_table(table);
  XFrag<BL> xf;
  xf.load(x + lane * 16 * BL);
  __syncthreads();
  const uint32_t lane4 = lane * 4;
  for (; r < rows; r += step) {
    RowFrag<BL> nxt[R];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int rn = r + step + i;
      if (rn < rows) {
        nxt[i].load(codes + rn * kCodeRow + lane * 8 * BL, scales + rn * kScaleRow + lane * BL);
      } else {
        nxt[i].zero();
      }
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const float v = warp_sum(cur[i].dot(xf, table, lane4));
      if (lane == 0 && r + i < rows) out[r + i] = from_float<T>(v * global);
    }
#pragma unroll
    for (int i = 0; i < R; ++i) cur[i] = nxt[i];
  }
}

// The same rows in one pass: warp w owns rows [w * R, w * R + R), every load issued before
// the table is built, no loop (the grid covers the rows; the launcher picks R so it fits on
// the GPU at once).
template <typename T, int BL, int R, int MINB>
__global__ void __launch_bounds__(kThreads, MINB)
    gemv_once_kernel(const T* __restrict__ x, const uint8_t* __restrict__ codes,
                     const uint8_t* __restrict__ scales, T* __restrict__ out, float global,
                     int rows) {
  extern __shared__ __align__(16) unsigned char table[];
  constexpr int64_t kCodeRow = 256 * BL, kScaleRow = 32 * BL;
  const int lane = threadIdx.x & 31;
  const int r = (blockIdx.x * kWarps + (threadIdx.x >> 5)) * R;
  RowFrag<BL> row[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int ri = r + i < rows ? r + i : rows - 1;  // NOTE: past the end: a row again, unused
    row[i].load(codes + ri * kCodeRow + lane * 8 * BL, scales + ri * kScaleRow + lane * BL);
  }
  fill_table(table);
  XFrag<BL> xf;
  xf.load(x + lane * 16 * BL);
  __syncthreads();
  const uint32_t lane4 = lane * 4;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const float v = warp_sum(row[i].dot(xf, table, lane4));
    if (lane == 0 && r + i < rows) out[r + i] = from_float<T>(v * global);
  }
}

// ------------------------------------------------------------------------------- MoE decode

// Pair q = t * KP + j: routed slot ids[t * topk + j] for j < topk, the shared expert (slot 0
// of its own buffers) for j == topk when has_shared.
struct Experts {
  const uint8_t* codes;  // [S, rows, K/2]
  const uint8_t* scales;  // [S, rows, K/16]
  const float* global;  // gate_up: [S, 2] (gate, up); down: [S]
};

__device__ __forceinline__ int64_t slot_of(const void* ids, int ids64, int64_t i) {
  return ids64 ? static_cast<const int64_t*>(ids)[i] : static_cast<const int32_t*>(ids)[i];
}

// inter[q, f] = silu(gate_f . x_t) * (up_f . x_t) in fp32, one feature (its gate and up
// rows) per warp and step, the next feature's rows in flight during this one's decode.
template <typename T, int BL, int MINB>
__global__ void __launch_bounds__(kThreads, MINB)
    moe_gate_up_kernel(const T* __restrict__ x, int64_t x_stride, const void* __restrict__ ids,
                       int ids64, int topk, int kp, Experts routed, Experts shared,
                       float* __restrict__ inter, int tokens, int F) {
  extern __shared__ __align__(16) unsigned char table[];
  constexpr int64_t kCodeRow = 256 * BL, kScaleRow = 32 * BL;
  const int lane = threadIdx.x & 31;
  const int units = tokens * kp * F;
  const int step = gridDim.x * kWarps;
  int u = blockIdx.x * kWarps + (threadIdx.x >> 5);

  auto expert = [&](int q, int64_t& slot) -> const Experts& {
    const int t = q / kp, j = q % kp;
    slot = j >= topk ? 0 : slot_of(ids, ids64, int64_t(t) * topk + j);
    return j >= topk ? shared : routed;
  };
  auto load_unit = [&](int unit, RowFrag<BL>& g, RowFrag<BL>& up) {
    int64_t slot;
    const Experts& e = expert(unit / F, slot);
    const int64_t rg = slot * 2 * F + unit % F, ru = rg + F;
    g.load(e.codes + rg * kCodeRow + lane * 8 * BL, e.scales + rg * kScaleRow + lane * BL);
    up.load(e.codes + ru * kCodeRow + lane * 8 * BL, e.scales + ru * kScaleRow + lane * BL);
  };

  RowFrag<BL> g, up;
  if (u < units) load_unit(u, g, up);
  fill_table(table);
  __syncthreads();
  const uint32_t lane4 = lane * 4;
  int x_token = -1;
  XFrag<BL> xf;
  for (; u < units; u += step) {
    RowFrag<BL> g2, up2;
    if (u + step < units) load_unit(u + step, g2, up2);
    const int q = u / F, t = q / kp;
    if (t != x_token) {
      xf.load(x + int64_t(t) * x_stride + lane * 16 * BL);
      x_token = t;
    }
    int64_t slot;
    const Experts& e = expert(q, slot);
    const float a = warp_sum(g.dot(xf, table, lane4)) * e.global[2 * slot];
    const float b = warp_sum(up.dot(xf, table, lane4)) * e.global[2 * slot + 1];
    if (lane == 0) inter[u] = a / (1.f + expf(-a)) * b;  // u = q * F + f
    g = g2;
    up = up2;
  }
}

// gate_up in one pass: warp w owns features [w * RF, w * RF + RF) of the flattened
// (pair, feature) index, all 2 * RF rows loaded at once, no loop (the grid covers them).
template <typename T, int BL, int RF, int MINB>
__global__ void __launch_bounds__(kThreads, MINB)
    moe_gate_up_once_kernel(const T* __restrict__ x, int64_t x_stride,
                            const void* __restrict__ ids, int ids64, int topk, int kp,
                            Experts routed, Experts shared, float* __restrict__ inter,
                            int tokens, int F) {
  extern __shared__ __align__(16) unsigned char table[];
  constexpr int64_t kCodeRow = 256 * BL, kScaleRow = 32 * BL;
  const int lane = threadIdx.x & 31;
  const int u0 = (blockIdx.x * kWarps + (threadIdx.x >> 5)) * RF;  // F % RF == 0
  const bool live = u0 < tokens * kp * F;
  const int q = live ? u0 / F : 0, t = q / kp, j = q % kp;
  const bool is_shared = j >= topk;
  const Experts& e = is_shared ? shared : routed;
  const int64_t slot = is_shared ? 0 : slot_of(ids, ids64, int64_t(t) * topk + j);
  const int64_t rg = slot * 2 * F + u0 % F;
  RowFrag<BL> g[RF], up[RF];
#pragma unroll
  for (int i = 0; i < RF; ++i) {
    g[i].load(e.codes + (rg + i) * kCodeRow + lane * 8 * BL,
              e.scales + (rg + i) * kScaleRow + lane * BL);
    up[i].load(e.codes + (rg + F + i) * kCodeRow + lane * 8 * BL,
               e.scales + (rg + F + i) * kScaleRow + lane * BL);
  }
  fill_table(table);
  XFrag<BL> xf;
  xf.load(x + int64_t(t) * x_stride + lane * 16 * BL);
  __syncthreads();
  if (!live) return;
  const uint32_t lane4 = lane * 4;
  const float gg = e.global[2 * slot], gu = e.global[2 * slot + 1];
#pragma unroll
  for (int i = 0; i < RF; ++i) {
    const float a = warp_sum(g[i].dot(xf, table, lane4)) * gg;
    const float b = warp_sum(up[i].dot(xf, table, lane4)) * gu;
    if (lane == 0) inter[u0 + i] = a / (1.f + expf(-a)) * b;
  }
}

// out[t, n] = sum_j w_j * global_j * (down_j[n] . inter[t * KP + j]), w_j = wts[t * topk + j]
// for routed pairs and sigmoid(logit[t]) rounded to T for the shared one; pairs summed in
// order in fp32. Grid (blocks per token, tokens). Each block first converts its token's KP
// rows of inter to the fp16 fragments of XFrag in shared memory (chunk-major, so a lane's
// 16-byte reads are conflict-free), then its warps take one output row per step with the
// rows of every pair loaded before any decode. KP <= kMaxPairs.
constexpr int kMaxPairs = 9;

template <typename T, int BL, int MINB>
__global__ void __launch_bounds__(kThreads, MINB)
    moe_down_kernel(const float* __restrict__ inter, const void* __restrict__ ids, int ids64,
                    const void* __restrict__ wts, int wts_dtype, const void* __restrict__ logit,
                    int logit_dtype, int64_t logit_stride, int topk, int kp, Experts routed,
                    Experts shared, T* __restrict__ out, int H) {
  extern __shared__ __align__(16) unsigned char table[];
  constexpr int64_t kCodeRow = 256 * BL, kScaleRow = 32 * BL;
  constexpr int F = 512 * BL, kBlocks = F / 16, kChunks = 2 * BL;  // chunk: 4 half2
  __shared__ uint4 hs[kMaxPairs][kChunks][32];
  __shared__ float inv[kMaxPairs][kBlocks];
  __shared__ float wj[kMaxPairs];
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.y;
  const int step = gridDim.x * kWarps;
  int n = blockIdx.x * kWarps + (threadIdx.x >> 5);

  auto load_row = [&](int row, RowFrag<BL>(&frag)[kMaxPairs]) {
#pragma unroll
    for (int j = 0; j < kMaxPairs; ++j) {
      if (j < kp) {
        const bool is_shared = j >= topk;
        const Experts& e = is_shared ? shared : routed;
        const int64_t slot = is_shared ? 0 : slot_of(ids, ids64, int64_t(t) * topk + j);
        const int64_t r = slot * H + row;
        frag[j].load(e.codes + r * kCodeRow + lane * 8 * BL, e.scales + r * kScaleRow + lane * BL);
      }
    }
  };

  RowFrag<BL> cur[kMaxPairs];
  if (n < H) load_row(n, cur);
  fill_table(table);
  for (int i = threadIdx.x; i < kp * kBlocks; i += kThreads) {
    const int j = i / kBlocks, b = i % kBlocks;
    const float4* src = reinterpret_cast<const float4*>(inter + (int64_t(t) * kp + j) * F + 16 * b);
    float v[16];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const float4 f4 = src[c];
      v[4 * c] = f4.x;
      v[4 * c + 1] = f4.y;
      v[4 * c + 2] = f4.z;
      v[4 * c + 3] = f4.w;
    }
    XFrag<1> one;
    one.set(v);
    const uint4* h4 = reinterpret_cast<const uint4*>(one.h);
    hs[j][2 * (b % BL)][b / BL] = h4[0];
    hs[j][2 * (b % BL) + 1][b / BL] = h4[1];
    inv[j][b] = one.inv[0];
  }
  if (threadIdx.x < kp) {
    const int j = threadIdx.x;
    if (j < topk) {
      const int64_t slot = slot_of(ids, ids64, int64_t(t) * topk + j);
      wj[j] = load_any(wts, wts_dtype, int64_t(t) * topk + j) * routed.global[slot];
    } else {
      const float l = load_any(logit, logit_dtype, int64_t(t) * logit_stride);
      wj[j] = to_float(from_float<T>(1.f / (1.f + expf(-l)))) * shared.global[0];
    }
  }
  __syncthreads();
  const uint32_t lane4 = lane * 4;
  for (; n < H; n += step) {
    RowFrag<BL> nxt[kMaxPairs];
    if (n + step < H) load_row(n + step, nxt);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxPairs; ++j) {
      if (j < kp) {
        XFrag<BL> hf;
        uint4* h4 = reinterpret_cast<uint4*>(hf.h);
#pragma unroll
        for (int c = 0; c < kChunks; ++c) h4[c] = hs[j][c][lane];
#pragma unroll
        for (int q = 0; q < BL; ++q) hf.inv[q] = inv[j][lane * BL + q];
        acc += wj[j] * warp_sum(cur[j].dot(hf, table, lane4));
      }
    }
    if (lane == 0) out[int64_t(t) * H + n] = from_float<T>(acc);
#pragma unroll
    for (int j = 0; j < kMaxPairs; ++j) cur[j] = nxt[j];
  }
}

// ---------------------------------------------------------------------------------- launch

constexpr int kMaxDevices = 64;

// Blocks of `kernel` that fit on the current device (64 KB of table each), asked once per
// kernel and device: `cache` is the launcher instantiation's own.
int fit_on_device(const void* kernel, int (&cache)[kMaxDevices], int& sms) {
  int dev = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (dev >= kMaxDevices) dev = kMaxDevices - 1;
  if (cache[dev] <= 0) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kTableBytes);
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, kTableBytes);
    cache[dev] = n > 0 ? n : 1;
  }
  return cache[dev];
}

// blocks for `work_warps` warps of work: at most the resident ones (the kernels loop)
int grid_for(int per_sm, int sms, int64_t work_warps) {
  const int64_t want = (work_warps + kWarps - 1) / kWarps;
  const int64_t cap = int64_t(per_sm) * sms;
  return int(want < cap ? (want > 0 ? want : 1) : cap);
}

template <typename T, int BL, int R, int MINB>
int launch_gemv(const void* x, const uint8_t* codes, const uint8_t* scales, void* out,
                float global, int rows, cudaStream_t stream) {
  static int fit[kMaxDevices];
  auto k = gemv_kernel<T, BL, R, MINB>;
  int sms = 0;
  const int per_sm = fit_on_device(reinterpret_cast<const void*>(k), fit, sms);
  const int grid = grid_for(per_sm, sms, (int64_t(rows) + R - 1) / R);
  k<<<grid, kThreads, kTableBytes, stream>>>(static_cast<const T*>(x), codes, scales,
                                             static_cast<T*>(out), global, rows);
  return 0;
}

// One pass with R rows per warp when the rows fit on the GPU at once (1 when the warps
// suffice); 1 = launched, 0 = too many rows for R (nothing launched).
template <typename T, int BL, int R>
int launch_gemv_once(const void* x, const uint8_t* codes, const uint8_t* scales, void* out,
                     float global, int rows, cudaStream_t stream) {
  static int fit[kMaxDevices];
  auto k = gemv_once_kernel<T, BL, R, 2>;
  int sms = 0;
  const int per_sm = fit_on_device(reinterpret_cast<const void*>(k), fit, sms);
  const int64_t blocks = (int64_t(rows) + R * kWarps - 1) / (R * kWarps);
  if (blocks > int64_t(per_sm) * sms) return 0;
  k<<<int(blocks), kThreads, kTableBytes, stream>>>(static_cast<const T*>(x), codes, scales,
                                                     static_cast<T*>(out), global, rows);
  return 1;
}

// variant 2: one pass with the fewest rows per warp (1, 2, 4) that fits, else variant 0
template <typename T, int BL>
int gemv_once(const void* x, const uint8_t* codes, const uint8_t* scales, void* out,
              float global, int rows, cudaStream_t stream) {
  if (launch_gemv_once<T, BL, 1>(x, codes, scales, out, global, rows, stream)) return 0;
  if (launch_gemv_once<T, BL, 2>(x, codes, scales, out, global, rows, stream)) return 0;
  if (launch_gemv_once<T, BL, 4>(x, codes, scales, out, global, rows, stream)) return 0;
  return -1;
}

// variant 0 / 1: (rows per warp and step, blocks per SM) for each K (one choice at 4096);
// variant 2: one pass (gemv_once) where the rows fit at once, else variant 0
template <typename T>
int gemv_for_k(int k, int variant, const void* x, const uint8_t* codes, const uint8_t* scales,
               void* out, float global, int rows, cudaStream_t stream) {
  if (variant == 2) {
    int rc = -1;
    if (k == 512) rc = gemv_once<T, 1>(x, codes, scales, out, global, rows, stream);
    if (k == 1024) rc = gemv_once<T, 2>(x, codes, scales, out, global, rows, stream);
    if (k == 2048) rc = gemv_once<T, 4>(x, codes, scales, out, global, rows, stream);
    if (rc == 0) return 0;  // else (K = 4096 or too many rows) the loop
    variant = 0;
  }
  const bool v1 = variant == 1;
  switch (k) {
    case 512:
      return v1 ? launch_gemv<T, 1, 2, 3>(x, codes, scales, out, global, rows, stream)
                : launch_gemv<T, 1, 4, 2>(x, codes, scales, out, global, rows, stream);
    case 1024:
      return v1 ? launch_gemv<T, 2, 2, 3>(x, codes, scales, out, global, rows, stream)
                : launch_gemv<T, 2, 4, 2>(x, codes, scales, out, global, rows, stream);
    case 2048:
      return v1 ? launch_gemv<T, 4, 1, 3>(x, codes, scales, out, global, rows, stream)
                : launch_gemv<T, 4, 2, 2>(x, codes, scales, out, global, rows, stream);
    case 4096:  // NOTE: 2 blocks per SM would spill
      return launch_gemv<T, 8, 1, 1>(x, codes, scales, out, global, rows, stream);
    default:
      return 2;
  }
}

// gate_up in one pass with RF features per warp if they fit at once (1 = launched)
template <typename T, int BH, int RF>
int launch_gate_up_once(const void* x, int64_t x_stride, const void* ids, int ids64, int topk,
                        int kp, Experts r13, Experts s13, float* inter, int tokens, int F,
                        cudaStream_t stream) {
  static int fit[kMaxDevices];
  auto k = moe_gate_up_once_kernel<T, BH, RF, 2>;
  int sms = 0;
  const int per_sm = fit_on_device(reinterpret_cast<const void*>(k), fit, sms);
  const int64_t blocks = (int64_t(tokens) * kp * F + RF * kWarps - 1) / (RF * kWarps);
  if (blocks > int64_t(per_sm) * sms) return 0;
  k<<<int(blocks), kThreads, kTableBytes, stream>>>(static_cast<const T*>(x), x_stride, ids,
                                                     ids64, topk, kp, r13, s13, inter, tokens, F);
  return 1;
}

// the fewest features per warp (1, 2, 4) that fit at once; 0 = none (the loop kernel runs)
template <typename T, int BH, int F>
int gate_up_once(const void* x, int64_t x_stride, const void* ids, int ids64, int topk, int kp,
                 Experts r13, Experts s13, float* inter, int tokens, cudaStream_t stream) {
  if constexpr (BH >= 8) {
    return 0;  // NOTE: H = 4096 keeps the loop kernel (registers)
  } else {
    return launch_gate_up_once<T, BH, 1>(x, x_stride, ids, ids64, topk, kp, r13, s13, inter,
                                         tokens, F, stream) ||
           launch_gate_up_once<T, BH, 2>(x, x_stride, ids, ids64, topk, kp, r13, s13, inter,
                                         tokens, F, stream) ||
           launch_gate_up_once<T, BH, 4>(x, x_stride, ids, ids64, topk, kp, r13, s13, inter,
                                         tokens, F, stream);
  }
}

// gate_up in one pass (ONCE, where it fits) or the loop kernel at 2 blocks per SM (1 for
// H = 4096: 2 would spill); down at DOWN_MINB blocks per SM
template <typename T, int BH, int BF, int DOWN_MINB, bool ONCE>
int launch_moe(const void* x, int64_t x_stride, const void* ids, int ids64, const void* wts,
               int wts_dtype, const void* logit, int logit_dtype, int64_t logit_stride,
               int topk, int kp, Experts r13, Experts s13, Experts r2, Experts s2, float* inter,
               void* out, int tokens, int H, cudaStream_t stream) {
  constexpr int F = 512 * BF;
  static int fit_gu[kMaxDevices], fit_dn[kMaxDevices];
  int sms = 0, per_sm = 0;
  if (!(ONCE && gate_up_once<T, BH, F>(x, x_stride, ids, ids64, topk, kp, r13, s13, inter,
                                        tokens, stream))) {
    auto gu = moe_gate_up_kernel<T, BH, (BH >= 8 ? 1 : 2)>;
    per_sm = fit_on_device(reinterpret_cast<const void*>(gu), fit_gu, sms);
    gu<<<grid_for(per_sm, sms, int64_t(tokens) * kp * F), kThreads, kTableBytes, stream>>>(
        static_cast<const T*>(x), x_stride, ids, ids64, topk, kp, r13, s13, inter, tokens, F);
  }
  auto dn = moe_down_kernel<T, BF, DOWN_MINB>;
  per_sm = fit_on_device(reinterpret_cast<const void*>(dn), fit_dn, sms);
  // blocks per token: the rows' warps, at most a token's share of the resident blocks
  const int per_token = grid_for(per_sm, sms, H) / tokens;
  const dim3 grid(per_token > 0 ? per_token : 1, tokens);
  dn<<<grid, kThreads, kTableBytes, stream>>>(inter, ids, ids64, wts, wts_dtype, logit,
                                              logit_dtype, logit_stride, topk, kp, r2, s2,
                                              static_cast<T*>(out), H);
  return 0;
}

// variant 0 / 1: the down kernel at 2 / 3 blocks per SM; 2: gate_up in one pass where it
// fits, down at 2
template <typename T, int BH, int BF>
int moe_variant(int variant, const void* x, int64_t x_stride, const void* ids, int ids64,
                const void* wts, int wts_dtype, const void* logit, int logit_dtype,
                int64_t logit_stride, int topk, int kp, Experts r13, Experts s13, Experts r2,
                Experts s2, float* inter, void* out, int tokens, int H, cudaStream_t stream) {
#define TS_LAUNCH(MINB, ONCE)                                                                  \
  return launch_moe<T, BH, BF, MINB, ONCE>(x, x_stride, ids, ids64, wts, wts_dtype, logit,     \
                                           logit_dtype, logit_stride, topk, kp, r13, s13, r2, \
                                           s2, inter, out, tokens, H, stream)
  if (variant == 1) TS_LAUNCH(3, false);
  if (variant == 2) TS_LAUNCH(2, true);
  TS_LAUNCH(2, false);
#undef TS_LAUNCH
}

template <typename T>
int moe_for_shape(int H, int F, int variant, const void* x, int64_t x_stride, const void* ids,
                  int ids64, const void* wts, int wts_dtype, const void* logit, int logit_dtype,
                  int64_t logit_stride, int topk, int kp, Experts r13, Experts s13, Experts r2,
                  Experts s2, float* inter, void* out, int tokens, cudaStream_t stream) {
#define TS_MOE(BH, BF)                                                                        \
  return moe_variant<T, BH, BF>(variant, x, x_stride, ids, ids64, wts, wts_dtype, logit,      \
                                logit_dtype, logit_stride, topk, kp, r13, s13, r2, s2, inter, \
                                out, tokens, H, stream)
  if (F == 512) {
    if (H == 512) TS_MOE(1, 1);
    if (H == 1024) TS_MOE(2, 1);
    if (H == 2048) TS_MOE(4, 1);
    if (H == 4096) TS_MOE(8, 1);
  } else if (F == 1024) {
    if (H == 2048) TS_MOE(4, 2);
    if (H == 4096) TS_MOE(8, 2);
  }
#undef TS_MOE
  return 2;
}

int status(int rc) {
  if (rc) return rc;
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : 1000 + int(err);
}

}  // namespace

// dtype of x / out: 1 bf16, 2 f16. variant: the tile choice (0 default, 1 the alternative).
// Returns 0, 2 (unsupported K, F, H or pairs), 3 (dtype) or 1000 + a CUDA error.
extern "C" int tinyserve_nvfp4_gemv(const void* x, const uint8_t* codes, const uint8_t* scales,
                                    void* out, float global, int rows, int k, int dtype,
                                    int variant, cudaStream_t stream) {
  int rc = 3;
  if (dtype == 1) {
    rc = gemv_for_k<__nv_bfloat16>(k, variant, x, codes, scales, out, global, rows, stream);
  } else if (dtype == 2) {
    rc = gemv_for_k<__half>(k, variant, x, codes, scales, out, global, rows, stream);
  }
  return status(rc);
}

// x [tokens, H] (row stride x_stride), ids / wts [tokens * topk], logit [tokens] (stride
// logit_stride) when has_shared; inter: fp32 [tokens * KP, F] scratch; out [tokens, H].
extern "C" int tinyserve_nvfp4_moe_decode(
    const void* x, int64_t x_stride, const void* ids, int ids64, const void* wts, int wts_dtype,
    const void* logit, int logit_dtype, int64_t logit_stride, int topk, int has_shared,
    const uint8_t* w13, const uint8_t* w13_scale, const float* w13_global, const uint8_t* w2,
    const uint8_t* w2_scale, const float* w2_global, const uint8_t* sh13,
    const uint8_t* sh13_scale, const float* sh13_global, const uint8_t* sh2,
    const uint8_t* sh2_scale, const float* sh2_global, float* inter, void* out, int tokens,
    int H, int F, int dtype, int variant, cudaStream_t stream) {
  const int kp = topk + (has_shared ? 1 : 0);
  if (kp > kMaxPairs || topk < 1 || tokens < 1) return 2;
  const Experts r13{w13, w13_scale, w13_global}, s13{sh13, sh13_scale, sh13_global};
  const Experts r2{w2, w2_scale, w2_global}, s2{sh2, sh2_scale, sh2_global};
  int rc = 3;
  if (dtype == 1) {
    rc = moe_for_shape<__nv_bfloat16>(H, F, variant, x, x_stride, ids, ids64, wts, wts_dtype,
                                      logit, logit_dtype, logit_stride, topk, kp, r13, s13, r2,
                                      s2, inter, out, tokens, stream);
  } else if (dtype == 2) {
    rc = moe_for_shape<__half>(H, F, variant, x, x_stride, ids, ids64, wts, wts_dtype, logit,
                               logit_dtype, logit_stride, topk, kp, r13, s13, r2, s2, inter,
                               out, tokens, stream);
  }
  return status(rc);
}
