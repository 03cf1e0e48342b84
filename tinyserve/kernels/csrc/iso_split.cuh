// Split-K decode helpers shared by the ISO decode kernels: cp.async copies and the
// log-sum-exp merge of the per-split partials (one inverse rotation per 4-D group).
#pragma once

#include <math_constants.h>

#include "iso_common.cuh"

namespace iso {

// The last step of a split's CTA: its NW warps each hold an online-softmax partial of `heads`
// query heads, unnormalised accumulators macc [NW][rows][D] and (running max in log2 units,
// sum) ml [NW][rows][2] (rows >= heads), in shared memory after a barrier. Merge them into the
// split's partial rows ((row0 + h) * n_splits + split) of part_acc [.., D] and part_ml [.., 2].
template <int NW, int D>
__device__ __forceinline__ void merge_warp_partials(const float* macc, const float* ml, int rows,
                                                    int heads, int64_t row0, int n_splits,
                                                    int split, float* __restrict__ part_acc,
                                                    float* __restrict__ part_ml) {
  for (int i = threadIdx.x; i < heads * D; i += NW * 32) {
    const int h = i / D;
    const int d = i - h * D;
    float mx = -CUDART_INF_F;
#pragma unroll
    for (int w = 0; w < NW; ++w) mx = fmaxf(mx, ml[(w * rows + h) * 2]);
    float a = 0.0f, sum = 0.0f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float mw = ml[(w * rows + h) * 2];
      if (mw != -CUDART_INF_F) {
        const float f = exp2f(mw - mx);
        a += f * macc[(w * rows + h) * D + d];
        sum += f * ml[(w * rows + h) * 2 + 1];
      }
    }
    const int64_t prow = (row0 + h) * n_splits + split;
    part_acc[prow * D + d] = a;
    if (d == 0) {
      part_ml[prow * 2] = mx;
      part_ml[prow * 2 + 1] = sum;
    }
  }
}

// Asynchronous global -> shared copies (sm_80+); plain copies elsewhere and for 2-byte words.
template <typename W>
__device__ __forceinline__ void copy_word(W* dst, const W* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (sizeof(W) == 4) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(src));
    return;
  }
#endif
  *dst = *src;
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

template <typename T>
__global__ void decode_merge_kernel(const float* __restrict__ part_acc,
                                    const float* __restrict__ part_ml,
                                    const int32_t* __restrict__ seq_lens, int chunk, int n_splits,
                                    int hq, int d, T* __restrict__ out, int64_t out_stride_b) {
  const int h = blockIdx.x;
  const int b = blockIdx.y;
  const int gi = threadIdx.x;  // 4-D group index within the head vector
  if (gi * 4 >= d) return;
  const int len = seq_lens[b];
  const int ns = min(n_splits, (len + chunk - 1) / chunk);
  const int64_t row0 = ((int64_t)b * hq + h) * n_splits;
  float mx = -CUDART_INF_F;
  for (int s = 0; s < ns; ++s) mx = fmaxf(mx, part_ml[(row0 + s) * 2]);
  float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float sum = 0.0f;
  for (int s = 0; s < ns; ++s) {
    const float ms = part_ml[(row0 + s) * 2];
    if (ms == -CUDART_INF_F) continue;
    const float f = exp2f(ms - mx);
    sum += f * part_ml[(row0 + s) * 2 + 1];
    const float4 pa = *reinterpret_cast<const float4*>(part_acc + (row0 + s) * d + gi * 4);
    a[0] += f * pa.x;
    a[1] += f * pa.y;
    a[2] += f * pa.z;
    a[3] += f * pa.w;
  }
  float y[4];
  rotate_fast(gi % 32, true, a, y);
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  T* o = out + (int64_t)b * out_stride_b + (int64_t)h * d + gi * 4;
#pragma unroll
  for (int j = 0; j < 4; ++j) o[j] = from_float<T>(y[j] * inv);
}

// The same merge for many splits (hundreds at batch 1): 512 threads per (head, sequence);
// thread (j, gi) adds the splits s = j (mod 512 / (D/4)) of 4-D group gi, so the loads of
// many splits are in flight at once; the slices are summed in shared memory.
constexpr int kWideMergeThreads = 512;

template <typename T>
__global__ void __launch_bounds__(kWideMergeThreads)
    decode_merge_wide_kernel(const float* __restrict__ part_acc,
                             const float* __restrict__ part_ml,
                             const int32_t* __restrict__ seq_lens, int chunk, int n_splits,
                             int hq, int d, T* __restrict__ out, int64_t out_stride_b) {
  __shared__ float red[kWideMergeThreads * 4];
  __shared__ float red_ml[kWideMergeThreads];
  const int h = blockIdx.x;
  const int b = blockIdx.y;
  const int tid = threadIdx.x;
  const int g4 = d / 4;
  const int slices = kWideMergeThreads / g4;
  const int j = tid / g4;
  const int gi = tid - j * g4;
  const int len = seq_lens[b];
  const int ns = min(n_splits, (len + chunk - 1) / chunk);
  const int64_t row0 = ((int64_t)b * hq + h) * n_splits;
  float mx = -CUDART_INF_F;
  for (int s = tid; s < ns; s += kWideMergeThreads) mx = fmaxf(mx, part_ml[(row0 + s) * 2]);
  red_ml[tid] = mx;
  __syncthreads();
  for (int w = kWideMergeThreads / 2; w > 0; w >>= 1) {
    if (tid < w) red_ml[tid] = fmaxf(red_ml[tid], red_ml[tid + w]);
    __syncthreads();
  }
  mx = red_ml[0];  // finite: split 0 holds >= 1 token
  __syncthreads();
  float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float sum = 0.0f;
#pragma unroll 4
  for (int s = j; s < ns; s += slices) {
    const float ms = part_ml[(row0 + s) * 2];
    const float f = ms == -CUDART_INF_F ? 0.0f : exp2f(ms - mx);
    sum += f * part_ml[(row0 + s) * 2 + 1];
    const float4 pa = *reinterpret_cast<const float4*>(part_acc + (row0 + s) * d + gi * 4);
    a[0] += f * pa.x;
    a[1] += f * pa.y;
    a[2] += f * pa.z;
    a[3] += f * pa.w;
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) red[tid * 4 + c] = a[c];
  if (gi == 0) red_ml[j] = sum;
  __syncthreads();
  if (j != 0) return;
  for (int jj = 1; jj < slices; ++jj) {
#pragma unroll
    for (int c = 0; c < 4; ++c) a[c] += red[(jj * g4 + gi) * 4 + c];
  }
  float total = 0.0f;
  for (int jj = 0; jj < slices; ++jj) total += red_ml[jj];
  float y[4];
  rotate_fast(gi % 32, true, a, y);
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  T* o = out + (int64_t)b * out_stride_b + (int64_t)h * d + gi * 4;
#pragma unroll
  for (int c = 0; c < 4; ++c) o[c] = from_float<T>(y[c] * inv);
}

}  // namespace iso
