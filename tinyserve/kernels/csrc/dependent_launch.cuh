// Programmatic dependent launch (sm_90+), for the ISO and NVFP4 kernels: a kernel lets the
// one after it on the stream launch while its own CTAs run (`allow_dependent_launch`), and
// that kernel, launched with `dependent_launch_attr`, waits for the grid before it to finish
// and its writes to be visible (`wait_for_prior_grid`) before it reads any of them. Both are
// no-ops in a kernel launched without the attribute, and below sm_90.
#pragma once

#include <cuda_runtime.h>

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The launch attribute of a programmatic dependent launch (captured into CUDA graphs as a
// programmatic edge). Host only.
inline cudaLaunchAttribute* dependent_launch_attr() {
  static cudaLaunchAttribute attr = [] {
    cudaLaunchAttribute a{};
    a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    a.val.programmaticStreamSerializationAllowed = 1;
    return a;
  }();
  return &attr;
}
