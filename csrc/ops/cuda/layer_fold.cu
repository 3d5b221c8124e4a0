// combine_hadamard (exl3_ops.h): the o projection's input side with the paged
// attention's chunk combine folded in, so a decode layer launches one kernel fewer
// (bench/NOTES-gpu.md "Launches per layer (issue 10, session 8)"). One warp per (row,
// 128-column block); each lane's 4 columns lie in one head (head_dim is 64, 128 or 256),
// whose chunk statistics it reads itself. The combine follows paged_attention.cu's
// combine_chunks_kernel operation for operation (max, then the sum of l * exp(m_c - m),
// then the accumulators in chunk order, one division), so the rounded attention output
// has the same bits, and the input side follows norm_hadamard_kernel without a norm.
// No float atomics: the same order on every run.
//
// out_norm (exl3_ops.h): the o projection's output side (split sum, H128, svh, bias,
// residual -> h) and the MLP's input side (RMSNorm of h, suh, H128 for gate and up) in
// one launch: the last block of each row (an integer ticket) runs the second half.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "exl3_convert.cuh"
#include "../../codec/exl3_hadamard.cuh"
#include "exl3_launch.cuh"
#include "layer_prologue.cuh"
#include "exl3_lora.cuh"
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

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

struct TailParts {
  const float* pre[kMaxParts];
  __half* out[kMaxParts];
};

constexpr int kTailBatch = 4;  // tasks of a warp whose pre values are loaded together

// The pre values of the kTailBatch tasks t0, t0 + 8, ... (task t: part t / in_blocks,
// column block t % in_blocks) at this lane's 4 columns; 0 past cols or past the tasks.
__device__ __forceinline__ void load_pre(const TailParts& tail, int in_blocks, int tasks,
                                         int t0, int lane, int cols,
                                         float (&pv)[kTailBatch][4]) {
#pragma unroll
  for (int j = 0; j < kTailBatch; j++) {
    const int t = t0 + j * kWarps;
    const int b = (t % in_blocks) * 128 + lane * 4;
#pragma unroll
    for (int e = 0; e < 4; e++)
      pv[j][e] = t < tasks && b + e < cols ? __ldg(tail.pre[t / in_blocks] + b + e) : 0.0f;
  }
}

// out_norm: grid (blocks of 8 of the row's 128-column blocks, rows). Each warp makes 128
// columns of h = residual + dtype(H128(split sum) * post + bias) as hadamard_out_kernel
// does; the row's last block to finish (an int ticket per row, set back to 0 by it) reads
// the whole row of h back and runs norm_hadamard_kernel's work for the next input (the
// same sums in the same order: the same bits). Dynamic shared memory: the row of h.
template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    out_norm_kernel(const float* __restrict__ partial, int splits, int width, int cols,
                    const float* __restrict__ post, const float* __restrict__ bias,
                    const T* __restrict__ residual, int64_t residual_stride, T* h,
                    int64_t h_stride, int rows, const float* __restrict__ norm_w, float eps,
                    bool unit_offset, const __grid_constant__ TailParts tail, int nparts,
                    int in_width, int* counters) {
  pdl_trigger();
  pdl_wait();
  extern __shared__ float hrow[];  // [cols] h, then [cols] the norm weight
  __shared__ float partial_sums[kWarps];
  __shared__ bool last;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int row = blockIdx.y;
  // The tail's constants on their way to L2 while the sums run (every block takes a share).
  const int lines = gridDim.x * kWarps * 32 * 32;  // 128-byte lines, one per thread a pass
  for (int i = (blockIdx.x * kWarps * 32 + threadIdx.x) * 32; i < cols; i += lines) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(norm_w + i));
    for (int p = 0; p < nparts; p++)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(tail.pre[p] + i));
  }
  const int base = (blockIdx.x * kWarps + warp) * 128 + lane * 4;
  if (base < width) {
    float v[4];
    prologue::load_split_sum(partial, splits, rows, width, row, base, v);
    hadamard128_warp(v, lane);
    T* hr = h + (size_t)row * h_stride;
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int c = base + e;
      float y = v[e] * kHadamardScale;
      if (post != nullptr) y *= post[c];
      if (bias != nullptr && c < cols) y += bias[c];
      y = round_to<T>(y);
      if (c < cols) hr[c] = from_f32<T>(to_f32(residual[(size_t)row * residual_stride + c]) + y);
    }
  }
  __threadfence();  // every thread's h stores visible on the device before the ticket
  __syncthreads();
  if (threadIdx.x == 0) {
    const int ticket = atomicAdd(counters + row, 1);
    last = ticket == (int)gridDim.x - 1;
    if (last) counters[row] = 0;  // ready for the next launch
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  // The tail is latency-bound: every load it needs is issued before what waits on it.
  // The pre values of this warp's first kTailBatch tasks, in flight during the norm pass.
  const int in_blocks = in_width / 128, tasks = nparts * in_blocks;
  float pv[kTailBatch][4];
  load_pre(tail, in_blocks, tasks, warp, lane, cols, pv);
  // norm_hadamard_kernel's sum of squares, thread for thread (same order: same bits);
  // h and the norm weight kept in shared memory.
  float* wrow = hrow + cols;
  const T* hr = h + (size_t)row * h_stride;
  float s = 0.0f;
#pragma unroll 4
  for (int c = threadIdx.x; c < cols; c += kWarps * 32) {
    const float f = to_f32(__ldcg(hr + c));
    wrow[c] = __ldg(norm_w + c);
    hrow[c] = f;
    s += f * f;
  }
  s = warp_sum(s);
  if (lane == 0) partial_sums[warp] = s;
  __syncthreads();
  s = warp_sum(lane < kWarps ? partial_sums[lane] : 0.0f);
  const float rs = rsqrtf(s / (float)cols + eps);
  for (int t0 = warp; t0 < tasks; t0 += kWarps * kTailBatch) {
    if (t0 != warp) load_pre(tail, in_blocks, tasks, t0, lane, cols, pv);
#pragma unroll
    for (int j = 0; j < kTailBatch; j++) {
      const int t = t0 + j * kWarps;
      if (t >= tasks) break;
      const int p = t / in_blocks;
      const int b = (t % in_blocks) * 128 + lane * 4;
      float x[4];
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int c = b + e;
        float f = 0.0f;
        if (c < cols) {
          f = unit_offset ? round_to<T>(hrow[c] * rs * wrow[c])
                          : round_to<T>(round_to<T>(hrow[c] * rs) * wrow[c]);
          f *= pv[j][e];
        }
        x[e] = f;
      }
      hadamard128_warp(x, lane);
      __half2* out2 = reinterpret_cast<__half2*>(tail.out[p] + (size_t)row * in_width + b);
      out2[0] = __floats2half2_rn(x[0] * kHadamardScale, x[1] * kHadamardScale);
      out2[1] = __floats2half2_rn(x[2] * kHadamardScale, x[3] * kHadamardScale);
    }
  }
}

template <typename T>
void run_out_norm(const float* partial, int splits, int width, int cols, const float* post,
                  const float* bias, const void* residual, int64_t residual_stride, void* h,
                  int64_t h_stride, int rows, const float* norm_w, float eps, bool unit_offset,
                  const TailParts& tail, int nparts, int in_width, int* counters,
                  cudaStream_t stream) {
  const dim3 grid((unsigned)((width / 128 + kWarps - 1) / kWarps), (unsigned)rows);
  const size_t smem = 2 * (size_t)cols * sizeof(float);  // h and the norm weight
  if (smem > 48 * 1024)
    cudaFuncSetAttribute(out_norm_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         (int)smem);
  launch(out_norm_kernel<T>, grid, dim3(kWarps * 32), smem, stream,
         partial, splits, width, cols, post, bias, static_cast<const T*>(residual),
         residual_stride, static_cast<T*>(h), h_stride, rows, norm_w, eps, unit_offset, tail,
         nparts, in_width, counters);
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

bool launch_out_norm(int dtype, const float* partial, int splits, int width, int cols,
                     const float* post, const float* bias, const void* residual,
                     int64_t residual_stride, void* h, int64_t h_stride, int rows,
                     const float* norm_w, float eps, bool unit_offset, int nparts,
                     const float* const* pre, void* const* out, int in_width, int* counters,
                     cudaStream_t stream) {
  if (width % 128 != 0 || in_width % 128 != 0 || cols > width || cols > in_width ||
      cols > kOutNormMaxCols || splits < 1 || nparts < 1 ||
      nparts > kMaxParts || rows < 0 || rows > kOutNormMaxRows || norm_w == nullptr ||
      residual == nullptr || h == nullptr || counters == nullptr)
    return false;
  TailParts tail{};
  for (int p = 0; p < nparts; p++) {
    if (pre[p] == nullptr || out[p] == nullptr) return false;
    tail.pre[p] = pre[p];
    tail.out[p] = static_cast<__half*>(out[p]);
  }
  if (rows == 0) return true;
  switch (dtype) {
    case DT_HALF: run_out_norm<__half>(partial, splits, width, cols, post, bias, residual, residual_stride, h, h_stride, rows, norm_w, eps, unit_offset, tail, nparts, in_width, counters, stream); return true;
    case DT_BF16: run_out_norm<__nv_bfloat16>(partial, splits, width, cols, post, bias, residual, residual_stride, h, h_stride, rows, norm_w, eps, unit_offset, tail, nparts, in_width, counters, stream); return true;
    case DT_FLOAT: run_out_norm<float>(partial, splits, width, cols, post, bias, residual, residual_stride, h, h_stride, rows, norm_w, eps, unit_offset, tail, nparts, in_width, counters, stream); return true;
    default: return false;
  }
}

}  // namespace exl3
