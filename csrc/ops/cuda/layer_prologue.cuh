// The element math of a decode layer's input sides, shared by the stand-alone kernels
// (layer_fused.cu: norm_hadamard, glu_hadamard) and the GEMM that makes its own input
// (gemm_pro.cuh, EXL3_LAYER_FOLD=pro): one source, so both round and sum alike and the
// GEMM's x is bit for bit the float16 rows the stand-alone kernels write.
//   norm_block  RMSNorm (by a given 1/rms) + suh of 4 columns, before the Hadamard
//   glu_block   gate/up outputs (after their Hadamard) + act(gate) * up + suh
// The 1/rms itself: norm_sumsq_256 is the sum of squares in norm_hadamard_kernel's order
// (256 threads, each a strided serial sum, a butterfly per warp, a butterfly over the 8
// warp sums); norm_rs turns the 8 warp sums into 1/rms.
// Every svh / bias / suh term is __fmul_rn / __fadd_rn: a plain PTX mul.f32 / add.f32 may
// be fused into an FFMA by ptxas, case by case, and the GEMM that inlines this code
// (gemm_pro.cuh) got act(gate) * up * suh fused into the Hadamard's first add where
// glu_hadamard_kernel kept FMUL, FADD (run 40: every kProGlu case 1 bit off); the
// explicitly rounded forms are never fused, so both kernels round at the same places. The
// stand-alone kernels' SASS is unchanged by them (diffed).
#pragma once

#include "exl3_convert.cuh"
#include "exl3_lora.cuh"

// Split-K partial sums loaded per batch ahead of their adds (load_split_sum); an A/B knob
// (EXL3_NVCC_FLAGS=-DEXL3_SPLIT_BATCH=4), the sums' bits the same at every value. 8: run
// 48 (4 / 8 / 16: 243.4 / 245.5 / 244.5 tok/s, 8B one job; bench/NOTES-gpu.md).
#ifndef EXL3_SPLIT_BATCH
#define EXL3_SPLIT_BATCH 8
#endif

namespace exl3 {
namespace prologue {

constexpr int kSplitBatch = EXL3_SPLIT_BATCH;
static_assert(kSplitBatch >= 1 && kSplitBatch <= 32, "EXL3_SPLIT_BATCH: 1 to 32");

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// The serial sum of squares of virtual thread `t` (of 256): columns t, t + 256, ...
template <typename T>
__device__ __forceinline__ float sumsq_thread(const T* __restrict__ xr, int x_cols, int t) {
  float s = 0.0f;
  for (int c = t; c < x_cols; c += 256) {
    const float f = to_f32(xr[c]);
    s += f * f;
  }
  return s;
}

// sumsq_thread's sum with its loads issued kBatch at a time ahead of the adds (the same
// adds in the same order; past x_cols the added squares are +0, which leaves a sum of
// squares unchanged): for a GEMM block that sums whole rows before its own work.
template <typename T, int kBatch = 8>
__device__ __forceinline__ float sumsq_thread_batched(const T* __restrict__ xr, int x_cols,
                                                      int t) {
  float s = 0.0f;
  for (int c0 = t; c0 < x_cols; c0 += 256 * kBatch) {
    float f[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; k++) {
      const int c = c0 + 256 * k;
      f[k] = c < x_cols ? to_f32(xr[c]) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kBatch; k++) s += f[k] * f[k];
  }
  return s;
}

// 1/rms from the 8 warp sums `partial` (every lane of the calling warp gets it).
__device__ __forceinline__ float norm_rs(const float* partial, int lane, int x_cols, float eps) {
  const float s = warp_sum(lane < 8 ? partial[lane] : 0.0f);
  return rsqrtf(s / (float)x_cols + eps);
}

// v[e] = norm(x[base + e]) * pre[base + e] (0 past x_cols); rs is 1/rms, norm_w null:
// no norm. normed_row (or null) receives norm(x) in T.
template <typename T>
__device__ __forceinline__ void norm_block(const T* __restrict__ xr, int x_cols, int base,
                                           const float* __restrict__ norm_w, float rs,
                                           bool unit_offset, const float* __restrict__ pre,
                                           T* __restrict__ normed_row, float (&v)[4]) {
#pragma unroll
  for (int e = 0; e < 4; e++) {
    const int c = base + e;
    float f = 0.0f;
    if (c < x_cols) {
      f = to_f32(xr[c]);
      if (norm_w != nullptr)
        f = unit_offset ? round_to<T>(f * rs * norm_w[c])
                        : round_to<T>(round_to<T>(f * rs) * norm_w[c]);
      if (normed_row != nullptr) normed_row[c] = from_f32<T>(f);
      f = __fmul_rn(f, pre[c]);  // rounded: never fused into the Hadamard's first add
    }
    v[e] = f;
  }
}

// Sum of the splits of partial (splits, rows, width) at 4 columns from `col`.
__device__ __forceinline__ void load_split_sum(const float* __restrict__ partial, int splits,
                                               int rows, int width, int row, int col,
                                               float (&v)[4]) {
  const size_t slice = (size_t)rows * width;
  const float* p = partial + (size_t)row * width + col;
  float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
  // kSplitBatch loads in flight ahead of their adds (the adds in split order: the same
  // bits at every batch size).
#pragma unroll 1
  for (int s0 = 0; s0 < splits; s0 += kSplitBatch) {
    float4 t[kSplitBatch];
#pragma unroll
    for (int k = 0; k < kSplitBatch; k++)
      if (s0 + k < splits) t[k] = __ldg(reinterpret_cast<const float4*>(p + (s0 + k) * slice));
#pragma unroll
    for (int k = 0; k < kSplitBatch; k++) {
      if (s0 + k < splits) {
        s.x += t[k].x;
        s.y += t[k].y;
        s.z += t[k].z;
        s.w += t[k].w;
      }
    }
  }
  v[0] = s.x;
  v[1] = s.y;
  v[2] = s.z;
  v[3] = s.w;
}

// load_split_sum of two partials (gate and up) at once, their loads issued kBatch splits
// at a time ahead of the adds (each sum's adds in split order, as load_split_sum's).
template <int kBatch = 4>
__device__ __forceinline__ void load_split_sums2(const float* __restrict__ pa,
                                                 const float* __restrict__ pb, int splits,
                                                 int rows, int width, int row, int col,
                                                 float (&a)[4], float (&b)[4]) {
  const size_t slice = (size_t)rows * width, at = (size_t)row * width + col;
  float4 sa = make_float4(0.f, 0.f, 0.f, 0.f), sb = sa;
#pragma unroll 1
  for (int s0 = 0; s0 < splits; s0 += kBatch) {
    float4 ta[kBatch], tb[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; k++) {
      if (s0 + k < splits) {
        ta[k] = __ldg(reinterpret_cast<const float4*>(pa + at + (s0 + k) * slice));
        tb[k] = __ldg(reinterpret_cast<const float4*>(pb + at + (s0 + k) * slice));
      }
    }
#pragma unroll
    for (int k = 0; k < kBatch; k++) {
      if (s0 + k < splits) {
        sa.x += ta[k].x;
        sa.y += ta[k].y;
        sa.z += ta[k].z;
        sa.w += ta[k].w;
        sb.x += tb[k].x;
        sb.y += tb[k].y;
        sb.z += tb[k].z;
        sb.w += tb[k].w;
      }
    }
  }
  a[0] = sa.x;
  a[1] = sa.y;
  a[2] = sa.z;
  a[3] = sa.w;
  b[0] = sb.x;
  b[1] = sb.y;
  b[2] = sb.z;
  b[3] = sb.w;
}

__device__ __forceinline__ float activation(float g, int act) {
  if (act == 0) return g / (1.0f + expf(-g));
  const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  return 0.5f * g * (1.0f + tanhf(inner));
}

// g/u: the gate/up split sums after their Hadamard (unscaled) at 4 columns from base;
// v[e] = act(g) * u (as glu_hadamard_kernel rounds it, 0 past inter) times pre. adapted:
// d holds the LoRA deltas of gate (d[0]) and up (d[1]); product_row (or null) receives
// act(g) * u in T.
template <typename T>
__device__ __forceinline__ void glu_block(const float (&g)[4], const float (&u)[4], int base,
                                          const float* __restrict__ post_gate,
                                          const float* __restrict__ post_up,
                                          const float* __restrict__ bias_gate,
                                          const float* __restrict__ bias_up, int inter, int act,
                                          bool adapted, const float (&d)[2][4],
                                          T* __restrict__ product_row,
                                          const float* __restrict__ pre, float (&v)[4]) {
#pragma unroll
  for (int e = 0; e < 4; e++) {
    const int c = base + e;
    float a = 0.0f;
    if (c < inter) {
      float gv = __fmul_rn(g[e], kHadamardScale);
      float uv = __fmul_rn(u[e], kHadamardScale);
      if (post_gate != nullptr) gv = __fmul_rn(gv, post_gate[c]);
      if (post_up != nullptr) uv = __fmul_rn(uv, post_up[c]);
      if (bias_gate != nullptr) gv = __fadd_rn(gv, bias_gate[c]);
      if (bias_up != nullptr) uv = __fadd_rn(uv, bias_up[c]);
      gv = round_to<T>(gv);
      uv = round_to<T>(uv);
      if (adapted) {
        gv = round_to<T>(gv + d[0][e]);
        uv = round_to<T>(uv + d[1][e]);
      }
      a = round_to<T>(round_to<T>(activation(gv, act)) * uv);
      if (product_row != nullptr) product_row[c] = from_f32<T>(a);
    }
    v[e] = __fmul_rn(a, pre[c]);  // rounded: never fused into the Hadamard's first add
  }
}

}  // namespace prologue
}  // namespace exl3
