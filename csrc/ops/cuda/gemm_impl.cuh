// Fused decode + GEMM for 1..64 rows: partial = xh · Ŵ with Ŵ decoded tile by tile.
//
// Each warp owns TN adjacent tile columns and one run ("split") of tile rows. The
// packed tiles stream through a warp-private ring of STAGES shared-memory slots
// (cp.async, 16-byte copies, no L1); a lane decodes its 8 weights of a tile straight
// into an m16n8k16 A fragment (Ŵᵀ, see exl3_trellis.cuh) and multiplies it with the
// x fragment of 8 rows (B = xhᵀ), accumulating in float32. Splits write separate
// partial sums; the output Hadamard kernel adds them (deterministic, no atomics).
// One launch may run several parts on the same rows and tile-row count (q/k/v, gate/up:
// one xh, trellis and partial buffer each), blockIdx.z picking the part; an adapted
// projection's first LoRA product may ride along in the same launch (gemm_lora.cuh).
#pragma once

#include "exl3_launch.cuh"
#include "exl3_ops.h"
#include "gemm_lora.cuh"
#include "../../codec/exl3_trellis.cuh"

namespace exl3 {
namespace gemm {

constexpr int kWarps = 4;
constexpr int kTN = 4;
constexpr int kStages = 8;

__device__ __forceinline__ void cp_async16(uint32_t s, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// NG: groups of 8 rows handled (1 for rows <= 8, 4 for rows <= 32, 8 for rows <= 64).
// LORA: the launch carries a LoRA product (gemm_lora.cuh) in the grid rows from
// parts.lora.y0 on; its own instance, so the bare one keeps its code and registers.
template <int K2, int CB, int NG, bool LORA>
__global__ void __launch_bounds__(kWarps * 32)
    gemm_kernel(const __grid_constant__ GemmParts parts, int rows, int kb_total,
                int kb_per_split) {
  extern __shared__ __align__(16) uint32_t smem[];
  if constexpr (LORA) {
    if ((int)blockIdx.y >= parts.lora.y0) {
      pdl_trigger();
      lora_rows<kWarps>(parts.lora, rows, reinterpret_cast<float*>(smem));
      return;
    }
  }
  const GemmPart& mine = parts.part[blockIdx.z];
  const __half* __restrict__ xh = static_cast<const __half*>(mine.xh);
  const uint32_t* __restrict__ trellis = static_cast<const uint32_t*>(mine.trellis);
  float* __restrict__ partial = mine.partial;
  const int nb_total = mine.nb;
  pdl_trigger();
  constexpr int W = TileBits<K2>::kWords;
  constexpr int kStageWords = kTN * W;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int nb0 = (blockIdx.x * kWarps + warp) * kTN;
  if (nb0 >= nb_total) return;  // no block-wide barriers below
  const int tn = min(kTN, nb_total - nb0);
  const int split = blockIdx.y;
  const int kb0 = split * kb_per_split;
  const int kb1 = min(kb0 + kb_per_split, kb_total);
  uint32_t* ring = smem + warp * kStages * kStageWords;
  // Each lane copies 16-byte pieces lane, lane+32, ... of a stage; pointers advance by
  // one tile row per iteration instead of recomputing 64-bit offsets.
  constexpr int kIters = (kStageWords / 4 + 31) / 32;
  const int chunks = tn * W / 4;  // 16-byte pieces per stage (fewer at the right edge)
  const size_t row_bytes = (size_t)nb_total * W * 4;
  const char* src_lane = reinterpret_cast<const char*>(trellis + (size_t)nb0 * W) + lane * 16;
  const uint32_t dst_lane = static_cast<uint32_t>(__cvta_generic_to_shared(ring)) + lane * 16;
  const int in_cols = kb_total * 16;

  auto issue = [&](const char* src, int slot) {
    const uint32_t dst = dst_lane + slot * (kStageWords * 4);
#pragma unroll
    for (int i = 0; i < kIters; i++)
      if (lane + 32 * i < chunks) cp_async16(dst + 512 * i, src + 512 * i);
  };

  const char* next_src = src_lane + (size_t)kb0 * row_bytes;
#pragma unroll
  for (int s = 0; s < kStages - 1; s++) {
    if (kb0 + s < kb1) issue(next_src, s);
    next_src += row_bytes;
    cp_async_commit();
  }

  pdl_wait();  // the weights are in flight; xh (and the partial buffer) belong to the step

  float acc[NG][kTN][4];
#pragma unroll
  for (int g = 0; g < NG; g++)
#pragma unroll
    for (int t = 0; t < kTN; t++)
#pragma unroll
      for (int e = 0; e < 4; e++) acc[g][t][e] = 0.0f;

  const int gid = lane >> 2;       // B fragment column = row of x within its group of 8
  const int k2 = 2 * (lane & 3);   // B fragment k offset
  int slot = 0;
  for (int kb = kb0; kb < kb1; kb++) {
    {
      const int next = kb + kStages - 1;
      int next_slot = slot + kStages - 1;
      if (next_slot >= kStages) next_slot -= kStages;
      if (next < kb1) issue(next_src, next_slot);
      next_src += row_bytes;
      cp_async_commit();
    }
    uint32_t b[NG][2];
#pragma unroll
    for (int g = 0; g < NG; g++) {
      const int row = g * 8 + gid;
      if (row < rows) {
        const uint32_t* xr =
            reinterpret_cast<const uint32_t*>(xh + (size_t)row * in_cols + kb * 16 + k2);
        b[g][0] = __ldg(xr);
        b[g][1] = __ldg(xr + 4);
      } else {
        b[g][0] = 0u;
        b[g][1] = 0u;
      }
    }
    cp_async_wait<kStages - 1>();
    __syncwarp();
    const uint32_t* stage = ring + slot * kStageWords;
#pragma unroll
    for (int t = 0; t < kTN; t++) {
      if (t < tn) {
        uint32_t a[4];
        decode_lane<K2, CB>(stage + t * W, lane, a);
#pragma unroll
        for (int g = 0; g < NG; g++)
          if (NG == 1 || g * 8 < rows) mma_16816(acc[g][t], a, b[g][0], b[g][1]);
      }
    }
    __syncwarp();  // every lane is done with this slot before it is refilled
    if (++slot == kStages) slot = 0;
  }

  const size_t out_cols = (size_t)nb_total * 16;
  float* part = partial + (size_t)split * rows * out_cols;
#pragma unroll
  for (int t = 0; t < kTN; t++) {
    if (t >= tn) continue;
    const size_t col = (size_t)(nb0 + t) * 16 + gid;  // C fragment row = output column
#pragma unroll
    for (int g = 0; g < NG; g++) {
      const int r = g * 8 + k2;  // C fragment columns = rows of x
      if (r < rows) {
        part[r * out_cols + col] = acc[g][t][0];
        part[r * out_cols + col + 8] = acc[g][t][2];
      }
      if (r + 1 < rows) {
        part[(r + 1) * out_cols + col] = acc[g][t][1];
        part[(r + 1) * out_cols + col + 8] = acc[g][t][3];
      }
    }
  }
}

// One warp's share of a fused GEMM: tile columns nb0..nb0+kTN-1 (of nb_total) over the
// tile rows kb0..kb1-1, for `rows` rows of xh (row stride 16*kb_total halves); the
// partial sums go to part[r * 16*nb_total + column] with part = out_base(), asked for
// after the loop (no live register through it). `ring` is the warp's kStages slots.
// The indexed expert GEMM of moe_decode.cu runs it; it is gemm_kernel's loop with the
// output address asked for at the end (gemm_kernel keeps its own copy until an A/B on
// the device shows the shared version costs nothing: its SASS differs, bench/NOTES-gpu.md).
// NG: groups of 8 rows handled (1 for rows <= 8, 4 for rows <= 32, 8 for rows <= 64).
template <int K2, int CB, int NG, typename OutBase>
__device__ __forceinline__ void gemm_warp(const __half* __restrict__ xh,
                                          const uint32_t* __restrict__ trellis,
                                          OutBase out_base, int nb_total, int nb0,
                                          int rows, int kb_total, int kb0, int kb1,
                                          uint32_t* ring, int lane) {
  constexpr int W = TileBits<K2>::kWords;
  constexpr int kStageWords = kTN * W;
  const int tn = min(kTN, nb_total - nb0);
  // Each lane copies 16-byte pieces lane, lane+32, ... of a stage; pointers advance by
  // one tile row per iteration instead of recomputing 64-bit offsets.
  constexpr int kIters = (kStageWords / 4 + 31) / 32;
  const int chunks = tn * W / 4;  // 16-byte pieces per stage (fewer at the right edge)
  const size_t row_bytes = (size_t)nb_total * W * 4;
  const char* src_lane = reinterpret_cast<const char*>(trellis + (size_t)nb0 * W) + lane * 16;
  const uint32_t dst_lane = static_cast<uint32_t>(__cvta_generic_to_shared(ring)) + lane * 16;
  const int in_cols = kb_total * 16;

  auto issue = [&](const char* src, int slot) {
    const uint32_t dst = dst_lane + slot * (kStageWords * 4);
#pragma unroll
    for (int i = 0; i < kIters; i++)
      if (lane + 32 * i < chunks) cp_async16(dst + 512 * i, src + 512 * i);
  };

  const char* next_src = src_lane + (size_t)kb0 * row_bytes;
#pragma unroll
  for (int s = 0; s < kStages - 1; s++) {
    if (kb0 + s < kb1) issue(next_src, s);
    next_src += row_bytes;
    cp_async_commit();
  }

  pdl_wait();  // the weights are in flight; xh (and the partial buffer) belong to the step

  float acc[NG][kTN][4];
#pragma unroll
  for (int g = 0; g < NG; g++)
#pragma unroll
    for (int t = 0; t < kTN; t++)
#pragma unroll
      for (int e = 0; e < 4; e++) acc[g][t][e] = 0.0f;

  const int gid = lane >> 2;       // B fragment column = row of x within its group of 8
  const int k2 = 2 * (lane & 3);   // B fragment k offset
  int slot = 0;
  for (int kb = kb0; kb < kb1; kb++) {
    {
      const int next = kb + kStages - 1;
      int next_slot = slot + kStages - 1;
      if (next_slot >= kStages) next_slot -= kStages;
      if (next < kb1) issue(next_src, next_slot);
      next_src += row_bytes;
      cp_async_commit();
    }
    uint32_t b[NG][2];
#pragma unroll
    for (int g = 0; g < NG; g++) {
      const int row = g * 8 + gid;
      if (row < rows) {
        const uint32_t* xr =
            reinterpret_cast<const uint32_t*>(xh + (size_t)row * in_cols + kb * 16 + k2);
        b[g][0] = __ldg(xr);
        b[g][1] = __ldg(xr + 4);
      } else {
        b[g][0] = 0u;
        b[g][1] = 0u;
      }
    }
    cp_async_wait<kStages - 1>();
    __syncwarp();
    const uint32_t* stage = ring + slot * kStageWords;
#pragma unroll
    for (int t = 0; t < kTN; t++) {
      if (t < tn) {
        uint32_t a[4];
        decode_lane<K2, CB>(stage + t * W, lane, a);
#pragma unroll
        for (int g = 0; g < NG; g++)
          if (NG == 1 || g * 8 < rows) mma_16816(acc[g][t], a, b[g][0], b[g][1]);
      }
    }
    __syncwarp();  // every lane is done with this slot before it is refilled
    if (++slot == kStages) slot = 0;
  }

  const size_t out_cols = (size_t)nb_total * 16;
  float* __restrict__ part = out_base();
#pragma unroll
  for (int t = 0; t < kTN; t++) {
    if (t >= tn) continue;
    const size_t col = (size_t)(nb0 + t) * 16 + gid;  // C fragment row = output column
#pragma unroll
    for (int g = 0; g < NG; g++) {
      const int r = g * 8 + k2;  // C fragment columns = rows of x
      if (r < rows) {
        part[r * out_cols + col] = acc[g][t][0];
        part[r * out_cols + col + 8] = acc[g][t][2];
      }
      if (r + 1 < rows) {
        part[(r + 1) * out_cols + col] = acc[g][t][1];
        part[(r + 1) * out_cols + col + 8] = acc[g][t][3];
      }
    }
  }
}

}  // namespace gemm
}  // namespace exl3

#include "gemm_lean.cuh"  // build-time variants (EXL3_GEMM_VARIANT, default 4; 0: gemm_kernel alone)

namespace exl3 {
namespace gemm {

template <int K2, int CB>
void run_gemm(const GemmParts& parts, int rows, int kb, int splits, cudaStream_t stream) {
  if constexpr (lean::kAllRows) {
    lean::run<K2, CB>(parts, rows, kb, splits, stream);
    return;
  }
  if constexpr (EXL3_GEMM_VARIANT >= 1) {
    if (rows <= 8) {
      lean::run<K2, CB>(parts, rows, kb, splits, stream);
      return;
    }
  }
  if constexpr (!lean::kAllRows) {
    const size_t smem = (size_t)kWarps * kStages * kTN * TileBits<K2>::kWords * 4;
    int nb_max = 0;
    for (int p = 0; p < parts.count; p++) nb_max = max(nb_max, parts.part[p].nb);
    const int groups = (nb_max + kTN - 1) / kTN;
    const int kb_per_split = (kb + splits - 1) / splits;
    const unsigned grid_x = (groups + kWarps - 1) / kWarps;
    GemmParts with = parts;
    with.lora.y0 = splits;
    const dim3 grid(grid_x, splits + lora_grid_rows(parts.lora, rows, grid_x), parts.count);
    const bool lora = parts.lora.x != nullptr;
#define EXL3_GEMM_LAUNCH(NG_)                                                              \
  launch(lora ? gemm_kernel<K2, CB, NG_, true> : gemm_kernel<K2, CB, NG_, false>, grid,    \
         dim3(kWarps * 32), smem, stream, with, rows, kb, kb_per_split)
    if (rows <= 8)
      EXL3_GEMM_LAUNCH(1);
    else if (rows <= 32)
      EXL3_GEMM_LAUNCH(4);
    else
      EXL3_GEMM_LAUNCH(8);
#undef EXL3_GEMM_LAUNCH
  }
}

}  // namespace gemm
}  // namespace exl3

// Defines launch_gemm_<NAME> for codebook CB_ over the K2 values in FOR_K2.
#define EXL3_DEFINE_GEMM_LAUNCHER(NAME, CB_, FOR_K2)                                       \
  namespace exl3 {                                                                         \
  bool launch_gemm_##NAME(const GemmParts& parts, int rows, int kb, int k2, int splits,    \
                          cudaStream_t stream) {                                           \
    if (rows < 1 || rows > 64 || splits < 1) return false;                                 \
    if (parts.count < 1 || parts.count > kMaxParts) return false;                          \
    if (!gemm_lora_ok(parts.lora)) return false;                                           \
    switch (k2) {                                                                          \
      FOR_K2(EXL3_GEMM_CASE_##NAME)                                                        \
      default:                                                                             \
        return false;                                                                      \
    }                                                                                      \
  }                                                                                        \
  }
