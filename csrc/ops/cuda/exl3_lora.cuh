// The LoRA update of the fused decode layer's output kernels (layer_fused.cu; exl3_ops.h
// LowRank): per row, the masked low-rank product with B^T at a lane's 4 columns.
#pragma once

#include <cstdint>

#include "exl3_convert.cuh"
#include "exl3_ops.h"

namespace exl3 {

// v rounded to T and back: where the PyTorch path rounds to the activation dtype.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_f32(from_f32<T>(v));
}

// The bt rows a warp reads between two waits on memory, over all parts: their loads are
// issued together (a rank-16 adapter's columns are two rounds of loads, not 16). A/B with
// EXL3_NVCC_FLAGS=-DEXL3_LORA_LOADS=16 (a power of two, 2..32).
#ifndef EXL3_LORA_LOADS
#define EXL3_LORA_LOADS 8
#endif
constexpr int kLoraLoads = EXL3_LORA_LOADS;
static_assert(kLoraLoads >= 2 && kLoraLoads <= 32 && (kLoraLoads & (kLoraLoads - 1)) == 0,
              "EXL3_LORA_LOADS: a power of two, 2..32");

template <typename T>
struct alignas(4 * sizeof(T)) Four {
  T v[4];
};

// s[p][e] += sum over the rank columns k0 + j (j < 32, k0 + j < rank) of h_j *
// bt[k0 + j, col[p] + e], h_j lane j's value of h (0 but for the row's own adapter's
// columns, the bits of `m`; bt is finite); groups of U = kLoraLoads / N columns without
// a bit are skipped. VEC: each part's 4 columns are one aligned vector load (n is 0 or
// 4); else scalar loads of the first n.
template <typename T, int N, bool VEC>
__device__ __forceinline__ void lora_columns(const T* const (&col)[N], int64_t stride, int rank,
                                             int k0, unsigned m, float h, int n,
                                             float (&s)[N][4]) {
  constexpr int U = kLoraLoads / N;
  for (int j0 = 0; j0 < 32; j0 += U) {
    if (((m >> j0) & ((1u << U) - 1)) == 0) continue;
    Four<T> f[U][N];  // every load of the group first, then the products
#pragma unroll
    for (int j = 0; j < U; j++) {
      // Columns past the rank read the last one (h_j is 0 there, as for another
      // adapter's columns): every load of the group is issued, none out of bounds.
      const size_t r = (size_t)min(k0 + j0 + j, rank - 1) * stride;
#pragma unroll
      for (int p = 0; p < N; p++) {
        if (VEC) {
          if (n > 0) f[j][p] = *reinterpret_cast<const Four<T>*>(col[p] + r);
        } else {
#pragma unroll
          for (int e = 0; e < 4; e++)
            if (e < n) f[j][p].v[e] = col[p][r + e];
        }
      }
    }
#pragma unroll
    for (int j = 0; j < U; j++) {
      const float hj = __shfl_sync(0xffffffffu, h, j0 + j);
#pragma unroll
      for (int p = 0; p < N; p++)
#pragma unroll
        for (int e = 0; e < 4; e++)
          if (e < n) s[p][e] = fmaf(hj, to_f32(f[j][p].v[e]), s[p][e]);
    }
  }
}

// The LoRA deltas (exl3_ops.h LowRank) of `row` at 4 columns from `base` of N parts whose
// columns start at offset[p] in bt, rounded to T; false (d untouched) when the row has no
// adapter. Columns from `cols` on get 0. Lane k holds rank column k0 + k's low value
// masked by the row's slot; the warp walks the groups of columns that hold the row's
// adapter (ballot). Every branch but the lane's own column range is uniform.
template <typename T, int N>
__device__ __forceinline__ bool lora_delta(const LowRank& lora, int row, const int (&offset)[N],
                                           int base, int cols, int lane, float (&d)[N][4]) {
  if (lora.low == nullptr) return false;
  const int64_t slot = lora.slots[row];
  if (slot == 0) return false;
  const T* low = static_cast<const T*>(lora.low) + (size_t)row * lora.low_stride;
  const int n = max(0, min(4, cols - base));  // this lane's columns inside the part
  bool vec = cols % 4 == 0 && lora.bt_stride % 4 == 0 &&
             reinterpret_cast<uintptr_t>(lora.bt) % sizeof(Four<T>) == 0;
  const T* col[N];
#pragma unroll
  for (int p = 0; p < N; p++) {
    col[p] = static_cast<const T*>(lora.bt) + offset[p] + base;
    vec = vec && offset[p] % 4 == 0;
  }
  float s[N][4] = {};
  for (int k0 = 0; k0 < lora.rank; k0 += 32) {
    const int k = k0 + lane;
    const bool mine = k < lora.rank && lora.columns[k] == slot;
    const float h = mine ? to_f32(low[k]) : 0.0f;
    const unsigned m = __ballot_sync(0xffffffffu, mine);
    if (vec)
      lora_columns<T, N, true>(col, lora.bt_stride, lora.rank, k0, m, h, n, s);
    else
      lora_columns<T, N, false>(col, lora.bt_stride, lora.rank, k0, m, h, n, s);
  }
#pragma unroll
  for (int p = 0; p < N; p++)
#pragma unroll
    for (int e = 0; e < 4; e++) d[p][e] = round_to<T>(s[p][e]);
  return true;
}

// Ranks up to kLoraFetchRank take a shorter path: every bt load of the row's update is
// issued at the top of the kernel (lora_fetch, before the split sums are read) and the
// products are formed after (lora_apply), so the update costs about one trip to memory
// that overlaps the kernel's own loads instead of a chain of dependent ones (slot ->
// columns/low -> groups of bt). Same sums in the same order as lora_delta.
constexpr int kLoraFetchRank = 16;

template <typename T, int N>
struct LoraFetch {
  Four<T> f[kLoraFetchRank][N];
  float h;  // lane k's low value masked by the row's slot (k < rank)
  int n;  // this lane's columns inside the part (0 or 4)
  bool fast;  // this path applies (else lora_delta)
  bool on;  // the row has an adapter
};

template <typename T, int N>
__device__ __forceinline__ void lora_fetch(const LowRank& lora, int row, const int (&offset)[N],
                                           int base, int cols, int lane, LoraFetch<T, N>& lf) {
  lf.fast = lf.on = false;
  lf.h = 0.0f;
  lf.n = max(0, min(4, cols - base));
  if (lora.low == nullptr || lora.rank > kLoraFetchRank) return;
  bool vec = cols % 4 == 0 && lora.bt_stride % 4 == 0 &&
             reinterpret_cast<uintptr_t>(lora.bt) % sizeof(Four<T>) == 0;
#pragma unroll
  for (int p = 0; p < N; p++) vec = vec && offset[p] % 4 == 0;
  if (!vec) return;
  lf.fast = true;
  if (lf.n > 0) {
#pragma unroll
    for (int j = 0; j < kLoraFetchRank; j++) {
      const size_t r = (size_t)min(j, lora.rank - 1) * lora.bt_stride;
#pragma unroll
      for (int p = 0; p < N; p++)
        lf.f[j][p] = *reinterpret_cast<const Four<T>*>(static_cast<const T*>(lora.bt) +
                                                       offset[p] + base + r);
    }
  }
  const int64_t slot = lora.slots[row];
  const T* low = static_cast<const T*>(lora.low) + (size_t)row * lora.low_stride;
  const bool mine = lane < lora.rank && slot != 0 && lora.columns[lane] == slot;
  lf.h = mine ? to_f32(low[lane]) : 0.0f;
  lf.on = slot != 0;
}

// The deltas of a fetched update (lora_delta's contract); false when the row has none.
template <typename T, int N>
__device__ __forceinline__ bool lora_apply(const LoraFetch<T, N>& lf, float (&d)[N][4]) {
  if (!lf.on) return false;  // uniform: a warp holds one row
  float s[N][4] = {};
#pragma unroll
  for (int j = 0; j < kLoraFetchRank; j++) {
    const float hj = __shfl_sync(0xffffffffu, lf.h, j);
#pragma unroll
    for (int p = 0; p < N; p++)
#pragma unroll
      for (int e = 0; e < 4; e++) s[p][e] = fmaf(hj, to_f32(lf.f[j][p].v[e]), s[p][e]);
  }
#pragma unroll
  for (int p = 0; p < N; p++)
#pragma unroll
    for (int e = 0; e < 4; e++) d[p][e] = lf.n > 0 ? round_to<T>(s[p][e]) : 0.0f;
  return true;
}

}  // namespace exl3
