// Build-time variants of the fused decode + GEMM (gemm_impl.cuh), picked with
// EXL3_NVCC_FLAGS=-DEXL3_GEMM_VARIANT=N (default 4, below); 0 is gemm_kernel alone. Same
// launch contract and partial layout (exl3_ops.h). bench/NOTES-gpu.md, "For the next run:
// batch-1 GEMM variants", has the per-shape analysis and the predictions.
//
// 1 (lean loop, 1-8 rows; more rows run gemm_kernel): the ring unrolled (a stage's slot
//   is a compile-time constant: shared-memory addresses are per-lane word pointers plus
//   immediates); one warp barrier per step (a slot is refilled right after the barrier
//   that ends every lane's reads of it); full-width column groups run without per-tile
//   predicates; one flattened grid over the parts (no empty blocks when q/k/v or gate/up
//   differ in width); at K = 4 and 8, where a lane's bit offset in its words is the same
//   for every lane, the states come from the raw words at compile-time positions (no
//   normalising funnel shifts, one word fewer loaded at K = 4); a state 0, 8 or 16 bits
//   into a word costs one PRMT / shift / mask.
// 2 (lean + tensor-core byte sums): 1, and mul1's byte sums (one dp4a per weight) run on
//   the tensor cores: one m16n8k32 u8 mma whose constant B operand holds ones at rows
//   4*sigma(n)..4*sigma(n)+3 of column n, sigma(n) = n/2 + 4*(n%2), returns in each lane
//   the byte sums of that lane's own four A registers (d0..d3 = sums of a0, a2, a1, a3):
//   2 mma instead of 8 dp4a per tile, exact (integer sums, C = 0x6400 as dp4a's addend).
// 3: 2 at every row count (9-64 rows: the loop kept rolled; 127-160 registers at 9-32
//   rows and 236-242 at 33-64 against gemm_kernel's 96 and 168-178, no spills).
// 4 (the default): the lean loop at every row count, the tensor-core byte sums only at
//   9-64 rows: run 28 measured 1 over 2 at one row (1.13-1.56x over 0, 2 at 1.03-1.41x)
//   and 3 over 0-2 at 16 rows (1.07-1.60x; 1 and 2 run gemm_kernel there).
// 5: the lean loop at every row count, never the tensor-core sums (4's A/B at 9-64 rows).
#pragma once

#ifndef EXL3_GEMM_VARIANT
#define EXL3_GEMM_VARIANT 4
#endif
#if EXL3_GEMM_VARIANT < 0 || EXL3_GEMM_VARIANT > 5
#error "EXL3_GEMM_VARIANT must be 0 to 5"
#endif

namespace exl3 {
namespace gemm {
namespace lean {

// Where lane `lane`'s 16-bit state windows lie in its tile (exl3_trellis.cuh decode_lane).
template <int K2>
struct Lane {
  using B = TileBits<K2>;
  // 8*K bits per lane: a multiple of 32 at K = 4 and 8, so every lane starts at one offset.
  static constexpr bool kFixed = (K2 % 8) == 0;
  static constexpr int kOff = (B::S(0) - 16 + B::kRing) % 32;  // bit offset when kFixed
  static constexpr int kLoad = kFixed ? (kOff + B::kSpan + 31) / 32 : B::kLoad;
};

template <int P, int N>
__host__ __device__ constexpr bool fits16() {
  return (P >> 5) < N && ((P & 31) <= 16 || (P >> 5) + 1 < N);
}
template <int P>
__host__ __device__ constexpr int cost16() {
  return ((P & 31) == 0 || (P & 31) == 8 || (P & 31) == 16) ? 1 : 2;
}

// The 16 bits at bit P (first bit = MSB of w[0]) of the words w, zero-extended.
template <int P, int N>
__device__ __forceinline__ uint32_t bits16(const uint32_t (&w)[N]) {
  static_assert(fits16<P, N>(), "state outside the loaded words");
  constexpr int a = P >> 5, b = P & 31;
  if constexpr (b == 0) return w[a] >> 16;
  else if constexpr (b == 16) return w[a] & 0xFFFFu;
  else if constexpr (b == 8) return __byte_perm(w[a], 0u, 0x4421);
  else if constexpr (b < 16) return (w[a] >> (16 - b)) & 0xFFFFu;
  else return __funnelshift_l(w[a + 1], w[a], b) >> 16;
}

// State j of a lane from its loaded words w (kFixed: raw words, else normalised by `off`).
template <int K2, int J>
__device__ __forceinline__ uint32_t state(const uint32_t (&w)[Lane<K2>::kLoad],
                                          const uint32_t (&n)[Lane<K2>::kLoad - 1]) {
  using B = TileBits<K2>;
  using L = Lane<K2>;
  constexpr int Q = B::S(J) - B::S(0);  // position in the normalised window n
  if constexpr (L::kFixed) {
    constexpr int P = L::kOff + Q;  // position in the raw words
    if constexpr (fits16<Q, L::kLoad - 1>() && cost16<Q>() < cost16<P>()) return bits16<Q>(n);
    else return bits16<P>(w);
  } else {
    return bits16<Q>(n);
  }
}

template <int K2>
__device__ __forceinline__ void states(const uint32_t (&w)[Lane<K2>::kLoad], int off,
                                       uint32_t (&st)[8]) {
  using L = Lane<K2>;
  const int shift = L::kFixed ? L::kOff : off;
  uint32_t n[L::kLoad - 1];  // unused words are dead code in the fixed case
#pragma unroll
  for (int i = 0; i < L::kLoad - 1; i++) n[i] = __funnelshift_l(w[i + 1], w[i], shift);
  st[0] = state<K2, 0>(w, n);
  st[1] = state<K2, 1>(w, n);
  st[2] = state<K2, 2>(w, n);
  st[3] = state<K2, 3>(w, n);
  st[4] = state<K2, 4>(w, n);
  st[5] = state<K2, 5>(w, n);
  st[6] = state<K2, 6>(w, n);
  st[7] = state<K2, 7>(w, n);
}

// d = (bytesum(x0), bytesum(x2), bytesum(x1), bytesum(x3)) + c, one u8 tensor-core mma
// (b0/b1: this lane's share of the constant 0/1 B operand, see the file comment).
__device__ __forceinline__ void bytesums(uint32_t (&d)[4], uint32_t x0, uint32_t x1, uint32_t x2,
                                         uint32_t x3, uint32_t b0, uint32_t b1, uint32_t c) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%10,%10,%10};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(x0), "r"(x1), "r"(x2), "r"(x3), "r"(b0), "r"(b1), "r"(c));
}

// The A fragment of one tile from the lane's 8 states (decode_lane's register order).
template <int CB, bool kTC>
__device__ __forceinline__ void fragment(const uint32_t (&st)[8], uint32_t b0, uint32_t b1,
                                         uint32_t (&a)[4]) {
  if constexpr (kTC) {
    uint32_t x[8];
#pragma unroll
    for (int j = 0; j < 8; j++) x[j] = st[j] * 0x83DCD12Du;
    uint32_t d[4], e[4];
    bytesums(d, x[0], x[1], x[4], x[5], b0, b1, 0x6400u);  // h0, h4, h1, h5
    bytesums(e, x[2], x[3], x[6], x[7], b0, b1, 0x6400u);  // h2, h6, h3, h7
    const __half2 scale = bits_h2(0x1EEE1EEEu), bias = bits_h2(0xC931C931u);
    a[0] = h2_bits(__hfma2(bits_h2(__byte_perm(d[0], d[2], 0x5410)), scale, bias));
    a[1] = h2_bits(__hfma2(bits_h2(__byte_perm(d[1], d[3], 0x5410)), scale, bias));
    a[2] = h2_bits(__hfma2(bits_h2(__byte_perm(e[0], e[2], 0x5410)), scale, bias));
    a[3] = h2_bits(__hfma2(bits_h2(__byte_perm(e[1], e[3], 0x5410)), scale, bias));
  } else {
    a[0] = codebook_pair<CB>(st[0], st[1]);
    a[1] = codebook_pair<CB>(st[4], st[5]);
    a[2] = codebook_pair<CB>(st[2], st[3]);
    a[3] = codebook_pair<CB>(st[6], st[7]);
  }
}

// No input side of the warp's own (prep, below).
struct NoPrep {
  __device__ __forceinline__ void operator()() const {}
};

// One warp: tile columns nb0..nb0+tn-1 (kFull: tn == kTN) over tile rows kb0..kb1-1.
// kSmemX (gemm_pro.cuh): x comes from xs (xh unused), shared memory holding the columns
// from x_col0 on with a row stride of x_stride halves, written by prep(), which runs
// right after pdl_wait() (the weights' first stages in flight); xs is not __restrict__,
// so no load of it moves above prep()'s stores and barrier. Else x is xh, global (rows,
// 16*kb_total).
template <int K2, int CB, int NG, bool kFull, bool kSmemX = false, typename Prep = NoPrep>
__device__ __forceinline__ void warp_gemm(const __half* __restrict__ xh,
                                          const uint32_t* __restrict__ trellis,
                                          float* __restrict__ part, int nb_total, int nb0,
                                          int tn, int rows, int kb_total, int kb0, int kb1,
                                          uint32_t* ring, int lane, const Prep& prep = Prep{},
                                          int x_stride = 0, int x_col0 = 0,
                                          const __half* xs = nullptr) {
  using B = TileBits<K2>;
  using L = Lane<K2>;
  constexpr bool kTC = CB == CB_MUL1 && (EXL3_GEMM_VARIANT == 2 || EXL3_GEMM_VARIANT == 3 ||
                                         (EXL3_GEMM_VARIANT == 4 && NG > 1));
  constexpr int W = B::kWords;
  constexpr int kStageWords = kTN * W;
  constexpr int kChunks = kStageWords / 4;  // 16-byte pieces per full stage
  constexpr int kIters = (kChunks + 31) / 32;
  const int chunks = kFull ? kChunks : tn * W / 4;
  const size_t row_bytes = (size_t)nb_total * W * 4;
  const char* src = reinterpret_cast<const char*>(trellis + (size_t)nb0 * W) + lane * 16 +
                    (size_t)kb0 * row_bytes;
  const uint32_t dst_lane = static_cast<uint32_t>(__cvta_generic_to_shared(ring)) + lane * 16;
  auto issue = [&](int slot) {
    const uint32_t dst = dst_lane + slot * (kStageWords * 4);
#pragma unroll
    for (int i = 0; i < kIters; i++)
      if ((kFull && (kChunks % 32) == 0) || lane + 32 * i < chunks)
        cp_async16(dst + 512 * i, src + 512 * i);
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; s++) {
    if (kb0 + s < kb1) issue(s);
    src += row_bytes;
    cp_async_commit();
  }

  // Per-lane constants: the words of the lane's window (tail-biting wrap), its bit
  // offset, the tensor-core B operand, the x fragment's address.
  const int start = (B::S(8 * lane) - 16 + B::kRing) % B::kRing;
  const int off = start & 31;
  int idx[L::kLoad];
#pragma unroll
  for (int i = 0; i < L::kLoad; i++) {
    int w = (start >> 5) + i;
    idx[i] = w >= W ? w - W : w;
  }
  const int gid = lane >> 2;      // B fragment column = row of x within its group of 8
  const int k2 = 2 * (lane & 3);  // B fragment k offset
  const int sigma = (gid >> 1) + 4 * (gid & 1);
  const uint32_t tc_b0 = sigma == (lane & 3) ? 0x01010101u : 0u;
  const uint32_t tc_b1 = sigma == (lane & 3) + 4 ? 0x01010101u : 0u;
  const int in_cols = kSmemX ? x_stride : kb_total * 16;
  const __half* x_lane =
      kSmemX ? xs + (gid * in_cols + (kb0 * 16 - x_col0) + k2)
             : xh + (size_t)gid * in_cols + (size_t)kb0 * 16 + k2;
  const size_t x_group = (size_t)8 * in_cols;  // halves between groups of 8 rows

  pdl_wait();  // the weights are in flight; xh (and the partial buffer) belong to the step
  prep();

  float acc[NG][kTN][4];
#pragma unroll
  for (int g = 0; g < NG; g++)
#pragma unroll
    for (int t = 0; t < kTN; t++)
#pragma unroll
      for (int e = 0; e < 4; e++) acc[g][t][e] = 0.0f;

  // The ring unrolled: a stage's slot is a compile-time constant, so the shared-memory
  // addresses are the lane's word pointers plus immediates.
  const uint32_t* words[L::kLoad];
#pragma unroll
  for (int i = 0; i < L::kLoad; i++) words[i] = ring + idx[i];
  // More row groups keep the loop rolled (unrolled, ptxas hoists their x loads and spills).
  constexpr int kUnroll = NG == 1 ? kStages : 1;
  int dyn = 0;  // the slot of a rolled loop
  for (int kb = kb0; kb < kb1; kb += kUnroll) {
#pragma unroll
    for (int u = 0; u < kUnroll; u++) {
      if (kb + u >= kb1) break;
      const int slot = NG == 1 ? u : dyn;
      uint32_t b[NG][2];
#pragma unroll
      for (int g = 0; g < NG; g++) {
        if (g * 8 + gid < rows) {
          const uint32_t* xr =
              reinterpret_cast<const uint32_t*>(x_lane + g * x_group + u * 16);
          if constexpr (kSmemX) {
            b[g][0] = xr[0];
            b[g][1] = xr[4];
          } else {
            b[g][0] = __ldg(xr);
            b[g][1] = __ldg(xr + 4);
          }
        } else {
          b[g][0] = 0u;
          b[g][1] = 0u;
        }
      }
      cp_async_wait<kStages - 2>();  // this step's stage has landed (for this lane)
      __syncwarp();                  // ... for every lane; every lane is done with slot - 1
      if (kb + u + kStages - 1 < kb1) issue((slot + kStages - 1) % kStages);
      src += row_bytes;
      cp_async_commit();
#pragma unroll
      for (int t = 0; t < kTN; t++) {
        if (kFull || t < tn) {
          uint32_t w[L::kLoad];
#pragma unroll
          for (int i = 0; i < L::kLoad; i++) w[i] = words[i][slot * kStageWords + t * W];
          uint32_t st[8];
          states<K2>(w, off, st);
          uint32_t a[4];
          fragment<CB, kTC>(st, tc_b0, tc_b1, a);
#pragma unroll
          for (int g = 0; g < NG; g++)
            if (NG == 1 || g * 8 < rows) mma_16816(acc[g][t], a, b[g][0], b[g][1]);
        }
      }
      if (NG > 1 && ++dyn == kStages) dyn = 0;
    }
    x_lane += kUnroll * 16;
  }

  const size_t out_cols = (size_t)nb_total * 16;
#pragma unroll
  for (int t = 0; t < kTN; t++) {
    if (!kFull && t >= tn) continue;
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

// Column groups of kTN tiles of all parts in one flattened x dimension (blockIdx.x *
// kWarps + warp), runs of tile rows in y; no block-wide barriers (warps leave early).
// LORA: the grid rows from parts.lora.y0 on compute the launch's LoRA product (gemm_lora.cuh).
template <int K2, int CB, int NG, bool LORA>
__global__ void __launch_bounds__(kWarps * 32)
    gemm_kernel_lean(const __grid_constant__ GemmParts parts, int rows, int kb_total,
                     int kb_per_split) {
  pdl_trigger();
  constexpr int kStageWords = kTN * TileBits<K2>::kWords;
  extern __shared__ __align__(16) uint32_t smem[];
  if constexpr (LORA) {
    if ((int)blockIdx.y >= parts.lora.y0) {
      lora_rows<kWarps>(parts.lora, rows, reinterpret_cast<float*>(smem));
      return;
    }
  }
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  int group = blockIdx.x * kWarps + warp;
  int p = 0;
  for (; p < parts.count; p++) {
    const int groups = (parts.part[p].nb + kTN - 1) / kTN;
    if (group < groups) break;
    group -= groups;
  }
  if (p >= parts.count) return;
  const GemmPart& mine = parts.part[p];
  const int nb_total = mine.nb;
  const int nb0 = group * kTN;
  const int tn = min(kTN, nb_total - nb0);
  const int split = blockIdx.y;
  const int kb0 = split * kb_per_split;
  const int kb1 = min(kb0 + kb_per_split, kb_total);
  const __half* xh = static_cast<const __half*>(mine.xh);
  const uint32_t* trellis = static_cast<const uint32_t*>(mine.trellis);
  float* part = mine.partial + (size_t)split * rows * nb_total * 16;
  uint32_t* ring = smem + warp * kStages * kStageWords;
  if (tn == kTN)
    warp_gemm<K2, CB, NG, true>(xh, trellis, part, nb_total, nb0, tn, rows, kb_total, kb0, kb1,
                                ring, lane);
  else
    warp_gemm<K2, CB, NG, false>(xh, trellis, part, nb_total, nb0, tn, rows, kb_total, kb0,
                                 kb1, ring, lane);
}

// Variants 1 and 2 run 1-8 rows (gemm_kernel the rest: more row groups cost the lean loop
// 128-160 and 220-240 registers against gemm_kernel's 96 and 168-178); 3-5 run all rows.
constexpr bool kAllRows = EXL3_GEMM_VARIANT >= 3;

template <int K2, int CB>
void run(const GemmParts& parts, int rows, int kb, int splits, cudaStream_t stream) {
  const size_t smem = (size_t)kWarps * kStages * kTN * TileBits<K2>::kWords * 4;
  int groups = 0;
  for (int p = 0; p < parts.count; p++) groups += (parts.part[p].nb + kTN - 1) / kTN;
  const int kb_per_split = (kb + splits - 1) / splits;
  const unsigned grid_x = (groups + kWarps - 1) / kWarps;
  GemmParts with = parts;
  with.lora.y0 = splits;
  const dim3 grid(grid_x, splits + lora_grid_rows(parts.lora, rows, grid_x), 1);
  const bool lora = parts.lora.x != nullptr;
#define EXL3_LEAN_LAUNCH(NG_)                                                                 \
  launch(lora ? gemm_kernel_lean<K2, CB, NG_, true> : gemm_kernel_lean<K2, CB, NG_, false>,   \
         grid, dim3(kWarps * 32), smem, stream, with, rows, kb, kb_per_split)
  if (rows <= 8) {
    EXL3_LEAN_LAUNCH(1);
  } else if constexpr (kAllRows) {
    if (rows <= 32)
      EXL3_LEAN_LAUNCH(4);
    else
      EXL3_LEAN_LAUNCH(8);
  }
#undef EXL3_LEAN_LAUNCH
}

}  // namespace lean
}  // namespace gemm
}  // namespace exl3
