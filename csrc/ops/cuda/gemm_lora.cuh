// The first LoRA product of an adapted projection inside the fused GEMM's launch
// (exl3_ops.h GemmLora): low = x @ A^T for the rows of a decode step.
//
// Run as its own product it was a launch per adapted input on the step's critical path
// (lora_low.cu: ~6 us each, 128 per 8B step; cuBLAS at 5-64 rows: more). Here the GEMM's
// grid gets lora_grid_rows() more rows in y (after the splits; the blocks at z = 0 make
// the product, one block per task, those at z > 0 leave at once), which compute the
// product while the GEMM's blocks stream the quantized weights: A is 0.1-0.5 MB against
// the GEMM's 8-60 MB, so the product hides under the weights' time, and the output
// kernel (the next launch, which waits for the whole grid) reads `low` as before.
//
// A task is (4 rows, 1 rank column); a block's 4 warps take interleaved 256-column
// vectors of K (one 16-byte load of x per row and of A per rank column and lane), sum in
// float32, reduce over the warp and then over the 4 warps in order through shared memory
// (the GEMM's dynamic ring, unused by these blocks): deterministic, no atomics, no
// workspace. The block loops over tasks, so any grid layer size covers any product.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "exl3_convert.cuh"
#include "exl3_launch.cuh"
#include "exl3_ops.h"

namespace exl3 {
namespace gemm {

constexpr int kLoraRows = 4;   // rows of one task
constexpr int kLoraRanks = 1;  // rank columns of one task (2: 64 registers at 1-8 rows, not 56)
constexpr int kLoraVec = 8;    // values per 16-byte load

// The tasks of a product (rows <= 64, rank <= kGemmLoraMaxRank).
__host__ __device__ inline int lora_tasks(int rows, int rank) {
  return ((rows + kLoraRows - 1) / kLoraRows) * ((rank + kLoraRanks - 1) / kLoraRanks);
}

// The grid rows a product adds to a GEMM grid `grid_x` blocks wide: a block per task.
inline int lora_grid_rows(const GemmLora& lora, int rows, int grid_x) {
  if (lora.x == nullptr) return 0;
  const int tasks = lora_tasks(rows, lora.rank);
  return (tasks + grid_x - 1) / grid_x;
}

// Block `block` of `blocks` (WARPS warps, the whole block calls this; red: >= WARPS *
// kLoraRows * kLoraRanks floats of shared memory).
template <typename T, int WARPS>
__device__ __forceinline__ void lora_product(const GemmLora& lora, int rows, int block,
                                             int blocks, float* red) {
  constexpr int kVals = kLoraRows * kLoraRanks;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const T* __restrict__ x = static_cast<const T*>(lora.x);
  const T* __restrict__ a = static_cast<const T*>(lora.a);
  T* __restrict__ low = static_cast<T*>(lora.low);
  const int chunks = (lora.rank + kLoraRanks - 1) / kLoraRanks;
  const int tasks = lora_tasks(rows, lora.rank);
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int task = block; task < tasks; task += blocks) {
    const int j0 = (task % chunks) * kLoraRanks, r0 = (task / chunks) * kLoraRows;
    float acc[kLoraRows][kLoraRanks];
#pragma unroll
    for (int i = 0; i < kLoraRows; i++)
#pragma unroll
      for (int j = 0; j < kLoraRanks; j++) acc[i][j] = 0.0f;
#pragma unroll 1
    for (int c = (warp * 32 + lane) * kLoraVec; c < lora.k_dim; c += WARPS * 32 * kLoraVec) {
      uint4 av[kLoraRanks], xv[kLoraRows];
#pragma unroll
      for (int j = 0; j < kLoraRanks; j++)
        av[j] = j0 + j < lora.rank
                    ? __ldg(reinterpret_cast<const uint4*>(a + (size_t)(j0 + j) * lora.k_dim + c))
                    : zero;
#pragma unroll
      for (int i = 0; i < kLoraRows; i++)
        xv[i] = r0 + i < rows
                    ? *reinterpret_cast<const uint4*>(x + (size_t)(r0 + i) * lora.x_stride + c)
                    : zero;
#pragma unroll
      for (int i = 0; i < kLoraRows; i++)
#pragma unroll
        for (int j = 0; j < kLoraRanks; j++) acc[i][j] = dot8_f32<T>(xv[i], av[j], acc[i][j]);
    }
#pragma unroll
    for (int i = 0; i < kLoraRows; i++)
#pragma unroll
      for (int j = 0; j < kLoraRanks; j++) {
        const float s = warp_sum32(acc[i][j]);
        if (lane == 0) red[warp * kVals + i * kLoraRanks + j] = s;
      }
    __syncthreads();
    if (threadIdx.x < kVals) {
      const int i = threadIdx.x / kLoraRanks, j = threadIdx.x % kLoraRanks;
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < WARPS; w++) s += red[w * kVals + threadIdx.x];
      if (r0 + i < rows && j0 + j < lora.rank)
        low[(size_t)(r0 + i) * lora.rank + j0 + j] = from_f32<T>(s);
    }
    __syncthreads();  // red is the next task's
  }
}

// A block of the grid rows from lora.y0 on: at z = 0 its share of the product.
template <int WARPS>
__device__ __forceinline__ void lora_rows(const GemmLora& lora, int rows, float* red) {
  if (blockIdx.z != 0) return;
  pdl_wait();  // x is the previous kernel's output; low may still be read by an older one
  const int block = (blockIdx.y - lora.y0) * gridDim.x + blockIdx.x;
  const int blocks = (gridDim.y - lora.y0) * gridDim.x;
  if (lora.dtype == DT_HALF)
    lora_product<__half, WARPS>(lora, rows, block, blocks, red);
  else
    lora_product<__nv_bfloat16, WARPS>(lora, rows, block, blocks, red);
}

}  // namespace gemm
}  // namespace exl3
