// 128-point block Hadamard with fused scales, bias and split-sum (EXL3-FORMAT.md 4).
// One warp per (row, 128-column block): the butterfly of exl3_hadamard.cuh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "exl3_convert.cuh"
#include "../../codec/exl3_hadamard.cuh"
#include "exl3_launch.cuh"
#include "exl3_ops.h"

namespace exl3 {
namespace {


constexpr int kWarps = 8;

template <typename Tin, typename Tout>
__global__ void __launch_bounds__(kWarps * 32)
    hadamard_kernel(const Tin* __restrict__ x, int64_t slice_stride, int64_t row_stride,
                    int nslices, int x_cols, int width, const float* __restrict__ pre,
                    const float* __restrict__ post, const float* __restrict__ bias,
                    Tout* __restrict__ out, int64_t out_row_stride, int out_cols, int rows) {
  pdl_trigger();
  pdl_wait();
  const int lane = threadIdx.x & 31;
  const int blocks_per_row = width / 128;
  const int64_t id = (int64_t)blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int row = (int)(id / blocks_per_row);
  if (row >= rows) return;
  const int base = (int)(id % blocks_per_row) * 128 + lane * 4;
  float v[4];
#pragma unroll
  for (int e = 0; e < 4; e++) {
    const int c = base + e;
    float s = 0.0f;
    if (c < x_cols) {
      const Tin* p = x + row * row_stride + c;
      for (int sl = 0; sl < nslices; sl++) s += to_f32(p[sl * slice_stride]);
      if (pre) s *= pre[c];
    }
    v[e] = s;
  }
  hadamard128_warp(v, lane);
  const float scale = kHadamardScale;
#pragma unroll
  for (int e = 0; e < 4; e++) {
    const int c = base + e;
    if (c >= out_cols) continue;
    float r = v[e] * scale;
    if (post) r *= post[c];
    if (bias) r += bias[c];
    out[row * out_row_stride + c] = from_f32<Tout>(r);
  }
}

template <typename Tin, typename Tout>
void run(const void* x, int64_t slice_stride, int64_t row_stride, int nslices, int x_cols,
         int width, const float* pre, const float* post, const float* bias, void* out,
         int64_t out_row_stride, int out_cols, int rows, cudaStream_t stream) {
  const int64_t warps = (int64_t)rows * (width / 128);
  const int64_t blocks = (warps + kWarps - 1) / kWarps;
  launch(hadamard_kernel<Tin, Tout>, dim3((unsigned)blocks), dim3(kWarps * 32), 0, stream,
         static_cast<const Tin*>(x), slice_stride, row_stride, nslices, x_cols, width, pre, post,
         bias, static_cast<Tout*>(out), out_row_stride, out_cols, rows);
}

template <typename Tin>
bool run_out(int out_dtype, const void* x, int64_t ss, int64_t rs, int ns, int xc, int w,
             const float* pre, const float* post, const float* bias, void* out, int64_t ors,
             int oc, int rows, cudaStream_t st) {
  switch (out_dtype) {
    case DT_HALF: run<Tin, __half>(x, ss, rs, ns, xc, w, pre, post, bias, out, ors, oc, rows, st); return true;
    case DT_BF16: run<Tin, __nv_bfloat16>(x, ss, rs, ns, xc, w, pre, post, bias, out, ors, oc, rows, st); return true;
    case DT_FLOAT: run<Tin, float>(x, ss, rs, ns, xc, w, pre, post, bias, out, ors, oc, rows, st); return true;
    default: return false;
  }
}

}  // namespace

bool launch_hadamard(int in_dtype, int out_dtype, const void* x, int64_t slice_stride,
                     int64_t row_stride, int nslices, int x_cols, int width, const float* pre,
                     const float* post, const float* bias, void* out, int64_t out_row_stride,
                     int out_cols, int rows, cudaStream_t stream) {
  if (width % 128 != 0 || rows < 0) return false;
  if (rows == 0 || width == 0) return true;
  switch (in_dtype) {
    case DT_HALF: return run_out<__half>(out_dtype, x, slice_stride, row_stride, nslices, x_cols, width, pre, post, bias, out, out_row_stride, out_cols, rows, stream);
    case DT_BF16: return run_out<__nv_bfloat16>(out_dtype, x, slice_stride, row_stride, nslices, x_cols, width, pre, post, bias, out, out_row_stride, out_cols, rows, stream);
    case DT_FLOAT: return run_out<float>(out_dtype, x, slice_stride, row_stride, nslices, x_cols, width, pre, post, bias, out, out_row_stride, out_cols, rows, stream);
    default: return false;
  }
}

}  // namespace exl3
