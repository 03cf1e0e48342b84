// ISO store (quantize-on-write) and row dequantization.
//
// iso_store: K and V rows [N, H, D] (fp32 / bf16 / fp16) -> packed slots of the paged cache
// (uint8 [slots, H, row_bytes]) at locations loc[N] (int32 or int64). One warp per (token,
// head, K|V); lane g owns group g of each 128-block. Byte-exact with kernels/iso/ref.py
// quantize_ref: explicit round-to-nearest intrinsics (no FMA), the two norms summed
// sequentially over j = 0..127 (the reference order) by every lane from values broadcast with
// shuffles (no shared memory), and the fp16 norm rounded in integer arithmetic.
//
// iso_dequant_rows: packed rows at slots[M] -> out[h * head_stride + m * row_stride + d] in
// fp32 / bf16 / fp16, bit-exact in fp32 with dequantize_ref.
//
// Launched by kernels/iso/cuda.py: store_kernel<BITS, T, IDX> on ceil(N * H * 2 / kStoreWarps)
// CTAs of 32 * kStoreWarps threads, dequant_rows_kernel<BITS, T> on ceil(M * H / 4) CTAs of 128.
#include "iso_common.cuh"

namespace iso {

constexpr int kStoreWarps = 4;

// Sequential fp32 sum of the warp's 128 values in element order (lane l holds elements
// 4l..4l+3), without shared memory: the running sum is handed from lane to lane with shuffles
// (lane i adds its 4 values to lane i-1's total); every lane receives the final sum.
__device__ __forceinline__ float warp_sequential_sum(const float (&s)[4], int lane) {
  float acc = 0.0f;
  for (int i = 0; i < 32; ++i) {
    const float prev = __shfl_sync(0xffffffffu, acc, i == 0 ? 0 : i - 1);
    if (lane == i) {
      acc = i == 0 ? 0.0f : prev;
#pragma unroll
      for (int c = 0; c < 4; ++c) acc = __fadd_rn(acc, s[c]);
    }
  }
  return __shfl_sync(0xffffffffu, acc, 31);
}

template <int BITS, typename T, typename IDX>
__global__ void store_kernel(uint8_t* __restrict__ k_cache, uint8_t* __restrict__ v_cache,
                             int64_t slot_stride, const T* __restrict__ k,
                             const T* __restrict__ v, int64_t k_tok_stride, int64_t v_tok_stride,
                             const IDX* __restrict__ loc, int n_tokens, int n_heads, int nb) {
  allow_dependent_launch();  // the decode attention after it may be scheduled (and wait) now
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int64_t item = (int64_t)blockIdx.x * kStoreWarps + warp;
  if (item >= (int64_t)n_tokens * n_heads * 2) return;  // whole warps only
  const int is_v = (int)(item & 1);
  const int head = (int)((item >> 1) % n_heads);
  const int64_t tok = (item >> 1) / n_heads;
  const int d = nb * kBlock;
  const T* src = (is_v ? v + tok * v_tok_stride : k + tok * k_tok_stride) + (int64_t)head * d;
  const int row_bytes = nb * Fmt<BITS>::kBytes;
  uint8_t* dst = (is_v ? v_cache : k_cache) + (int64_t)loc[tok] * slot_stride +
                 (int64_t)head * row_bytes;

  for (int b = 0; b < nb; ++b) {
    float x[4], sq[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      x[c] = to_float<T>(src[b * kBlock + lane * 4 + c]);
      sq[c] = __fmul_rn(x[c], x[c]);
    }
    // 1-2. sequential sum of squares, sqrt
    const float ns = warp_sequential_sum(sq, lane);
    const float grp_norm = __fsqrt_rn(ns);
    // 3-4. reciprocal, normalise by multiplying
    const float inv = grp_norm > 1e-10f ? __fdiv_rn(1.0f, grp_norm) : 0.0f;
    float vn[4], r[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) vn[c] = __fmul_rn(x[c], inv);
    // 5. rotate, nearest centroid (strictly smaller distance wins, ties to the lower index)
    rotate_exact(lane, false, vn, r);
    int idx[4];
    float csq[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float best = fabsf(__fsub_rn(r[c], centroid<BITS>(0)));
      int bi = 0;
#pragma unroll
      for (int i = 1; i < Fmt<BITS>::kCents; ++i) {
        const float dist = fabsf(__fsub_rn(r[c], centroid<BITS>(i)));
        if (dist < best) {
          best = dist;
          bi = i;
        }
      }
      idx[c] = bi;
      const float cv = centroid<BITS>(bi);
      csq[c] = __fmul_rn(cv, cv);
    }
    // 6-7. reconstruction norm (sequential), corrected norm
    const float rs = warp_sequential_sum(csq, lane);
    const float recon = __fsqrt_rn(rs);
    const float corrected = recon > 1e-10f ? __fdiv_rn(grp_norm, recon) : grp_norm;
    const uint32_t hbits = f32_to_f16_bits(corrected);
    // 8. write the block
    uint8_t* blk = dst + b * Fmt<BITS>::kBytes;
    if (lane == 0) {
      blk[0] = (uint8_t)(hbits & 0xffu);
      blk[1] = (uint8_t)(hbits >> 8);
      if (BITS == 4) {
        blk[2] = 0;
        blk[3] = 0;
      }
    }
    if (BITS == 3) {
      blk[2 + lane] = (uint8_t)((idx[0] & 3) | ((idx[1] & 3) << 2) | ((idx[2] & 3) << 4) |
                                ((idx[3] & 3) << 6));
      const int nib = ((idx[0] >> 2) & 1) | (((idx[1] >> 2) & 1) << 1) |
                      (((idx[2] >> 2) & 1) << 2) | (((idx[3] >> 2) & 1) << 3);
      const int other = __shfl_down_sync(0xffffffffu, nib, 1);
      if ((lane & 1) == 0) blk[34 + (lane >> 1)] = (uint8_t)(nib | (other << 4));
    } else {
      blk[4 + 2 * lane] = (uint8_t)(idx[0] | (idx[1] << 4));
      blk[5 + 2 * lane] = (uint8_t)(idx[2] | (idx[3] << 4));
    }
  }
}

template <int BITS, typename T>
__global__ void dequant_rows_kernel(const uint8_t* __restrict__ cache, int64_t slot_stride,
                                    const int64_t* __restrict__ slots, T* __restrict__ out,
                                    int64_t out_row_stride, int64_t out_head_stride,
                                    int n_rows, int n_heads, int nb) {
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int64_t item = (int64_t)blockIdx.x * 4 + warp;
  if (item >= (int64_t)n_rows * n_heads) return;
  const int head = (int)(item % n_heads);
  const int64_t row = item / n_heads;
  const int row_bytes = nb * Fmt<BITS>::kBytes;
  const uint8_t* src = cache + slots[row] * slot_stride + (int64_t)head * row_bytes;
  T* dst = out + row * out_row_stride + head * out_head_stride;
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = src + b * Fmt<BITS>::kBytes;
    const float norm = block_norm(blk);
    int idx[4];
    group_indices<BITS>(blk, lane, idx);
    float c[4], y[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) c[i] = centroid<BITS>(idx[i]);
    rotate_exact(lane, true, c, y);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      dst[b * kBlock + lane * 4 + i] = from_float<T>(__fmul_rn(y[i], norm));
  }
}

}  // namespace iso
