// moe_out's work at the end of the down projection's indexed GEMM (moe_gemm_impl.cuh,
// kCombine; exl3_ops.h MoeCombine): the warp that finishes a 128-column block of the
// output last (a counter per block) sums the splits of every (row, expert) pair of that
// block, takes H128, * svh[e] and the routing weight, sums each row's experts and writes
// the row (+ residual), rounding exactly as moe_out (moe_decode.cu) does. One launch
// instead of two at decode sizes (max_rows <= 8).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../../codec/exl3_hadamard.cuh"
#include "exl3_moe.cuh"
#include "exl3_ops.h"

namespace exl3 {

constexpr int kCombineBatch = 4;  // a row's experts whose loads are in flight together

__device__ __forceinline__ float round_dt(float v, int dtype) {
  if (dtype == DT_HALF) return __half2float(__float2half_rn(v));
  if (dtype == DT_BF16) return __bfloat162float(__float2bfloat16_rn(v));
  return v;
}

__device__ __forceinline__ float load_dt(const void* p, size_t i, int dtype) {
  if (dtype == DT_HALF) return __half2float(static_cast<const __half*>(p)[i]);
  if (dtype == DT_BF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

__device__ __forceinline__ void store_dt(void* p, size_t i, float v, int dtype) {
  if (dtype == DT_HALF)
    static_cast<__half*>(p)[i] = __float2half_rn(v);
  else if (dtype == DT_BF16)
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  else
    static_cast<float*>(p)[i] = v;
}

// Host-side check of a combine launch (the launcher refuses anything else).
inline bool moe_combine_ok(const MoeCombine& c, const MoeGemmParts& parts, int pairs,
                           int max_rows) {
  const int width = 16 * parts.part[0].nb;
  return parts.count == 1 && max_rows <= 8 && width % 128 == 0 && c.counters != nullptr &&
         c.post != nullptr && c.weights != nullptr && c.out != nullptr && c.top_k >= 1 &&
         c.rows >= 1 && c.rows <= max_rows && c.rows * c.top_k == pairs && c.out_cols >= 1 &&
         c.out_cols <= width && c.dtype >= DT_HALF && c.dtype <= DT_FLOAT;
}

// Called by every warp of the GEMM after its partial sums for 128-column block `block`
// are stored; `expected` warps write each block (active experts x splits x warps per
// block). Warp-uniform arguments; no block-wide barrier.
__device__ __forceinline__ void moe_combine_tail(const MoeCombine& c, const MoePlan& pv,
                                                 int expected, const float* partial,
                                                 int splits, int pairs, int width, int block,
                                                 int lane) {
  __threadfence();  // this lane's partial sums, before the count says they are there
  __syncwarp();
  int ticket = 0;
  if (lane == 0) ticket = atomicAdd(c.counters + block, 1);
  ticket = __shfl_sync(0xffffffffu, ticket, 0);
  if (ticket != expected - 1) return;
  if (lane == 0) c.counters[block] = 0;  // ready for the next launch
  __threadfence();
  const int base = block * 128 + lane * 4;
  const size_t slice = (size_t)pairs * width;
  const int dt = c.dtype;
  for (int row = 0; row < c.rows; row++) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int j0 = 0; j0 < c.top_k; j0 += kCombineBatch) {
      const int n = min(kCombineBatch, c.top_k - j0);
      int q[kCombineBatch];
      float w[kCombineBatch];
#pragma unroll
      for (int j = 0; j < kCombineBatch; j++)
        if (j < n) {
          const int p = row * c.top_k + j0 + j;
          q[j] = __ldg(pv.pair_slot + p);
          w[j] = round_dt(__ldg(c.weights + p), dt);
        }
      float4 y[kCombineBatch], sv[kCombineBatch];
#pragma unroll
      for (int j = 0; j < kCombineBatch; j++)
        if (j < n) {
          const size_t e = (size_t)__ldg(pv.slot_expert + q[j]) * width;
          sv[j] = __ldg(reinterpret_cast<const float4*>(c.post + e + base));
          y[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        }
      for (int sl = 0; sl < splits; sl++) {
#pragma unroll
        for (int j = 0; j < kCombineBatch; j++)
          if (j < n) {  // written by other blocks of this launch: read from L2
            const float4 t = __ldcg(reinterpret_cast<const float4*>(
                partial + sl * slice + (size_t)q[j] * width + base));
            y[j].x += t.x, y[j].y += t.y, y[j].z += t.z, y[j].w += t.w;
          }
      }
#pragma unroll
      for (int j = 0; j < kCombineBatch; j++)
        if (j < n) {
          float v[4] = {y[j].x, y[j].y, y[j].z, y[j].w};
          const float s4[4] = {sv[j].x, sv[j].y, sv[j].z, sv[j].w};
          hadamard128_warp(v, lane);
#pragma unroll
          for (int i = 0; i < 4; i++)
            acc[i] += round_dt(round_dt(v[i] * kHadamardScale * s4[i], dt) * w[j], dt);
        }
    }
    const size_t o = (size_t)row * c.out_stride + base;
    const size_t r = (size_t)row * c.res_stride + base;
#pragma unroll
    for (int i = 0; i < 4; i++)
      if (base + i < c.out_cols)
        store_dt(c.out, o + i,
                 c.residual != nullptr ? round_dt(acc[i], dt) + load_dt(c.residual, r + i, dt)
                                       : acc[i], dt);
  }
}

}  // namespace exl3
