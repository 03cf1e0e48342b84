// What the kernels take from CUDA beyond the language itself: fixed-width integers, fp16 /
// bf16 values as raw bits with their conversions, infinity. No toolkit header is needed:
// NVRTC (kernels/cuda_build.py) compiles every kernel with this alone, on a machine with
// nothing but the driver and the pip packages. Compiled by a plain C++ compiler (no
// __CUDACC__), the file brings in the tests' CPU emulation of CUDA instead
// (tests/kernels/cuda_emu/emu.h, on the include path of those builds).
#pragma once

#ifndef __CUDACC__
#define TINYSERVE_CUDA_EMU 1
#include "emu.h"
#else

#ifdef __CUDACC_RTC__
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
typedef unsigned long long uintptr_t;
#else
#include <stdint.h>
#endif

#ifndef CUDART_INF_F
#define CUDART_INF_F __int_as_float(0x7f800000)
#endif

namespace ts {

// 16-bit floats as stored in memory: the element types of bf16 / fp16 tensors.
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

__device__ __forceinline__ float f16_to_float(uint16_t h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// round to nearest even
__device__ __forceinline__ uint16_t float_to_f16(float f) {
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

__device__ __forceinline__ float bf16_to_float(uint16_t b) {
  return __uint_as_float((uint32_t)b << 16);
}

// round to nearest even (sm_80+)
__device__ __forceinline__ uint16_t float_to_bf16(float f) {
  uint16_t b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
  return b;
}

// (lo, hi) rounded to fp16, lo in the low half
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

}  // namespace ts
#endif  // __CUDACC__

namespace ts {

// fp16 -> fp32 of the low / high half of a packed pair
__device__ __forceinline__ float half_lo(uint32_t h) { return f16_to_float((uint16_t)h); }
__device__ __forceinline__ float half_hi(uint32_t h) { return f16_to_float((uint16_t)(h >> 16)); }

}  // namespace ts
