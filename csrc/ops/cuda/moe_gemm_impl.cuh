// The indexed expert GEMM of the mixture-of-experts decode (exl3_ops.h): the fused
// decode-GEMM of gemm_impl.cuh (gemm_warp: the same cp.async ring, tile decode and mma)
// with blockIdx.z picking an active expert of the plan and a part (gate, up). Its
// trellis comes from a device array of per-expert pointers, its rows are the expert's
// slots (contiguous in xh and partial: the pairs sorted by expert), so only the chosen
// experts' weights are read, once per step whatever the number of rows that chose them.
// Blocks of an expert slot beyond the active count return at once. The row-group count
// NG (registers: 48-64 for 1 group, ~170 for 8) is chosen per expert, not per launch:
// one launch per class of experts (1-8, 9-32, 33-64 rows; only the classes max_rows can
// reach), each block returning when its expert is of another class. Most experts of a
// decode batch get 1-8 rows (Qwen3-30B-A3B at 64 jobs: 4 on average), and they run at
// the occupancy of the one-group kernel.
#pragma once

#include "../../codec/exl3_hadamard.cuh"
#include "exl3_moe.cuh"
#include "gemm_impl.cuh"
#include "moe_combine.cuh"

namespace exl3 {
namespace gemm {

// kCombine: one part, rows <= 8 per expert (one launch), and moe_combine_tail after the
// warp's partial sums (exl3_ops.h MoeCombine).
template <int K2, int CB, int NG, bool kCombine = false>
__global__ void __launch_bounds__(kWarps * 32)
    moe_gemm_kernel(const __grid_constant__ MoeGemmParts parts, const int* __restrict__ plan,
                    int pairs, int slots, int kb_total, int kb_per_split, int min_rows,
                    int max_rows, const __grid_constant__ MoeCombine combine) {
  const int a = blockIdx.z / parts.count;
  const MoeGemmPart& mine = parts.part[blockIdx.z - a * parts.count];
  const int nb_total = mine.nb;
  pdl_trigger();
  constexpr int kStageWords = kTN * TileBits<K2>::kWords;
  extern __shared__ __align__(16) uint32_t smem[];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int nb0 = (blockIdx.x * kWarps + warp) * kTN;
  if (nb0 >= nb_total) return;  // no block-wide barriers below
  pdl_wait();  // the plan is this step's (the weights' addresses depend on it)
  const MoePlan pv = moe_plan(const_cast<int*>(plan), pairs, slots);
  const int active = __ldg(pv.active);
  if (a >= active) return;
  const int expert = __ldg(pv.act_expert + a);
  const int offset = __ldg(pv.act_offset + a);
  const int rows = __ldg(pv.act_rows + a);
  if (rows < min_rows || rows > max_rows) return;  // another launch's class
  const uint32_t* trellis = reinterpret_cast<const uint32_t*>(__ldg(mine.trellis + expert));
  const __half* xh = static_cast<const __half*>(mine.xh) + (size_t)offset * kb_total * 16;
  const int split = blockIdx.y;
  const int kb0 = split * kb_per_split;
  const int kb1 = min(kb0 + kb_per_split, kb_total);
  auto out_base = [&]() {
    return mine.partial + ((size_t)blockIdx.y * pairs + offset) * ((size_t)nb_total * 16);
  };
  gemm_warp<K2, CB, NG>(xh, trellis, out_base, nb_total, nb0, rows, kb_total, kb0, kb1,
                        smem + warp * kStages * kStageWords, lane);
  if constexpr (kCombine)
    moe_combine_tail(combine, pv, active * (int)gridDim.y * (128 / (kTN * 16)),
                     mine.partial, (int)gridDim.y, pairs, nb_total * 16, nb0 * 16 / 128,
                     lane);
}

template <int K2, int CB>
void run_moe_gemm(const MoeGemmParts& parts, const int* plan, int pairs, int slots,
                  int max_rows, int kb, int splits, const MoeCombine* combine,
                  cudaStream_t stream) {
  const size_t smem = (size_t)kWarps * kStages * kTN * TileBits<K2>::kWords * 4;
  int nb_max = 0;
  for (int p = 0; p < parts.count; p++) nb_max = max(nb_max, parts.part[p].nb);
  const int groups = (nb_max + kTN - 1) / kTN;
  const int kb_per_split = (kb + splits - 1) / splits;
  dim3 grid((groups + kWarps - 1) / kWarps, splits, slots * parts.count);
  const MoeCombine none{};
  if (combine != nullptr) {
    launch(moe_gemm_kernel<K2, CB, 1, true>, grid, dim3(kWarps * 32), smem, stream, parts,
           plan, pairs, slots, kb, kb_per_split, 1, 8, *combine);
    return;
  }
  launch(moe_gemm_kernel<K2, CB, 1>, grid, dim3(kWarps * 32), smem, stream, parts, plan,
         pairs, slots, kb, kb_per_split, 1, 8, none);
  if (max_rows > 8)
    launch(moe_gemm_kernel<K2, CB, 4>, grid, dim3(kWarps * 32), smem, stream, parts, plan,
           pairs, slots, kb, kb_per_split, 9, 32, none);
  if (max_rows > 32)
    launch(moe_gemm_kernel<K2, CB, 8>, grid, dim3(kWarps * 32), smem, stream, parts, plan,
           pairs, slots, kb, kb_per_split, 33, 64, none);
}

}  // namespace gemm
}  // namespace exl3

// Defines launch_moe_gemm_<NAME> for codebook CB_ over the K2 values in FOR_K2.
#define EXL3_DEFINE_MOE_GEMM_LAUNCHER(NAME, CB_, FOR_K2)                                   \
  namespace exl3 {                                                                         \
  bool launch_moe_gemm_##NAME(const MoeGemmParts& parts, const int* plan, int pairs,       \
                              int slots, int max_rows, int kb, int k2, int splits,         \
                              const MoeCombine* combine, cudaStream_t stream) {            \
    if (max_rows < 1 || max_rows > 64 || splits < 1 || pairs < 1 || slots < 1 ||           \
        slots > 65535 / kMoeMaxParts)                                                      \
      return false;                                                                        \
    if (parts.count < 1 || parts.count > kMoeMaxParts) return false;                       \
    if (combine != nullptr && !moe_combine_ok(*combine, parts, pairs, max_rows))           \
      return false;                                                                        \
    switch (k2) {                                                                          \
      FOR_K2(EXL3_MOE_GEMM_CASE_##NAME)                                                    \
      default:                                                                             \
        return false;                                                                      \
    }                                                                                      \
  }                                                                                        \
  }
