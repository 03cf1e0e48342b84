// The NVFP4 MoE decode in two launches (the "fused" path of kernels/moe/fused.py): for
// every (token, expert) pair q = t * KP + j of a few tokens (j < topk: routed slot ids[t, j];
// j == topk: the layer's shared expert, when KP = topk + 1)
//   1. moe_gate_up: h[q, f] = silu(x_t . W13_q[f]) * (x_t . W13_q[F + f]), fp32;
//   2. moe_down:    out[t, r] = sum_j w_tj * (h[q] . W2_q[r]), the shared pair weighted by
//                   sigmoid(logit_t) rounded to x's dtype; out in x's dtype or fp32 (a sum
//                   that a CPU part joins before its one rounding);
// a programmatic dependent launch of 1 on sm_90 (its ids, routing weights and weight rows
// are requested before it waits for h). As in the GEMV (nvfp4_gemv.cu) every CTA requests
// all of its weight bytes first and stages its inputs once in shared memory; every sum runs
// in a fixed order (no atomics): the same bits on every run. Decode and numerics:
// nvfp4_decode.cuh (the intermediate h is rounded to fp16 per block of 16 like x).
#include "dependent_launch.cuh"
#include "nvfp4_decode.cuh"

namespace nvfp4 {

constexpr int kMaxPairs = 10;              // KP per token (routed + shared)

__device__ __forceinline__ int64_t load_id(const void* ids, bool wide, int64_t i) {
  return wide ? static_cast<const int64_t*>(ids)[i] : static_cast<const int32_t*>(ids)[i];
}

// A float of dtype code `dtype` (0 fp32, 1 bf16, 2 fp16) at p[i].
__device__ __forceinline__ float load_float(const void* p, int dtype, int64_t i) {
  if (dtype == 0) return static_cast<const float*>(p)[i];
  const uint32_t bits = static_cast<const uint16_t*>(p)[i];
  return dtype == 1 ? Bf16::value(bits) : Fp16::value(bits);
}

__device__ __forceinline__ float sigmoid(float v) {
#ifdef TINYSERVE_CUDA_EMU
  return 1.0f / (1.0f + expf(-v));
#else
  return 1.0f / (1.0f + __expf(-v));
#endif
}

struct Experts {  // one layer's NVFP4 slots (fused_moe.ExpertSlots) and its shared expert
  const uint8_t* codes;   // [S, rows, K/2]
  const uint8_t* scales;  // [S, rows, K/16]
  const float* global;    // gate_up: [S, 2] (gate, up); down: [S]
  const uint8_t* shared_codes;
  const uint8_t* shared_scales;
  const float* shared_global;
};

// Launch 1, grid (F / 16, N * KP): a warp owns features f, f + 1 of pair q, i.e. the rows gate
// f, f + 1 and up F + f, F + f + 1 of its slot. H = P * 1024. Three CTAs per SM (80
// registers): one token's 9 pairs (288 CTAs at 35B-A3B shapes) run in one wave.
template <typename T, int P>
__global__ void __launch_bounds__(kThreads, 3)
moe_gate_up(const uint16_t* __restrict__ x, int64_t x_stride, const void* __restrict__ ids,
            bool ids64, int topk, int kp, Experts w, float* __restrict__ h, int f_size) {
  constexpr int H = P * kInputsPerPiece;
  constexpr int R = 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int q = blockIdx.y, t = q / kp, j = q - t * kp;
  const bool shared = j >= topk;
  const int64_t slot = shared ? 0 : load_id(ids, ids64, (int64_t)t * topk + j);
  const size_t slot_rows = 2 * (size_t)f_size;
  const uint8_t* codes = shared ? w.shared_codes : w.codes + slot * slot_rows * (H / 2);
  const uint8_t* scales = shared ? w.shared_scales : w.scales + slot * slot_rows * (H / 16);
  const float* global = shared ? w.shared_global : w.global + 2 * slot;
  const int f = (blockIdx.x * kWarps + warp) * 2;
  const int rows[R] = {f, f + 1, f_size + f, f_size + f + 1};

  // 1. the weights, then the global scales (all independent of x)
  const WarpRows<P, R> w13 = load_warp_rows<P, R>(codes, scales, rows);
  const float gate_scale = global[0], up_scale = global[1];
  allow_dependent_launch();  // the down kernel may launch now; it waits for this grid

  // 2. x_t, once per CTA
  __shared__ uint4 xh[H / 8];
  __shared__ float xf[H / 16];
  stage_inputs<T, H, stage_iters(H)>(x + t * x_stride, H, xh, xf);
  __syncthreads();

  // 3. the 4 dots; lanes 0 / 8 end up with gate f / f + 1, lanes 16 / 24 with up f / f + 1
  float acc[R];
  dot_warp_rows(w13, xh, xf, acc);
  const float sum = warp_sum_rows<R>(acc);
  const float up = __shfl_xor_sync(kFull, sum, 16) * (up_scale * 0x1p14f);
  if (lane == 0 || lane == 8) {
    const float gate = sum * (gate_scale * 0x1p14f);
    h[(size_t)q * f_size + f + lane / 8] = gate * sigmoid(gate) * up;
  }
}

// Launch 2, grid (ceil(H / (8 R)), N): a warp owns R output rows of token t; the F / 32
// lanes of a group read one pair's row at a time (G = 32 / (F / 32) pairs side by side),
// every pair's rows requested before the wait for h.
template <typename T, int F, int R>
__global__ void __launch_bounds__(kThreads)
moe_down(const float* __restrict__ h, const void* __restrict__ ids, bool ids64,
         const void* __restrict__ wts, int wts_dtype, const void* __restrict__ logit,
         int logit_dtype, int64_t logit_stride, int topk, int kp, Experts w,
         void* __restrict__ out, bool out_f32, int h_size) {
  constexpr int PR = F / 32, G = 32 / PR, JL = (kMaxPairs + G - 1) / G;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.y, grp = lane / PR, piece = lane % PR;
  const int row0 = (blockIdx.x * kWarps + warp) * R;

  // 1. this lane's pairs j = grp + G i: slots, then every weight row, then the pair weights
  int64_t slot[JL];
#pragma unroll
  for (int i = 0; i < JL; ++i) {
    const int j = grp + G * i;
    slot[i] = j < topk ? load_id(ids, ids64, (int64_t)t * topk + j) : 0;
  }
  uint4 c[JL][R];
  uint32_t s[JL][R];
#pragma unroll
  for (int i = 0; i < JL; ++i) {
    const int j = grp + G * i;
    const bool shared = j >= topk;
    const uint8_t* codes = shared ? w.shared_codes : w.codes + slot[i] * h_size * (F / 2);
    const uint8_t* scales = shared ? w.shared_scales : w.scales + slot[i] * h_size * (F / 16);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const size_t row = (size_t)min(row0 + r, h_size - 1);  // rows past H: never stored
      c[i][r] = make_uint4(0, 0, 0, 0);
      s[i][r] = 0;
      if (j < kp) {
        c[i][r] = load_stream(reinterpret_cast<const uint4*>(codes + row * (F / 2)) + piece);
        s[i][r] = reinterpret_cast<const uint16_t*>(scales + row * (F / 16))[piece];
      }
    }
  }
  float weight[JL];
#pragma unroll
  for (int i = 0; i < JL; ++i) {
    const int j = grp + G * i;
    if (j < topk) {
      weight[i] = load_float(wts, wts_dtype, (int64_t)t * topk + j) * w.global[slot[i]];
    } else if (j < kp) {  // the shared expert: its gate rounded to the output dtype
      const float gate = sigmoid(load_float(logit, logit_dtype, t * logit_stride));
      weight[i] = T::value(T::bits(gate)) * w.shared_global[0];
    } else {
      weight[i] = 0.0f;
    }
  }

  // 2. h of the token's pairs, once per CTA, after launch 1 has written it
  wait_for_prior_grid();
  __shared__ uint4 xh[kMaxPairs * F / 8];
  __shared__ float xf[kMaxPairs * F / 16];
  stage_inputs<F32, F, stage_iters(kMaxPairs * F)>(h + (size_t)t * kp * F, kp * F, xh, xf);
  __syncthreads();

  // 3. pair by pair (its h piece read once), every row
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
#pragma unroll
  for (int i = 0; i < JL; ++i) {
    const int j = grp + G * i;
    if (j < kp) {
      const InputPiece hp = input_piece<F>(xh, xf, j, piece);
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r] = piece_dot(c[i][r], s[i][r], hp, weight[i], acc[r]);
    }
  }
  const float sum = warp_sum_rows<R>(acc);
  const int row = row0 + lane / (32 / R);
  if (lane % (32 / R) == 0 && row < h_size) {
    const size_t i = (size_t)t * h_size + row;
    if (out_f32) {
      static_cast<float*>(out)[i] = sum * 0x1p14f;
    } else {
      static_cast<uint16_t*>(out)[i] = T::bits(sum * 0x1p14f);
    }
  }
}

}  // namespace nvfp4
