// Decode attention straight over the paged KV cache, and the quantized cache write.
//
// Attention: one query token per sequence. Grid (chunks, kv_heads, batch); a block
// takes the G = heads / kv_heads query heads sharing one kv head over one chunk of
// kChunk positions: scores (a warp per position, lanes over channels, so each key row
// is one coalesced read), softmax statistics (a warp per head), then the weighted sum
// of values (a warp per position again). With more than one chunk each block writes an
// unnormalised partial result and its (max, sum), and a second kernel combines them. Pages are read where they lie, through the page
// table: no gathered copy of the history.
//
// Quantized pages (kv_quant.py, EXL3-FORMAT.md 6) hold, per position, b-bit codes of
// the Hadamard-rotated channels (groups of 32) as bit-planes (per 8 channels, b bytes:
// byte j holds bit j of each channel's code) and one float16 scale per 32 channels.
// They are dequantized in registers and never un-rotated per position: q.k equals
// (H q).(H k) for the symmetric orthogonal H, so the query is rotated once, and the
// rotation of the values is applied once to the weighted sum.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "exl3_convert.cuh"
#include "exl3_launch.cuh"
#include "exl3_ops.h"

namespace exl3 {
namespace {

constexpr int kThreads = 256;  // 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 64;  // positions per block
constexpr int kPerWarp = kChunk / kWarps;  // positions a warp loads at once
constexpr int kMaxGroupDim = 2048;  // G * D held in shared memory
constexpr unsigned kFull = 0xffffffffu;


// The 32-point Sylvester Hadamard transform divided by sqrt(32) of the values held by
// the 32 lanes of a warp (lane e gets sum_j v_j (-1)^popc(j & e) / sqrt(32)): the
// rotation kv_quant.py applies per 32 channels. Every lane must take part.
__device__ __forceinline__ float hadamard32_warp(float v, int lane) {
#pragma unroll
  for (int h = 1; h < 32; h <<= 1) {
    const float other = __shfl_xor_sync(kFull, v, h);
    v = (lane & h) ? other - v : v + other;
  }
  return v * 0.17677669529663687f;
}

struct Args {
  const void* q;  // [B, H, D]
  const void* k;  // [slots, KV, D] (T) or codes [slots, KV*D/8*bits]
  const __half* k_scales;  // [slots, KV*D/32] (quantized)
  const void* v;
  const __half* v_scales;
  int k_bits, v_bits;  // 16: not quantized
  const int64_t* page_table;  // [B, P]
  const int64_t* lengths;  // [B]
  int pages, page_size;
  int heads, kv_heads, dim;
  int window;  // <= 0: none
  float softcap;  // <= 0: none
  float scale;
  int chunks;
  float* part_acc;  // [B, H, chunks, D]
  float* part_ml;  // [B, H, chunks, 2]
  void* out;  // [B, H, D]
};


// A quantized row's bytes for this lane and its scale, loaded before any unpacking so a
// warp's loads of all its rows are in flight together. bits == 8: the lane's CPL code
// bytes; else the `bits` bit-plane bytes of its 8-channel group (one load for 2 and 4).
struct RawRow {
  uint64_t word;
  float scale;
};

template <int CPL>
__device__ __forceinline__ RawRow load_raw(const void* base, const __half* scales, int bits,
                                           int64_t slot, int C, int c) {
  const uint8_t* row = reinterpret_cast<const uint8_t*>(base) + slot * (C / 8 * bits);
  RawRow raw;
  raw.scale = __half2float(scales[slot * (C / 32) + (c >> 5)]);
  if (bits == 8) {
    if constexpr (CPL == 8) raw.word = *reinterpret_cast<const uint64_t*>(row + c);
    else if constexpr (CPL == 4) raw.word = *reinterpret_cast<const uint32_t*>(row + c);
    else raw.word = *reinterpret_cast<const uint16_t*>(row + c);
    return raw;
  }
  const uint8_t* planes = row + (c >> 3) * bits;
  if (bits == 4) {
    raw.word = *reinterpret_cast<const uint32_t*>(planes);
  } else if (bits == 2) {
    raw.word = *reinterpret_cast<const uint16_t*>(planes);
  } else {
    raw.word = 0;
    for (int j = 0; j < bits; ++j) raw.word |= (uint64_t)planes[j] << (8 * j);
  }
  return raw;
}

// Bits 8j + i (plane j, channel i; i, j < 4) of x moved to 8i + j: channel i's code in
// byte i. Two delta swaps: the 2x2 blocks of the 4x4 bit matrix, then inside them.
__device__ __forceinline__ uint32_t transpose_nibbles(uint32_t x) {
  uint32_t t = ((x >> 14) ^ x) & 0x00000C0Cu;
  x ^= t ^ (t << 14);
  t = ((x >> 7) ^ x) & 0x000A000Au;
  return x ^ t ^ (t << 7);
}

// Byte i of w (< 256) as a float, exactly: 2^23 + byte, read as a float, minus 2^23.
__device__ __forceinline__ float byte_to_float(uint32_t w, int i) {
  return __int_as_float(__byte_perm(w, 0x4B000000u, 0x7540u | i)) - 8388608.f;
}

template <int CPL>
__device__ __forceinline__ void unpack_raw(const RawRow& raw, int bits, int c,
                                           float (&out)[CPL]) {
  // code -> (code - (2^(bits-1) - 0.5)) * scale / 2^(bits-1): one FMA per channel.
  if (bits == 4) {  // the common q4 cache: a bit transpose, byte-permute conversion
    const float step = raw.scale * 0.125f, bias = -7.5f * step;
    const uint32_t w32 = (uint32_t)raw.word >> (c & 7);
    if constexpr (CPL <= 4) {
      const uint32_t codes = transpose_nibbles(w32 & (0x01010101u * ((1u << CPL) - 1)));
#pragma unroll
      for (int i = 0; i < CPL; ++i) out[i] = fmaf(byte_to_float(codes, i), step, bias);
    } else {
      const uint32_t lo = transpose_nibbles(w32 & 0x0F0F0F0Fu);
      const uint32_t hi = transpose_nibbles((w32 >> 4) & 0x0F0F0F0Fu);
#pragma unroll
      for (int i = 0; i < CPL; ++i)
        out[i] = fmaf(byte_to_float(i < 4 ? lo : hi, i & 3), step, bias);
    }
    return;
  }
  if (bits == 8) {  // one code byte per channel
    const float step = raw.scale * 0.0078125f, bias = -127.5f * step;
    const uint32_t lo = (uint32_t)raw.word, hi = (uint32_t)(raw.word >> 32);
#pragma unroll
    for (int i = 0; i < CPL; ++i)
      out[i] = fmaf(byte_to_float(i < 4 ? lo : hi, i & 3), step, bias);
    return;
  }
  // 2, 3, 5, 6, 7 bits: bit j of every code from plane byte j.
  const float step = raw.scale / (float)(1 << (bits - 1));
  const float bias = -((float)(1 << (bits - 1)) - 0.5f) * step;
  const int sub = c & 7;
  int codes[CPL];
#pragma unroll
  for (int i = 0; i < CPL; ++i) codes[i] = 0;
  for (int j = 0; j < bits; ++j) {
    const int byte = (int)(raw.word >> (8 * j + sub));
#pragma unroll
    for (int i = 0; i < CPL; ++i) codes[i] |= ((byte >> i) & 1) << j;
  }
#pragma unroll
  for (int i = 0; i < CPL; ++i) out[i] = fmaf((float)codes[i], step, bias);
}

// The kPerWarp rows a warp reads (positions warp, warp + kWarps, ... of the chunk), CPL
// channels each for this lane (c0 = lane * CPL of the kv head's D), as floats. Every
// load is issued before any row is converted.
template <typename T, bool Q, int CPL>
__device__ __forceinline__ void load_rows(const void* base, const __half* scales, int bits,
                                          const int* slots, int t0, int t_lo, int t_hi,
                                          int warp, int kv_heads, int kvh, int D, int C,
                                          int c0, float (&out)[kPerWarp][CPL]) {
  if constexpr (Q) {
    const int c = kvh * D + c0;
    RawRow raw[kPerWarp];
#pragma unroll
    for (int j = 0; j < kPerWarp; ++j) {
      const int tl = warp + j * kWarps, t = t0 + tl;
      if (t >= t_lo && t < t_hi) raw[j] = load_raw<CPL>(base, scales, bits, slots[tl], C, c);
    }
#pragma unroll
    for (int j = 0; j < kPerWarp; ++j) {
      const int tl = warp + j * kWarps, t = t0 + tl;
      if (t >= t_lo && t < t_hi) unpack_raw<CPL>(raw[j], bits, c, out[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPerWarp; ++j) {
      const int tl = warp + j * kWarps, t = t0 + tl;
      if (t < t_lo || t >= t_hi) continue;
      const T* row = reinterpret_cast<const T*>(base) + ((int64_t)slots[tl] * kv_heads + kvh) * D + c0;
      if constexpr (CPL * sizeof(T) == 16) {
        const uint4 raw = *reinterpret_cast<const uint4*>(row);
        const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < CPL; ++i) out[j][i] = to_f32(v[i]);
      } else if constexpr (CPL * sizeof(T) == 8) {
        const uint2 raw = *reinterpret_cast<const uint2*>(row);
        const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < CPL; ++i) out[j][i] = to_f32(v[i]);
      } else {
#pragma unroll
        for (int i = 0; i < CPL; ++i) out[j][i] = to_f32(row[i]);
      }
    }
  }
}

// Grid (chunks, kv_heads, batch), kThreads threads: one kv head's G query heads over
// kChunk positions. Lane l of a warp holds channels l*CPL .. l*CPL + CPL - 1 of every
// row it reads (coalesced); warps take positions in turn.
template <typename T, bool KQ, bool VQ, int D>
__global__ void __launch_bounds__(kThreads) paged_attention_kernel(Args a) {
  pdl_trigger();
  pdl_wait();
  constexpr int CPL = D / 32;
  constexpr int kMaxG = 64 / CPL < 16 ? 64 / CPL : 16;  // accumulators: G * CPL <= 64, G <= 16
  extern __shared__ float smem[];
  const int chunk = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int G = a.heads / a.kv_heads, C = a.kv_heads * D;
  float* qs = smem;  // [G][D]
  float* scores = qs + G * D;  // [G][kChunk]
  float* red = scores + G * kChunk;  // [G][D]
  int* slots = reinterpret_cast<int*>(red + G * D);  // [kChunk]
  __shared__ float stat_m[16], stat_l[16];

  const int length = (int)a.lengths[b];
  const int first = a.window > 0 ? max(0, length - a.window) : 0;
  const int t0 = chunk * kChunk;
  const int t_lo = max(t0, first), t_hi = min(t0 + kChunk, length);
  const int head0 = kvh * G;
  if (t_lo >= t_hi) {  // nothing of this row in the chunk
    if (a.chunks > 1 && threadIdx.x < G) {
      float* ml = a.part_ml + (((int64_t)b * a.heads + head0 + threadIdx.x) * a.chunks + chunk) * 2;
      ml[0] = -CUDART_INF_F;
      ml[1] = 0.f;
    }
    return;
  }

  // The queries of this kv head, scaled (and rotated per 32 channels for quantized keys).
  const T* q = reinterpret_cast<const T*>(a.q) + ((int64_t)b * a.heads + head0) * D;
  for (int i = threadIdx.x; i < G * D; i += kThreads) red[i] = to_f32(q[i]) * a.scale;
  for (int tl = threadIdx.x; tl < kChunk; tl += kThreads) {
    const int t = t0 + tl;
    slots[tl] = (t >= t_lo && t < t_hi)
                    ? (int)(a.page_table[(int64_t)b * a.pages + t / a.page_size] * a.page_size +
                            t % a.page_size)
                    : 0;
  }
  __syncthreads();
  // G * D is a multiple of 32: each warp's lanes hold one whole 32-channel group.
  for (int i = threadIdx.x; i < G * D; i += kThreads)
    qs[i] = KQ ? hadamard32_warp(red[i], i & 31) : red[i];
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c0 = lane * CPL;
  // Scores: a warp per position, partial dot products reduced across the lanes. Each
  // warp issues the loads of all its kPerWarp rows before any arithmetic.
  {
    float k[kPerWarp][CPL];
    load_rows<T, KQ, CPL>(a.k, a.k_scales, a.k_bits, slots, t0, t_lo, t_hi, warp, a.kv_heads,
                          kvh, D, C, c0, k);
#pragma unroll
    for (int j = 0; j < kPerWarp; ++j) {
      const int tl = warp + j * kWarps, t = t0 + tl;
      if (t < t_lo || t >= t_hi) {
        if (lane < G) scores[lane * kChunk + tl] = -CUDART_INF_F;
        continue;
      }
      for (int g = 0; g < G; ++g) {  // a runtime loop: nothing indexed by g in registers
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < CPL; ++i) s += qs[g * D + c0 + i] * k[j][i];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(kFull, s, o);
        if (a.softcap > 0.f) s = a.softcap * tanhf(s / a.softcap);
        if (lane == 0) scores[g * kChunk + tl] = s;
      }
    }
  }
  __syncthreads();

  // Softmax statistics: a warp per head; scores become exp(s - max).
  for (int g = warp; g < G; g += kWarps) {
    float* s = scores + g * kChunk;
    float m = -CUDART_INF_F;
    for (int i = lane; i < kChunk; i += 32) m = fmaxf(m, s[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
    float l = 0.f;
    for (int i = lane; i < kChunk; i += 32) {
      const float p = s[i] == -CUDART_INF_F ? 0.f : __expf(s[i] - m);
      s[i] = p;
      l += p;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(kFull, l, o);
    if (lane == 0) {
      stat_m[g] = m;
      stat_l[g] = l;
    }
  }
  for (int i = threadIdx.x; i < G * D; i += kThreads) red[i] = 0.f;
  __syncthreads();

  // Weighted sum of values: a warp per position again, lanes over channels.
  float acc[kMaxG][CPL];
#pragma unroll
  for (int g = 0; g < kMaxG; ++g)
#pragma unroll
    for (int i = 0; i < CPL; ++i) acc[g][i] = 0.f;
  {
    float v[kPerWarp][CPL];
    load_rows<T, VQ, CPL>(a.v, a.v_scales, a.v_bits, slots, t0, t_lo, t_hi, warp, a.kv_heads,
                          kvh, D, C, c0, v);
#pragma unroll
    for (int j = 0; j < kPerWarp; ++j) {
      const int tl = warp + j * kWarps, t = t0 + tl;
      if (t < t_lo || t >= t_hi) continue;
#pragma unroll
      for (int g = 0; g < kMaxG; ++g) {
        if (g < G) {
          const float p = scores[g * kChunk + tl];
#pragma unroll
          for (int i = 0; i < CPL; ++i) acc[g][i] += p * v[j][i];
        }
      }
    }
  }
  // The warps' sums added in warp order, not by atomics: the same float order on every
  // run, so two generations of one model give the same tokens (atomics made near-tied
  // greedy tokens flip between runs; bench/NOTES-gpu.md, run 27).
  for (int w = 0; w < kWarps; ++w) {
    if (warp == w) {
#pragma unroll
      for (int g = 0; g < kMaxG; ++g)
        if (g < G)
#pragma unroll
          for (int i = 0; i < CPL; ++i) red[g * D + c0 + i] += acc[g][i];
    }
    __syncthreads();
  }

  // Un-rotate quantized values per 32 channels, then write the row or the chunk's part.
  for (int i = threadIdx.x; i < G * D; i += kThreads) {
    const int g = i / D, d = i % D;
    const float value = VQ ? hadamard32_warp(red[i], i & 31) : red[i];
    const int64_t bh = (int64_t)b * a.heads + head0 + g;
    if (a.chunks == 1) {
      const float l = stat_l[g];
      reinterpret_cast<T*>(a.out)[bh * D + d] = from_f32<T>(l > 0.f ? value / l : 0.f);
    } else {
      a.part_acc[(bh * a.chunks + chunk) * D + d] = value;
      if (d == 0) {
        a.part_ml[(bh * a.chunks + chunk) * 2] = stat_m[g];
        a.part_ml[(bh * a.chunks + chunk) * 2 + 1] = stat_l[g];
      }
    }
  }
}

// out[b, h, :] from the chunks' partial sums: grid (B * H), threads over D.
template <typename T>
__global__ void combine_chunks_kernel(const float* part_acc, const float* part_ml, T* out,
                                      int chunks, int dim) {
  pdl_trigger();
  pdl_wait();
  const int64_t bh = blockIdx.x;
  const float* ml = part_ml + bh * chunks * 2;
  float m = -CUDART_INF_F;
  for (int c = 0; c < chunks; ++c) m = fmaxf(m, ml[2 * c]);
  float l = 0.f;
  for (int c = 0; c < chunks; ++c)
    if (ml[2 * c + 1] > 0.f) l += ml[2 * c + 1] * __expf(ml[2 * c] - m);
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    float acc = 0.f;
    for (int c = 0; c < chunks; ++c)
      if (ml[2 * c + 1] > 0.f) acc += part_acc[(bh * chunks + c) * dim + d] * __expf(ml[2 * c] - m);
    out[bh * dim + d] = from_f32<T>(l > 0.f ? acc / l : 0.f);
  }
}

template <typename T, int D>
bool launch_dim(const Args& a, cudaStream_t stream, int batch, bool combine) {
  const int G = a.heads / a.kv_heads;
  if (G * (D / 32) > 64) return false;
  const size_t smem = (size_t)(2 * G * D + G * kChunk) * sizeof(float) + kChunk * sizeof(int);
  const dim3 grid(a.chunks, a.kv_heads, batch);
  // Keys and values are quantized together or not at all (the cache types of kv_quant.py).
  const bool quantized = a.k_bits < 16;
  if (quantized != (a.v_bits < 16)) return false;
  auto kernel = quantized ? paged_attention_kernel<T, true, true, D>
                          : paged_attention_kernel<T, false, false, D>;
  if (smem > 48 * 1024 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
          cudaSuccess)
    return false;
  launch(kernel, grid, dim3(kThreads), smem, stream, a);
  if (a.chunks > 1 && combine) {  // else the caller combines (layer_fold.cu)
    launch(combine_chunks_kernel<T>, dim3(batch * a.heads), dim3(D < 128 ? D : 128), 0, stream,
           a.part_acc, a.part_ml, reinterpret_cast<T*>(a.out), a.chunks, D);
  }
  return true;
}

template <typename T>
bool launch_typed(const Args& a, cudaStream_t stream, int batch, bool combine) {
  switch (a.dim) {
    case 64: return launch_dim<T, 64>(a, stream, batch, combine);
    case 128: return launch_dim<T, 128>(a, stream, batch, combine);
    case 256: return launch_dim<T, 256>(a, stream, batch, combine);
    default: return false;
  }
}

// Quantized cache write: one warp per (row, 32-channel group).
template <typename T>
__global__ void kv_quant_write_kernel(const T* x, int64_t x_row_stride, const int64_t* slots,
                                      int rows, int channels, int bits, uint8_t* codes,
                                      __half* scales) {
  pdl_trigger();
  pdl_wait();
  const int warp_global = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const int groups = channels / 32;
  if (warp_global >= rows * groups) return;
  const int row = warp_global / groups, group = warp_global % groups;
  float v = to_f32(x[(int64_t)row * x_row_stride + group * 32 + lane]);
  // Fast Walsh-Hadamard transform across the warp: Sylvester order, then 1/sqrt(32).
#pragma unroll
  for (int h = 1; h < 32; h <<= 1) {
    const float other = __shfl_xor_sync(kFull, v, h);
    v = (lane & h) ? other - v : v + other;
  }
  v *= 0.17677669529663687f;
  float absmax = fabsf(v);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) absmax = fmaxf(absmax, __shfl_xor_sync(kFull, absmax, o));
  absmax = fminf(absmax, 65504.f);
  const __half scale = __float2half_ru(absmax);  // the smallest float16 >= absmax
  const float safe = fmaxf(__half2float(scale), 6.103515625e-05f);
  const float half_range = (float)(1 << (bits - 1));
  float q = __fadd_rn(__fmul_rn(__fdiv_rn(v, safe), half_range), half_range - 0.5f);
  q = fminf(fmaxf(rintf(q), 0.f), (float)((1 << bits) - 1));
  const int code = (int)q;
  const int64_t slot = slots[row];
  if (bits == 8) {
    codes[slot * channels + group * 32 + lane] = (uint8_t)code;
  } else {
    const int64_t packed = (int64_t)channels / 8 * bits;
    const int mine_j = lane % bits, mine_m = lane / bits;
    unsigned mine = 0;
    for (int j = 0; j < bits; ++j) {
      const unsigned ballot = __ballot_sync(kFull, (code >> j) & 1);
      if (j == mine_j) mine = ballot;
    }
    if (lane < 4 * bits)
      codes[slot * packed + (int64_t)(group * 4 + mine_m) * bits + mine_j] =
          (uint8_t)((mine >> (8 * mine_m)) & 0xff);
  }
  if (lane == 0) scales[slot * groups + group] = scale;
}

}  // namespace

bool launch_paged_attention(int dtype, const void* q, int batch, int heads, int kv_heads,
                            int dim, const void* k, const void* k_scales, int k_bits,
                            const void* v, const void* v_scales, int v_bits,
                            const int64_t* page_table, int pages, const int64_t* lengths,
                            int page_size, int window, float softcap, float scale,
                            float* part_acc, float* part_ml, int chunks, void* out,
                            cudaStream_t stream, bool combine) {
  if (kv_heads <= 0 || heads % kv_heads || (dim != 64 && dim != 128 && dim != 256)) return false;
  const int G = heads / kv_heads;
  if (G > 16 || G * dim > kMaxGroupDim) return false;
  if ((k_bits < 16 && (k_bits < 2 || k_bits > 8)) || (v_bits < 16 && (v_bits < 2 || v_bits > 8)))
    return false;
  Args a{q, k, reinterpret_cast<const __half*>(k_scales), v,
         reinterpret_cast<const __half*>(v_scales), k_bits, v_bits, page_table, lengths, pages,
         page_size, heads, kv_heads, dim, window, softcap, scale, chunks, part_acc, part_ml, out};
  if (dtype == DT_HALF) return launch_typed<__half>(a, stream, batch, combine);
  if (dtype == DT_BF16) return launch_typed<__nv_bfloat16>(a, stream, batch, combine);
  return false;
}

bool launch_kv_quant_write(int dtype, const void* x, int64_t x_row_stride,
                           const int64_t* slots, int rows,
                           int channels, int bits, void* codes, void* scales,
                           cudaStream_t stream) {
  if (channels % 32 || bits < 2 || bits > 8 || rows <= 0) return false;
  const int warps = rows * (channels / 32);
  const int threads = 256;
  const int blocks = (warps * 32 + threads - 1) / threads;
  auto* c = reinterpret_cast<uint8_t*>(codes);
  auto* s = reinterpret_cast<__half*>(scales);
  if (dtype == DT_HALF)
    launch(kv_quant_write_kernel<__half>, dim3(blocks), dim3(threads), 0, stream,
           reinterpret_cast<const __half*>(x), x_row_stride, slots, rows, channels, bits, c, s);
  else if (dtype == DT_BF16)
    launch(kv_quant_write_kernel<__nv_bfloat16>, dim3(blocks), dim3(threads), 0, stream,
           reinterpret_cast<const __nv_bfloat16*>(x), x_row_stride, slots,
           rows, channels, bits, c, s);
  else if (dtype == DT_FLOAT)
    launch(kv_quant_write_kernel<float>, dim3(blocks), dim3(threads), 0, stream,
           reinterpret_cast<const float*>(x), x_row_stride, slots, rows, channels, bits, c, s);
  else
    return false;
  return true;
}

}  // namespace exl3
