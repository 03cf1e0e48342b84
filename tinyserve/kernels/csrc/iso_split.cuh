// Split-K helpers of the ISO tensor-core decode kernel (iso_decode_mma.cu): the merge of a
// CTA's warp partials, cp.async copies and the log-sum-exp merge of the per-split partials
// (one inverse rotation per 4-D group).
#pragma once

#include "iso_common.cuh"

namespace iso {

// The last step of a split's CTA: its NW warps each hold an online-softmax partial of `heads`
// query heads, unnormalised accumulators macc [NW][rows] rows of Rows::kFloats floats (element
// d of row r at Rows::at(r, d)) and (running max in log2 units, sum) ml [NW][rows][2] (rows >=
// heads), in shared memory after a barrier. Merge them into the split's partial rows
// ((row0 + h) * n_splits + split) of part_acc [.., D] and part_ml [.., 2]. Every thread of
// the CTA calls it (it has a barrier). One thread per head first replaces each warp's sum in
// ml by its factor exp2(m_w - max) (-1: a warp without tokens, skipped), once per head; then
// each thread merges 4 columns at a time, its NW x 4 loads independent of one another (not a
// chain of dependent loads and exp2 per column), one 16-byte store per 4 columns.
template <int NW, int D, typename Rows>
__device__ __forceinline__ void merge_warp_partials(const float* macc, float* ml, int rows,
                                                    int heads, int64_t row0, int n_splits,
                                                    int split, float* __restrict__ part_acc,
                                                    float* __restrict__ part_ml) {
  static_assert(D % 4 == 0, "4 columns per step");
  for (int h = threadIdx.x; h < heads; h += NW * 32) {
    float mx = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < NW; ++w) mx = fmaxf(mx, ml[(w * rows + h) * 2]);
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float mw = ml[(w * rows + h) * 2];
      float f = -1.0f;
      if (mw != -CUDART_INF_F) {
        f = exp2f(mw - mx);
        sum += f * ml[(w * rows + h) * 2 + 1];
      }
      ml[(w * rows + h) * 2 + 1] = f;  // read by this thread only, above
    }
    const int64_t prow = (row0 + h) * n_splits + split;
    part_ml[prow * 2] = mx;
    part_ml[prow * 2 + 1] = sum;
  }
  __syncthreads();
  for (int i = 4 * threadIdx.x; i < heads * D; i += 4 * NW * 32) {
    const int h = i / D;
    const int d = i - h * D;
    float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float f = ml[(w * rows + h) * 2 + 1];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float m = macc[Rows::at(w * rows + h, d + j)];
        a[j] = f >= 0.0f ? a[j] + f * m : a[j];
      }
    }
    const int64_t prow = (row0 + h) * n_splits + split;
    *reinterpret_cast<float4*>(part_acc + prow * D + d) = make_float4(a[0], a[1], a[2], a[3]);
  }
}

// 16 bytes global -> shared (both 16-byte aligned), asynchronously on sm_80+.
__device__ __forceinline__ void copy_chunk16(uint8_t* dst, const uint8_t* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
#else
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// The split merge spread over many CTAs: grid (q heads, batch, D / kMergeCols), so batch 1
// still fills the GPU (16 heads x 8 column slices = 128 CTAs at D = 256). Thread (j, gi) folds the splits s = j (mod kMergeSlices) of the 4-D group gi
// of its CTA's columns in one pass with an online max (the (max, sum) rows and the partials
// are loaded together: one round of memory latency per split, not two); the slices are merged
// by shuffles within a warp and through shared memory across warps, then one inverse rotation
// per group and the division by the sum.
constexpr int kMergeCols = 32;                               // output columns per CTA
constexpr int kMergeThreads = 256;
constexpr int kMergeGroups = kMergeCols / 4;                 // 4-D groups per CTA
constexpr int kMergeSlices = kMergeThreads / kMergeGroups;  // split slices per CTA
// Splits in flight per thread where a thread has several (batch 1 at 32k: all 4 of its
// splits at once); with one split per thread the kernel keeps 32 registers, 8 CTAs per SM,
// where the grid is large (batch 8: 1,024 CTAs; 4 in flight take 64 registers: two waves).
constexpr int kMergeBatch = 4;

// (m, l, a) <- the log-sum-exp merge of (m, l, a) and (m2, l2, a2); m or m2 may be -inf.
__device__ __forceinline__ void merge_lse(float& m, float& l, float (&a)[4], float m2, float l2,
                                          const float (&a2)[4]) {
  const float mx = fmaxf(m, m2);
  if (mx == -CUDART_INF_F) return;  // both empty
  const float f = exp2f(m - mx), f2 = exp2f(m2 - mx);
  l = l * f + l2 * f2;
#pragma unroll
  for (int c = 0; c < 4; ++c) a[c] = a[c] * f + a2[c] * f2;
  m = mx;
}

template <typename T, int BATCH>
__global__ void __launch_bounds__(kMergeThreads)
    decode_merge_cols_kernel(const float* __restrict__ part_acc,
                             const float* __restrict__ part_ml,
                             const int32_t* __restrict__ seq_lens, int chunk, int n_splits,
                             int hq, int d, T* __restrict__ out, int64_t out_stride_b) {
  __shared__ float red[kMergeThreads / 32][kMergeGroups][6];
  const int h = blockIdx.x;
  const int b = blockIdx.y;
  const int tid = threadIdx.x;
  const int gi = tid % kMergeGroups;
  const int j = tid / kMergeGroups;
  const int col = blockIdx.z * kMergeCols + 4 * gi;
  const float4 quat = quat_row((col >> 2) % 32);
  wait_for_prior_grid();
  allow_dependent_launch();  // the next decode kernel's CTAs may be scheduled from here on
  const int len = seq_lens[b];
  const int ns = min(n_splits, (len + chunk - 1) / chunk);
  const int64_t row0 = ((int64_t)b * hq + h) * n_splits;
  float m = -CUDART_INF_F, l = 0.0f;
  float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  // BATCH of the thread's splits per round: all their loads first (bounded by n_splits, not
  // by the length: they go out beside its load), then the merges of the splits the sequence
  // has (ns), in split order. A merge may return early, so loads inside the merge loop went
  // out one split, or one dependent pair of loads, at a time.
  for (int s0 = j; s0 < n_splits; s0 += BATCH * kMergeSlices) {
    float ms[BATCH], ls[BATCH];
    float4 pa[BATCH];
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
      const int s = s0 + u * kMergeSlices;
      if (s < n_splits) {
        ms[u] = part_ml[(row0 + s) * 2];
        ls[u] = part_ml[(row0 + s) * 2 + 1];
        pa[u] = *reinterpret_cast<const float4*>(part_acc + (row0 + s) * d + col);
      }
    }
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
      if (s0 + u * kMergeSlices < ns) {
        const float as[4] = {pa[u].x, pa[u].y, pa[u].z, pa[u].w};
        merge_lse(m, l, a, ms[u], ls[u], as);
      }
    }
  }
  // lanes (j % 4, gi): merge the warp's 4 slices of each group
#pragma unroll
  for (int off = kMergeGroups; off < 32; off <<= 1) {
    float a2[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) a2[c] = __shfl_xor_sync(0xffffffffu, a[c], off);
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
    const float l2 = __shfl_xor_sync(0xffffffffu, l, off);
    merge_lse(m, l, a, m2, l2, a2);
  }
  const int warp = tid >> 5;
  if ((tid & 31) < kMergeGroups) {
    float* r = red[warp][gi];
    r[0] = m;
    r[1] = l;
#pragma unroll
    for (int c = 0; c < 4; ++c) r[2 + c] = a[c];
  }
  __syncthreads();
  if (tid >= kMergeGroups) return;
  for (int w = 1; w < kMergeThreads / 32; ++w) {
    const float* r = red[w][gi];
    const float a2[4] = {r[2], r[3], r[4], r[5]};
    merge_lse(m, l, a, r[0], r[1], a2);
  }
  float y[4];
  rotate_by(quat, true, a, y);
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  T* o = out + (int64_t)b * out_stride_b + (int64_t)h * d + col;
#pragma unroll
  for (int c = 0; c < 4; ++c) o[c] = from_float<T>(y[c] * inv);
}

}  // namespace iso
