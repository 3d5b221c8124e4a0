// Per-head q/k RMSNorm then rotate-half rotary, in place, for the fused decode layer
// (exl3_ops.h launch_qk_norm_rope; Qwen3-style q/k norms): one launch instead of the
// PyTorch norm and rotary (~10 small kernels per layer). Rounds where
// engine/layers/norm.py (a 2-D weight: normalise in float32, round, scale, round) and
// ops/reference.py's apply_rotary (x * cos, rotated * sin, their sum, each rounded) do.
// One warp per (row, head); lane l holds columns l*V .. l*V+V-1 (V = head_dim / 32), so
// column d pairs with d +- head_dim/2 in lane l ^ 16.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "exl3_convert.cuh"
#include "exl3_launch.cuh"
#include "exl3_lora.cuh"
#include "exl3_ops.h"

namespace exl3 {
namespace {

constexpr int kWarps = 8;

template <typename T, int V>
__global__ void __launch_bounds__(kWarps * 32)
    qk_norm_rope_kernel(T* __restrict__ x, int64_t row_stride, int heads, int rows,
                        const float* __restrict__ weight, float eps,
                        const T* __restrict__ cos, const T* __restrict__ sin) {
  pdl_trigger();
  pdl_wait();
  constexpr int D = 32 * V;
  const int lane = threadIdx.x & 31;
  const int id = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int row = id / heads, head = id % heads;
  if (row >= rows) return;  // whole warps
  T* xr = x + row * row_stride + head * D + lane * V;
  const float* w = weight + head * D + lane * V;
  float v[V];
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < V; i++) {
    v[i] = to_f32(xr[i]);
    ss += v[i] * v[i];
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
  const float rs = rsqrtf(ss / (float)D + eps);
#pragma unroll
  for (int i = 0; i < V; i++) v[i] = round_to<T>(round_to<T>(v[i] * rs) * w[i]);
  if (cos != nullptr) {
    const T* cr = cos + (size_t)row * D + lane * V;
    const T* sr = sin + (size_t)row * D + lane * V;
    const bool low = lane < 16;  // columns below head_dim / 2
#pragma unroll
    for (int i = 0; i < V; i++) {
      const float p = __shfl_xor_sync(0xffffffffu, v[i], 16);
      const float rot = low ? -p : p;
      v[i] = round_to<T>(round_to<T>(v[i] * to_f32(cr[i])) + round_to<T>(rot * to_f32(sr[i])));
    }
  }
#pragma unroll
  for (int i = 0; i < V; i++) xr[i] = from_f32<T>(v[i]);
}

template <typename T>
bool run(void* x, int64_t row_stride, int heads, int head_dim, int rows, const float* weight,
         float eps, const void* cos, const void* sin, cudaStream_t stream) {
  const dim3 grid((unsigned)(((int64_t)rows * heads + kWarps - 1) / kWarps));
  T* xt = static_cast<T*>(x);
  const T* c = static_cast<const T*>(cos);
  const T* s = static_cast<const T*>(sin);
  switch (head_dim) {
    case 64: launch(qk_norm_rope_kernel<T, 2>, grid, dim3(kWarps * 32), 0, stream, xt, row_stride, heads, rows, weight, eps, c, s); return true;
    case 128: launch(qk_norm_rope_kernel<T, 4>, grid, dim3(kWarps * 32), 0, stream, xt, row_stride, heads, rows, weight, eps, c, s); return true;
    case 256: launch(qk_norm_rope_kernel<T, 8>, grid, dim3(kWarps * 32), 0, stream, xt, row_stride, heads, rows, weight, eps, c, s); return true;
    default: return false;
  }
}

}  // namespace

bool launch_qk_norm_rope(int dtype, void* x, int64_t row_stride, int heads, int head_dim,
                         int rows, const float* weight, float eps, const void* cos,
                         const void* sin, cudaStream_t stream) {
  if (rows < 0 || heads < 1 || weight == nullptr || (cos == nullptr) != (sin == nullptr))
    return false;
  if (rows == 0) return true;
  switch (dtype) {
    case DT_HALF: return run<__half>(x, row_stride, heads, head_dim, rows, weight, eps, cos, sin, stream);
    case DT_BF16: return run<__nv_bfloat16>(x, row_stride, heads, head_dim, rows, weight, eps, cos, sin, stream);
    case DT_FLOAT: return run<float>(x, row_stride, heads, head_dim, rows, weight, eps, cos, sin, stream);
    default: return false;
  }
}

}  // namespace exl3
