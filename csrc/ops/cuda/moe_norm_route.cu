// RMSNorm + the router's linear + softmax top-k + the routing plan of the
// mixture-of-experts decode in one launch (exl3_ops.h launch_moe_norm_route): before it,
// a decode layer ran the norm in PyTorch (4-7 kernels), the router as a cuBLAS GEMV and
// the routing kernel, each a few microseconds of launch latency at one row.
//
// grid (expert groups, rows), kThreads threads. Every block normalises its row itself
// (the row is a few KB; blocks of expert group 0 also write it for moe_in) into shared
// memory, then one warp per expert of its group takes the dot product with the router's
// row and writes the logit, rounded to the activation dtype as F.linear's output is. The
// block that finishes last (a counter in global memory, reset by that block for the next
// launch: no zero-fill per step) reads every logit back and routes them with the same
// code as moe_route_logits (moe_route.cuh): each row's softmax top-k by one warp, then
// the plan.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "exl3_convert.cuh"
#include "exl3_launch.cuh"
#include "exl3_lora.cuh"  // round_to
#include "exl3_moe.cuh"
#include "exl3_ops.h"
#include "moe_route.cuh"

namespace exl3 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBlocksPerLaunch = 256;  // expert groups x rows, about

// 8 consecutive values of a dtype row as float32 (16-byte aligned for 2-byte types).
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[8]);
template <>
__device__ __forceinline__ void load8<__half>(const __half* p, float (&v)[8]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const float2 f = __half22float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
template <>
__device__ __forceinline__ void load8<__nv_bfloat16>(const __nv_bfloat16* p, float (&v)[8]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const float2 f = __bfloat1622float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
template <>
__device__ __forceinline__ void load8<float>(const float* p, float (&v)[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p + 4));
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
  v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// Dynamic shared memory: max(hidden floats, 2 * experts + pairs ints).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    moe_norm_route_kernel(const T* __restrict__ x, int64_t row_stride, int hidden,
                          const float* __restrict__ norm_w, float eps, bool unit_offset,
                          const T* __restrict__ router_w, int experts, int per_block,
                          int top_k, bool normalize, float scale, T* __restrict__ normed,
                          float* logits, float* __restrict__ weights,
                          int64_t* __restrict__ chosen, int* plan, int* counter) {
  pdl_trigger();
  pdl_wait();
  extern __shared__ __align__(16) float xs[];  // the normed row; later the routing's ints
  __shared__ float partial[kWarps];
  __shared__ int scratch[32];
  __shared__ bool last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row = blockIdx.y, rows = gridDim.y;
  const T* xr = x + row * row_stride;
  float s = 0.0f;
  for (int c = threadIdx.x; c < hidden; c += kThreads) {
    const float f = to_f32(xr[c]);
    s += f * f;
  }
  s = moe::warp_sum(s);
  if (lane == 0) partial[warp] = s;
  __syncthreads();
  s = moe::warp_sum(lane < kWarps ? partial[lane] : 0.0f);
  const float rs = rsqrtf(s / (float)hidden + eps);
  T* nr = blockIdx.x == 0 ? normed + (size_t)row * hidden : nullptr;
  for (int c = threadIdx.x; c < hidden; c += kThreads) {
    const float f = to_f32(xr[c]);
    const float v = unit_offset ? round_to<T>(f * rs * norm_w[c])
                                : round_to<T>(round_to<T>(f * rs) * norm_w[c]);
    xs[c] = v;
    if (nr != nullptr) nr[c] = from_f32<T>(v);
  }
  __syncthreads();
  // The group's router rows: one warp per expert when there are kWarps or more, else
  // `slices` warps per expert, each over every slices-th run of 256 columns.
  const int e0 = blockIdx.x * per_block;
  const int local = min(experts - e0, per_block);
  const int slices = local >= kWarps ? 1 : kWarps / local;
  const int units = hidden / 8;  // 8 columns (16 bytes of a 2-byte router) per lane load
  for (int j = warp / slices; j < local; j += kWarps / slices) {
    const T* wr = router_w + (size_t)(e0 + j) * hidden;
    float acc = 0.0f;
#pragma unroll 4
    for (int u = (warp % slices) * 32 + lane; u < units; u += 32 * slices) {
      float w[8];
      load8(wr + 8 * u, w);
      const float4 a = *reinterpret_cast<const float4*>(xs + 8 * u);
      const float4 b = *reinterpret_cast<const float4*>(xs + 8 * u + 4);
      acc += a.x * w[0] + a.y * w[1] + a.z * w[2] + a.w * w[3];
      acc += b.x * w[4] + b.y * w[5] + b.z * w[6] + b.w * w[7];
    }
    acc = moe::warp_sum(acc);
    if (slices == 1) {
      if (lane == 0) logits[(size_t)row * experts + e0 + j] = round_to<T>(acc);
    } else if (lane == 0) {
      partial[warp] = acc;
    }
  }
  if (slices > 1) {
    __syncthreads();
    if (threadIdx.x < local) {
      float sum = 0.0f;
      for (int i = 0; i < slices; i++) sum += partial[threadIdx.x * slices + i];
      logits[(size_t)row * experts + e0 + threadIdx.x] = round_to<T>(sum);
    }
  }
  // The last block to finish routes every row.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int done = atomicAdd(counter, 1);
    last = done == (int)(gridDim.x * gridDim.y) - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x == 0) *counter = 0;  // ready for the next launch
  const int pairs = rows * top_k;
  int* sm = reinterpret_cast<int*>(xs);
  int* counts = sm;
  int* cursor = sm + experts;
  int* ids = cursor + experts;
  const MoePlan pv = moe_plan(plan, pairs, min(experts, pairs));
  for (int e = threadIdx.x; e < experts; e += kThreads) counts[e] = 0;
  __syncthreads();
  for (int r = warp; r < rows; r += kWarps) {
    const float* lr = logits + (size_t)r * experts;
    moe::route_row([&](int e) { return __ldcg(lr + e); }, r, top_k, experts, normalize,
                   scale, weights, chosen, ids, counts);
  }
  __syncthreads();
  moe::place_pairs<kThreads>(counts, cursor, ids, pairs, experts, pv, scratch);
}

template <typename T>
void run_norm_route(const void* x, int64_t row_stride, int rows, int hidden,
                    const float* norm_w, float eps, bool unit_offset, const void* router_w,
                    int experts, int top_k, bool normalize, float scale, void* normed,
                    float* logits, float* weights, int64_t* chosen, int* plan, int* counter,
                    size_t smem, cudaStream_t stream) {
  const int groups = max(1, min(experts, kBlocksPerLaunch / rows));
  const int per_block = (experts + groups - 1) / groups;
  const int grid_x = (experts + per_block - 1) / per_block;
  launch(moe_norm_route_kernel<T>, dim3(grid_x, rows), dim3(kThreads), smem, stream,
         static_cast<const T*>(x), row_stride, hidden, norm_w, eps, unit_offset,
         static_cast<const T*>(router_w), experts, per_block, top_k, normalize, scale,
         static_cast<T*>(normed), logits, weights, chosen, plan, counter);
}

}  // namespace

bool launch_moe_norm_route(int dtype, const void* x, int64_t row_stride, int rows,
                           int hidden, const float* norm_w, float eps, bool unit_offset,
                           const void* router_w, int experts, int top_k, bool normalize,
                           float scale, void* normed, float* logits, float* weights,
                           int64_t* chosen, int* plan, int* counter, cudaStream_t stream) {
  const int pairs = rows * top_k;
  if (rows < 1 || rows > 64 || hidden < 8 || hidden % 8 != 0 || top_k < 1 || top_k > 32 ||
      top_k > experts || experts > moe::kRouterMax || norm_w == nullptr ||
      counter == nullptr)
    return false;
  const size_t smem = max((size_t)hidden * sizeof(float), (size_t)(2 * experts + pairs) * 4);
  if (smem > 48 * 1024) return false;
#define EXL3_NORM_ROUTE(T) run_norm_route<T>(x, row_stride, rows, hidden, norm_w, eps, unit_offset, router_w, experts, top_k, normalize, scale, normed, logits, weights, chosen, plan, counter, smem, stream)
  switch (dtype) {
    case DT_HALF: EXL3_NORM_ROUTE(__half); return true;
    case DT_BF16: EXL3_NORM_ROUTE(__nv_bfloat16); return true;
    case DT_FLOAT: EXL3_NORM_ROUTE(float); return true;
    default: return false;
  }
#undef EXL3_NORM_ROUTE
}

}  // namespace exl3
