// NVFP4 W4A16 GEMV for one row of activations (decode): y = x @ dequantize(W).T.
//
// A decode GEMV of a few MB is short enough that its time is the DRAM latency and the tail
// more than the bytes, so every CTA requests all of its weight bytes before it does anything
// else: a warp owns R whole rows, lane L the pieces L, L + 32, ... of each row, held in
// registers until decoded. Where the weight allows, the grid is one wave (the launcher picks
// R), so the DRAM stream starts at once on every SM and the decode overlaps it. Decode and
// numerics: nvfp4_decode.cuh.
#include <cuda_runtime.h>
#include <stdint.h>

#include "dependent_launch.cuh"
#include "nvfp4_decode.cuh"

namespace {

using namespace nvfp4;

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
  int rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) rows[r] = min(row0 + r, n - 1);
  const WarpRows<P, R> w = load_warp_rows<P, R>(codes, scales, rows);
  // As a dependent launch: the weights are in flight, x may be the kernel before's output.
  wait_for_prior_grid();
  allow_dependent_launch();

  // 2. x, once per CTA, while the weights are in flight.
  __shared__ uint4 xh[K / 8];
  __shared__ float xf[K / 16];
  stage_inputs<T, K, stage_iters(K)>(x, K, xh, xf);
  __syncthreads();

  // 3. Decode and dot.
  float acc[R];
  dot_warp_rows(w, xh, xf, acc);

  // 4. Sum over the warp; the first lane of row r's group stores it. 2^14: the decoded codes
  //    are code * 2^-14.
  const float sum = warp_sum_rows<R>(acc);
  const int row = row0 + lane / (32 / R);
  if (lane % (32 / R) == 0 && row < n) out[row] = T::bits(sum * (factor * 0x1p14f));
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
