// Mixture-of-experts decode without host synchronisation (exl3_ops.h, "Mixture-of-experts
// decode"): the kernels around the indexed expert GEMM (moe_gemm_impl.cuh).
//   moe_route  top-k ids -> the plan: pairs sorted by expert, the active experts
//   moe_in     x * suh[e] + input Hadamard, per (slot, gate|up)
//   moe_glu    split sums + output Hadamard + svh[e] (gate, up), act(g) * u, the down
//              projection's suh[e] + input Hadamard
//   moe_out    split sums + output Hadamard + svh[e] of down, times the routing weights,
//              summed over each row's experts
// Every value the PyTorch path (engine/layers/moe.py with EXL3 experts) rounds to the
// activation dtype is rounded here at the same place; the weighted sum is the one
// exception (float32, one rounding: moe_decode.py's StackedExperts sums the same way).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../../codec/exl3_hadamard.cuh"
#include "exl3_convert.cuh"
#include "exl3_launch.cuh"
#include "exl3_lora.cuh"
#include "exl3_moe.cuh"
#include "exl3_ops.h"
#include "moe_route.cuh"

namespace exl3 {
namespace {

constexpr int kWarps = 8;
constexpr int kRouteThreads = 1024;
constexpr int kOutBatch = 4;  // moe_out: a row's experts whose loads are in flight together
                              // (8: 128-140 registers and a spill; 4: 72, none)

// One block of kRouteThreads threads; shared: counts[experts], cursor[experts], ids[pairs].
__global__ void __launch_bounds__(kRouteThreads)
    moe_route_kernel(const int64_t* __restrict__ chosen, int pairs, int experts, int* plan) {
  pdl_trigger();
  pdl_wait();
  extern __shared__ int sm[];
  __shared__ int scratch[32];
  int* counts = sm;
  int* cursor = sm + experts;
  int* ids = cursor + experts;
  const MoePlan pv = moe_plan(plan, pairs, min(experts, pairs));
  for (int e = threadIdx.x; e < experts; e += kRouteThreads) counts[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < pairs; p += kRouteThreads) {
    const int64_t e = chosen[p];
    const int id = e < 0 ? 0 : (e >= experts ? experts - 1 : (int)e);
    ids[p] = id;
    atomicAdd(&counts[id], 1);
  }
  __syncthreads();
  moe::place_pairs<kRouteThreads>(counts, cursor, ids, pairs, experts, pv, scratch);
}

// The router's softmax, top-k and renormalisation (engine/layers/moe.py Router, scoring
// "softmax" without score bias or groups) fused with the routing: one warp per row reads
// its logits (experts <= kRouterMax), moe::route_row, then the plan as moe_route.
using moe::kRouterMax;

template <typename T>
__global__ void __launch_bounds__(kRouteThreads)
    moe_route_logits_kernel(const T* __restrict__ logits, int64_t logit_stride, int rows,
                            int top_k, int experts, bool normalize, float scale,
                            float* __restrict__ weights, int64_t* __restrict__ chosen,
                            int* plan) {
  pdl_trigger();
  pdl_wait();
  extern __shared__ int sm[];
  __shared__ int scratch[32];
  const int pairs = rows * top_k;
  int* counts = sm;
  int* cursor = sm + experts;
  int* ids = cursor + experts;
  const MoePlan pv = moe_plan(plan, pairs, min(experts, pairs));
  for (int e = threadIdx.x; e < experts; e += kRouteThreads) counts[e] = 0;
  __syncthreads();
  const int warp = threadIdx.x >> 5;
  for (int row = warp; row < rows; row += kRouteThreads / 32) {
    const T* lr = logits + row * logit_stride;
    moe::route_row([&](int e) { return to_f32(lr[e]); }, row, top_k, experts, normalize,
                   scale, weights, chosen, ids, counts);
  }
  __syncthreads();
  moe::place_pairs<kRouteThreads>(counts, cursor, ids, pairs, experts, pv, scratch);
}

struct MoeIn {
  const float* pre[kMoeMaxParts];
  __half* out[kMoeMaxParts];
};

// grid (blocks of 8 column blocks, parts, slots).
template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    moe_in_kernel(const T* __restrict__ x, int64_t row_stride, int x_cols, int width,
                  int top_k, const int* __restrict__ plan, int pairs,
                  const __grid_constant__ MoeIn parts) {
  pdl_trigger();
  pdl_wait();
  const int lane = threadIdx.x & 31;
  const int base = (blockIdx.x * kWarps + (threadIdx.x >> 5)) * 128 + lane * 4;
  if (base >= width) return;  // whole warps: width is a multiple of 128
  const int q = blockIdx.z;
  const MoePlan pv = moe_plan(const_cast<int*>(plan), pairs, 0);
  const int row = pv.slot_pair[q] / top_k;
  const int e = pv.slot_expert[q];
  const float* pre = parts.pre[blockIdx.y] + (size_t)e * width;
  const T* xr = x + row * row_stride;
  float v[4];
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const int c = base + i;
    v[i] = c < x_cols ? to_f32(xr[c]) * pre[c] : 0.0f;
  }
  hadamard128_warp(v, lane);
  __half2* out2 = reinterpret_cast<__half2*>(parts.out[blockIdx.y] + (size_t)q * width + base);
  out2[0] = __floats2half2_rn(v[0] * kHadamardScale, v[1] * kHadamardScale);
  out2[1] = __floats2half2_rn(v[2] * kHadamardScale, v[3] * kHadamardScale);
}

__device__ __forceinline__ float activation(float g, int act) {
  if (act == 0) return g / (1.0f + expf(-g));
  const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  return 0.5f * g * (1.0f + tanhf(inner));
}

// grid (warps over slots x column blocks / 8).
template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    moe_glu_kernel(const float* __restrict__ gate, const float* __restrict__ up, int splits,
                   int width, int inter, const float* __restrict__ post_gate,
                   const float* __restrict__ post_up, int act, const float* __restrict__ pre,
                   const int* __restrict__ plan, int pairs, __half* __restrict__ out) {
  pdl_trigger();
  pdl_wait();
  const int lane = threadIdx.x & 31;
  const int blocks_per_row = width / 128;
  const int id = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int q = id / blocks_per_row;
  if (q >= pairs) return;
  const int base = (id % blocks_per_row) * 128 + lane * 4;
  const MoePlan pv = moe_plan(const_cast<int*>(plan), pairs, 0);
  const size_t e = (size_t)pv.slot_expert[q] * width;
  // gate's and up's split sums in one loop (their loads in flight together), in the
  // order moe_out sums splits (ascending).
  const size_t slice = (size_t)pairs * width, at = (size_t)q * width + base;
  float4 gs = make_float4(0.f, 0.f, 0.f, 0.f), us = gs;
#pragma unroll 4
  for (int sl = 0; sl < splits; sl++) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(gate + sl * slice + at));
    const float4 b = __ldg(reinterpret_cast<const float4*>(up + sl * slice + at));
    gs.x += a.x, gs.y += a.y, gs.z += a.z, gs.w += a.w;
    us.x += b.x, us.y += b.y, us.z += b.z, us.w += b.w;
  }
  float g[4] = {gs.x, gs.y, gs.z, gs.w}, u[4] = {us.x, us.y, us.z, us.w}, v[4];
  hadamard128_warp(g, lane);
  hadamard128_warp(u, lane);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    const int c = base + i;
    const float gv = round_to<T>(g[i] * kHadamardScale * post_gate[e + c]);
    const float uv = round_to<T>(u[i] * kHadamardScale * post_up[e + c]);
    v[i] = c < inter ? round_to<T>(round_to<T>(activation(gv, act)) * uv) * pre[e + c] : 0.0f;
  }
  hadamard128_warp(v, lane);
  __half2* out2 = reinterpret_cast<__half2*>(out + (size_t)q * width + base);
  out2[0] = __floats2half2_rn(v[0] * kHadamardScale, v[1] * kHadamardScale);
  out2[1] = __floats2half2_rn(v[2] * kHadamardScale, v[3] * kHadamardScale);
}

// grid (warps over rows x column blocks / 8).
template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    moe_out_kernel(const float* __restrict__ partial, int splits, int width,
                   const float* __restrict__ post, const float* __restrict__ weights,
                   int top_k, const int* __restrict__ plan, int pairs, int rows,
                   T* __restrict__ out, int64_t out_row_stride, int out_cols,
                   const T* __restrict__ residual, int64_t res_row_stride) {
  pdl_trigger();
  pdl_wait();
  const int lane = threadIdx.x & 31;
  const int blocks_per_row = width / 128;
  const int id = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int row = id / blocks_per_row;
  if (row >= rows) return;
  const int base = (id % blocks_per_row) * 128 + lane * 4;
  const MoePlan pv = moe_plan(const_cast<int*>(plan), pairs, 0);
  const size_t slice = (size_t)pairs * width;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  // A row's experts kOutBatch at a time, their plan, partial and svh loads in flight
  // together (one after the other they were ~3 dependent L2 round trips per expert);
  // sums over splits ascending, then over the row's experts ascending.
  for (int j0 = 0; j0 < top_k; j0 += kOutBatch) {
    const int n = min(kOutBatch, top_k - j0);  // warp-uniform
    int q[kOutBatch];
    float w[kOutBatch];
#pragma unroll
    for (int j = 0; j < kOutBatch; j++)
      if (j < n) {
        const int p = row * top_k + j0 + j;
        q[j] = pv.pair_slot[p];
        w[j] = round_to<T>(weights[p]);
      }
    float4 y[kOutBatch], sv[kOutBatch];
#pragma unroll
    for (int j = 0; j < kOutBatch; j++)
      if (j < n) {
        const size_t e = (size_t)pv.slot_expert[q[j]] * width;
        sv[j] = __ldg(reinterpret_cast<const float4*>(post + e + base));
        y[j] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    for (int sl = 0; sl < splits; sl++) {
#pragma unroll
      for (int j = 0; j < kOutBatch; j++)
        if (j < n) {
          const float4 t = __ldg(
              reinterpret_cast<const float4*>(partial + sl * slice + (size_t)q[j] * width + base));
          y[j].x += t.x, y[j].y += t.y, y[j].z += t.z, y[j].w += t.w;
        }
    }
#pragma unroll
    for (int j = 0; j < kOutBatch; j++)
      if (j < n) {
        float v[4] = {y[j].x, y[j].y, y[j].z, y[j].w};
        const float pv4[4] = {sv[j].x, sv[j].y, sv[j].z, sv[j].w};
        hadamard128_warp(v, lane);
#pragma unroll
        for (int i = 0; i < 4; i++)
          acc[i] += round_to<T>(round_to<T>(v[i] * kHadamardScale * pv4[i]) * w[j]);
      }
  }
  T* o = out + (size_t)row * out_row_stride;
  const T* r = residual != nullptr ? residual + (size_t)row * res_row_stride : nullptr;
#pragma unroll
  for (int i = 0; i < 4; i++)
    if (base + i < out_cols)  // + residual as `h + moe(x)` rounds: the sum rounded, then added
      o[base + i] = from_f32<T>(r != nullptr ? round_to<T>(acc[i]) + to_f32(r[base + i])
                                             : acc[i]);
}

unsigned warp_blocks(int64_t warps) { return (unsigned)((warps + kWarps - 1) / kWarps); }

template <typename T>
void run_route_logits(const void* logits, int64_t logit_stride, int rows, int top_k,
                      int experts, bool normalize, float scale, float* weights,
                      int64_t* chosen, int* plan, size_t smem, cudaStream_t stream) {
  launch(moe_route_logits_kernel<T>, dim3(1), dim3(kRouteThreads), smem, stream,
         static_cast<const T*>(logits), logit_stride, rows, top_k, experts, normalize, scale,
         weights, chosen, plan);
}

template <typename T>
void run_in(const void* x, int64_t row_stride, int x_cols, int width, int top_k,
            const int* plan, int pairs, const MoeIn& parts, int nparts, cudaStream_t stream) {
  launch(moe_in_kernel<T>, dim3(warp_blocks(width / 128), nparts, pairs), dim3(kWarps * 32), 0,
         stream, static_cast<const T*>(x), row_stride, x_cols, width, top_k, plan, pairs, parts);
}

template <typename T>
void run_glu(const float* gate, const float* up, int splits, int width, int inter,
             const float* post_gate, const float* post_up, int act, const float* pre,
             const int* plan, int pairs, void* out, cudaStream_t stream) {
  launch(moe_glu_kernel<T>, dim3(warp_blocks((int64_t)pairs * (width / 128))),
         dim3(kWarps * 32), 0, stream, gate, up, splits, width, inter, post_gate, post_up, act,
         pre, plan, pairs, static_cast<__half*>(out));
}

template <typename T>
void run_out(const float* partial, int splits, int width, const float* post,
             const float* weights, int top_k, const int* plan, int pairs, int rows, void* out,
             int64_t out_row_stride, int out_cols, const void* residual,
             int64_t res_row_stride, cudaStream_t stream) {
  launch(moe_out_kernel<T>, dim3(warp_blocks((int64_t)rows * (width / 128))),
         dim3(kWarps * 32), 0, stream, partial, splits, width, post, weights, top_k, plan,
         pairs, rows, static_cast<T*>(out), out_row_stride, out_cols,
         static_cast<const T*>(residual), res_row_stride);
}

}  // namespace

bool launch_moe_route(const int64_t* chosen, int pairs, int experts, int* plan,
                      cudaStream_t stream) {
  if (pairs < 1 || pairs > 65535 || experts < 1 || experts > kRouteThreads) return false;
  const size_t smem = (size_t)(2 * experts + pairs) * sizeof(int);
  if (smem > 48 * 1024) return false;
  launch(moe_route_kernel, dim3(1), dim3(kRouteThreads), smem, stream, chosen, pairs, experts,
         plan);
  return true;
}

#define EXL3_MOE_DTYPES(CALL)                                      \
  switch (dtype) {                                                 \
    case DT_HALF: CALL(__half); return true;                       \
    case DT_BF16: CALL(__nv_bfloat16); return true;                \
    case DT_FLOAT: CALL(float); return true;                       \
    default: return false;                                         \
  }

bool launch_moe_route_logits(int dtype, const void* logits, int64_t logit_stride, int rows,
                             int top_k, int experts, bool normalize, float scale,
                             float* weights, int64_t* chosen, int* plan, cudaStream_t stream) {
  const int pairs = rows * top_k;
  if (rows < 1 || top_k < 1 || top_k > 32 || top_k > experts || experts > kRouterMax ||
      pairs > 65535)
    return false;
  const size_t smem = (size_t)(2 * experts + pairs) * sizeof(int);
  if (smem > 48 * 1024) return false;
#define EXL3_MOE_ROUTE(T) run_route_logits<T>(logits, logit_stride, rows, top_k, experts, normalize, scale, weights, chosen, plan, smem, stream)
  EXL3_MOE_DTYPES(EXL3_MOE_ROUTE)
#undef EXL3_MOE_ROUTE
}

bool launch_moe_in(int dtype, const void* x, int64_t row_stride, int x_cols, int width,
                   int top_k, const int* plan, int pairs, int nparts,
                   const float* const* pre, void* const* out, cudaStream_t stream) {
  if (width % 128 != 0 || x_cols > width || nparts < 1 || nparts > kMoeMaxParts ||
      pairs < 1 || pairs > 65535 || top_k < 1)
    return false;
  MoeIn parts{};
  for (int p = 0; p < nparts; p++) {
    if (pre[p] == nullptr || out[p] == nullptr) return false;
    parts.pre[p] = pre[p];
    parts.out[p] = static_cast<__half*>(out[p]);
  }
#define EXL3_MOE_IN(T) run_in<T>(x, row_stride, x_cols, width, top_k, plan, pairs, parts, nparts, stream)
  EXL3_MOE_DTYPES(EXL3_MOE_IN)
#undef EXL3_MOE_IN
}

bool launch_moe_glu(int dtype, const float* gate, const float* up, int splits, int width,
                    int inter, const float* post_gate, const float* post_up, int act,
                    const float* pre, const int* plan, int pairs, void* out,
                    cudaStream_t stream) {
  if (width % 128 != 0 || inter < 1 || inter > width || splits < 1 || (act != 0 && act != 1) ||
      pairs < 1 || post_gate == nullptr || post_up == nullptr || pre == nullptr)
    return false;
#define EXL3_MOE_GLU(T) run_glu<T>(gate, up, splits, width, inter, post_gate, post_up, act, pre, plan, pairs, out, stream)
  EXL3_MOE_DTYPES(EXL3_MOE_GLU)
#undef EXL3_MOE_GLU
}

bool launch_moe_out(int dtype, const float* partial, int splits, int width, const float* post,
                    const float* weights, int top_k, const int* plan, int pairs, int rows,
                    void* out, int64_t out_row_stride, int out_cols, const void* residual,
                    int64_t res_row_stride, cudaStream_t stream) {
  if (width % 128 != 0 || splits < 1 || out_cols > width || rows < 1 || top_k < 1 ||
      rows * top_k != pairs || post == nullptr || weights == nullptr)
    return false;
#define EXL3_MOE_OUT(T) run_out<T>(partial, splits, width, post, weights, top_k, plan, pairs, rows, out, out_row_stride, out_cols, residual, res_row_stride, stream)
  EXL3_MOE_DTYPES(EXL3_MOE_OUT)
#undef EXL3_MOE_OUT
}

}  // namespace exl3
