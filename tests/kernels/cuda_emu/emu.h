#pragma once
// A minimal CPU emulation of the CUDA features the ISO and NVFP4 kernels use, so their indexing,
// warp shuffles, shared memory and merges can be tested without a GPU (tests/kernels/
// test_iso_emulated.py). Each CTA runs as blockDim std::threads; __syncthreads and __syncwarp
// are barriers; shuffles exchange through a per-warp buffer; __shared__ becomes static (CTAs run
// one after another; the dynamic shared memory a launch asks for is a fresh 16-byte aligned
// buffer per CTA, emu::ctx.dyn). The *_rn intrinsics are plain IEEE operations (built with
// -ffp-contract=off). `kernel<<<grid, block, smem, stream>>>(args)` is rewritten by the test to
// `emu::Launch(grid, block, smem, stream)(kernel, args)`.
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>
#include <algorithm>
using std::min; using std::max;
struct dim3 { unsigned x = 1, y = 1, z = 1; dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
typedef void* cudaStream_t;
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline int cudaGetLastError() { return 0; }
typedef int cudaError_t;
constexpr cudaError_t cudaSuccess = 0, cudaErrorInvalidValue = 1;
// The emulation has no SMs: every kernel "fits" twice.
template <typename K> inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, K, int, size_t) { *n = 2; return cudaSuccess; }
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
template <typename K> inline cudaError_t cudaFuncSetAttribute(K, cudaFuncAttribute, int) { return cudaSuccess; }
// One device with the H200's shared memory per SM; kernels report no static shared memory.
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81, cudaDevAttrReservedSharedMemoryPerBlock = 111 };
inline cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) { *v = a == cudaDevAttrMaxSharedMemoryPerMultiprocessor ? 233472 : 1024; return cudaSuccess; }
struct cudaFuncAttributes { size_t sharedSizeBytes = 0; };
template <typename K> inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, K) { a->sharedSizeBytes = 0; return cudaSuccess; }
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
struct __half { uint16_t x; };
struct __nv_bfloat16 { uint16_t x; };
inline float __half2float(__half h) { _Float16 f; std::memcpy(&f, &h.x, 2); return (float)f; }
inline __half __float2half_rn(float v) { _Float16 f = (_Float16)v; __half h; std::memcpy(&h.x, &f, 2); return h; }
inline __half __ushort_as_half(unsigned short s) { return __half{s}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }
inline float __bfloat162float(__nv_bfloat16 b) { uint32_t u = (uint32_t)b.x << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { uint32_t u; std::memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return __nv_bfloat16{(uint16_t)(u >> 16)}; }
namespace emu {
struct Launch {
  dim3 g, b;
  size_t smem;
  Launch(dim3 g_, dim3 b_, size_t smem_ = 0, cudaStream_t = nullptr) : g(g_), b(b_), smem(smem_) {}
  template <typename K, typename... A> void operator()(K kernel, A... args) {
    int nthr = b.x * b.y * b.z, nw = (nthr + 31) / 32;
    for (unsigned z = 0; z < g.z; ++z) for (unsigned y = 0; y < g.y; ++y) for (unsigned x = 0; x < g.x; ++x) {
      std::barrier<> block(nthr);
      std::vector<float> xbuf(nw * 32);
      std::vector<uint4> dyn((smem + 15) / 16);  // poisoned: a read before a write shows
      std::memset(dyn.data(), 0xff, dyn.size() * sizeof(uint4));
      std::barrier<>* warps = static_cast<std::barrier<>*>(::operator new(sizeof(std::barrier<>) * nw));
      for (int w = 0; w < nw; ++w) new (&warps[w]) std::barrier<>(32);
      std::vector<std::thread> ts;
      for (int t = 0; t < nthr; ++t) ts.emplace_back([&, t] {
        ctx.tid = dim3(t); ctx.bid = dim3(x, y, z); ctx.bdim = b; ctx.block = &block; ctx.warps = warps; ctx.xbuf = xbuf.data(); ctx.dyn = reinterpret_cast<uint8_t*>(dyn.data());
        kernel(args...);
      });
      for (auto& t : ts) t.join();
      for (int w = 0; w < nw; ++w) warps[w].~barrier();
      ::operator delete(warps);
    }
  }
};
}
// cudaLaunchKernelEx: the emulation runs kernels in launch order, so a programmatic dependent
// launch (the only attribute the kernels set) is a plain launch here.
enum cudaLaunchAttributeID { cudaLaunchAttributeProgrammaticStreamSerialization = 5 };
union cudaLaunchAttributeValue { int programmaticStreamSerializationAllowed; };
struct cudaLaunchAttribute { cudaLaunchAttributeID id; cudaLaunchAttributeValue val; };
struct cudaLaunchConfig_t {  // the fields of CUDA's struct in its order (names: the macros)
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  cudaLaunchAttribute* attrs;
  unsigned num_attrs;
};
template <typename... P, typename... A>
inline cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* cfg, void (*kernel)(P...),
                                      A&&... args) {
  emu::Launch(cfg->grid, cfg->block, cfg->smem, cfg->stream)(kernel, P(args)...);
  return cudaSuccess;
}
