#pragma once
// A minimal CPU emulation of the CUDA features the ISO and NVFP4 kernels use, so their indexing,
// warp shuffles, shared memory and merges can be tested without a GPU (tests/kernels/
// emulation.py). Each CTA runs as blockDim std::threads; __syncthreads and __syncwarp are
// barriers; shuffles exchange through a per-warp buffer; __shared__ becomes static (CTAs run
// one after another; the dynamic shared memory a launch asks for is a fresh 16-byte aligned
// buffer per CTA, emu::ctx.dyn). The *_rn intrinsics are plain IEEE operations (built with
// -ffp-contract=off). The kernels' prelude.cuh includes this file when no CUDA compiler
// builds them; `emu::launch_packed` runs a kernel on arguments packed as the driver API's
// cuLaunchKernel takes them (one pointer per parameter).
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>
#include <algorithm>
#include <type_traits>
#include <utility>
using std::min; using std::max;
struct dim3 { unsigned x = 1, y = 1, z = 1; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __constant__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define CUDART_INF_F INFINITY
namespace emu {
struct Ctx { dim3 tid, bid, bdim; std::barrier<>* block; std::barrier<>* warps; float* xbuf; uint8_t* dyn; };
inline thread_local Ctx ctx;
}
#define threadIdx (emu::ctx.tid)
#define blockIdx (emu::ctx.bid)
#define blockDim (emu::ctx.bdim)
inline void __syncthreads() { emu::ctx.block->arrive_and_wait(); }
inline int emu_lane() { return emu::ctx.tid.x & 31; }
inline int emu_warp() { return emu::ctx.tid.x >> 5; }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::ctx.warps[emu_warp()].arrive_and_wait(); }
template <typename T> inline T emu_shfl(T v, int src) {
  static_assert(sizeof(T) <= 4, "");
  float* buf = emu::ctx.xbuf + emu_warp() * 32;
  std::memcpy(&buf[emu_lane()], &v, sizeof(T));
  __syncwarp();
  T r; std::memcpy(&r, &buf[src], sizeof(T));
  __syncwarp();
  return r;
}
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int off) { return emu_shfl(v, emu_lane() ^ off); }
template <typename T> inline T __shfl_sync(unsigned, T v, int src) { return emu_shfl(v, src); }
template <typename T> inline T __shfl_down_sync(unsigned, T v, int d) { int s = emu_lane() + d; return emu_shfl(v, s < 32 ? s : emu_lane()); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
namespace ts {
struct bf16 { uint16_t bits; };
struct f16 { uint16_t bits; };
inline float f16_to_float(uint16_t h) { _Float16 f; std::memcpy(&f, &h, 2); return (float)f; }
inline uint16_t float_to_f16(float v) { _Float16 f = (_Float16)v; uint16_t h; std::memcpy(&h, &f, 2); return h; }
inline float bf16_to_float(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline uint16_t float_to_bf16(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fff + ((u >> 16) & 1); return (uint16_t)(u >> 16);
}
inline uint32_t pack_half2(float lo, float hi) { return float_to_f16(lo) | (uint32_t)float_to_f16(hi) << 16; }
}  // namespace ts
namespace emu {
struct Launch {
  dim3 g, b;
  size_t smem;
  Launch(dim3 g_, dim3 b_, size_t smem_ = 0) : g(g_), b(b_), smem(smem_) {}
  template <typename K, typename... A> void operator()(K kernel, A... args) {
    int nthr = b.x * b.y * b.z, nw = (nthr + 31) / 32;
    for (unsigned z = 0; z < g.z; ++z) for (unsigned y = 0; y < g.y; ++y) for (unsigned x = 0; x < g.x; ++x) {
      std::barrier<> block(nthr);
      std::vector<float> xbuf(nw * 32);
      std::vector<uint4> dyn((smem + 15) / 16);  // poisoned: a read before a write shows
      std::memset(dyn.data(), 0xff, dyn.size() * sizeof(uint4));
      std::barrier<>* warps = static_cast<std::barrier<>*>(::operator new(sizeof(std::barrier<>) * nw));
      for (int w = 0; w < nw; ++w) new (&warps[w]) std::barrier<>(32);
      std::vector<std::thread> threads;
      for (int t = 0; t < nthr; ++t) threads.emplace_back([&, t] {
        ctx.tid = dim3(t); ctx.bid = dim3(x, y, z); ctx.bdim = b; ctx.block = &block; ctx.warps = warps; ctx.xbuf = xbuf.data(); ctx.dyn = reinterpret_cast<uint8_t*>(dyn.data());
        kernel(args...);
      });
      for (auto& t : threads) t.join();
      for (int w = 0; w < nw; ++w) warps[w].~barrier();
      ::operator delete(warps);
    }
  }
};
// A launch with the arguments packed as cuLaunchKernel takes them: args[i] points at the value
// of parameter i. Launches run in order, so a programmatic dependent launch is a plain one.
template <typename... P, size_t... I>
inline void launch_unpacked(void (*kernel)(P...), Launch& l, void** args, std::index_sequence<I...>) {
  l(kernel, *static_cast<std::remove_cv_t<std::remove_reference_t<P>>*>(args[I])...);
}
template <typename... P>
inline void launch_packed(void (*kernel)(P...), dim3 g, dim3 b, size_t smem, void** args) {
  Launch l(g, b, smem);
  launch_unpacked(kernel, l, args, std::index_sequence_for<P...>{});
}
}  // namespace emu
