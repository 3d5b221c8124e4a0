// The first LoRA product of the fused decode layer (engine/layers/adapted_linear.py):
// low = x @ A^T for the few rows of a decode step, x (rows, K) and A (rank, K) in the
// activation dtype, low (rows, rank) rounded to it.
//
// A small matmul that a library GEMM runs on a handful of blocks walking all of K. Here
// K is split into at most kMaxSplits slices of whole 256-column vectors, one block per
// slice: each warp holds its rank columns' slice of A in registers and dots it with
// every row's slice of x (one 16-byte load per lane and row); the block writes its
// float32 partial sums to a workspace and the last block to finish (a ticket counter it
// resets) adds the slices in order and writes low. One launch, deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "exl3_convert.cuh"
#include "exl3_launch.cuh"
#include "exl3_ops.h"

namespace exl3 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 8;  // values per 16-byte load
constexpr int kSpan = 32 * kVec;  // columns of one warp-wide load
constexpr int kMaxVecs = 8;  // 16-byte loads per lane and row in one slice

// Grid: one block per slice of VECS * kSpan columns. partial: (slices, rows, rank).
template <typename T, int VECS>
__global__ void __launch_bounds__(kThreads)
    lora_low_kernel(const T* x, int64_t x_stride, const T* a, int k_dim, int rank, int rows,
                    float* partial, unsigned* ticket, T* low) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int k0 = blockIdx.x * VECS * kSpan + lane * kVec;
  pdl_wait();
  for (int j = warp; j < rank; j += kWarps) {
    uint4 av[VECS];  // this lane's part of A's row j in the slice (zeros past K)
#pragma unroll
    for (int v = 0; v < VECS; ++v) {
      const int k = k0 + v * kSpan;
      av[v] = k < k_dim ? *reinterpret_cast<const uint4*>(a + (size_t)j * k_dim + k)
                        : make_uint4(0, 0, 0, 0);
    }
    for (int r0 = 0; r0 < rows; r0 += 4) {  // four rows' loads in flight
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (r0 + i >= rows) break;
        const T* xr = x + (size_t)(r0 + i) * x_stride;
#pragma unroll
        for (int v = 0; v < VECS; ++v) {
          const int k = k0 + v * kSpan;
          if (k < k_dim) s[i] = dot8_f32<T>(*reinterpret_cast<const uint4*>(xr + k), av[v], s[i]);
        }
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float total = warp_sum32(s[i]);
        if (lane == 0 && r0 + i < rows)
          partial[((size_t)blockIdx.x * rows + r0 + i) * rank + j] = total;
      }
    }
  }
  // The last block to finish adds the slices in order.
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  pdl_trigger();
  if (!last) return;
  __threadfence();
  const int outputs = rows * rank, slices = gridDim.x;
  for (int o = threadIdx.x; o < outputs; o += kThreads) {
    float total = 0.f;
    for (int b = 0; b < slices; ++b) total += __ldcg(partial + (size_t)b * outputs + o);
    low[o] = from_f32<T>(total);  // (rows, rank) contiguous, as partial's slices
  }
  if (threadIdx.x == 0) *ticket = 0u;
}

template <typename T>
bool launch_typed(const void* x, int64_t x_stride, const void* a, int k_dim, int rank,
                  int rows, float* partial, unsigned* ticket, void* low, cudaStream_t stream) {
  const int vecs_total = (k_dim + kSpan - 1) / kSpan;
  const int needed = (vecs_total + kLoraLowMaxSplits - 1) / kLoraLowMaxSplits;
  if (needed > kMaxVecs) return false;  // k_dim > 32768: more slices than the workspace holds
  const int vecs = needed <= 1 ? 1 : needed <= 2 ? 2 : needed <= 4 ? 4 : 8;
  const dim3 grid((vecs_total + vecs - 1) / vecs);  // <= kLoraLowMaxSplits
  const T* xt = static_cast<const T*>(x);
  const T* at = static_cast<const T*>(a);
  T* lt = static_cast<T*>(low);
#define EXL3_LORA_LOW(V)                                                                  \
  launch(lora_low_kernel<T, V>, grid, dim3(kThreads), 0, stream, xt, x_stride, at, k_dim, \
         rank, rows, partial, ticket, lt)
  if (vecs == 1) EXL3_LORA_LOW(1);
  else if (vecs == 2) EXL3_LORA_LOW(2);
  else if (vecs == 4) EXL3_LORA_LOW(4);
  else EXL3_LORA_LOW(8);
#undef EXL3_LORA_LOW
  return true;
}

}  // namespace

bool launch_lora_low(int dtype, const void* x, int64_t x_stride, const void* a, int k_dim,
                     int rank, int rows, float* partial, unsigned* ticket, void* low,
                     cudaStream_t stream) {
  if (k_dim % kVec || rank < 1 || rank > kLoraLowMaxRank || rows < 1 ||
      rows > kLoraLowMaxRows || x_stride % kVec ||
      reinterpret_cast<uintptr_t>(x) % 16 || reinterpret_cast<uintptr_t>(a) % 16)
    return false;  // (16-byte loads of x and A)
  if (dtype == DT_HALF)
    return launch_typed<__half>(x, x_stride, a, k_dim, rank, rows, partial, ticket, low, stream);
  if (dtype == DT_BF16)
    return launch_typed<__nv_bfloat16>(x, x_stride, a, k_dim, rank, rows, partial, ticket, low,
                                       stream);
  return false;
}

}  // namespace exl3
