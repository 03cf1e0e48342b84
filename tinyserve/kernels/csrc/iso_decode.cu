// ISO paged decode attention in the rotated space (specs/iso_kv.md §6.5), split-K.
//
// Pass 1 (decode_partial_kernel): grid (splits, kv heads, batch), 4 warps. A CTA owns `chunk`
// context tokens of one (sequence, kv head) and all G query heads of its GQA group, so every
// packed K/V row is read once per group. Each lane owns E = D/32 consecutive elements and
// keeps the G rotated, pre-scaled queries and G rotated accumulators in registers. Per tile
// of 32 tokens: coalesced copy of the packed K and V rows into shared memory (through the
// page table; cp.async, double-buffered so the next tile loads during this one's math), scores = norm * dot(q_rot, centroids) reduced with a reduce-scatter over the
// warp, one online-softmax rescale per warp per tile, then V accumulated in rotated space.
// The 4 warps' states are merged in shared memory and written as one partial per split.
// Pass 2 (decode_merge_kernel): log-sum-exp merge of the splits, one inverse rotation per
// 4-D group, divide by the softmax sum, cast to the output dtype.
#include "iso_common.cuh"
#include "iso_split.cuh"

namespace iso {

constexpr int kWarps = 4;
constexpr int kTile = 32;
constexpr int kTokPerWarp = kTile / kWarps;

// Sum over the warp of G per-lane values; returns the total of head lane / (32 / G).
template <int G>
__device__ __forceinline__ float reduce_scatter(float (&v)[G], int lane) {
#pragma unroll
  for (int w = G / 2, off = 16; w >= 1; w >>= 1, off >>= 1) {
    const bool upper = (lane & off) != 0;
#pragma unroll
    for (int i = 0; i < w; ++i) {
      const float send = upper ? v[i] : v[i + w];
      const float keep = upper ? v[i + w] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
    }
  }
  float s = v[0];
#pragma unroll
  for (int off = 32 / G / 2; off >= 1; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  return s;
}

template <int BITS, int NB>
__device__ __forceinline__ float decode_lane(const uint8_t* row, int blk, int g0,
                                             const float* cent, float (&c)[NB * 4]) {
  const uint8_t* b = row + blk * Fmt<BITS>::kBytes;
#pragma unroll
  for (int k = 0; k < NB; ++k) {
    int idx[4];
    group_indices<BITS>(b, g0 + k, idx);
#pragma unroll
    for (int j = 0; j < 4; ++j) c[4 * k + j] = cent[idx[j]];
  }
  return block_norm(b);
}

template <int BITS, int NB, int G>
__global__ void __launch_bounds__(kWarps * 32)
    decode_partial_kernel(const float* __restrict__ q, const uint8_t* __restrict__ k_cache,
                          const uint8_t* __restrict__ v_cache, int64_t slot_stride,
                          const int32_t* __restrict__ page_table, int64_t pt_stride,
                          const int32_t* __restrict__ seq_lens, int page_size, int n_kv_heads,
                          int chunk, int n_splits, float scale_log2, float* __restrict__ part_acc,
                          float* __restrict__ part_ml) {
  constexpr int D = NB * kBlock;
  constexpr int E = NB * 4;
  constexpr int RB = NB * Fmt<BITS>::kBytes;
  constexpr int kLanesPerBlock = 32 / NB;
  using W = typename ts::select<RB % 4 == 0, uint32_t, uint16_t>::type;
  constexpr int RW = RB / (int)sizeof(W);
  constexpr int kTileBytes = 2 * 2 * kTile * RB;  // two buffers of K and V
  constexpr int kMergeBytes = kWarps * G * D * 4;
  constexpr int kRaw = kTileBytes > kMergeBytes ? kTileBytes : kMergeBytes;

  __shared__ __align__(16) uint8_t raw[kRaw];
  __shared__ int64_t slot_sm[2][kTile];
  __shared__ float score_sm[kWarps][G][kTokPerWarp];
  __shared__ float ml_sm[kWarps][G][2];
  __shared__ float cent_sm[16];

  const int split = blockIdx.x;
  const int kvh = blockIdx.y;
  const int b = blockIdx.z;
  const int len = seq_lens[b];
  const int t_begin = split * chunk;
  if (t_begin >= len) return;
  const int t_end = min(len, t_begin + chunk);
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int hq = n_kv_heads * G;
  if (threadIdx.x < Fmt<BITS>::kCents) cent_sm[threadIdx.x] = centroid<BITS>(threadIdx.x);

  const int blk = lane / kLanesPerBlock;
  const int g0 = (lane % kLanesPerBlock) * NB;
  const int e0 = lane * E;

  float qr[G][E];  // rotated query, times scale * log2(e)
  float acc[G][E];  // rotated, unnormalised output
  float m[G], l[G];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    const float* qh = q + ((int64_t)b * hq + kvh * G + h) * D + e0;
#pragma unroll
    for (int k = 0; k < NB; ++k) {
      float v4[4], r4[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) v4[j] = qh[4 * k + j];
      rotate_by(quat_row(g0 + k), false, v4, r4);  // g0 is per lane
#pragma unroll
      for (int j = 0; j < 4; ++j) qr[h][4 * k + j] = r4[j] * scale_log2;
    }
#pragma unroll
    for (int e = 0; e < E; ++e) acc[h][e] = 0.0f;
    m[h] = -CUDART_INF_F;
    l[h] = 0.0f;
  }

  // Double-buffered tiles: the copy of tile i+1 (cp.async) overlaps the math of tile i.
  auto load_slots = [&](int t0, int buf) {
    const int n = min(kTile, t_end - t0);
    if (threadIdx.x < n) {
      const int t = t0 + threadIdx.x;
      const int64_t page = page_table[(int64_t)b * pt_stride + t / page_size];
      slot_sm[buf][threadIdx.x] = page * page_size + t % page_size;
    }
  };
  auto issue_copy = [&](int t0, int buf) {
    const int n = min(kTile, t_end - t0);
    W* kd = reinterpret_cast<W*>(raw + buf * 2 * kTile * RB);
    W* vd = reinterpret_cast<W*>(raw + buf * 2 * kTile * RB + kTile * RB);
    for (int i = threadIdx.x; i < n * RW; i += kWarps * 32) {
      const int tok = i / RW;
      const int w = i - tok * RW;
      const int64_t off = slot_sm[buf][tok] * slot_stride + (int64_t)kvh * RB;
      copy_word(kd + i, reinterpret_cast<const W*>(k_cache + off) + w);
      copy_word(vd + i, reinterpret_cast<const W*>(v_cache + off) + w);
    }
    cp_async_commit();
  };
  load_slots(t_begin, 0);
  __syncthreads();
  issue_copy(t_begin, 0);

  for (int t0 = t_begin, it = 0; t0 < t_end; t0 += kTile, ++it) {
    const int n = min(kTile, t_end - t0);
    const int buf = it & 1;
    const bool has_next = t0 + kTile < t_end;
    // every thread finished tile it-1 (its buffer is buf ^ 1) before this barrier
    if (has_next) load_slots(t0 + kTile, buf ^ 1);
    __syncthreads();
    if (has_next) {
      issue_copy(t0 + kTile, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // tile `it` is in shared memory for everyone (and cent_sm is visible)
    const uint8_t* k_sm = raw + buf * 2 * kTile * RB;
    const uint8_t* v_sm = k_sm + kTile * RB;

    // scores of this warp's tokens
#pragma unroll
    for (int k = 0; k < kTokPerWarp; ++k) {
      const int i = warp * kTokPerWarp + k;
      if (i < n) {
        float c[E];
        const float nk = decode_lane<BITS, NB>(k_sm + i * RB, blk, g0, cent_sm, c);
        float s[G];
#pragma unroll
        for (int h = 0; h < G; ++h) {
          float a = 0.0f;
#pragma unroll
          for (int e = 0; e < E; ++e) a += qr[h][e] * c[e];
          s[h] = a * nk;
        }
        // NOTE: lanes of different 128-blocks carry different norms; the sum still adds
        // norm_b * dot_b over the blocks, as §6.5 requires.
        const float tot = reduce_scatter<G>(s, lane);
        if (lane % (32 / G) == 0) score_sm[warp][lane / (32 / G)][k] = tot;
      } else if (lane < G) {
        score_sm[warp][lane][k] = -CUDART_INF_F;
      }
    }
    __syncwarp();

    // one online-softmax rescale per warp per tile
#pragma unroll
    for (int h = 0; h < G; ++h) {
      float mt = m[h];
#pragma unroll
      for (int k = 0; k < kTokPerWarp; ++k) mt = fmaxf(mt, score_sm[warp][h][k]);
      if (mt != -CUDART_INF_F) {
        const float alpha = exp2f(m[h] - mt);  // m[h] = -inf gives 0
        m[h] = mt;
        l[h] *= alpha;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[h][e] *= alpha;
      }
    }
#pragma unroll
    for (int k = 0; k < kTokPerWarp; ++k) {
      const int i = warp * kTokPerWarp + k;
      if (i < n) {
        float c[E];
        const float nv = decode_lane<BITS, NB>(v_sm + i * RB, blk, g0, cent_sm, c);
#pragma unroll
        for (int h = 0; h < G; ++h) {
          const float p = exp2f(score_sm[warp][h][k] - m[h]);
          l[h] += p;
          const float pn = p * nv;
#pragma unroll
          for (int e = 0; e < E; ++e) acc[h][e] += pn * c[e];
        }
      }
    }
  }

  // merge the warps of this CTA; `raw` is reused
  __syncthreads();
  float* macc = reinterpret_cast<float*>(raw);  // [kWarps][G][D]
#pragma unroll
  for (int h = 0; h < G; ++h) {
#pragma unroll
    for (int e = 0; e < E; ++e) macc[(warp * G + h) * D + e0 + e] = acc[h][e];
    if (lane == 0) {
      ml_sm[warp][h][0] = m[h];
      ml_sm[warp][h][1] = l[h];
    }
  }
  __syncthreads();
  merge_warp_partials<kWarps, D>(macc, &ml_sm[0][0][0], G, G, (int64_t)b * hq + kvh * G,
                                 n_splits, split, part_acc, part_ml);
}

}  // namespace iso
