// ISO store (quantize-on-write) and row dequantization.
//
// iso_store: K and V rows [N, H, D] (fp32 / bf16 / fp16) -> packed slots of the paged cache
// (uint8 [slots, H, row_bytes]) at locations loc[N] (int32 or int64). One warp per (token,
// head, K|V); lane g owns group g of each 128-block. Byte-exact with kernels/iso.py
// quantize_ref: explicit round-to-nearest intrinsics (no FMA) and the two norms summed
// sequentially over j = 0..127 by lane 0, exactly the reference order.
//
// iso_dequant_rows: packed rows at slots[M] -> [M, H, D] in fp32 / bf16 / fp16, bit-exact in
// fp32 with dequantize_ref.
#include "iso_common.cuh"

namespace iso {

constexpr int kStoreWarps = 4;

template <int BITS, typename T, typename IDX>
__global__ void store_kernel(uint8_t* __restrict__ k_cache, uint8_t* __restrict__ v_cache,
                             int64_t slot_stride, const T* __restrict__ k,
                             const T* __restrict__ v, int64_t k_tok_stride, int64_t v_tok_stride,
                             const IDX* __restrict__ loc, int n_tokens, int n_heads, int nb) {
  __shared__ float sq[kStoreWarps][kBlock];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int64_t item = (int64_t)blockIdx.x * kStoreWarps + warp;
  if (item >= (int64_t)n_tokens * n_heads * 2) return;
  const int is_v = (int)(item & 1);
  const int head = (int)((item >> 1) % n_heads);
  const int64_t tok = (item >> 1) / n_heads;
  const int d = nb * kBlock;
  const T* src = (is_v ? v + tok * v_tok_stride : k + tok * k_tok_stride) + (int64_t)head * d;
  const int row_bytes = nb * Fmt<BITS>::kBytes;
  uint8_t* dst = (is_v ? v_cache : k_cache) + (int64_t)loc[tok] * slot_stride +
                 (int64_t)head * row_bytes;
  float* my_sq = sq[warp];

  for (int b = 0; b < nb; ++b) {
    float x[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) x[c] = to_float<T>(src[b * kBlock + lane * 4 + c]);
    // 1-2. sequential sum of squares, sqrt
#pragma unroll
    for (int c = 0; c < 4; ++c) my_sq[lane * 4 + c] = __fmul_rn(x[c], x[c]);
    __syncwarp();
    float ns = 0.0f;
    if (lane == 0) {
      for (int j = 0; j < kBlock; ++j) ns = __fadd_rn(ns, my_sq[j]);
    }
    ns = __shfl_sync(0xffffffffu, ns, 0);
    __syncwarp();
    const float grp_norm = __fsqrt_rn(ns);
    // 3-4. reciprocal, normalise by multiplying
    const float inv = grp_norm > 1e-10f ? __fdiv_rn(1.0f, grp_norm) : 0.0f;
    float vn[4], r[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) vn[c] = __fmul_rn(x[c], inv);
    // 5. rotate, nearest centroid (strictly smaller distance wins, ties to the lower index)
    rotate_exact(lane, false, vn, r);
    int idx[4];
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
      my_sq[lane * 4 + c] = __fmul_rn(cv, cv);
    }
    __syncwarp();
    // 6-7. reconstruction norm (sequential), corrected norm
    float rs = 0.0f;
    if (lane == 0) {
      for (int j = 0; j < kBlock; ++j) rs = __fadd_rn(rs, my_sq[j]);
    }
    rs = __shfl_sync(0xffffffffu, rs, 0);
    __syncwarp();
    const float recon = __fsqrt_rn(rs);
    const float corrected = recon > 1e-10f ? __fdiv_rn(grp_norm, recon) : grp_norm;
    // 8. write the block
    uint8_t* blk = dst + b * Fmt<BITS>::kBytes;
    if (lane == 0) {
      const unsigned short h = __half_as_ushort(__float2half_rn(corrected));
      blk[0] = (uint8_t)(h & 0xff);
      blk[1] = (uint8_t)(h >> 8);
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
                                    int n_rows, int n_heads, int nb) {
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int64_t item = (int64_t)blockIdx.x * 4 + warp;
  if (item >= (int64_t)n_rows * n_heads) return;
  const int head = (int)(item % n_heads);
  const int64_t row = item / n_heads;
  const int row_bytes = nb * Fmt<BITS>::kBytes;
  const uint8_t* src = cache + slots[row] * slot_stride + (int64_t)head * row_bytes;
  T* dst = out + item * (int64_t)(nb * kBlock);
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
    for (int i = 0; i < 4; ++i) dst[b * kBlock + lane * 4 + i] = from_float<T>(__fmul_rn(y[i], norm));
  }
}

}  // namespace iso

extern "C" int tinyserve_iso_store(void* k_cache, void* v_cache, int64_t slot_stride,
                                   const void* k, const void* v, int64_t k_tok_stride,
                                   int64_t v_tok_stride, const void* loc, int loc_is_64,
                                   int n_tokens, int n_heads, int head_dim, int bits,
                                   int dtype_code, cudaStream_t stream) {
  using namespace iso;
  if (n_tokens == 0) return 0;
  if (head_dim % kBlock != 0 || (bits != 3 && bits != 4)) return 2;
  const int nb = head_dim / kBlock;
  const int64_t items = (int64_t)n_tokens * n_heads * 2;
  const dim3 grid((unsigned)((items + kStoreWarps - 1) / kStoreWarps));
  const dim3 block(32 * kStoreWarps);
  auto* kc = static_cast<uint8_t*>(k_cache);
  auto* vc = static_cast<uint8_t*>(v_cache);
  ISO_DISPATCH_DTYPE(dtype_code, T, {
    const T* kp = static_cast<const T*>(k);
    const T* vp = static_cast<const T*>(v);
    if (loc_is_64) {
      const auto* lp = static_cast<const int64_t*>(loc);
      if (bits == 3)
        store_kernel<3, T, int64_t><<<grid, block, 0, stream>>>(
            kc, vc, slot_stride, kp, vp, k_tok_stride, v_tok_stride, lp, n_tokens, n_heads, nb);
      else
        store_kernel<4, T, int64_t><<<grid, block, 0, stream>>>(
            kc, vc, slot_stride, kp, vp, k_tok_stride, v_tok_stride, lp, n_tokens, n_heads, nb);
    } else {
      const auto* lp = static_cast<const int32_t*>(loc);
      if (bits == 3)
        store_kernel<3, T, int32_t><<<grid, block, 0, stream>>>(
            kc, vc, slot_stride, kp, vp, k_tok_stride, v_tok_stride, lp, n_tokens, n_heads, nb);
      else
        store_kernel<4, T, int32_t><<<grid, block, 0, stream>>>(
            kc, vc, slot_stride, kp, vp, k_tok_stride, v_tok_stride, lp, n_tokens, n_heads, nb);
    }
  });
  return (int)cudaGetLastError();
}

extern "C" int tinyserve_iso_dequant_rows(const void* cache, int64_t slot_stride,
                                          const int64_t* slots, void* out, int n_rows,
                                          int n_heads, int head_dim, int bits, int dtype_code,
                                          cudaStream_t stream) {
  using namespace iso;
  if (n_rows == 0) return 0;
  if (head_dim % kBlock != 0 || (bits != 3 && bits != 4)) return 2;
  const int nb = head_dim / kBlock;
  const int64_t items = (int64_t)n_rows * n_heads;
  const dim3 grid((unsigned)((items + 3) / 4));
  const auto* cp = static_cast<const uint8_t*>(cache);
  ISO_DISPATCH_DTYPE(dtype_code, T, {
    T* op = static_cast<T*>(out);
    if (bits == 3)
      dequant_rows_kernel<3, T><<<grid, 128, 0, stream>>>(cp, slot_stride, slots, op, n_rows,
                                                          n_heads, nb);
    else
      dequant_rows_kernel<4, T><<<grid, 128, 0, stream>>>(cp, slot_stride, slots, op, n_rows,
                                                          n_heads, nb);
  });
  return (int)cudaGetLastError();
}
