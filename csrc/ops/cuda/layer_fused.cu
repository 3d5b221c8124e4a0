// The kernels around the fused EXL3 GEMM in a decode layer (exl3_ops.h, "Fused
// decode-layer kernels"): the steps between two GEMMs become one launch each.
//   norm_hadamard  RMSNorm + suh + input Hadamard for up to 4 projections of one input
//   hadamard_out   split sum + output Hadamard + svh + bias (+ rotary, + residual)
//   glu_hadamard   gate/up outputs + act(gate) * up + the down projection's input side
// An adapted layer's LoRA update (exl3_ops.h LowRank) is added in the output kernels,
// right where engine/adapters/lora.py's AdaptedLinear adds it: after svh and bias,
// before rotary, the activation and the residual; norm_hadamard and glu_hadamard can
// also write the LoRA inputs (the normed rows, act(gate) * up) in the activation dtype.
// Every value that the PyTorch path rounds to the activation dtype is rounded here at
// the same place (engine/layers/norm.py, engine/layers/rope.py, engine/layers/mlp.py), so the fused layer
// follows the reference to the last bit in most positions. One warp per (row,
// 128-column block), the butterfly of exl3_hadamard.cuh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "exl3_convert.cuh"
#include "../../codec/exl3_hadamard.cuh"
#include "exl3_launch.cuh"
#include "exl3_lora.cuh"
#include "exl3_ops.h"
#include "layer_prologue.cuh"

namespace exl3 {
namespace {

constexpr int kWarps = 8;
// glu_hadamard: gate's and up's split-K loads issued together (load_split_sums2), the
// same sums as two load_split_sum calls; -DEXL3_GLU_PAIRED=0 for the A/B.
#ifndef EXL3_GLU_PAIRED
#define EXL3_GLU_PAIRED 1
#endif
constexpr bool kGluPaired = EXL3_GLU_PAIRED != 0;


using prologue::load_split_sum;
using prologue::warp_sum;

// The same from a float16 (1, rows, width) partial (a prompt's cuBLAS sums), or float32.
__device__ __forceinline__ void load_sum(const void* partial, bool half, int splits, int rows,
                                         int width, int row, int col, float (&v)[4]) {
  if (!half) {
    load_split_sum(static_cast<const float*>(partial), splits, rows, width, row, col, v);
    return;
  }
  const __half* p = static_cast<const __half*>(partial) + (size_t)row * width + col;
  const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
  const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&raw.x));
  const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&raw.y));
  v[0] = lo.x;
  v[1] = lo.y;
  v[2] = hi.x;
  v[3] = hi.y;
}

struct InParts {
  const float* pre[kMaxParts];
  __half* out[kMaxParts];
};

// grid (blocks of 8 column blocks, parts, rows); each block normalises its row itself.
template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    norm_hadamard_kernel(const T* __restrict__ x, int64_t row_stride, int x_cols, int width,
                         const float* __restrict__ norm_w, float eps, bool unit_offset,
                         const __grid_constant__ InParts parts, T* __restrict__ normed,
                         int64_t normed_stride) {
  pdl_trigger();
  pdl_wait();
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int row = blockIdx.z;
  const T* xr = x + row * row_stride;
  float rs = 1.0f;
  if (norm_w != nullptr) {
    __shared__ float partial[kWarps];
    static_assert(kWarps * 32 == 256, "prologue::sumsq_thread's order: 256 threads");
    const float s = warp_sum(prologue::sumsq_thread(xr, x_cols, threadIdx.x));
    if (lane == 0) partial[warp] = s;
    __syncthreads();
    rs = prologue::norm_rs(partial, lane, x_cols, eps);
  }
  const int base = (blockIdx.x * kWarps + warp) * 128 + lane * 4;
  if (base >= width) return;  // whole warps: width is a multiple of 128
  const float* pre = parts.pre[blockIdx.y];
  T* normed_row = normed != nullptr && blockIdx.y == 0 ? normed + row * normed_stride : nullptr;
  float v[4];
  prologue::norm_block<T>(xr, x_cols, base, norm_w, rs, unit_offset, pre, normed_row, v);
  hadamard128_warp(v, lane);
  __half* out = parts.out[blockIdx.y] + (size_t)row * width + base;
  __half2* out2 = reinterpret_cast<__half2*>(out);
  out2[0] = __floats2half2_rn(v[0] * kHadamardScale, v[1] * kHadamardScale);
  out2[1] = __floats2half2_rn(v[2] * kHadamardScale, v[3] * kHadamardScale);
}

// grid (warps over rows x column blocks of the widest part / 8, parts). LORA: with the
// LoRA update (its own instance: the bare one keeps its registers).
template <typename T, bool LORA>
__global__ void __launch_bounds__(kWarps * 32)
    hadamard_out_kernel(const __grid_constant__ OutParts parts, int rows,
                        const T* __restrict__ residual, int64_t residual_stride,
                        const T* __restrict__ cos, const T* __restrict__ sin, int head_dim,
                        const __grid_constant__ LowRank lora, const __grid_constant__ KvStore kv) {
  pdl_trigger();
  pdl_wait();
  const OutPart& part = parts.part[blockIdx.y];
  const int lane = threadIdx.x & 31;
  const int blocks_per_row = part.width / 128;
  const int id = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int row = id / blocks_per_row;
  if (row >= rows) return;  // whole warps
  const int base = (id % blocks_per_row) * 128 + lane * 4;
  const int64_t kv_slot = kv.keys != nullptr ? kv.slots[row] : 0;  // in flight with the sums
  const int lora_offset[1] = {part.lora_offset};
  LoraFetch<T, 1> lf;
  if (LORA) lora_fetch<T, 1>(lora, row, lora_offset, base, part.out_cols, lane, lf);
  float v[4];
  load_sum(part.partial, part.half, part.splits, rows, part.width, row, base, v);
  hadamard128_warp(v, lane);
#pragma unroll
  for (int e = 0; e < 4; e++) {
    const int c = base + e;
    float y = v[e] * kHadamardScale;
    if (part.post != nullptr) y *= part.post[c];
    if (part.bias != nullptr && c < part.out_cols) y += part.bias[c];
    v[e] = round_to<T>(y);
  }
  float d[1][4];
  if (LORA && (lf.fast ? lora_apply<T, 1>(lf, d)
                       : lora_delta<T, 1>(lora, row, lora_offset, base, part.out_cols, lane, d))) {
#pragma unroll
    for (int e = 0; e < 4; e++) v[e] = round_to<T>(v[e] + d[0][e]);
  }
  if (cos != nullptr && part.rope_cols > 0) {
    // rotate-half: d < h pairs with d + h (x*cos - x[d+h]*sin), d >= h with d - h.
    const int half = head_dim / 2;
    float p[4];
#pragma unroll
    for (int e = 0; e < 4; e++) p[e] = __shfl_xor_sync(0xffffffffu, v[e], half / 4);
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int c = base + e;
      if (c >= part.rope_cols) continue;
      const int d = c % head_dim;
      const float rot = d < half ? -p[e] : p[e];
      const float cs = to_f32(cos[(size_t)row * head_dim + d]);
      const float sn = to_f32(sin[(size_t)row * head_dim + d]);
      v[e] = round_to<T>(round_to<T>(v[e] * cs) + round_to<T>(rot * sn));
    }
  }
  T* out = static_cast<T*>(part.out) + (size_t)row * part.out_row_stride;
  if (kv.keys != nullptr) {  // the decode step's new key/value rows (exl3_ops.h KvStore)
    const int p = blockIdx.y;
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int c = base + e;
      if (c >= kv.k_lo[p] && c < kv.k_hi[p])
        static_cast<T*>(kv.keys)[kv_slot * kv.row_stride + (c - kv.k_lo[p])] = from_f32<T>(v[e]);
      else if (c >= kv.v_lo[p] && c < kv.v_hi[p])
        static_cast<T*>(kv.values)[kv_slot * kv.row_stride + (c - kv.v_lo[p])] = from_f32<T>(v[e]);
    }
  }
#pragma unroll
  for (int e = 0; e < 4; e++) {
    const int c = base + e;
    if (c >= part.out_cols) continue;
    float y = v[e];
    if (residual != nullptr) y = to_f32(residual[(size_t)row * residual_stride + c]) + y;
    out[c] = from_f32<T>(y);
  }
}

// LORA: with the LoRA update or the product output (the bare instance keeps its registers).
template <typename T, bool LORA>
__global__ void __launch_bounds__(kWarps * 32)
    glu_hadamard_kernel(const void* __restrict__ gate, const void* __restrict__ up, bool half,
                        int splits, int width, const float* __restrict__ post_gate,
                        const float* __restrict__ post_up, const float* __restrict__ bias_gate,
                        const float* __restrict__ bias_up, int inter, int act,
                        const float* __restrict__ pre, __half* __restrict__ out, int rows,
                        const __grid_constant__ LowRank lora, T* __restrict__ product,
                        int64_t product_stride) {
  pdl_trigger();
  pdl_wait();
  const int lane = threadIdx.x & 31;
  const int blocks_per_row = width / 128;
  const int id = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int row = id / blocks_per_row;
  if (row >= rows) return;
  const int base = (id % blocks_per_row) * 128 + lane * 4;
  const int lora_offset[2] = {0, inter};  // bt columns: [gate | up]
  LoraFetch<T, 2> lf;
  if (LORA) lora_fetch<T, 2>(lora, row, lora_offset, base, inter, lane, lf);
  float g[4], u[4];
  if (kGluPaired && !half) {  // gate's and up's split loads in flight together
    prologue::load_split_sums2<prologue::kSplitBatch>(static_cast<const float*>(gate),
                                                       static_cast<const float*>(up), splits,
                                                       rows, width, row, base, g, u);
  } else {
    load_sum(gate, half, splits, rows, width, row, base, g);
    load_sum(up, half, splits, rows, width, row, base, u);
  }
  hadamard128_warp(g, lane);
  hadamard128_warp(u, lane);
  float d[2][4];
  const bool adapted =
      LORA && (lf.fast ? lora_apply<T, 2>(lf, d)
                       : lora_delta<T, 2>(lora, row, lora_offset, base, inter, lane, d));
  T* product_row = LORA && product != nullptr ? product + (size_t)row * product_stride : nullptr;
  float v[4];
  prologue::glu_block<T>(g, u, base, post_gate, post_up, bias_gate, bias_up, inter, act,
                         adapted, d, product_row, pre, v);
  hadamard128_warp(v, lane);
  __half2* out2 = reinterpret_cast<__half2*>(out + (size_t)row * width + base);
  out2[0] = __floats2half2_rn(v[0] * kHadamardScale, v[1] * kHadamardScale);
  out2[1] = __floats2half2_rn(v[2] * kHadamardScale, v[3] * kHadamardScale);
}

unsigned warp_blocks(int64_t warps) { return (unsigned)((warps + kWarps - 1) / kWarps); }

template <typename T>
void run_norm(const void* x, int64_t row_stride, int x_cols, int width, const float* norm_w,
              float eps, bool unit_offset, const InParts& parts, int nparts, int rows,
              void* normed, int64_t normed_stride, cudaStream_t stream) {
  dim3 grid(warp_blocks(width / 128), nparts, rows);
  launch(norm_hadamard_kernel<T>, grid, dim3(kWarps * 32), 0, stream, static_cast<const T*>(x),
         row_stride, x_cols, width, norm_w, eps, unit_offset, parts, static_cast<T*>(normed),
         normed_stride);
}

template <typename T>
void run_out(const OutParts& parts, int rows, const void* residual, int64_t residual_stride,
             const void* cos, const void* sin, int head_dim, const LowRank& lora,
             const KvStore& kv, cudaStream_t stream) {
  int width = 0;
  for (int p = 0; p < parts.count; p++) width = max(width, parts.part[p].width);
  dim3 grid(warp_blocks((int64_t)rows * (width / 128)), parts.count);
  launch(lora.low != nullptr ? hadamard_out_kernel<T, true> : hadamard_out_kernel<T, false>,
         grid, dim3(kWarps * 32), 0, stream, parts, rows,
         static_cast<const T*>(residual), residual_stride, static_cast<const T*>(cos),
         static_cast<const T*>(sin), head_dim, lora, kv);
}

template <typename T>
void run_glu(const void* gate, const void* up, bool half, int splits, int width,
             const float* post_gate, const float* post_up, const float* bias_gate,
             const float* bias_up, int inter, int act, const float* pre, void* out, int rows,
             const LowRank& lora, void* product, int64_t product_stride, cudaStream_t stream) {
  const bool extras = lora.low != nullptr || product != nullptr;
  launch(extras ? glu_hadamard_kernel<T, true> : glu_hadamard_kernel<T, false>,
         dim3(warp_blocks((int64_t)rows * (width / 128))),
         dim3(kWarps * 32), 0, stream, gate, up, half, splits, width, post_gate, post_up, bias_gate,
         bias_up, inter, act, pre, static_cast<__half*>(out), rows, lora,
         static_cast<T*>(product), product_stride);
}

// A LowRank the kernels can use: none (low null), or every pointer set.
bool lora_ok(const LowRank& lora) {
  return lora.low == nullptr ||
         (lora.bt != nullptr && lora.columns != nullptr && lora.slots != nullptr &&
          lora.rank >= 0);
}

}  // namespace

bool launch_norm_hadamard(int dtype, const void* x, int64_t row_stride, int x_cols,
                          int width, const float* norm_w, float eps, bool unit_offset,
                          int nparts, const float* const* pre, void* const* out, int rows,
                          void* normed, int64_t normed_stride, cudaStream_t stream) {
  if (width % 128 != 0 || x_cols > width || nparts < 1 || nparts > kMaxParts || rows < 0)
    return false;
  if (rows == 0) return true;
  InParts parts{};
  for (int p = 0; p < nparts; p++) {
    if (pre[p] == nullptr || out[p] == nullptr) return false;
    parts.pre[p] = pre[p];
    parts.out[p] = static_cast<__half*>(out[p]);
  }
  switch (dtype) {
    case DT_HALF: run_norm<__half>(x, row_stride, x_cols, width, norm_w, eps, unit_offset, parts, nparts, rows, normed, normed_stride, stream); return true;
    case DT_BF16: run_norm<__nv_bfloat16>(x, row_stride, x_cols, width, norm_w, eps, unit_offset, parts, nparts, rows, normed, normed_stride, stream); return true;
    case DT_FLOAT: run_norm<float>(x, row_stride, x_cols, width, norm_w, eps, unit_offset, parts, nparts, rows, normed, normed_stride, stream); return true;
    default: return false;
  }
}

bool launch_hadamard_out(int dtype, const OutParts& parts, int rows, const void* residual,
                         int64_t residual_stride, const void* cos, const void* sin,
                         int head_dim, const LowRank& lora, cudaStream_t stream,
                         const KvStore& kv) {
  if (parts.count < 1 || parts.count > kMaxParts || rows < 0 || !lora_ok(lora)) return false;
  if (kv.keys != nullptr && (kv.values == nullptr || kv.slots == nullptr || residual != nullptr))
    return false;
  for (int p = 0; p < parts.count; p++) {
    const OutPart& part = parts.part[p];
    if (part.width % 128 != 0 || part.out_cols > part.width || part.splits < 1) return false;
    if (part.half && part.splits != 1) return false;
    if (part.rope_cols > 0 && (cos == nullptr || sin == nullptr)) return false;
  }
  if (cos != nullptr && head_dim != 64 && head_dim != 128) return false;
  if (rows == 0) return true;
  switch (dtype) {
    case DT_HALF: run_out<__half>(parts, rows, residual, residual_stride, cos, sin, head_dim, lora, kv, stream); return true;
    case DT_BF16: run_out<__nv_bfloat16>(parts, rows, residual, residual_stride, cos, sin, head_dim, lora, kv, stream); return true;
    case DT_FLOAT: run_out<float>(parts, rows, residual, residual_stride, cos, sin, head_dim, lora, kv, stream); return true;
    default: return false;
  }
}

bool launch_glu_hadamard(int dtype, const void* gate, const void* up, int splits,
                         int width, const float* post_gate, const float* post_up,
                         const float* bias_gate, const float* bias_up, int inter, int act,
                         const float* pre, void* out, int rows, const LowRank& lora,
                         void* product, int64_t product_stride, cudaStream_t stream,
                         bool half) {
  if (width % 128 != 0 || inter > width || splits < 1 || (half && splits != 1) ||
      (act != 0 && act != 1) ||
      pre == nullptr || rows < 0 || !lora_ok(lora))
    return false;
  if (rows == 0) return true;
  switch (dtype) {
    case DT_HALF: run_glu<__half>(gate, up, half, splits, width, post_gate, post_up, bias_gate, bias_up, inter, act, pre, out, rows, lora, product, product_stride, stream); return true;
    case DT_BF16: run_glu<__nv_bfloat16>(gate, up, half, splits, width, post_gate, post_up, bias_gate, bias_up, inter, act, pre, out, rows, lora, product, product_stride, stream); return true;
    case DT_FLOAT: run_glu<float>(gate, up, half, splits, width, post_gate, post_up, bias_gate, bias_up, inter, act, pre, out, rows, lora, product, product_stride, stream); return true;
    default: return false;
  }
}

}  // namespace exl3
