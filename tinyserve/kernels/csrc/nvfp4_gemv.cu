// NVFP4 W4A16 GEMV for one row of activations (decode): y = x @ dequantize(W).T.
//
// A decode GEMV of a few MB is short enough that its time is the DRAM latency and the tail
// more than the bytes, so every CTA requests all of its weight bytes before it does anything
// else: a warp owns R whole rows, lane L the pieces L, L + 32, ... of each row, held in
// registers until decoded. Where the weight allows, the grid is one wave (the launcher picks
// R), so the DRAM stream starts at once on every SM and the decode overlaps it. Decode and
// numerics: nvfp4_decode.cuh. Launched by kernels/nvfp4/cuda.py: ceil(N / (kWarps * R)) CTAs
// of kThreads threads.
#include "nvfp4_decode.cuh"

namespace nvfp4 {

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

}  // namespace nvfp4
