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

// Row `row`'s low value of rank column k as a float (LowRank's contract): low[row, k], or
// the sum of its float32 slices in slice order rounded to T. Every load is independent
// of the others (issued together).
template <typename T>
__device__ __forceinline__ float lora_low_value(const LowRank& lora, int row, int k) {
  if (lora.slices == 0)
    return to_f32(static_cast<const T*>(lora.low)[(size_t)row * lora.low_stride + k]);
  const float* p = static_cast<const float*>(lora.low) + (size_t)row * lora.low_stride + k;
  float s = 0.0f;
#pragma unroll 8
  for (int i = 0; i < lora.slices; i++) s += __ldg(p + (size_t)i * lora.slice_stride);
  return round_to<T>(s);
}

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
    const bool in = k < lora.rank;  // the column's slot and low value: loads side by side
    const int64_t column = in ? lora.columns[k] : 0;
    const float value = in ? lora_low_value<T>(lora, row, k) : 0.0f;
    const bool mine = in && column == slot;
    const float h = mine ? value : 0.0f;
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

// Parts whose rank columns span at most kLoraFetchRank (LowRank lo/count: a rank-16
// adapter's part of a fused q|k|v or gate|up, whose B^T is block-diagonal) take a shorter
// path: every bt load of the row's update is issued at the top of the kernel (lora_fetch,
// before the split sums are read) and the products are formed after (lora_apply), so the
// update costs about one trip to memory that overlaps the kernel's own loads instead of a
// chain of dependent ones (slot -> columns/low -> groups of bt). The same products as
// lora_delta's (the columns outside a part's range hold zeros of bt), summed in column
// order from the range's first.
constexpr int kLoraFetchRank = 16;

template <typename T, int N>
struct LoraFetch {
  Four<T> f[kLoraFetchRank][N];
  float h[N];  // lane k's low value of part p's column lo[p] + k, masked by the row's slot
  int n;  // this lane's columns inside the part (0 or 4)
  bool fast;  // this path applies (else lora_delta)
  bool on;  // the row has an adapter
};

// part[p]: the LowRank part index of the N parts (their lo/count).
template <typename T, int N>
__device__ __forceinline__ void lora_fetch(const LowRank& lora, int row, const int (&offset)[N],
                                           const int (&part)[N], int base, int cols, int lane,
                                           LoraFetch<T, N>& lf) {
  lf.fast = lf.on = false;
  lf.n = max(0, min(4, cols - base));
#pragma unroll
  for (int p = 0; p < N; p++) lf.h[p] = 0.0f;
  if (lora.low == nullptr) return;
  bool vec = cols % 4 == 0 && lora.bt_stride % 4 == 0 &&
             reinterpret_cast<uintptr_t>(lora.bt) % sizeof(Four<T>) == 0;
#pragma unroll
  for (int p = 0; p < N; p++)
    vec = vec && offset[p] % 4 == 0 && lora.count[part[p]] <= kLoraFetchRank;
  if (!vec) return;
  lf.fast = true;
  int lo[N], last[N];
#pragma unroll
  for (int p = 0; p < N; p++) {
    lo[p] = lora.lo[part[p]];
    last[p] = lo[p] + max(lora.count[part[p]], 1) - 1;  // past the count: that row again
  }
  if (lf.n > 0) {
#pragma unroll
    for (int j = 0; j < kLoraFetchRank; j++) {
#pragma unroll
      for (int p = 0; p < N; p++) {
        const size_t r = (size_t)min(lo[p] + j, last[p]) * lora.bt_stride;
        lf.f[j][p] = *reinterpret_cast<const Four<T>*>(static_cast<const T*>(lora.bt) +
                                                       offset[p] + base + r);
      }
    }
  }
  // The row's slot, the lane's column slots and low values: independent loads (one trip
  // to memory, not a chain), combined after.
  const int64_t slot = lora.slots[row];
#pragma unroll
  for (int p = 0; p < N; p++) {
    const bool in = lane < lora.count[part[p]];
    const int k = lo[p] + lane;
    const int64_t column = in ? lora.columns[k] : 0;
    const float value = in ? lora_low_value<T>(lora, row, k) : 0.0f;
    lf.h[p] = in && slot != 0 && column == slot ? value : 0.0f;
  }
  lf.on = slot != 0;
}

// The deltas of a fetched update (lora_delta's contract); false when the row has none.
template <typename T, int N>
__device__ __forceinline__ bool lora_apply(const LoraFetch<T, N>& lf, float (&d)[N][4]) {
  if (!lf.on) return false;  // uniform: a warp holds one row
  float s[N][4] = {};
#pragma unroll
  for (int j = 0; j < kLoraFetchRank; j++) {
#pragma unroll
    for (int p = 0; p < N; p++) {
      const float hj = __shfl_sync(0xffffffffu, lf.h[p], j);
#pragma unroll
      for (int e = 0; e < 4; e++) s[p][e] = fmaf(hj, to_f32(lf.f[j][p].v[e]), s[p][e]);
    }
  }
#pragma unroll
  for (int p = 0; p < N; p++)
#pragma unroll
    for (int e = 0; e < 4; e++) d[p][e] = lf.n > 0 ? round_to<T>(s[p][e]) : 0.0f;
  return true;
}

// ---- The first product folded into the kernel that makes the LoRA input (exl3_ops.h
// LoraFold). A warp holds 4 columns from `base` of its row's input (x, as rounded to T;
// 0 past k_dim); per chunk of kFoldChunk rank columns it loads those columns of A's rows
// (LoraFoldChunk, issued early: before the kernel's own loads where it can), forms the
// lane's 16 products, reduces them across the warp in 4 + 1 exchange steps (a
// reduce-scatter: lane l ends with column l >> 1), and the block adds its warps in warp
// order through shared memory into one partial sum per (slice, row, column). Fixed order
// everywhere: deterministic, no atomics.
constexpr int kFoldChunk = 16;  // the reduce-scatter below: 16 columns over 32 lanes
static_assert(kFoldMaxRank % kFoldChunk == 0, "whole chunks");

template <typename T>
struct LoraFoldChunk {
  Four<T> a[kFoldChunk];
};

template <typename T>
__device__ __forceinline__ void lora_fold_load(const LoraFold& fold, int j0, int base, int k_dim,
                                               LoraFoldChunk<T>& c) {
  const bool vec = k_dim % 4 == 0 && fold.a_stride % 4 == 0 &&
                   reinterpret_cast<uintptr_t>(fold.a) % sizeof(Four<T>) == 0;
  const T* a = static_cast<const T*>(fold.a) + base;
#pragma unroll
  for (int j = 0; j < kFoldChunk; j++) {
    const size_t r = (size_t)min(j0 + j, fold.rank - 1) * fold.a_stride;  // past the rank:
    if (vec) {                                                          // the last row, unused
      if (base < k_dim) c.a[j] = *reinterpret_cast<const Four<T>*>(a + r);
      else c.a[j] = Four<T>{};
    } else {
#pragma unroll
      for (int e = 0; e < 4; e++) c.a[j].v[e] = base + e < k_dim ? a[r + e] : from_f32<T>(0.0f);
    }
  }
}

// Lane l's share of chunk j0: the warp's sum for column j0 + (l >> 1), written to
// red[j0 + (l >> 1)] by the even lanes (red: this warp's kFoldMaxRank floats in shared).
template <typename T>
__device__ __forceinline__ void lora_fold_dot(const LoraFoldChunk<T>& c, const float (&x)[4],
                                              int lane, int j0, float* red) {
  float s[kFoldChunk];
#pragma unroll
  for (int j = 0; j < kFoldChunk; j++) {
    float t = 0.0f;
#pragma unroll
    for (int e = 0; e < 4; e++) t = fmaf(x[e], to_f32(c.a[j].v[e]), t);
    s[j] = t;
  }
  // Step h (16, 8, 4, 2): lanes with bit h keep the upper half of their n values and
  // send the lower half; the partner keeps the lower half. Then one plain exchange.
#pragma unroll
  for (int n = kFoldChunk, h = 16; n > 1; n >>= 1, h >>= 1) {
    const bool upper = lane & h;
#pragma unroll
    for (int i = 0; i < n / 2; i++) {
      const float send = upper ? s[i] : s[i + n / 2];
      const float keep = upper ? s[i + n / 2] : s[i];
      s[i] = keep + __shfl_xor_sync(0xffffffffu, send, h);
    }
  }
  const float total = s[0] + __shfl_xor_sync(0xffffffffu, s[0], 1);
  if ((lane & 1) == 0) red[j0 + (lane >> 1)] = total;
}

// One block's share of the fold: WARPS warps (WARPS * 32 >= kFoldChunk; red: WARPS *
// kFoldMaxRank floats in shared memory), all of them one row's, slice `slice`, the chunks
// from column first, first + step, ... below the rank. `c` holds chunk `first`, loaded by the caller; every thread of the block calls
// this (it synchronises the block).
template <typename T, int WARPS>
__device__ __forceinline__ void lora_fold_block(const LoraFold& fold, LoraFoldChunk<T>& c,
                                                const float (&x)[4], int base, int k_dim,
                                                int rows, int row, int slice, int first,
                                                int step, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int j0 = first; j0 < fold.rank; j0 += step) {
    if (j0 > first) lora_fold_load<T>(fold, j0, base, k_dim, c);
    lora_fold_dot<T>(c, x, lane, j0, red + warp * kFoldMaxRank);
  }
  __syncthreads();
  float* out = fold.partial + ((size_t)slice * rows + row) * fold.rank;
  for (int j0 = first; j0 < fold.rank; j0 += step) {
    const int j = j0 + threadIdx.x;
    if (threadIdx.x >= kFoldChunk || j >= fold.rank) continue;
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; w++) t += red[w * kFoldMaxRank + j];
    out[j] = t;
  }
}

}  // namespace exl3
