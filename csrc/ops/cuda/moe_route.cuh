// The routing pieces shared by the mixture-of-experts decode kernels (moe_decode.cu,
// moe_norm_route.cu): a block-wide scan, the plan from the pairs' expert ids, and the
// router's softmax top-k of one row by one warp.
#pragma once

#include <cuda_runtime.h>

#include "exl3_moe.cuh"

namespace exl3 {
namespace moe {

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// Inclusive sum over the block (blockDim.x == kThreads, a multiple of 32 up to 1024);
// `scratch` >= 32 ints.
template <int kThreads>
__device__ int block_inclusive_scan(int v, int* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const int t = __shfl_up_sync(0xffffffffu, v, m);
    if (lane >= m) v += t;
  }
  if (lane == 31) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int w = lane < kThreads / 32 ? scratch[lane] : 0;
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {
      const int t = __shfl_up_sync(0xffffffffu, w, m);
      if (lane >= m) w += t;
    }
    scratch[lane] = w;
  }
  __syncthreads();
  return warp > 0 ? v + scratch[warp - 1] : v;
}

// The plan from the pairs' expert ids (ids[p] in shared memory, counts[e] of them
// counted; experts <= kThreads): a packed scan gives expert e = threadIdx.x its first
// slot (low 16 bits) and its index among the active experts (high 16 bits); pairs <=
// 65535. Then each pair takes the next slot of its expert (a shared cursor). Every
// thread of the block calls it.
template <int kThreads>
__device__ void place_pairs(int* counts, int* cursor, const int* ids, int pairs, int experts,
                            const MoePlan& pv, int* scratch) {
  const int e = threadIdx.x;
  const int c = e < experts ? counts[e] : 0;
  const int v = c | ((c > 0 ? 1 : 0) << 16);
  const int incl = block_inclusive_scan<kThreads>(v, scratch);
  const int excl = incl - v;
  if (e < experts) {
    cursor[e] = excl & 0xffff;
    if (c > 0) {
      const int a = excl >> 16;
      pv.act_expert[a] = e;
      pv.act_offset[a] = excl & 0xffff;
      pv.act_rows[a] = c;
    }
  }
  if (threadIdx.x == kThreads - 1) pv.active[0] = incl >> 16;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += kThreads) {
    const int id = ids[p];
    const int q = atomicAdd(&cursor[id], 1);
    pv.slot_pair[q] = p;
    pv.pair_slot[p] = q;
    pv.slot_expert[q] = id;
  }
}

constexpr int kRouterMax = 256;
constexpr int kRouterPerLane = kRouterMax / 32;

// One warp: the softmax of row `row`'s logits (load(e) -> float32, experts <=
// kRouterMax), its top_k largest (ties: the lower expert), w = p / sum of the chosen
// (normalize) times scale -> weights/chosen (row * top_k + j), ids[] and counts[] (shared).
template <typename Load>
__device__ void route_row(Load load, int row, int top_k, int experts, bool normalize,
                          float scale, float* __restrict__ weights,
                          int64_t* __restrict__ chosen, int* ids, int* counts) {
  const int lane = threadIdx.x & 31;
  float p[kRouterPerLane];
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < kRouterPerLane; j++) {
    const int e = lane + 32 * j;
    p[j] = e < experts ? load(e) : -INFINITY;
    m = fmaxf(m, p[j]);
  }
  m = warp_max(m);
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < kRouterPerLane; j++) {
    p[j] = lane + 32 * j < experts ? expf(p[j] - m) : 0.0f;
    s += p[j];
  }
  s = warp_sum(s);
#pragma unroll
  for (int j = 0; j < kRouterPerLane; j++)
    p[j] = lane + 32 * j < experts ? p[j] / s : -1.0f;  // -1: not an expert, or taken
  float mine_w = 0.0f;
  int mine_e = 0;
  for (int t = 0; t < top_k; t++) {
    float best = -1.0f;
    int bi = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < kRouterPerLane; j++)
      if (p[j] > best) {  // ascending j: the lowest expert of this lane wins ties
        best = p[j];
        bi = lane + 32 * j;
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ob > best || (ob == best && oi < bi)) {
        best = ob;
        bi = oi;
      }
    }
    if ((bi & 31) == lane) {
#pragma unroll
      for (int j = 0; j < kRouterPerLane; j++)
        if (lane + 32 * j == bi) p[j] = -1.0f;
    }
    if (lane == t) {
      mine_w = best;
      mine_e = bi;
    }
  }
  const float total = warp_sum(lane < top_k ? mine_w : 0.0f);
  if (lane < top_k) {
    const int pair = row * top_k + lane;
    weights[pair] = (normalize ? mine_w / total : mine_w) * scale;
    chosen[pair] = mine_e;
    ids[pair] = mine_e;
    atomicAdd(&counts[mine_e], 1);
  }
}

}  // namespace moe
}  // namespace exl3
