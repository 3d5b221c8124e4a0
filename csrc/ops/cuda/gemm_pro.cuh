// The lean fused GEMM (gemm_lean.cuh, 1..8 rows) that makes its own input, in place of
// the launch before it (EXL3_LAYER_FOLD=pro, exl3_ops.h ProIn):
//   kProNorm  RMSNorm + suh + input Hadamard (norm_hadamard_kernel) for q/k/v, gate/up
//   kProGlu   gate/up split sums + Hadamard + svh + bias + act(gate) * up + suh + Hadamard
//             (glu_hadamard_kernel) for down
// Each block owns a run of tile rows (its split) and kWarps column groups. After
// pdl_wait() (the weights' first stages already in flight) its warps make the float16 x
// of the 128-column blocks that cover the run, for every row and every part its warps
// touch (q/k/v parts may meet inside a block), in shared memory; a named barrier; then
// each warp runs the lean loop with its x fragments from there. The 128-column blocks of
// the Hadamard are independent, so no block needs another's work: no ticket, no second
// pass. kProNorm's 1/rms: every block sums the squares of its rows itself (from L2; 8-28
// KB a row), in norm_hadamard_kernel's order (128 threads play its 256: thread t sums
// for t and t + 128, layer_prologue.cuh), so the x is bit for bit norm_hadamard's.
#pragma once

#include "../../codec/exl3_hadamard.cuh"
#include "gemm_impl.cuh"
#include "layer_prologue.cuh"

// Splits of gate/up whose loads kProGlu issues together (per tensor) before adding them:
// 4 costs the down instances 119-121 registers (4 blocks an SM: the 8B down grid of 512
// blocks in one wave), 2 costs 72-80 with a few bytes of spills. A/B with
// EXL3_NVCC_FLAGS=-DEXL3_PRO_GLU_BATCH=2.
#ifndef EXL3_PRO_GLU_BATCH
#define EXL3_PRO_GLU_BATCH 4
#endif

namespace exl3 {
namespace gemm {
namespace pro {

// The part of the flattened column group `group` (parts.count past the last); `group`
// becomes the part's own index.
__host__ __device__ __forceinline__ int part_of(const GemmParts& parts, int& group) {
  int p = 0;
  for (; p < parts.count; p++) {
    const int groups = (parts.part[p].nb + kTN - 1) / kTN;
    if (group < groups) break;
    group -= groups;
  }
  return p;
}

// All kWarps warps of the block (barrier 1: warps reach it from two call sites).
__device__ __forceinline__ void block_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kWarps * 32) : "memory");
}

// The block's x: rows x nh 128-column blocks (from block h0) for the parts p0..p0+nbuf-1,
// row r of buffer b at xs + (b * rows + r) * x_stride.
template <typename T, int MODE>
struct Prep {
  const ProIn* in;
  __half* xs;
  float* sums;  // kProMaxRows x 8 warp sums (shared)
  int rows, x_stride, h0, nh, p0, nbuf, width, warp, lane;

  __device__ __forceinline__ void operator()() const {
    using namespace prologue;
    static_assert(kWarps * 32 == 128, "two of norm_hadamard's 256 threads per thread");
    const T* x = static_cast<const T*>(in->x);
    if constexpr (MODE == kProNorm) {
      if (in->norm_w != nullptr) {
        const int t = warp * 32 + lane;
        for (int r = 0; r < rows; r++) {
          const T* xr = x + r * in->x_stride;
          const float a = warp_sum(sumsq_thread_batched(xr, in->x_cols, t));
          const float b = warp_sum(sumsq_thread_batched(xr, in->x_cols, t + 128));
          if (lane == 0) {
            sums[r * 8 + warp] = a;
            sums[r * 8 + warp + 4] = b;
          }
        }
        block_sync();
      }
    }
    const int per_buf = rows * nh;
    for (int it = warp; it < nbuf * per_buf; it += kWarps) {
      const int b = it / per_buf, r = (it % per_buf) / nh, hb = h0 + it % nh;
      const int base = hb * 128 + lane * 4;
      float v[4];
      if constexpr (MODE == kProNorm) {
        const float rs =
            in->norm_w != nullptr ? norm_rs(sums + r * 8, lane, in->x_cols, in->eps) : 1.0f;
        norm_block<T>(x + r * in->x_stride, in->x_cols, base, in->norm_w, rs, in->unit_offset,
                      in->pre[p0 + b], nullptr, v);
      } else {
        float g[4], u[4];
        load_split_sums2<EXL3_PRO_GLU_BATCH>(in->gate, in->up, in->g_splits, rows, width, r,
                                             base, g, u);
        hadamard128_warp(g, lane);
        hadamard128_warp(u, lane);
        const float d[2][4] = {};
        glu_block<T>(g, u, base, in->post_gate, in->post_up, in->bias_gate, in->bias_up,
                     in->inter, in->act, false, d, nullptr, in->pre[0], v);
      }
      hadamard128_warp(v, lane);
      __half2* dst = reinterpret_cast<__half2*>(xs + (size_t)(b * rows + r) * x_stride +
                                                (hb - h0) * 128 + lane * 4);
      dst[0] = __floats2half2_rn(v[0] * kHadamardScale, v[1] * kHadamardScale);
      dst[1] = __floats2half2_rn(v[2] * kHadamardScale, v[3] * kHadamardScale);
    }
    block_sync();
  }
};

// gemm_kernel_lean<K2, CB, 1, false>'s grid and loop, with the block's x made by Prep in
// the dynamic shared memory after the warps' rings.
template <int K2, int CB, typename T, int MODE>
__global__ void __launch_bounds__(kWarps * 32)
    gemm_kernel_pro(const __grid_constant__ GemmParts parts, const __grid_constant__ ProIn in,
                    int rows, int kb_total, int kb_per_split, int x_stride) {
  pdl_trigger();
  constexpr int kStageWords = kTN * TileBits<K2>::kWords;
  extern __shared__ __align__(16) uint32_t smem[];
  __shared__ float sums[kProMaxRows * 8];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  int total = 0;
  for (int q = 0; q < parts.count; q++) total += (parts.part[q].nb + kTN - 1) / kTN;
  int group = blockIdx.x * kWarps + warp;
  const int p = part_of(parts, group);
  int first = blockIdx.x * kWarps, last = min((int)blockIdx.x * kWarps + kWarps - 1, total - 1);
  const int p0 = part_of(parts, first);
  const int p1 = part_of(parts, last);
  const int split = blockIdx.y;
  const int kb0 = split * kb_per_split;
  const int kb1 = min(kb0 + kb_per_split, kb_total);
  const int h0 = kb0 / 8;
  const int nh = max(0, (kb1 + 7) / 8 - h0);
  __half* xs = reinterpret_cast<__half*>(smem + kWarps * kStages * kStageWords);
  const Prep<T, MODE> prep{&in, xs, sums, rows, x_stride, h0, nh, p0, p1 - p0 + 1,
                           kb_total * 16, warp, lane};
  if (p >= parts.count) {  // a warp past the last column group still helps make x
    pdl_wait();
    prep();
    return;
  }
  const GemmPart& mine = parts.part[p];
  const int nb_total = mine.nb;
  const int nb0 = group * kTN;
  const int tn = min(kTN, nb_total - nb0);
  const uint32_t* trellis = static_cast<const uint32_t*>(mine.trellis);
  float* part = mine.partial + (size_t)split * rows * nb_total * 16;
  uint32_t* ring = smem + warp * kStages * kStageWords;
  const __half* xb = xs + (size_t)(p - p0) * rows * x_stride;
  if (tn == kTN)
    lean::warp_gemm<K2, CB, 1, true, true>(nullptr, trellis, part, nb_total, nb0, tn, rows,
                                           kb_total, kb0, kb1, ring, lane, prep, x_stride,
                                           h0 * 128, xb);
  else
    lean::warp_gemm<K2, CB, 1, false, true>(nullptr, trellis, part, nb_total, nb0, tn, rows,
                                            kb_total, kb0, kb1, ring, lane, prep, x_stride,
                                            h0 * 128, xb);
}

// The arguments the kernel takes (the launchers refuse the rest before any launch).
inline bool ok(const GemmParts& parts, const ProIn& in, int rows, int kb, int splits) {
  if (rows < 1 || rows > kProMaxRows || splits < 1 || kb < 1 || splits > kb) return false;
  if (parts.count < 1 || parts.count > kMaxParts || parts.lora.x != nullptr) return false;
  if (in.dtype != DT_HALF && in.dtype != DT_BF16) return false;
  for (int p = 0; p < parts.count; p++)
    if (parts.part[p].trellis == nullptr || parts.part[p].partial == nullptr ||
        parts.part[p].nb < 1)
      return false;
  if (in.mode == kProNorm) {
    for (int p = 0; p < parts.count; p++)
      if (in.pre[p] == nullptr) return false;
    return in.x != nullptr && in.x_cols >= 1 && in.x_cols <= 16 * kb &&
           in.x_stride >= in.x_cols;
  }
  if (in.mode == kProGlu)
    return parts.count == 1 && in.pre[0] != nullptr && in.gate != nullptr &&
           in.up != nullptr && in.g_splits >= 1 && in.inter >= 1 && in.inter <= 16 * kb &&
           (in.act == 0 || in.act == 1);
  return false;
}

template <int K2, int CB, typename T, int MODE>
bool run(const GemmParts& parts, const ProIn& in, int rows, int kb, int splits,
         cudaStream_t stream) {
  const size_t ring = (size_t)kWarps * kStages * kTN * TileBits<K2>::kWords * 4;
  int groups = 0;
  for (int p = 0; p < parts.count; p++) groups += (parts.part[p].nb + kTN - 1) / kTN;
  const int kb_per_split = (kb + splits - 1) / splits;
  const int grid_x = (groups + kWarps - 1) / kWarps;
  int nh = 1;  // the most 128-column blocks a split's run touches
  for (int s = 0; s < splits; s++) {
    const int kb0 = s * kb_per_split, kb1 = min(kb0 + kb_per_split, kb);
    nh = max(nh, (kb1 + 7) / 8 - kb0 / 8);
  }
  int nbuf = 1;  // the most parts one block's warps touch
  for (int b = 0; b < grid_x; b++) {
    int first = b * kWarps, last = min(b * kWarps + kWarps - 1, groups - 1);
    nbuf = max(nbuf, part_of(parts, last) - part_of(parts, first) + 1);
  }
  // +8 halves a row: the 8 rows' x fragments fall in different banks.
  const int x_stride = nh * 128 + 8;
  const size_t smem = ring + (size_t)nbuf * rows * x_stride * sizeof(__half);
  if (smem > 227 * 1024) return false;
  auto kernel = gemm_kernel_pro<K2, CB, T, MODE>;
  if (smem > 48 * 1024 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
          cudaSuccess)
    return false;
  launch(kernel, dim3(grid_x, splits), dim3(kWarps * 32), smem, stream, parts, in, rows, kb,
         kb_per_split, x_stride);
  return true;
}

template <int K2, int CB>
bool dispatch(const GemmParts& parts, const ProIn& in, int rows, int kb, int splits,
              cudaStream_t stream) {
  const bool glu = in.mode == kProGlu;
  if (in.dtype == DT_HALF)
    return glu ? run<K2, CB, __half, kProGlu>(parts, in, rows, kb, splits, stream)
               : run<K2, CB, __half, kProNorm>(parts, in, rows, kb, splits, stream);
  return glu ? run<K2, CB, __nv_bfloat16, kProGlu>(parts, in, rows, kb, splits, stream)
             : run<K2, CB, __nv_bfloat16, kProNorm>(parts, in, rows, kb, splits, stream);
}

}  // namespace pro
}  // namespace gemm
}  // namespace exl3

// The K the prologue GEMM is built for (K = 2..6); other K: not taken (today's path).
#define EXL3_FOR_PRO_K2(X) X(4) X(6) X(8) X(10) X(12)

// Defines launch_gemm_pro_<NAME> for codebook CB_.
#define EXL3_DEFINE_PRO_LAUNCHER(NAME, CB_)                                                 \
  namespace exl3 {                                                                         \
  bool launch_gemm_pro_##NAME(const GemmParts& parts, const ProIn& in, int rows, int kb,    \
                              int k2, int splits, cudaStream_t stream) {                   \
    if (!gemm::pro::ok(parts, in, rows, kb, splits)) return false;                         \
    switch (k2) {                                                                          \
      EXL3_FOR_PRO_K2(EXL3_PRO_CASE_##NAME)                                                \
      default:                                                                             \
        return false;                                                                      \
    }                                                                                      \
  }                                                                                        \
  }
