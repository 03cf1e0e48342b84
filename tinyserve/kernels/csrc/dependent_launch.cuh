// Programmatic dependent launch (sm_90+), for the ISO and NVFP4 kernels: a kernel lets the
// one after it on the stream launch while its own CTAs run (`allow_dependent_launch`), and
// that kernel, launched as a programmatic dependent (kernels/cuda_build.py, `pdl=True`),
// waits for the grid before it to finish and its writes to be visible (`wait_for_prior_grid`)
// before it reads any of them. Both are no-ops in a kernel launched without the attribute, and
// below sm_90.
#pragma once

#include "prelude.cuh"

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
