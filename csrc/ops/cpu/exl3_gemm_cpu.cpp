// EXL3 linear layers on the CPU straight from the packed trellis (exl3cli/ops/cpu_kernels.py
// has the PyTorch twins; exl3cli/engine/layers/cpu_exl3.py is the layer that calls them).
//
//   y = H(H(x * suh) @ Ŵ) * svh + bias      (H: 128-point block Hadamard, Ŵ decoded)
//
// Ŵ is never stored: each 16x16 tile is decoded into registers row by row (16 output
// columns per AVX-512 vector) and multiplied into the accumulators at once, so the
// weights stay at their file size in RAM (K bits per weight) and a decode step reads
// K/32 of the bytes of the float32 matrix.
//
// Decoding one tile row (16 positions): the tile's ring of 256*K bits is 8*K uint32
// words (the int16 words of the file read as little-endian uint32, bits taken most
// significant first). The 16-bit state at a position is the window ending at its step's
// last bit; a per-K table gives, for every tile position, the word holding the window's
// first bit, the next word of the ring and the bit offset. The two words come from
// registers (vpermd / vpermt2d for rings of up to 32 words, K <= 4; two vpermt2d and a
// blend up to 64 words, K <= 8); two variable shifts make the state; the codebook is
// evaluated in registers (mul1: multiply, byte sum, one FMA; 3inst/mcg: multiply, mask,
// xor, two float16 halves added) and rounded to float16 once like the reference (a
// native float16 FMA/add with AVX512-FP16), so the decoded values are bit-identical to
// exl3cli.codec.decode_tiles. A CPU without AVX-512 decodes through the codebook
// table, one value at a time.
//
// Ops (registered in torch.ops.exl3_cpu):
//   exl3_decode(trellis_t, k_bits, codebook, lut) -> Ŵ (16*kb, 16*nb) float32
//   exl3_matmul(xh, trellis_t, k_bits, codebook, lut) -> xh @ Ŵ (M, 16*nb)
//   exl3_linear(x, trellis_t, suh, svh, bias, k_bits, codebook, n, lut) -> y (M, n)
// trellis_t is the file's trellis with its two tile axes swapped: (nb, kb, words), so
// the tiles of one 16-column strip are contiguous. codebook: 0 3inst, 1 mcg, 2 mul1.
// lut (65536 float32 values, codebook_lut_float32) serves the scalar build only.
// Up to kGemvRows rows run the fused decode-multiply; more rows (prompts) decode
// column strips of Ŵ once and multiply them with at::mm. Parallel over 16-column
// strips with at::parallel_for.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>
#include "decode_pool.h"
#include "exl3_gemm_cpu.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
// The step-order GEMV (exl3_step_gemv.h) needs AVX-512 BW; with AVX512-FP16 it rounds the
// codebook in float16, without it in float32 (the same bits). The row-pair kernel of 3-8
// rows needs AVX512-FP16.
#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(EXL3_CPU_NO_STEPS)
#define EXL3_STEP_PATH 1
#endif
#if defined(__AVX512FP16__) && defined(EXL3_STEP_PATH) && !defined(EXL3_CPU_NO_FP16)
#define EXL3_FP16_PATH 1
#endif

namespace {
#if defined(EXL3_STEP_PATH)
#include "exl3_step_gemv.h"
#endif

constexpr int kSteps = 256;
constexpr int64_t kGemvRows = 8;
constexpr int64_t kHadamard = 128;
constexpr int64_t kStripBytes = 8 << 20;  // decoded strip size for the prompt path
// Weights one thread's share of a 1-8 row product holds at least (~8 us of decoding):
// a small projection (k/v of a small model) is not split into tasks that cost less than
// waking a thread; an 8B layer's (kb 256) still splits at every strip.
constexpr int64_t kTaskWeights = int64_t{1} << 16;

// The at::parallel_for grain (strips per task) of a 16-column strip of kb tiles.
inline int64_t strip_grain(int64_t kb) { return std::max<int64_t>(1, kTaskWeights / (256 * kb)); }

// Where each tile position's 16-bit window lies in the ring (see the header comment).
struct StepTable {
  alignas(64) int32_t first[kSteps];
  alignas(64) int32_t second[kSteps];
  alignas(64) int32_t offset[kSteps];
  alignas(64) int32_t rest[kSteps];  // 32 - offset
  // The same in 16-bit ring words (file word index, offset) for the
  // AVX512-FP16 path, which decodes two tile rows (32 positions) per vector.
  alignas(64) int16_t first16[kSteps];
  alignas(64) int16_t second16[kSteps];
  alignas(64) int16_t offset16[kSteps];
  int words32 = 0;
#if defined(EXL3_STEP_PATH)
  StepOrderTable order;  // the step-order GEMV's (exl3_step_gemv.h)
#endif
};

// Tile position (16 * row + col) of trellis step p (codec/tiles.py).
int position_of_step(int p) {
  static const int row_of_j[4] = {0, 1, 8, 9};
  const int t = p / 8, j = p % 8;
  const int row = (t % 4) * 2 + row_of_j[j % 4];
  const int col = t / 4 + (j >= 4 ? 8 : 0);
  return 16 * row + col;
}

StepTable make_table(int half_k) {
  StepTable table;
  int per_step[kSteps];
  int ring = 0;
  for (int i = 0; i < kSteps; ++i) {
    per_step[i] = half_k % 2 == 0 ? half_k / 2 : half_k / 2 + ((0xAAAA >> (i & 15)) & 1);
    ring += per_step[i];
  }
  table.words32 = ring / 32;
  int end = 0, starts[kSteps];
  for (int p = 0; p < kSteps; ++p) {
    end += per_step[p];
    const int start = ((end - 16) % ring + ring) % ring;
    starts[p] = start;
    const int q = position_of_step(p);
    table.first[q] = start >> 5;
    table.second[q] = (table.first[q] + 1) % table.words32;
    table.offset[q] = start & 31;
    table.rest[q] = 32 - table.offset[q];
    // Ring word c (16 bits, most significant first) is file word c ^ 1: each uint32
    // is a little-endian pair of int16.
    const int chunk = start >> 4, chunks = 2 * table.words32;
    table.first16[q] = static_cast<int16_t>(chunk ^ 1);
    table.second16[q] = static_cast<int16_t>(((chunk + 1) % chunks) ^ 1);
    table.offset16[q] = static_cast<int16_t>(start & 15);
  }
#if defined(EXL3_STEP_PATH)
  table.order = make_step_table(starts, 2 * table.words32);
#endif
  return table;
}

// Valid K (bits per weight) as 2K: 1..8 and 1.5, 2.5, 3.5.
bool valid_half_k(int half_k) {
  return (half_k >= 2 && half_k <= 16 && half_k % 2 == 0) || half_k == 3 || half_k == 5 ||
         half_k == 7;
}

const StepTable& table_for(int half_k) {
  static const std::array<StepTable, 17> tables = [] {
    std::array<StepTable, 17> all{};
    for (int h = 2; h <= 16; ++h)
      if (valid_half_k(h)) all[h] = make_table(h);
    return all;
  }();
  return tables[half_k];
}

// The state at tile position q of a tile whose ring is `ring` (scalar path).
inline uint32_t state_at(const int16_t* tile, const StepTable& t, int q) {
  uint32_t a, b;
  std::memcpy(&a, tile + 2 * t.first[q], 4);
  std::memcpy(&b, tile + 2 * t.second[q], 4);
  const int o = t.offset[q];
  const uint32_t window = (a << o) | (o ? b >> (32 - o) : 0u);
  return window >> 16;
}

#if defined(__AVX512F__)
constexpr bool kSimd = true;

// Codebook values of 16 states, rounded to float16 (returned widened).
template <int CB>
inline __m512i codebook_hash(__m512i state) {
  if constexpr (CB == 0)
    return _mm512_add_epi32(_mm512_mullo_epi32(state, _mm512_set1_epi32(89226354)),
                            _mm512_set1_epi32(64248484));
  else if constexpr (CB == 1)
    return _mm512_mullo_epi32(state, _mm512_set1_epi32(static_cast<int>(0xCBAC1FEDu)));
  else
    return _mm512_mullo_epi32(state, _mm512_set1_epi32(static_cast<int>(0x83DCD12Du)));
}

// 1024 + the sum of the four bytes of each lane (mul1).
inline __m512i mul1_byte_sum(__m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_set1_epi32(1024), x, _mm512_set1_epi8(1));
#else
  const __m512i bytes = _mm512_set1_epi32(0x00FF00FF);
  __m512i s = _mm512_add_epi32(_mm512_and_si512(x, bytes),
                               _mm512_and_si512(_mm512_srli_epi32(x, 8), bytes));
  s = _mm512_add_epi32(_mm512_and_si512(s, _mm512_set1_epi32(0xFFFF)), _mm512_srli_epi32(s, 16));
  return _mm512_add_epi32(s, _mm512_set1_epi32(1024));
#endif
}

// Codebook values of 16 states, rounded to float16 once like the reference (returned
// widened). mul1: (1024 + bytesum(state * m)) * a + b; 3inst / mcg: the two float16
// halves of a masked hash, added. Both are exact in float32 before the rounding.
template <int CB>
inline __m512 codebook16(__m512i state) {
  constexpr float a = 1774.f / 262144.f;  // float16 0x1EEE
  constexpr float b = -10.3828125f;       // float16 0xC931
  const __m512i x = codebook_hash<CB>(state);
#if defined(__AVX512FP16__)
  if constexpr (CB == 2) {  // a float16 FMA rounds once, as the reference does
    const __m256h n = _mm512_cvtepi32_ph(mul1_byte_sum(x));
    const __m256h v = _mm256_fmadd_ph(n, _mm256_set1_ph(static_cast<_Float16>(a)),
                                      _mm256_set1_ph(static_cast<_Float16>(b)));
    return _mm512_cvtph_ps(_mm256_castph_si256(v));
  } else {  // a float16 add of the halves, the sum landing in the low half of each lane
    const __m512i m = _mm512_xor_si512(
        _mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0x8FFF8FFFu))),
        _mm512_set1_epi32(0x3B603B60));
    const __m512h sum = _mm512_add_ph(_mm512_castsi512_ph(m),
                                      _mm512_castsi512_ph(_mm512_srli_epi32(m, 16)));
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_castph_si512(sum)));
  }
#else
  __m512 v;
  if constexpr (CB == 2) {
    v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mul1_byte_sum(x)), _mm512_set1_ps(a),
                        _mm512_set1_ps(b));
  } else {
    const __m512i m = _mm512_xor_si512(
        _mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0x8FFF8FFFu))),
        _mm512_set1_epi32(0x3B603B60));
    const __m512 lo = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(m));
    const __m512 hi = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(m, 16)));
    v = _mm512_add_ps(lo, hi);
  }
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
}

// One tile's ring (8 K uint32 words, K <= 8: at most 64) in registers: MODE 0 up to 16
// words (one vpermd per lookup), 1 up to 32 (vpermt2d), 2 up to 64 (two vpermt2d and a
// blend on bit 5 of the index).
template <int MODE>
struct Ring {
  __m512i r0, r1, r2, r3;
  static __m512i part(const int* words, int have) {  // up to 16 words, zero past `have`
    if (have >= 16) return _mm512_loadu_si512(words);
    return _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << std::max(have, 0)) - 1), words);
  }
  Ring(const int16_t* tile, int words32) {
    const int* words = reinterpret_cast<const int*>(tile);
    r0 = part(words, words32);
    if constexpr (MODE >= 1) r1 = part(words + 16, words32 - 16);
    if constexpr (MODE >= 2) {
      r2 = part(words + 32, words32 - 32);
      r3 = part(words + 48, words32 - 48);
    }
  }
  inline __m512i get(__m512i index) const {
    if constexpr (MODE == 0) return _mm512_permutexvar_epi32(index, r0);
    else if constexpr (MODE == 1) return _mm512_permutex2var_epi32(r0, index, r1);
    else {
      const __mmask16 upper = _mm512_test_epi32_mask(index, _mm512_set1_epi32(32));
      return _mm512_mask_blend_epi32(upper, _mm512_permutex2var_epi32(r0, index, r1),
                                     _mm512_permutex2var_epi32(r2, index, r3));
    }
  }
};

// Decoded row r (16 columns) of a tile.
template <int CB, int MODE>
inline __m512 decode_row(const Ring<MODE>& ring, const StepTable& t, int r) {
  const __m512i first = _mm512_load_si512(t.first + 16 * r);
  const __m512i second = _mm512_load_si512(t.second + 16 * r);
  const __m512i offset = _mm512_load_si512(t.offset + 16 * r);
  const __m512i rest = _mm512_load_si512(t.rest + 16 * r);
  const __m512i a = ring.get(first), b = ring.get(second);
  // srlv by 32 gives 0, so offset 0 needs no special case.
  const __m512i window = _mm512_or_si512(_mm512_sllv_epi32(a, offset), _mm512_srlv_epi32(b, rest));
  return codebook16<CB>(_mm512_srli_epi32(window, 16));
}

// out[m][0..16) = sum over the kb tiles of one strip of xh[m][16 i + r] * Ŵ_tile[r][..].
template <int CB, int MODE, int MR>
void strip_rows(const float* xh, int64_t ldx, const int16_t* strip, int64_t kb, int64_t words,
                const StepTable& t, float* out, int64_t ldo) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < kb; ++i) {
    const Ring<MODE> ring(strip + i * words, t.words32);
    const float* xi = xh + 16 * i;
    for (int r = 0; r < 16; ++r) {
      const __m512 w = decode_row<CB, MODE>(ring, t, r);
      for (int m = 0; m < MR; ++m)
        acc[m][r & 1] = _mm512_fmadd_ps(_mm512_set1_ps(xi[m * ldx + r]), w, acc[m][r & 1]);
    }
  }
  for (int m = 0; m < MR; ++m)
    _mm512_storeu_ps(out + m * ldo, _mm512_add_ps(acc[m][0], acc[m][1]));
}

template <int CB, int MODE>
void strip_decode(const int16_t* strip, int64_t kb, int64_t words, const StepTable& t,
                  float* out, int64_t ldo) {
  for (int64_t i = 0; i < kb; ++i) {
    const Ring<MODE> ring(strip + i * words, t.words32);
    for (int r = 0; r < 16; ++r)
      _mm512_storeu_ps(out + (16 * i + r) * ldo, decode_row<CB, MODE>(ring, t, r));
  }
}

template <int CB, int MODE>
void strip_rows_any(const float* xh, int64_t ldx, int64_t rows, const int16_t* strip,
                    int64_t kb, int64_t words, const StepTable& t, float* out, int64_t ldo) {
  switch (rows) {
    case 1: return strip_rows<CB, MODE, 1>(xh, ldx, strip, kb, words, t, out, ldo);
    case 2: return strip_rows<CB, MODE, 2>(xh, ldx, strip, kb, words, t, out, ldo);
    case 3: return strip_rows<CB, MODE, 3>(xh, ldx, strip, kb, words, t, out, ldo);
    case 4: return strip_rows<CB, MODE, 4>(xh, ldx, strip, kb, words, t, out, ldo);
    case 5: return strip_rows<CB, MODE, 5>(xh, ldx, strip, kb, words, t, out, ldo);
    case 6: return strip_rows<CB, MODE, 6>(xh, ldx, strip, kb, words, t, out, ldo);
    case 7: return strip_rows<CB, MODE, 7>(xh, ldx, strip, kb, words, t, out, ldo);
    default: return strip_rows<CB, MODE, 8>(xh, ldx, strip, kb, words, t, out, ldo);
  }
}

#if defined(EXL3_FP16_PATH)
// Two tile rows per vector in 16-bit lanes: vpermw/vpermt2w fetch the ring words, the
// hash state * m (mod 2^32) is kept as its two 16-bit halves, and the codebook is
// evaluated in float16 for 32 values at once.
template <int MODE>
struct Ring16 {  // the tile's 16 K int16 words: MODE 0 <= 32, 1 <= 64, 2 <= 128
  __m512i r0, r1, r2, r3;
  static __m512i part(const int16_t* words, int have) {
    if (have >= 32) return _mm512_loadu_si512(words);
    const __mmask32 mask = have <= 0 ? 0u : static_cast<__mmask32>((uint64_t{1} << have) - 1);
    return _mm512_maskz_loadu_epi16(mask, words);
  }
  Ring16(const int16_t* tile, int words16) {
    r0 = part(tile, words16);
    if constexpr (MODE >= 1) r1 = part(tile + 32, words16 - 32);
    if constexpr (MODE >= 2) {
      r2 = part(tile + 64, words16 - 64);
      r3 = part(tile + 96, words16 - 96);
    }
  }
  inline __m512i get(__m512i index) const {
    if constexpr (MODE == 0) return _mm512_permutexvar_epi16(index, r0);
    else if constexpr (MODE == 1) return _mm512_permutex2var_epi16(r0, index, r1);
    else {
      const __mmask32 upper = _mm512_test_epi16_mask(index, _mm512_set1_epi16(64));
      return _mm512_mask_blend_epi16(upper, _mm512_permutex2var_epi16(r0, index, r1),
                                     _mm512_permutex2var_epi16(r2, index, r3));
    }
  }
};

// Rows 2p and 2p+1 of a tile, decoded.
template <int CB, int MODE>
inline void decode_pair(const Ring16<MODE>& ring, const StepTable& t, int p, __m512& row0,
                        __m512& row1) {
  const int q = 32 * p;
  const __m512i a = ring.get(_mm512_load_si512(t.first16 + q));
  const __m512i b = ring.get(_mm512_load_si512(t.second16 + q));
  const __m512i state = funnel16(a, b, _mm512_load_si512(t.offset16 + q));
  const __m512i bits = _mm512_castph_si512(codebook_ph<CB>(state));
  row0 = _mm512_cvtph_ps(_mm512_castsi512_si256(bits));
  row1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(bits, 1));
}

template <int CB, int MODE, int MR>
void strip_rows16(const float* xh, int64_t ldx, const int16_t* strip, int64_t kb,
                  int64_t words, const StepTable& t, float* out, int64_t ldo) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < kb; ++i) {
    const Ring16<MODE> ring(strip + i * words, static_cast<int>(words));
    const float* xi = xh + 16 * i;
    for (int p = 0; p < 8; ++p) {
      __m512 w0, w1;
      decode_pair<CB, MODE>(ring, t, p, w0, w1);
      for (int m = 0; m < MR; ++m) {
        acc[m][0] = _mm512_fmadd_ps(_mm512_set1_ps(xi[m * ldx + 2 * p]), w0, acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(_mm512_set1_ps(xi[m * ldx + 2 * p + 1]), w1, acc[m][1]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    _mm512_storeu_ps(out + m * ldo, _mm512_add_ps(acc[m][0], acc[m][1]));
}

template <int CB, int MODE>
void strip_decode16(const int16_t* strip, int64_t kb, int64_t words, const StepTable& t,
                    float* out, int64_t ldo) {
  for (int64_t i = 0; i < kb; ++i) {
    const Ring16<MODE> ring(strip + i * words, static_cast<int>(words));
    for (int p = 0; p < 8; ++p) {
      __m512 w0, w1;
      decode_pair<CB, MODE>(ring, t, p, w0, w1);
      _mm512_storeu_ps(out + (16 * i + 2 * p) * ldo, w0);
      _mm512_storeu_ps(out + (16 * i + 2 * p + 1) * ldo, w1);
    }
  }
}

template <int CB, int MODE>
void strip_rows16_any(const float* xh, int64_t ldx, int64_t rows, const int16_t* strip,
                      int64_t kb, int64_t words, const StepTable& t, float* out, int64_t ldo) {
  switch (rows) {
    case 1: return strip_rows16<CB, MODE, 1>(xh, ldx, strip, kb, words, t, out, ldo);
    case 2: return strip_rows16<CB, MODE, 2>(xh, ldx, strip, kb, words, t, out, ldo);
    case 3: return strip_rows16<CB, MODE, 3>(xh, ldx, strip, kb, words, t, out, ldo);
    case 4: return strip_rows16<CB, MODE, 4>(xh, ldx, strip, kb, words, t, out, ldo);
    case 5: return strip_rows16<CB, MODE, 5>(xh, ldx, strip, kb, words, t, out, ldo);
    case 6: return strip_rows16<CB, MODE, 6>(xh, ldx, strip, kb, words, t, out, ldo);
    case 7: return strip_rows16<CB, MODE, 7>(xh, ldx, strip, kb, words, t, out, ldo);
    default: return strip_rows16<CB, MODE, 8>(xh, ldx, strip, kb, words, t, out, ldo);
  }
}
#endif

// The (CB, MODE) instantiation for a layer: f(strip_rows_any<CB, MODE>, strip_decode<CB, MODE>).
template <typename F>
void dispatch(int64_t codebook, int words32, F&& f) {
  auto by_mode = [&](auto cb) {
    constexpr int CB = decltype(cb)::value;
#if defined(EXL3_FP16_PATH)
    if (words32 <= 16) f(strip_rows16_any<CB, 0>, strip_decode16<CB, 0>);
    else if (words32 <= 32) f(strip_rows16_any<CB, 1>, strip_decode16<CB, 1>);
    else f(strip_rows16_any<CB, 2>, strip_decode16<CB, 2>);
#else
    if (words32 <= 16) f(strip_rows_any<CB, 0>, strip_decode<CB, 0>);
    else if (words32 <= 32) f(strip_rows_any<CB, 1>, strip_decode<CB, 1>);
    else f(strip_rows_any<CB, 2>, strip_decode<CB, 2>);
#endif
  };
  if (codebook == 0) by_mode(std::integral_constant<int, 0>{});
  else if (codebook == 1) by_mode(std::integral_constant<int, 1>{});
  else by_mode(std::integral_constant<int, 2>{});
}
#if defined(EXL3_STEP_PATH)
constexpr int64_t kStepRows = 2;  // rows the step-order GEMV takes (its accumulators: 8 per row)

// EXL3_CPU_STEP_GEMV=0 turns the step-order GEMV off (A/B runs), read once.
bool step_order_disabled() {
  static const bool off = [] {
    const char* v = std::getenv("EXL3_CPU_STEP_GEMV");
    return v && std::string(v) == "0";
  }();
  return off;
}

// The GEMV mode (exl3_set_gemv_mode): false "exact" (the codec's values), true "fast" (the
// inexact integer product for mul1 layers, exl3_step_gemv.h). Process-wide, set at load.
std::atomic<bool> g_fast_gemv{false};

bool fast_gemv_for(int64_t codebook, int64_t rows, const StepTable& t) {
  return g_fast_gemv.load(std::memory_order_relaxed) && codebook == 2 && rows <= kStepRows &&
         t.order.ok && !step_order_disabled();
}

// f(strip_steps<CB, WIDE, MR>) for a layer's codebook, ring length and rows (1..kStepRows).
template <typename F>
void dispatch_steps(int64_t codebook, bool wide, int64_t rows, F&& f) {
  auto by_rows = [&](auto cb, auto w) {
    constexpr int CB = decltype(cb)::value;
    constexpr bool W = decltype(w)::value;
    if (rows == 1) f(strip_steps<CB, W, 1>);
    else f(strip_steps<CB, W, 2>);
  };
  auto by_wide = [&](auto cb) {
    if (wide) by_rows(cb, std::true_type{});
    else by_rows(cb, std::false_type{});
  };
  if (codebook == 0) by_wide(std::integral_constant<int, 0>{});
  else if (codebook == 1) by_wide(std::integral_constant<int, 1>{});
  else by_wide(std::integral_constant<int, 2>{});
}
#endif
#else
constexpr bool kSimd = false;
#endif

// Portable decode through the codebook table (any CPU without AVX-512).
void strip_rows_scalar(const float* xh, int64_t ldx, int64_t rows, const int16_t* strip,
                       int64_t kb, int64_t words, const StepTable& t, const float* lut,
                       float* out, int64_t ldo) {
  float acc[kGemvRows][16] = {};
  for (int64_t i = 0; i < kb; ++i) {
    const int16_t* tile = strip + i * words;
    for (int r = 0; r < 16; ++r) {
      float w[16];
      for (int c = 0; c < 16; ++c) w[c] = lut[state_at(tile, t, 16 * r + c)];
      for (int64_t m = 0; m < rows; ++m) {
        const float xv = xh[m * ldx + 16 * i + r];
        for (int c = 0; c < 16; ++c) acc[m][c] += xv * w[c];
      }
    }
  }
  for (int64_t m = 0; m < rows; ++m) std::memcpy(out + m * ldo, acc[m], sizeof(acc[m]));
}

void strip_decode_scalar(const int16_t* strip, int64_t kb, int64_t words, const StepTable& t,
                         const float* lut, float* out, int64_t ldo) {
  for (int64_t i = 0; i < kb; ++i)
    for (int q = 0; q < kSteps; ++q)
      out[(16 * i + q / 16) * ldo + q % 16] = lut[state_at(strip + i * words, t, q)];
}

// In-place normalised 128-point Walsh-Hadamard transform of one block.
inline void hadamard128(float* v) {
  const float norm = 1.f / std::sqrt(static_cast<float>(kHadamard));
#if defined(__AVX512F__)
  // Eight vectors of 16: stages 1..8 inside each vector (swap lanes i and i ^ h, then
  // a + b where bit h of the lane is clear, b - a where it is set), 16..64 across them.
  __m512 r[8];
  for (int j = 0; j < 8; ++j) r[j] = _mm512_loadu_ps(v + 16 * j);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int h = 1; h < 16; h <<= 1) {
    const __m512i swap = _mm512_xor_si512(lane, _mm512_set1_epi32(h));
    const __mmask16 upper = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(h));
    for (int j = 0; j < 8; ++j) {
      const __m512 other = _mm512_permutexvar_ps(swap, r[j]);
      r[j] = _mm512_mask_sub_ps(_mm512_add_ps(r[j], other), upper, other, r[j]);
    }
  }
  for (int h = 1; h < 8; h <<= 1)
    for (int j = 0; j < 8; ++j)
      if (!(j & h)) {
        const __m512 a = r[j], b = r[j + h];
        r[j] = _mm512_add_ps(a, b);
        r[j + h] = _mm512_sub_ps(a, b);
      }
  for (int j = 0; j < 8; ++j) _mm512_storeu_ps(v + 16 * j, _mm512_mul_ps(r[j], _mm512_set1_ps(norm)));
#else
  for (int64_t h = 1; h < kHadamard; h <<= 1)
    for (int64_t i = 0; i < kHadamard; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = v[j], c = v[j + h];
        v[j] = a + c;
        v[j + h] = a - c;
      }
  for (int64_t j = 0; j < kHadamard; ++j) v[j] *= norm;
#endif
}

// hadamard128 on each 128-block of rows x cols.
void hadamard_rows(float* x, int64_t rows, int64_t cols) {
  at::parallel_for(0, rows * (cols / kHadamard), 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) hadamard128(x + b * kHadamard);
  });
}

struct Layer {
  const int16_t* trellis;
  int64_t nb, kb, words;
  const StepTable* table;
  int64_t codebook;
  const float* lut;
};

Layer check_layer(const at::Tensor& trellis_t, double k_bits, int64_t codebook,
                  const c10::optional<at::Tensor>& lut) {
  TORCH_CHECK(trellis_t.device().is_cpu() && trellis_t.scalar_type() == at::kShort &&
                  trellis_t.dim() == 3 && trellis_t.is_contiguous(),
              "exl3: trellis must be a contiguous CPU int16 (nb, kb, words) tensor");
  const int half_k = static_cast<int>(std::lround(2 * k_bits));
  TORCH_CHECK(std::abs(2 * k_bits - half_k) < 1e-9 && valid_half_k(half_k),
              "exl3: unsupported bits per weight ", k_bits);
  TORCH_CHECK(trellis_t.size(2) == 8 * half_k, "exl3: K=", k_bits, " needs ", 8 * half_k,
              " words per tile, trellis has ", trellis_t.size(2));
  TORCH_CHECK(codebook >= 0 && codebook <= 2, "exl3: codebook must be 0, 1 or 2");
  const float* lp = nullptr;
  if (lut.has_value() && lut->defined()) {
    TORCH_CHECK(lut->scalar_type() == at::kFloat && lut->numel() == 65536 && lut->is_contiguous(),
                "exl3: lut must be 65536 contiguous float32 values");
    lp = lut->data_ptr<float>();
  }
  TORCH_CHECK(kSimd || lp, "exl3: this build decodes through the codebook table: pass lut");
  return Layer{trellis_t.data_ptr<int16_t>(), trellis_t.size(0), trellis_t.size(1),
               trellis_t.size(2), &table_for(half_k), codebook, lp};
}

// One part of a fused 1-8 row product, out (rows, 16 nb) = xh (rows, 16 kb) @ Ŵ: prepare()
// picks the kernel and lays x out for it (in the caller's lane buffers), strip(j) computes
// columns [16 j, 16 j + 16), finish() scales the integer product. Several parts with one
// input (q|k|v, gate|up) share one parallel region (run_products): every strip is
// computed alike whichever thread takes it, so the results do not depend on the grouping.
struct Product {
  Layer L;
  const float* xh = nullptr;
  int64_t rows = 0;
  float* out = nullptr;
  enum Kind { kRowsKind, kScalarKind, kStepsKind, kPairsKind, kIntKind } kind = kRowsKind;
  using RowsFn = void (*)(const float*, int64_t, int64_t, const int16_t*, int64_t, int64_t,
                          const StepTable&, float*, int64_t);
  RowsFn rows_fn = nullptr;
#if defined(EXL3_STEP_PATH)
  using StepsFn = void (*)(const float*, int64_t, const int16_t*, int64_t, const StepOrderTable&,
                           float*, int64_t);
  using IntFn = void (*)(const int16_t*, int64_t, const int16_t*, int64_t, const StepOrderTable&,
                         float*, int64_t);
  StepsFn steps_fn = nullptr;
  IntFn int_fn = nullptr;
#if !defined(EXL3_FP16_PATH)
  using PairsFn = void (*)(const float*, int64_t, const int16_t*, int64_t, const StepOrderTable&,
                           float*);
  PairsFn pairs_fn = nullptr;
#endif
  const float* xs = nullptr;
  const int16_t* xq = nullptr;
  float scale[kStepRows] = {};
  double qsum[kStepRows] = {};
#endif

  Product(const Layer& layer, const float* x, int64_t m, float* y) : L(layer), xh(x), rows(m), out(y) {
#if defined(EXL3_STEP_PATH)
    const bool steps = rows <= kStepRows && L.table->order.ok && !step_order_disabled();
    if (fast_gemv_for(L.codebook, rows, *L.table)) kind = kIntKind;
#if !defined(EXL3_FP16_PATH)
    else if (steps && rows == 1 && L.codebook == 2) kind = kPairsKind;
#endif
    else if (steps) kind = kStepsKind;
    else kind = kSimd ? kRowsKind : kScalarKind;
#else
    kind = kSimd ? kRowsKind : kScalarKind;
#endif
  }
  // Lane buffer sizes prepare() needs (floats, int16).
  int64_t lane_floats() const {
    return kind == kStepsKind ? rows * L.kb * 32 : kind == kPairsKind ? 16 * L.kb : 0;
  }
  int64_t lane_shorts() const { return kind == kIntKind ? rows * L.kb * 32 : 0; }

  void prepare(float* fbuf, int16_t* sbuf) {
#if defined(EXL3_STEP_PATH)
    const bool wide = L.table->order.words16 > 32;
    if (kind == kIntKind) {
      step_lanes_xq(xh, 16 * L.kb, rows, L.kb, sbuf, scale, qsum);
      xq = sbuf;
      if (rows == 1) int_fn = wide ? strip_steps_int<true, 1> : strip_steps_int<false, 1>;
      else int_fn = wide ? strip_steps_int<true, 2> : strip_steps_int<false, 2>;
      return;
    }
#if !defined(EXL3_FP16_PATH)
    if (kind == kPairsKind) {
      step_pairs_x(xh, L.kb, fbuf);
      xs = fbuf;
      pairs_fn = wide ? strip_steps_mul1<true> : strip_steps_mul1<false>;
      return;
    }
#endif
    if (kind == kStepsKind) {
      step_lanes_x(xh, 16 * L.kb, rows, L.kb, fbuf);
      xs = fbuf;
      dispatch_steps(L.codebook, wide, rows, [&](auto fn) { steps_fn = fn; });
      return;
    }
#endif
#if defined(__AVX512F__)
    dispatch(L.codebook, L.table->words32, [&](auto fn, auto) { rows_fn = fn; });
#endif
    (void)fbuf;
    (void)sbuf;
  }

  void strip(int64_t j) const {
    const int64_t ldo = 16 * L.nb;
    const int16_t* tiles = L.trellis + j * L.kb * L.words;
    float* o = out + 16 * j;
    switch (kind) {
#if defined(EXL3_STEP_PATH)
      case kIntKind: return int_fn(xq, L.kb, tiles, L.words, L.table->order, o, ldo);
      case kStepsKind: return steps_fn(xs, L.kb, tiles, L.words, L.table->order, o, ldo);
#if !defined(EXL3_FP16_PATH)
      case kPairsKind: return pairs_fn(xs, L.kb, tiles, L.words, L.table->order, o);
#endif
#endif
      case kRowsKind:
        return rows_fn(xh, 16 * L.kb, rows, tiles, L.kb, L.words, *L.table, o, ldo);
      default:
        return strip_rows_scalar(xh, 16 * L.kb, rows, tiles, L.kb, L.words, *L.table, L.lut, o, ldo);
    }
  }

  void finish() const {
#if defined(EXL3_STEP_PATH)
    if (kind != kIntKind) return;
    const int64_t ldo = 16 * L.nb;
    for (int64_t m = 0; m < rows; ++m) {
      const float mul = scale[m] * kMul1A;
      const float add = static_cast<float>(scale[m] * kMul1C * qsum[m]);
      float* o = out + m * ldo;
      for (int64_t c = 0; c < ldo; ++c) o[c] = o[c] * mul + add;
    }
#endif
  }
};

// All strips of the products in one parallel region. Thread t owns an equal contiguous
// share of the strips (what a static split gives a quiet machine) and claims them one by
// one from a counter of its own; done, it claims from the other shares' counters, so a
// thread that another job on the machine holds back leaves its rest to the others.
void run_products(Product* ps, int64_t count) {
  int64_t floats = 0, shorts = 0, total = 0, grain = int64_t{1} << 30;
  for (int64_t i = 0; i < count; ++i) {
    floats += ps[i].lane_floats();
    shorts += ps[i].lane_shorts();
    total += ps[i].L.nb;
    grain = std::min(grain, strip_grain(ps[i].L.kb));
  }
  if (total == 0) return;
  thread_local std::vector<float> fbuf;
  thread_local std::vector<int16_t> sbuf;
  fbuf.resize(static_cast<size_t>(floats));
  sbuf.resize(static_cast<size_t>(shorts));
  for (int64_t i = 0, f = 0, h = 0; i < count; ++i) {
    ps[i].prepare(fbuf.data() + f, sbuf.data() + h);
    f += ps[i].lane_floats();
    h += ps[i].lane_shorts();
  }
  auto run = [&](int64_t g) {  // global strip g
    int64_t part = 0;
    while (g >= ps[part].L.nb) g -= ps[part++].L.nb;
    ps[part].strip(g);
  };
  const int64_t threads = at::in_parallel_region() ? 1 : std::min<int64_t>(
      at::get_num_threads(), (total + grain - 1) / grain);
  if (threads <= 1) {
    for (int64_t g = 0; g < total; ++g) run(g);
  } else if (exl3_cpu::decode_pool_enabled()) {
    exl3_cpu::pool_for(total, threads, run);
  } else {
    struct alignas(64) Share {
      std::atomic<int64_t> next{0};
      int64_t end = 0;
    };
    std::vector<Share> shares(static_cast<size_t>(threads));
    for (int64_t t = 0; t < threads; ++t) {
      shares[t].next.store(total * t / threads, std::memory_order_relaxed);
      shares[t].end = total * (t + 1) / threads;
    }
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t k = 0; k < threads; ++k) {
          Share& share = shares[(t + k) % threads];
          for (int64_t g; (g = share.next.fetch_add(1, std::memory_order_relaxed)) < share.end;)
            run(g);
        }
    });
  }
  for (int64_t i = 0; i < count; ++i) ps[i].finish();
}

// out (rows, 16 nb) = xh (rows, 16 kb) @ Ŵ, rows <= kGemvRows.
void fused_matmul(const Layer& L, const float* xh, int64_t rows, float* out) {
  Product p(L, xh, rows, out);
  run_products(&p, 1);
}

// Ŵ columns [16 j0, 16 j1) into out (16 kb, ldo).
void decode_strips(const Layer& L, int64_t j0, int64_t j1, float* out, int64_t ldo) {
  const int64_t tile_words = L.kb * L.words;
#if defined(__AVX512F__)
  dispatch(L.codebook, L.table->words32, [&](auto, auto decode_fn) {
    at::parallel_for(j0, j1, 1, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j)
        decode_fn(L.trellis + j * tile_words, L.kb, L.words, *L.table, out + 16 * (j - j0), ldo);
    });
  });
#else
  at::parallel_for(j0, j1, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j)
      strip_decode_scalar(L.trellis + j * tile_words, L.kb, L.words, *L.table, L.lut,
                          out + 16 * (j - j0), ldo);
  });
#endif
}

// xh (M, 16 kb) @ Ŵ -> (M, 16 nb), float32, any M.
at::Tensor matmul_rotated(const Layer& L, const at::Tensor& xh) {
  const int64_t M = xh.size(0), padded_out = 16 * L.nb, padded_in = 16 * L.kb;
  at::Tensor out = at::empty({M, padded_out}, xh.options());
  if (M == 0 || padded_out == 0) return out;
  if (M <= kGemvRows) {
    fused_matmul(L, xh.data_ptr<float>(), M, out.data_ptr<float>());
    return out;
  }
  // Prompts: decode strips of Ŵ (bounded memory) and multiply each with at::mm.
  const int64_t strip_tiles = std::max<int64_t>(1, kStripBytes / (4 * 16 * padded_in));
  const int64_t cols = std::min(padded_out, 16 * strip_tiles);
  at::Tensor strip = at::empty({padded_in, cols}, xh.options());
  for (int64_t j0 = 0; j0 < L.nb; j0 += strip_tiles) {
    const int64_t j1 = std::min(L.nb, j0 + strip_tiles), width = 16 * (j1 - j0);
    at::Tensor part = strip.narrow(1, 0, width);
    decode_strips(L, j0, j1, strip.data_ptr<float>(), cols);
    out.narrow(1, 16 * j0, width).copy_(at::mm(xh, part));
  }
  return out;
}

at::Tensor float_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat,
              "exl3: ", what, " must be a 2-D CPU float32 tensor");
  return x.contiguous();
}

}  // namespace

namespace exl3_cpu {

at::Tensor exl3_decode(const at::Tensor& trellis_t, double k_bits, int64_t codebook,
                       const c10::optional<at::Tensor>& lut) {
  const Layer L = check_layer(trellis_t, k_bits, codebook, lut);
  at::Tensor out = at::empty({16 * L.kb, 16 * L.nb}, trellis_t.options().dtype(at::kFloat));
  if (out.numel()) decode_strips(L, 0, L.nb, out.data_ptr<float>(), 16 * L.nb);
  return out;
}

at::Tensor exl3_matmul(const at::Tensor& xh, const at::Tensor& trellis_t, double k_bits,
                       int64_t codebook, const c10::optional<at::Tensor>& lut) {
  const Layer L = check_layer(trellis_t, k_bits, codebook, lut);
  at::Tensor x = float_rows(xh, "xh");
  TORCH_CHECK(x.size(1) == 16 * L.kb, "exl3_matmul: xh has ", x.size(1), " columns, trellis ",
              16 * L.kb, " rows");
  return matmul_rotated(L, x);
}

at::Tensor exl3_linear(const at::Tensor& x, const at::Tensor& trellis_t, const at::Tensor& suh,
                       const at::Tensor& svh, const c10::optional<at::Tensor>& bias,
                       double k_bits, int64_t codebook, int64_t n,
                       const c10::optional<at::Tensor>& lut) {
  const at::Tensor* bp = bias.has_value() && bias->defined() ? &*bias : nullptr;
  const Exl3Part part{&trellis_t, &suh, &svh, bp, k_bits, n};
  return exl3_linear_parts(x, &part, 1, codebook, lut);
}

at::Tensor exl3_linear_parts(const at::Tensor& x, const Exl3Part* parts, int64_t count,
                             int64_t codebook, const c10::optional<at::Tensor>& lut) {
  const at::Tensor xc = float_rows(x, "x");
  const int64_t M = xc.size(0), in = xc.size(1);
  c10::SmallVector<Layer, 4> layers;
  int64_t total_n = 0, scratch_floats = 0;
  for (int64_t i = 0; i < count; ++i) {
    const Exl3Part& p = parts[i];
    const Layer L = check_layer(*p.trellis_t, p.k_bits, codebook, lut);
    const int64_t padded_in = 16 * L.kb, padded_out = 16 * L.nb;
    TORCH_CHECK(padded_in % kHadamard == 0 && padded_out % kHadamard == 0,
                "exl3_linear: stored shape ", padded_in, "x", padded_out,
                " is not a multiple of 128");
    TORCH_CHECK(in <= padded_in && p.n >= 0 && p.n <= padded_out, "exl3_linear: x has ", in,
                " features and n is ", p.n, " for a ", padded_in, "x", padded_out, " trellis");
    TORCH_CHECK(p.suh->scalar_type() == at::kFloat && p.suh->numel() == padded_in &&
                    p.suh->is_contiguous() && p.svh->scalar_type() == at::kFloat &&
                    p.svh->numel() == padded_out && p.svh->is_contiguous(),
                "exl3_linear: suh/svh must be contiguous float32 of the padded sizes");
    TORCH_CHECK(!p.bias || (p.bias->scalar_type() == at::kFloat && p.bias->numel() >= p.n &&
                            p.bias->is_contiguous()),
                "exl3_linear: bias must be contiguous float32 (>= n)");
    layers.push_back(L);
    total_n += p.n;
    scratch_floats += M * (padded_in + padded_out);
  }
  at::Tensor y = at::empty({M, total_n}, xc.options());
  float* op = y.data_ptr<float>();
  const float* xp = xc.data_ptr<float>();
  // Decode rows (<= kGemvRows) work in this thread's scratch (no tensor allocations per
  // call: ~200 calls a token) and all parts' products run in one parallel region; prompts
  // in tensors (matmul_rotated's strip path), part by part.
  const bool small = M <= kGemvRows;
  thread_local std::vector<float> scratch;
  if (small) scratch.resize(static_cast<size_t>(scratch_floats));
  c10::SmallVector<Product, 4> products;
  c10::SmallVector<float*, 4> outs;
  c10::SmallVector<at::Tensor, 4> keep;  // the prompt path's results
  for (int64_t i = 0, used = 0; i < count; ++i) {
    const Layer& L = layers[i];
    const int64_t padded_in = 16 * L.kb, padded_out = 16 * L.nb;
    at::Tensor xh;
    float* hp;
    if (small) {
      hp = scratch.data() + used;
      used += M * (padded_in + padded_out);
    } else {
      xh = at::empty({M, padded_in}, xc.options());
      hp = xh.data_ptr<float>();
    }
    const float* sp = parts[i].suh->data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < in; ++k) hp[m * padded_in + k] = xp[m * in + k] * sp[k];
      std::fill(hp + m * padded_in + in, hp + (m + 1) * padded_in, 0.f);
    }
    hadamard_rows(hp, M, padded_in);
    if (small) {
      outs.push_back(hp + M * padded_in);
      if (M > 0 && padded_out > 0) products.emplace_back(L, hp, M, outs.back());
    } else {
      keep.push_back(matmul_rotated(L, xh));
      outs.push_back(keep.back().data_ptr<float>());
    }
  }
  if (!products.empty()) run_products(products.data(), static_cast<int64_t>(products.size()));
  for (int64_t i = 0, col = 0; i < count; ++i) {
    const int64_t padded_out = 16 * layers[i].nb, n = parts[i].n;
    float* yp = outs[i];
    hadamard_rows(yp, M, padded_out);
    const float* vp = parts[i].svh->data_ptr<float>();
    const float* bp = parts[i].bias ? parts[i].bias->data_ptr<float>() : nullptr;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < n; ++j)
        op[m * total_n + col + j] = yp[m * padded_out + j] * vp[j] + (bp ? bp[j] : 0.f);
    col += n;
  }
  return y;
}

std::string exl3_set_gemv_mode(const std::string& mode) {
  TORCH_CHECK(mode == "exact" || mode == "fast", "exl3: GEMV mode must be exact or fast, got ",
              mode);
#if defined(EXL3_STEP_PATH)
  g_fast_gemv.store(mode == "fast");
  return mode;
#else
  return "exact";  // the integer product needs the step-order path (AVX-512 BW)
#endif
}

std::string exl3_gemv_kind(double k_bits, int64_t rows) {
  const int half_k = static_cast<int>(std::lround(2 * k_bits));
  TORCH_CHECK(std::abs(2 * k_bits - half_k) < 1e-9 && valid_half_k(half_k),
              "exl3: unsupported bits per weight ", k_bits);
  if (rows > kGemvRows) return "strips";
#if defined(EXL3_STEP_PATH)
  if (fast_gemv_for(2, rows, table_for(half_k))) return "steps-int";
  if (rows <= kStepRows && table_for(half_k).order.ok && !step_order_disabled()) return "steps";
#endif
  return kSimd ? "rows" : "scalar";
}

// How many threads one at::parallel_for of this build splits `items` items across (1 when
// it was compiled without OpenMP: ATen's parallel_for is inline and then runs serially).
int64_t exl3_parallel_threads(int64_t items) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, std::max<int64_t>(items, 1), 1, [&](int64_t, int64_t) {
    seen.fetch_or(uint64_t{1} << (at::get_thread_num() & 63));
  });
  return __builtin_popcountll(seen.load());
}

}  // namespace exl3_cpu

TORCH_LIBRARY_FRAGMENT(exl3_cpu, m) {
  m.def("exl3_decode(Tensor trellis_t, float k_bits, int codebook, Tensor? lut) -> Tensor");
  m.def("exl3_matmul(Tensor xh, Tensor trellis_t, float k_bits, int codebook, Tensor? lut) -> Tensor");
  m.def("exl3_linear(Tensor x, Tensor trellis_t, Tensor suh, Tensor svh, Tensor? bias, "
        "float k_bits, int codebook, int n, Tensor? lut) -> Tensor");
  // Which product serves `rows` rows: "steps" (trellis-step order), "rows" (row pairs),
  // "scalar" (codebook table) or "strips" (decoded strips and at::mm).
  m.def("exl3_gemv_kind(float k_bits, int rows) -> str", &exl3_cpu::exl3_gemv_kind);
  // "exact" (default) or "fast" (mul1 layers, 1-2 rows: the inexact integer product);
  // returns the mode in force ("exact" where the build has no step-order GEMV).
  m.def("exl3_set_gemv_mode(str mode) -> str", &exl3_cpu::exl3_set_gemv_mode);
  // Threads one parallel loop of `items` items ran on (the build's OpenMP check).
  m.def("exl3_parallel_threads(int items) -> int", &exl3_cpu::exl3_parallel_threads);
}

TORCH_LIBRARY_IMPL(exl3_cpu, CPU, m) {
  m.impl("exl3_decode", &exl3_cpu::exl3_decode);
  m.impl("exl3_matmul", &exl3_cpu::exl3_matmul);
  m.impl("exl3_linear", &exl3_cpu::exl3_linear);
}
