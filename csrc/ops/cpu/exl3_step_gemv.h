// The decode GEMV of exl3_gemm_cpu.cpp in trellis-step order (AVX-512 BW builds; included
// by exl3_gemm_cpu.cpp only, inside its anonymous namespace). The float16 rounding of the
// codebook is one native float16 FMA/add with AVX512-FP16 (Sapphire Rapids and later);
// without it (Zen 4, Ice Lake, Skylake-X) the same value is computed exactly in float32
// and rounded once there (round_half): the same bits, a few more instructions per 32 weights.
//
// The row-pair kernel there decodes tile rows: the 32 states of two rows lie all over the
// tile's ring (steps 8t + j with t spread over 0..31), so their words are fetched from the
// whole ring (two vpermt2w up to K=4, four and a blend past it). Here one vector holds 32
// CONSECUTIVE trellis steps 32v..32v+31 of a tile: their 16-bit windows lie in a stretch of
// 2K+2 ring words, so one 32-word load and two vpermw fetch them for every K, and one
// vpshldvw (VBMI2) makes the state. The price is that the vector's lanes are not one tile
// row: steps 32v..32v+31 are all 16 rows of columns v and v+8 (codec/tiles.py's order).
// So x is fed to the lanes through a per-call copy laid out the same way (xs: 32 floats per
// 16-row block, lane l holding x of row kLaneRow[l]), every vector v has its own
// accumulator, and a strip's 8 accumulators are folded to its 16 columns once at the end.
//
// The values are the codec's, bit for bit (same float16 rounding as decode_pair); only
// the float32 summation order differs from the row-pair kernel.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstdlib>

// Row of the tile for lane l of a step vector (the same for every v).
constexpr int kLaneRow[32] = {0, 1, 8,  9,  0, 1, 8,  9,  2, 3, 10, 11, 2, 3, 10, 11,
                              4, 5, 12, 13, 4, 5, 12, 13, 6, 7, 14, 15, 6, 7, 14, 15};

// Per K: for step s (lane s % 32 of vector s / 32) the window indices of the word holding
// its state's first bit and of the next word, and the bit offset; base[v] is the file word
// that vector v's 32-word window starts at. Rings of up to 32 words (K <= 2) sit in one
// register for all v. Longer rings: vector 0, whose first states wrap around the ring's
// end, indexes two registers (the ring's first and last 32 words: index 32.. = the last).
struct StepOrderTable {
  alignas(64) int16_t first[256];
  alignas(64) int16_t second[256];
  alignas(64) int16_t offset[256];
  // The VBMI form: lanes 4g..4g+3 of vector v gather the four ring words from the first
  // one of step 32v + 4g on, most significant word last (one 64-bit number, ring bits
  // from the top), and vpmultishiftqb cuts each state out of it (shift: the two byte
  // offsets of each lane).
  alignas(64) int16_t gather[256];
  alignas(64) uint8_t shift[512];
  int32_t base[8] = {};
  int words16 = 0;
  bool ok = false;
};

// start[s]: ring bit where step s's 16-bit window starts (bits most significant first;
// ring 16-bit word c is file word c ^ 1).
inline StepOrderTable make_step_table(const int* start, int words16) {
  StepOrderTable t;
  t.words16 = words16;
  const bool wide = words16 > 32;
  int fw[256], sw[256];
  for (int s = 0; s < 256; ++s) {
    const int chunk = start[s] >> 4, off = start[s] & 15;
    fw[s] = chunk ^ 1;
    sw[s] = off ? ((chunk + 1) % words16) ^ 1 : fw[s];  // offset 0: the second word is unused
    t.offset[s] = static_cast<int16_t>(off);
  }
  bool ok = true;
  for (int v = 0; v < 8; ++v) {
    int lo = 1 << 30, hi = -1;
    for (int l = 0; l < 32; ++l) {
      const int s = 32 * v + l;
      lo = std::min({lo, fw[s], sw[s]});
      hi = std::max({hi, fw[s], sw[s]});
    }
    int base = 0;
    if (wide && v > 0) {
      base = std::min(lo, words16 - 32);
      ok = ok && hi - base < 32 && base >= 0;
    }
    t.base[v] = base;
    for (int l = 0; l < 32; ++l) {
      const int s = 32 * v + l;
      auto index = [&](int w) {
        if (!wide || v > 0) return w - base;
        if (w < 32) return w;                      // from the ring's first 32 words
        ok = ok && w >= words16 - 32;
        return 32 + w - (words16 - 32);            // from its last 32
      };
      t.first[s] = static_cast<int16_t>(index(fw[s]));
      t.second[s] = static_cast<int16_t>(index(sw[s]));
    }
  }
  // The VBMI tables: qword g of vector v holds ring words c_g .. c_g + 3 (mod the ring).
  const int ring_bits = 16 * words16;
  for (int v = 0; v < 8; ++v)
    for (int g = 0; g < 8; ++g) {
      const int s0 = 32 * v + 4 * g, c = start[s0] >> 4;
      int p[4];
      for (int d = 0; d < 4; ++d) {
        p[d] = ((start[s0 + d] - 16 * c) % ring_bits + ring_bits) % ring_bits;
        ok = ok && p[d] <= 48;
        t.shift[2 * (s0 + d)] = static_cast<uint8_t>(48 - p[d]);
        t.shift[2 * (s0 + d) + 1] = static_cast<uint8_t>(56 - p[d]);
      }
      for (int j = 0; j < 4; ++j) {  // lane 4g + j: ring word c + 3 - j
        const int k = 3 - j;
        bool needed = false;  // by a state: bits [p, p + 16) meet word k's [16 k, 16 k + 16)
        for (int d = 0; d < 4; ++d) needed = needed || (p[d] < 16 * k + 16 && p[d] + 16 > 16 * k);
        const int chunk = (c + k) % words16, w = chunk ^ 1;
        int index;
        if (!needed) {
          index = 0;
        } else if (!wide || v > 0) {
          index = w - t.base[v];
          ok = ok && index >= 0 && index < 32;
        } else if (w < 32) {
          index = w;
        } else {
          ok = ok && w >= words16 - 32;
          index = 32 + w - (words16 - 32);
        }
        t.gather[s0 + j] = static_cast<int16_t>(index);
      }
    }
  t.ok = ok;
  return t;
}

// The hash of 32 states (16-bit lanes): state * m (+ mul1's offset) mod 2^32, kept as
// two 16-bit halves `lo` and `hi`.
template <int CB>
inline void hash_halves(__m512i state, __m512i& lo, __m512i& hi) {
  constexpr uint32_t mult = CB == 0 ? 89226354u : CB == 1 ? 0xCBAC1FEDu : 0x83DCD12Du;
  const __m512i ml = _mm512_set1_epi16(static_cast<int16_t>(mult & 0xFFFF));
  const __m512i mh = _mm512_set1_epi16(static_cast<int16_t>(mult >> 16));
  lo = _mm512_mullo_epi16(state, ml);
  hi = _mm512_add_epi16(_mm512_mulhi_epu16(state, ml), _mm512_mullo_epi16(state, mh));
  if constexpr (CB == 0) {  // + 64248484, carrying from the low half into the high one
    constexpr uint32_t add = 64248484u;
    const __m512i sum = _mm512_add_epi16(lo, _mm512_set1_epi16(static_cast<int16_t>(add & 0xFFFF)));
    const __mmask32 carry = _mm512_cmplt_epu16_mask(sum, lo);
    hi = _mm512_add_epi16(hi, _mm512_set1_epi16(static_cast<int16_t>(add >> 16)));
    hi = _mm512_mask_add_epi16(hi, carry, hi, _mm512_set1_epi16(1));
    lo = sum;
  }
}

// mul1's byte sums of 32 states' hashes (0..1020, 16-bit lanes; exl3_gemm_cpu.cpp's
// mul1_byte_sum does 16 states in 32-bit lanes): the codebook value is (1024 + sum) a + b.
inline __m512i mul1_state_sums(__m512i state) {
  __m512i lo, hi;
  hash_halves<2>(state, lo, hi);
  const __m512i ones = _mm512_set1_epi8(1);
  return _mm512_add_epi16(_mm512_maddubs_epi16(lo, ones), _mm512_maddubs_epi16(hi, ones));
}

#if defined(__AVX512FP16__) && !defined(EXL3_CPU_NO_FP16)
// 32 states (16-bit lanes) -> their codebook values, rounded to float16 once like the
// codec: the hash state * m (mod 2^32) kept as two 16-bit halves.
template <int CB>
inline __m512h codebook_ph(__m512i state) {
  if constexpr (CB == 2) {
    // (1024 + byte sum) * a + b = byte sum * a + (b + 1024 a), exactly (b + 1024 a =
    // -3.453125 is a float16): one float16 FMA rounds once, as the codec does.
    const __m512i n = mul1_state_sums(state);
    return _mm512_fmadd_ph(_mm512_cvtepi16_ph(n), _mm512_set1_ph(static_cast<_Float16>(1774.f / 262144.f)),
                           _mm512_set1_ph(static_cast<_Float16>(-3.453125f)));
  } else {
    __m512i lo, hi;
    hash_halves<CB>(state, lo, hi);
    const __m512i mask = _mm512_set1_epi16(static_cast<int16_t>(0x8FFF));
    const __m512i flip = _mm512_set1_epi16(0x3B60);
    return _mm512_add_ph(_mm512_castsi512_ph(_mm512_xor_si512(_mm512_and_si512(lo, mask), flip)),
                         _mm512_castsi512_ph(_mm512_xor_si512(_mm512_and_si512(hi, mask), flip)));
  }
}

#endif

#if !defined(__AVX512FP16__) || defined(EXL3_CPU_NO_FP16)
// A codebook value computed exactly in float32 (mul1: n a + c; 3inst/mcg: the sum of the
// two float16 halves) rounded to float16 precision in float32 by Veltkamp's split (2^13 + 1:
// 24 - 13 = 11 significant bits): three float ops for vcvtps2ph + vcvtph2ps, and the same
// value as float16 rounding for every input these codebooks make (checked exhaustively:
// the 1021 byte sums of mul1, the 65536 states of 3inst and mcg; the tests check the
// kernel's values bit for bit). The _round_ intrinsics keep the compiler from contracting
// the product and the difference into one FMA, which would break the split.
inline __m512 round_half(__m512 v) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 c = _mm512_mul_round_ps(v, _mm512_set1_ps(8193.f), kRound);
  return _mm512_sub_round_ps(c, _mm512_sub_round_ps(c, v, kRound), kRound);
}
#endif

// The codebook values of 32 states (16-bit lanes) as float32: w0 of lanes 0-15, w1 of
// lanes 16-31, each the codec's float16 value (rounded once from the exact value).
template <int CB>
inline void codebook_pair(__m512i state, __m512& w0, __m512& w1) {
#if defined(__AVX512FP16__) && !defined(EXL3_CPU_NO_FP16)
  const __m512i bits = _mm512_castph_si512(codebook_ph<CB>(state));
  w0 = _mm512_cvtph_ps(_mm512_castsi512_si256(bits));
  w1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(bits, 1));
#else
  if constexpr (CB == 2) {
    // byte sum * a + (b + 1024 a): the byte sum (0..1020) times a = 1774 / 2^18 and the sum
    // are exact in float32 (multiples of 2^-18 below 2^3), rounded once as the float16 FMA
    // rounds.
    const __m512i n = mul1_state_sums(state);
    const __m512 a = _mm512_set1_ps(1774.f / 262144.f), c = _mm512_set1_ps(-3.453125f);
    const __m512 f0 = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(n))), a, c);
    const __m512 f1 = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(n, 1))), a, c);
    w0 = round_half(f0);
    w1 = round_half(f1);
  } else {  // the two float16 halves, added exactly in float32, rounded once
    __m512i lo, hi;
    hash_halves<CB>(state, lo, hi);
    const __m512i mask = _mm512_set1_epi16(static_cast<int16_t>(0x8FFF));
    const __m512i flip = _mm512_set1_epi16(0x3B60);
    const __m512i l = _mm512_xor_si512(_mm512_and_si512(lo, mask), flip);
    const __m512i h = _mm512_xor_si512(_mm512_and_si512(hi, mask), flip);
    const __m512 s0 = _mm512_add_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(l)),
                                    _mm512_cvtph_ps(_mm512_castsi512_si256(h)));
    const __m512 s1 = _mm512_add_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(l, 1)),
                                    _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)));
    w0 = round_half(s0);
    w1 = round_half(s1);
  }
#endif
}

// (a:b) << offset, upper 16 bits, per 16-bit lane (offset 0..15).
inline __m512i funnel16(__m512i a, __m512i b, __m512i offset) {
#if defined(__AVX512VBMI2__)
  return _mm512_shldv_epi16(a, b, offset);
#else
  const __m512i rest = _mm512_sub_epi16(_mm512_set1_epi16(16), offset);
  return _mm512_or_si512(_mm512_sllv_epi16(a, offset), _mm512_srlv_epi16(b, rest));
#endif
}

// The 32 states of vector v of a tile (head/tail: its ring's first and last 32 words).
template <bool WIDE>
inline __m512i step_states(const int16_t* tile, __m512i head, __m512i tail,
                           const StepOrderTable& t, int v) {
#if defined(__AVX512VBMI__) && !defined(EXL3_CPU_NO_VBMI)
  const __m512i gi = _mm512_load_si512(t.gather + 32 * v);
  __m512i words;
  if (!WIDE) words = _mm512_permutexvar_epi16(gi, head);
  else if (v == 0) words = _mm512_permutex2var_epi16(head, gi, tail);
  else words = _mm512_permutexvar_epi16(gi, _mm512_loadu_si512(tile + t.base[v]));
  return _mm512_multishift_epi64_epi8(_mm512_load_si512(t.shift + 64 * v), words);
#else
  const __m512i fi = _mm512_load_si512(t.first + 32 * v);
  const __m512i si = _mm512_load_si512(t.second + 32 * v);
  __m512i a, b;
  if (!WIDE) {
    a = _mm512_permutexvar_epi16(fi, head);
    b = _mm512_permutexvar_epi16(si, head);
  } else if (v == 0) {
    a = _mm512_permutex2var_epi16(head, fi, tail);
    b = _mm512_permutex2var_epi16(head, si, tail);
  } else {
    const __m512i window = _mm512_loadu_si512(tile + t.base[v]);
    a = _mm512_permutexvar_epi16(fi, window);
    b = _mm512_permutexvar_epi16(si, window);
  }
  return funnel16(a, b, _mm512_load_si512(t.offset + 32 * v));
#endif
}

// A tile's ring ends for step_states: its first and last 32 words (WIDE), or its only
// words16 <= 32 words, masked by `narrow`, as both.
template <bool WIDE>
inline void ring_ends(const int16_t* tile, const StepOrderTable& t, __mmask32 narrow,
                      __m512i& head, __m512i& tail) {
  if constexpr (WIDE) {
    head = _mm512_loadu_si512(tile);
    tail = _mm512_loadu_si512(tile + t.words16 - 32);
  } else {
    head = tail = _mm512_maskz_loadu_epi16(narrow, tile);
  }
}

// Software prefetch of the trellis this far ahead of the tile being decoded (bytes; read
// from EXL3_CPU_PREFETCH once for A/B runs, 0 = off). The strips of a thread's range are
// contiguous, so prefetching past a strip's end fetches the next one.
inline int64_t prefetch_bytes() {
  static const int64_t bytes = [] {
    const char* v = std::getenv("EXL3_CPU_PREFETCH");
    return v ? std::atoll(v) : int64_t{2048};
  }();
  return bytes;
}

// One tile's lines (2 * words bytes), `ahead` bytes on.
inline void prefetch_tile(const int16_t* tile, int64_t words, int64_t ahead) {
  if (ahead <= 0) return;
  const char* p = reinterpret_cast<const char*>(tile) + ahead;
  for (int64_t b = 0; b < 2 * words; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// xs (rows, kb, 32): x of each 16-row block in step-lane order (kLaneRow).
inline void step_lanes_x(const float* xh, int64_t ldx, int64_t rows, int64_t kb, float* xs) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t i = 0; i < kb; ++i)
      for (int l = 0; l < 32; ++l) xs[(m * kb + i) * 32 + l] = xh[m * ldx + 16 * i + kLaneRow[l]];
}

// out[m][0..16) = the strip's 16 columns for rows m < MR; xs from step_lanes_x.
template <int CB, bool WIDE, int MR>
void strip_steps(const float* xs, int64_t kb, const int16_t* strip, int64_t words,
                 const StepOrderTable& t, float* out, int64_t ldo) {
  __m512 acc[MR][8];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 8; ++v) acc[m][v] = _mm512_setzero_ps();
  const __mmask32 narrow = static_cast<__mmask32>((uint64_t{1} << std::min(t.words16, 32)) - 1);
  const int64_t ahead = prefetch_bytes();
  for (int64_t i = 0; i < kb; ++i) {
    const int16_t* tile = strip + i * words;
    prefetch_tile(tile, words, ahead);
    __m512 x0[MR], x1[MR];
    for (int m = 0; m < MR; ++m) {
      x0[m] = _mm512_loadu_ps(xs + (m * kb + i) * 32);
      x1[m] = _mm512_loadu_ps(xs + (m * kb + i) * 32 + 16);
    }
    __m512i head, tail;
    ring_ends<WIDE>(tile, t, narrow, head, tail);
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) {
      const __m512i state = step_states<WIDE>(tile, head, tail, t, v);
      __m512 w0, w1;
      codebook_pair<CB>(state, w0, w1);
      for (int m = 0; m < MR; ++m)
        acc[m][v] = _mm512_fmadd_ps(x1[m], w1, _mm512_fmadd_ps(x0[m], w0, acc[m][v]));
    }
  }
  // Lanes 0-3 and 8-11 of acc[v] are column v, lanes 4-7 and 12-15 column v + 8.
  for (int m = 0; m < MR; ++m) {
    alignas(64) float folded[8][16];
    for (int v = 0; v < 8; ++v) {
      __m512 a = acc[m][v];
      a = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, 0x4E));     // + lanes l ^ 8
      a = _mm512_add_ps(a, _mm512_permute_ps(a, 0xB1));           // + lanes l ^ 1
      a = _mm512_add_ps(a, _mm512_permute_ps(a, 0x4E));           // + lanes l ^ 2
      _mm512_store_ps(folded[v], a);
    }
    float* o = out + m * ldo;
    for (int v = 0; v < 8; ++v) {
      o[v] = folded[v][0];
      o[v + 8] = folded[v][4];
    }
  }
}

#if !defined(__AVX512FP16__) || defined(EXL3_CPU_NO_FP16)
// One row of a mul1 layer without AVX512-FP16 (the model's decode rows): the byte sums n
// of a vector's 32 states go to float32 lanes by vpunpck[lh]wd with 0x4B00 above them
// (the float 2^23 + n: no widening, no integer conversion), and (2^23 + n) a + (c - 2^23 a)
// is the same exact value n a + c in one FMA. An unpack takes states 8g..8g+3 (low) and
// 8g+4..8g+7 (high) of each 128-bit group g: the low half's 16 states are all column v
// of the strip, the high half's all column v + 8, and both halves meet x of the same 16
// rows (kPairRow), so one x vector per tile serves both and acc[0][v], acc[1][v] each sum
// to one column.
constexpr int kPairRow[16] = {0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15};

// xs (kb, 16): x of each 16-row block in kPairRow order.
inline void step_pairs_x(const float* xh, int64_t kb, float* xs) {
  for (int64_t i = 0; i < kb; ++i)
    for (int l = 0; l < 16; ++l) xs[16 * i + l] = xh[16 * i + kPairRow[l]];
}

template <bool WIDE>
void strip_steps_mul1(const float* xs, int64_t kb, const int16_t* strip, int64_t words,
                      const StepOrderTable& t, float* out) {
  const __m512i magic = _mm512_set1_epi16(0x4B00);
  const __m512 a = _mm512_set1_ps(1774.f / 262144.f);
  const __m512 c = _mm512_set1_ps(-3.453125f - 56768.f);  // c - 2^23 a, exact
  __m512 acc[2][8];
  for (int v = 0; v < 8; ++v) acc[0][v] = acc[1][v] = _mm512_setzero_ps();
  const __mmask32 narrow = static_cast<__mmask32>((uint64_t{1} << std::min(t.words16, 32)) - 1);
  const int64_t ahead = prefetch_bytes();
  for (int64_t i = 0; i < kb; ++i) {
    const int16_t* tile = strip + i * words;
    prefetch_tile(tile, words, ahead);
    const __m512 x = _mm512_loadu_ps(xs + 16 * i);
    __m512i head, tail;
    ring_ends<WIDE>(tile, t, narrow, head, tail);
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) {
      const __m512i state = step_states<WIDE>(tile, head, tail, t, v);
      const __m512i n = mul1_state_sums(state);
      const __m512 f0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(n, magic)), a, c);
      const __m512 f1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(n, magic)), a, c);
      acc[0][v] = _mm512_fmadd_ps(x, round_half(f0), acc[0][v]);
      acc[1][v] = _mm512_fmadd_ps(x, round_half(f1), acc[1][v]);
    }
  }
  for (int h = 0; h < 2; ++h)
    for (int v = 0; v < 8; ++v) out[v + 8 * h] = _mm512_reduce_add_ps(acc[h][v]);
}
#endif

// --- The inexact integer GEMV (EXL3_CPU_GEMV=fast; mul1 only) ---
// mul1's value is float16((1024 + S) a + b), S the byte sum of the hash (0..1020). Here the
// float16 rounding is left out (w = S a + c, c = b + 1024 a) and x is rounded to int16 with
// one scale per row (xq = x / s), so a column's product is s (a sum xq S + c sum xq):
// vpdpwssd multiplies S by two rows of xq per 32-bit lane, ~10 vector uops per 32 weights
// against the exact path's ~17. Error: the float16 half-ulp of each weight (up to 2^-10 of
// |w| in [2, 4)) and x's int16 rounding: ~2e-4 of |y| (bench/NOTES-cpu-exl3.md).
constexpr float kMul1A = 1774.f / 262144.f;  // a (float16 0x1EEE)
constexpr float kMul1C = -3.453125f;          // b + 1024 a
constexpr int kIntFlush = 16;  // tiles per int32 flush: 16 x 2 x 1020 x 32767 < 2^31

// xq (rows, kb, 32) in step-lane order, scale[m] = max|x_m| / 32767, qsum[m] = sum of xq_m.
inline void step_lanes_xq(const float* xh, int64_t ldx, int64_t rows, int64_t kb, int16_t* xq,
                          float* scale, double* qsum) {
  for (int64_t m = 0; m < rows; ++m) {
    const float* x = xh + m * ldx;
    __m512 vmax = _mm512_setzero_ps();  // max |x|: the same in any order
    for (int64_t k = 0; k < 16 * kb; k += 16)
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    const float amax = _mm512_reduce_max_ps(vmax);
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
    scale[m] = amax / 32767.f;
    int64_t total = 0;
    alignas(64) int16_t lane_row[32];
    for (int l = 0; l < 32; ++l) lane_row[l] = static_cast<int16_t>(kLaneRow[l]);
    const __m512i lanes = _mm512_load_si512(lane_row);
    __m512i vsum = _mm512_setzero_si512();  // per lane < 2^15 x 2^15 values: no overflow
    for (int64_t i = 0; i < kb; ++i) {  // round to nearest even, like lrint
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * i), inv));
      const __m512i q16 = _mm512_castsi256_si512(_mm512_cvtsepi32_epi16(qi));
      vsum = _mm512_add_epi32(vsum, qi);
      if ((i & 32767) == 32767 || i + 1 == kb) {
        total += _mm512_reduce_add_epi32(vsum);
        vsum = _mm512_setzero_si512();
      }
      _mm512_storeu_si512(xq + (m * kb + i) * 32, _mm512_permutexvar_epi16(lanes, q16));
    }
    qsum[m] = static_cast<double>(total);
  }
}

// out[m][0..16) = sum over the strip's rows of xq_m[r] S[r][c] (the caller scales it).
template <bool WIDE, int MR>
void strip_steps_int(const int16_t* xq, int64_t kb, const int16_t* strip, int64_t words,
                     const StepOrderTable& t, float* out, int64_t ldo) {
  __m512i acc[MR][8];
  __m512 sum[MR][8];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 8; ++v) {
      acc[m][v] = _mm512_setzero_si512();
      sum[m][v] = _mm512_setzero_ps();
    }
  const __mmask32 narrow = static_cast<__mmask32>((uint64_t{1} << std::min(t.words16, 32)) - 1);
  const int64_t ahead = prefetch_bytes();
  for (int64_t i0 = 0; i0 < kb; i0 += kIntFlush) {
    const int64_t i1 = std::min(kb, i0 + kIntFlush);
    for (int64_t i = i0; i < i1; ++i) {
      const int16_t* tile = strip + i * words;
      prefetch_tile(tile, words, ahead);
      __m512i xv[MR];
      for (int m = 0; m < MR; ++m) xv[m] = _mm512_loadu_si512(xq + (m * kb + i) * 32);
      __m512i head, tail;
      ring_ends<WIDE>(tile, t, narrow, head, tail);
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) {
        const __m512i state = step_states<WIDE>(tile, head, tail, t, v);
        const __m512i s = mul1_state_sums(state);
        for (int m = 0; m < MR; ++m) {
#if defined(__AVX512VNNI__)
          acc[m][v] = _mm512_dpwssd_epi32(acc[m][v], s, xv[m]);
#else  // the same wrapping int32 sum
          acc[m][v] = _mm512_add_epi32(acc[m][v], _mm512_madd_epi16(s, xv[m]));
#endif
        }
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < 8; ++v) {
        sum[m][v] = _mm512_add_ps(sum[m][v], _mm512_cvtepi32_ps(acc[m][v]));
        acc[m][v] = _mm512_setzero_si512();
      }
  }
  // 32-bit lane j of sum[v] is 16-bit lanes 2j, 2j + 1: column v where bit 1 of j is clear,
  // v + 8 where it is set.
  for (int m = 0; m < MR; ++m) {
    alignas(64) float folded[8][16];
    for (int v = 0; v < 8; ++v) {
      __m512 a = sum[m][v];
      a = _mm512_add_ps(a, _mm512_permute_ps(a, 0xB1));         // + lane j ^ 1
      a = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, 0x4E));   // + 128-bit block ^ 2
      a = _mm512_add_ps(a, _mm512_shuffle_f32x4(a, a, 0xB1));   // + 128-bit block ^ 1
      _mm512_store_ps(folded[v], a);
    }
    float* o = out + m * ldo;
    for (int v = 0; v < 8; ++v) {
      o[v] = folded[v][0];
      o[v + 8] = folded[v][2];
    }
  }
}
