// EXL3 trellis decoding on the GPU (EXL3-FORMAT.md 3.1-3.4).
//
// One warp decodes one 16x16 tile: lane t produces steps 8t..8t+7, which land exactly
// on the registers of an m16n8k16 tensor-core A fragment of the TRANSPOSED tile
// (A row = tile column = output feature, A column = tile row = input feature):
//   reg0 = (v0, v1)  A(m=c0,   k=r0..r0+1)      reg1 = (v4, v5)  A(m=c0+8, k=r0..r0+1)
//   reg2 = (v2, v3)  A(m=c0,   k=r0+8..r0+9)    reg3 = (v6, v7)  A(m=c0+8, k=r0+8..r0+9)
// with r0 = 2*(t%4), c0 = t/4. So the GEMM multiplies Ŵᵀ·xᵀ with no data shuffling.
//
// K2 is twice the bits per weight (2..16; odd = half-integer K, mul1 only).
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

namespace exl3 {

enum Codebook : int { CB_3INST = 0, CB_MCG = 1, CB_MUL1 = 2 };

template <int K2>
struct TileBits {
  static constexpr bool kHalf = (K2 & 1) != 0;
  static constexpr int kKA = K2 / 2;
  static constexpr int kRing = kHalf ? 256 * kKA + 128 : 256 * kKA;  // bits per tile
  static constexpr int kWords = kRing / 32;                           // uint32 per tile
  // Running total of bits consumed after step i (odd steps take one more bit at half K).
  __host__ __device__ static constexpr int S(int i) {
    return kHalf ? (i + 1) * kKA + (i + 1) / 2 : (i + 1) * kKA;
  }
  // Bits covering the 8 states of one lane, and raw words loaded to hold them at any
  // bit offset.
  static constexpr int kSpan = S(7) - S(0) + 16;
  static constexpr int kLoad = (kSpan + 31) / 32 + 1;
};

__device__ __forceinline__ uint32_t h2_bits(__half2 h) {
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ __half2 bits_h2(uint32_t u) {
  return *reinterpret_cast<__half2*>(&u);
}

// Codebook values of two states, packed as half2 bits (low half = first state).
template <int CB>
__device__ __forceinline__ uint32_t codebook_pair(uint32_t s0, uint32_t s1) {
  if constexpr (CB == CB_MUL1) {
    uint32_t x0 = s0 * 0x83DCD12Du;
    uint32_t x1 = s1 * 0x83DCD12Du;
    // 0x6400 is float16 1024.0 with ulp 1, so 0x6400 + byte sum is exactly (1024 + s).
    uint32_t h0 = __dp4a(x0, 0x01010101u, 0x6400u);
    uint32_t h1 = __dp4a(x1, 0x01010101u, 0x6400u);
    __half2 v = bits_h2(__byte_perm(h0, h1, 0x5410));
    // One fused half FMA per value: the single rounding the format prescribes.
    return h2_bits(__hfma2(v, bits_h2(0x1EEE1EEEu), bits_h2(0xC931C931u)));
  } else {
    uint32_t x0, x1;
    if constexpr (CB == CB_3INST) {
      x0 = s0 * 89226354u + 64248484u;
      x1 = s1 * 89226354u + 64248484u;
    } else {
      x0 = s0 * 0xCBAC1FEDu;
      x1 = s1 * 0xCBAC1FEDu;
    }
    x0 = (x0 & 0x8FFF8FFFu) ^ 0x3B603B60u;
    x1 = (x1 & 0x8FFF8FFFu) ^ 0x3B603B60u;
    __half2 lo = bits_h2(__byte_perm(x0, x1, 0x5410));
    __half2 hi = bits_h2(__byte_perm(x0, x1, 0x7632));
    return h2_bits(__hadd2(lo, hi));
  }
}

// 16-bit window starting `pos` bits into the normalised window n (first bit = MSB).
template <int NN>
__device__ __forceinline__ uint32_t window16(const uint32_t (&n)[NN], int pos) {
  const int wi = pos >> 5;
  const int b = pos & 31;
  if (b <= 16) return (n[wi] >> (16 - b)) & 0xFFFFu;
  return __funnelshift_l(n[wi + 1], n[wi], b) >> 16;
}

// Decode lane `lane`'s 8 weights of the tile whose uint32 words start at `tw`
// (shared or global memory) into the four A-fragment registers described above.
template <int K2, int CB>
__device__ __forceinline__ void decode_lane(const uint32_t* tw, int lane, uint32_t (&a)[4]) {
  using B = TileBits<K2>;
  const int start = (B::S(8 * lane) - 16 + B::kRing) % B::kRing;  // ring bit of state 0
  const int w0 = start >> 5;
  const int off = start & 31;
  uint32_t w[B::kLoad];
#pragma unroll
  for (int i = 0; i < B::kLoad; i++) {
    int idx = w0 + i;
    if (idx >= B::kWords) idx -= B::kWords;  // tail-biting wrap
    w[i] = tw[idx];
  }
  uint32_t n[B::kLoad - 1];
#pragma unroll
  for (int i = 0; i < B::kLoad - 1; i++) n[i] = __funnelshift_l(w[i + 1], w[i], off);
  uint32_t st[8];
#pragma unroll
  for (int j = 0; j < 8; j++) st[j] = window16(n, B::S(j) - B::S(0));
  a[0] = codebook_pair<CB>(st[0], st[1]);
  a[1] = codebook_pair<CB>(st[4], st[5]);
  a[2] = codebook_pair<CB>(st[2], st[3]);
  a[3] = codebook_pair<CB>(st[6], st[7]);
}

// Supported K2 values, for switch statements: X(K2) per case.
#define EXL3_FOR_INTEGER_K2(X) X(2) X(4) X(6) X(8) X(10) X(12) X(14) X(16)
#define EXL3_FOR_HALF_K2(X) X(3) X(5) X(7)

}  // namespace exl3
