// combine_hadamard (exl3_ops.h): the o projection's input side with the paged
// attention's chunk combine folded in, so a decode layer launches one kernel fewer
// (bench/NOTES-gpu.md "Launches per layer (issue 10, session 8)"). One warp per (row,
// 128-column block); each lane's 4 columns lie in one head (head_dim is 64, 128 or 256),
// whose chunk statistics it reads itself. The combine follows paged_attention.cu's
// combine_chunks_kernel operation for operation (max, then the sum of l * exp(m_c - m),
// then the accumulators in chunk order, one division), so the rounded attention output
// has the same bits, and the input side follows norm_hadamard_kernel without a norm.
// No atomics: the same order on every run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "exl3_convert.cuh"
#include "../../codec/exl3_hadamard.cuh"
#include "exl3_launch.cuh"
#include "exl3_ops.h"

namespace exl3 {
namespace {

constexpr int kWarps = 8;

// grid (blocks of 8 column blocks, rows).
template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    combine_hadamard_kernel(const float* __restrict__ part_acc,
                            const float* __restrict__ part_ml, int chunks,
                            const T* __restrict__ attended, int heads, int head_dim,
                            const float* __restrict__ pre, __half* __restrict__ out,
                            int width) {
  pdl_trigger();
  pdl_wait();
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int row = blockIdx.y;
  const int base = (blockIdx.x * kWarps + warp) * 128 + lane * 4;
  if (base >= width) return;  // whole warps: width is a multiple of 128
  const int cols = heads * head_dim;
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  if (base < cols) {  // all 4 columns of this lane (cols is a multiple of 4)
    if (chunks > 1) {
      const int h = base / head_dim, d = base % head_dim;
      const int64_t bh = (int64_t)row * heads + h;
      const float* ml = part_ml + bh * chunks * 2;
      float m = -CUDART_INF_F;
      for (int c = 0; c < chunks; ++c) m = fmaxf(m, ml[2 * c]);
      float l = 0.f;
      for (int c = 0; c < chunks; ++c)
        if (ml[2 * c + 1] > 0.f) l += ml[2 * c + 1] * __expf(ml[2 * c] - m);
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      for (int c = 0; c < chunks; ++c) {
        if (ml[2 * c + 1] > 0.f) {
          const float4 t =
              __ldg(reinterpret_cast<const float4*>(part_acc + (bh * chunks + c) * head_dim + d));
          acc[0] += t.x * __expf(ml[2 * c] - m);
          acc[1] += t.y * __expf(ml[2 * c] - m);
          acc[2] += t.z * __expf(ml[2 * c] - m);
          acc[3] += t.w * __expf(ml[2 * c] - m);
        }
      }
#pragma unroll
      for (int e = 0; e < 4; e++) v[e] = to_f32(from_f32<T>(l > 0.f ? acc[e] / l : 0.f));
    } else {
      const T* a = attended + (int64_t)row * cols + base;
#pragma unroll
      for (int e = 0; e < 4; e++) v[e] = to_f32(a[e]);
    }
#pragma unroll
    for (int e = 0; e < 4; e++) v[e] *= pre[base + e];
  }
  hadamard128_warp(v, lane);
  __half2* out2 = reinterpret_cast<__half2*>(out + (size_t)row * width + base);
  out2[0] = __floats2half2_rn(v[0] * kHadamardScale, v[1] * kHadamardScale);
  out2[1] = __floats2half2_rn(v[2] * kHadamardScale, v[3] * kHadamardScale);
}

template <typename T>
void run_combine(const float* part_acc, const float* part_ml, int chunks, const void* attended,
                 int heads, int head_dim, const float* pre, void* out, int rows, int width,
                 cudaStream_t stream) {
  const dim3 grid((unsigned)((width / 128 + kWarps - 1) / kWarps), (unsigned)rows);
  launch(combine_hadamard_kernel<T>, grid, dim3(kWarps * 32), 0, stream, part_acc, part_ml,
         chunks, static_cast<const T*>(attended), heads, head_dim, pre,
         static_cast<__half*>(out), width);
}

}  // namespace

bool launch_combine_hadamard(int dtype, const float* part_acc, const float* part_ml,
                             int chunks, const void* attended, int heads, int head_dim,
                             const float* pre, void* out, int rows, int width,
                             cudaStream_t stream) {
  if (width % 128 != 0 || heads < 1 || (head_dim != 64 && head_dim != 128 && head_dim != 256) ||
      heads * head_dim > width || chunks < 1 || rows < 0 || pre == nullptr || out == nullptr)
    return false;
  if (chunks > 1 ? (part_acc == nullptr || part_ml == nullptr) : attended == nullptr)
    return false;
  if (rows == 0) return true;
  switch (dtype) {
    case DT_HALF: run_combine<__half>(part_acc, part_ml, chunks, attended, heads, head_dim, pre, out, rows, width, stream); return true;
    case DT_BF16: run_combine<__nv_bfloat16>(part_acc, part_ml, chunks, attended, heads, head_dim, pre, out, rows, width, stream); return true;
    default: return false;
  }
}

}  // namespace exl3
