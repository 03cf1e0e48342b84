// Split-K decode helpers shared by the ISO decode kernels: cp.async copies and the
// log-sum-exp merge of the per-split partials (one inverse rotation per 4-D group).
#pragma once

#include <math_constants.h>

#include "iso_common.cuh"

namespace iso {

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

}  // namespace iso
