// A decode step's weight prefetch into L2 (exl3_ops.h launch_l2_prefetch): while a layer's
// attention runs (latency-bound, the memory bus mostly idle) the next projections'
// trellises are asked into L2, so their GEMMs read part of their bytes from there. A
// prefetch is only a hint: no value any kernel computes depends on it. Each thread issues
// one bulk L2 prefetch per chunk (sm_90: cp.async.bulk.prefetch.L2, fire and forget;
// earlier GPUs: one prefetch.global.L2 per 128-byte line of the chunk). Under programmatic
// dependent launch it lets the next kernel be placed at once, issues its prefetches before
// waiting, and completes only after the kernel before it, so the kernel after it still
// sees every earlier write (exl3_launch.cuh).
#include <cuda_runtime.h>

#include <cstdint>

#include "exl3_launch.cuh"
#include "exl3_ops.h"

namespace exl3 {
namespace {

struct Regions {
  const char* ptr[kMaxPrefetchRegions];
  int64_t chunks[kMaxPrefetchRegions];  // kPrefetchChunk-byte chunks from ptr (the last full)
  int count;
};

__global__ void __launch_bounds__(128) l2_prefetch_kernel(const __grid_constant__ Regions r) {
  pdl_trigger();
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int p = 0; p < r.count; p++) {
    for (; i < r.chunks[p]; i += stride) {
      const char* at = r.ptr[p] + i * kPrefetchChunk;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(at),
                   "r"((uint32_t)kPrefetchChunk)
                   : "memory");
#else
      for (int line = 0; line < kPrefetchChunk; line += 128)
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(at + line));
#endif
    }
    i -= r.chunks[p];
  }
  pdl_wait();  // complete only after the kernel before (the next one waits on this grid)
}

}  // namespace

bool launch_l2_prefetch(int count, const void* const* ptrs, const int64_t* bytes,
                        cudaStream_t stream) {
  if (count < 0 || count > kMaxPrefetchRegions) return false;
  Regions r{};
  int64_t total = 0;
  for (int p = 0; p < count; p++) {
    if (bytes[p] < 0 || (bytes[p] > 0 && ptrs[p] == nullptr)) return false;
    if (reinterpret_cast<uintptr_t>(ptrs[p]) % 16 != 0) return false;
    r.ptr[r.count] = static_cast<const char*>(ptrs[p]);
    r.chunks[r.count] = bytes[p] / kPrefetchChunk;
    total += r.chunks[r.count];
    if (r.chunks[r.count] > 0) r.count++;
  }
  if (total == 0) return true;
  const int64_t threads = 128;
  const unsigned blocks = (unsigned)((total + threads - 1) / threads);
  launch(l2_prefetch_kernel, dim3(blocks < 64u ? blocks : 64u), dim3(threads), 0, stream, r);
  return true;
}

}  // namespace exl3
