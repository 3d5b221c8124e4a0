// Programmatic dependent launch (Hopper): with EXL3_PDL=1 the kernels of a decode step
// are launched so that the next one may start while the previous one finishes (its
// blocks are placed early and wait in pdl_wait() until the previous grid has completed
// and its writes are visible). Every kernel launched through launch() therefore calls
// pdl_wait() before it reads anything an earlier kernel wrote or writes any global
// memory, and pdl_trigger() to let the next kernel be placed. Work before pdl_wait()
// may only read data no kernel of the step writes (the GEMM streams its weights).
// Without EXL3_PDL (or before sm_90) both are no-ops and launches are plain.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <utility>

namespace exl3 {

inline bool pdl_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("EXL3_PDL");
    return v != nullptr && v[0] == '1';
  }();
  return on;
}

template <typename... KernelArgs, typename... Args>
void launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
            cudaStream_t stream, Args&&... args) {
  if (!pdl_enabled()) {
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    return;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
}

}  // namespace exl3
