// y = x · W for a few rows of x (decode), W stored bfloat16 or int8 with one float
// scale per output column, float32 accumulation (exl3cli/engine/layers/linear.py, CPU path).
//
// Decode on CPU is memory-bound: one token streams every weight once, so the speed is
// the bytes per weight. torch's bf16 GEMV converts the activations too and runs far
// below DRAM bandwidth, and its int8 paths are slower still; this kernel keeps the
// activations in float32, widens 16 weights per instruction (bf16: shift left 16;
// int8: sign-extend + convert) and accumulates with FMA in float32.
//
// W is (K, Npad) with row stride ldw, Npad a multiple of 32; each task computes one
// 32-column block for every row of x (rows in chunks of 4, so the block is read from
// DRAM once and from cache for the other chunks). Parallel over blocks with
// at::parallel_for, so torch.set_num_threads applies and no second OpenMP runtime loads.
// Registered as torch.ops.exl3_cpu.gemv (no pybind module: viterbi_cpu.cpp owns it);
// decode_ops.cpp calls it directly (gemv_cpu.h).
#include "gemv_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kCols = 32;   // output columns per block
constexpr int kMaxRows = 4;     // rows of x per pass over a block

#if defined(__AVX512F__)
inline __m512 widen16(const uint16_t* p) {  // 16 bf16 -> 16 float (exact)
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen16(const int8_t* p) {  // 16 int8 -> 16 float (exact)
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

// out[m][0..32) = sum_k x[m][k] * w[k][0..32); k unrolled by two with separate
// accumulators so one row still has four independent FMA chains.
template <int MR, typename T>
void block_rows(const float* x, int64_t ldx, const T* w, int64_t ldw, int64_t K,
                float* out) {
  __m512 a0[MR][2], a1[MR][2];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2; ++v) a0[m][v] = a1[m][v] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    const T* r0 = w + k * ldw;
    const T* r1 = r0 + ldw;
    __m512 w00 = widen16(r0), w01 = widen16(r0 + 16);
    __m512 w10 = widen16(r1), w11 = widen16(r1 + 16);
    for (int m = 0; m < MR; ++m) {
      __m512 x0 = _mm512_set1_ps(x[m * ldx + k]);
      __m512 x1 = _mm512_set1_ps(x[m * ldx + k + 1]);
      a0[m][0] = _mm512_fmadd_ps(x0, w00, a0[m][0]);
      a0[m][1] = _mm512_fmadd_ps(x0, w01, a0[m][1]);
      a1[m][0] = _mm512_fmadd_ps(x1, w10, a1[m][0]);
      a1[m][1] = _mm512_fmadd_ps(x1, w11, a1[m][1]);
    }
  }
  if (k < K) {
    const T* r0 = w + k * ldw;
    __m512 w00 = widen16(r0), w01 = widen16(r0 + 16);
    for (int m = 0; m < MR; ++m) {
      __m512 x0 = _mm512_set1_ps(x[m * ldx + k]);
      a0[m][0] = _mm512_fmadd_ps(x0, w00, a0[m][0]);
      a0[m][1] = _mm512_fmadd_ps(x0, w01, a0[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(out + m * kCols, _mm512_add_ps(a0[m][0], a1[m][0]));
    _mm512_storeu_ps(out + m * kCols + 16, _mm512_add_ps(a0[m][1], a1[m][1]));
  }
}
#else
inline float widen(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}
inline float widen(int8_t v) { return static_cast<float>(v); }
inline float widen(float v) { return v; }

// Plain C++ with fixed-width inner loops that gcc -O3 vectorises.
template <int MR, typename T>
void block_rows(const float* x, int64_t ldx, const T* w, int64_t ldw, int64_t K,
                float* out) {
  float acc[MR][kCols] = {};
  for (int64_t k = 0; k < K; ++k) {
    const T* row = w + k * ldw;
    float wf[kCols];
    for (int j = 0; j < kCols; ++j) wf[j] = widen(row[j]);
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * ldx + k];
      for (int j = 0; j < kCols; ++j) acc[m][j] += xv * wf[j];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kCols; ++j) out[m * kCols + j] = acc[m][j];
}
#endif


template <typename T>
void gemv_typed(const float* x, int64_t M, int64_t K, const T* w, int64_t ldw,
                int64_t block_stride, const float* scale, const float* bias, float* y,
                int64_t n) {
  const int64_t blocks = (n + kCols - 1) / kCols;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    float tile[kMaxRows * kCols];
    for (int64_t b = begin; b < end; ++b) {
      const T* wb = w + b * block_stride;
      const int64_t c0 = b * kCols, cols = std::min(kCols, n - c0);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t mr = std::min<int64_t>(kMaxRows, M - m0);
        const float* xm = x + m0 * K;
        switch (mr) {
          case 1: block_rows<1>(xm, K, wb, ldw, K, tile); break;
          case 2: block_rows<2>(xm, K, wb, ldw, K, tile); break;
          case 3: block_rows<3>(xm, K, wb, ldw, K, tile); break;
          default: block_rows<4>(xm, K, wb, ldw, K, tile); break;
        }
        for (int64_t m = 0; m < mr; ++m) {
          float* yr = y + (m0 + m) * n + c0;
          for (int64_t j = 0; j < cols; ++j) {
            float v = tile[m * kCols + j];
            if (scale) v *= scale[c0 + j];
            if (bias) v += bias[c0 + j];
            yr[j] = v;
          }
        }
      }
    }
  });
}

}  // namespace

namespace exl3_cpu {

// x (M, K) float32; w "blocked" (ceil(n/32), K, 32): 32-column block b of W^T (K, n) is
// w[b], contiguous, zero-padded past n. scale (>= n,) float32 for int8 weights.
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w,
                const c10::optional<at::Tensor>& scale,
                const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "gemv: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "gemv: x must be (M, K) float32");
  TORCH_CHECK(w.is_contiguous(), "gemv: weights must be contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.dim() == 3 && w.size(1) == K && w.size(2) == kCols,
              "gemv: weights must be blocked (ceil(n/32), K, 32)");
  TORCH_CHECK(n >= 0 && n <= w.size(0) * kCols, "gemv: n exceeds the stored columns");
  at::Tensor s, bb;
  const float* sp = nullptr;
  if (scale.has_value() && scale->defined()) {
    s = scale->contiguous();
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.numel() >= n, "gemv: scale must be float32 (>= n)");
    sp = s.data_ptr<float>();
  }
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bb = bias->contiguous();
    TORCH_CHECK(bb.scalar_type() == at::kFloat && bb.numel() >= n, "gemv: bias must be float32 (>= n)");
    bp = bb.data_ptr<float>();
  }
  TORCH_CHECK((w.scalar_type() == at::kChar) == (sp != nullptr),
              "gemv: int8 weights need a scale, other weights take none");
  at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (w.scalar_type()) {
    case at::kFloat: gemv_typed(xp, M, K, w.data_ptr<float>(), kCols, K * kCols, sp, bp, yp, n); break;
    case at::kBFloat16:
      gemv_typed(xp, M, K, reinterpret_cast<const uint16_t*>(w.data_ptr()), kCols, K * kCols, sp, bp, yp, n);
      break;
    case at::kChar: gemv_typed(xp, M, K, w.data_ptr<int8_t>(), kCols, K * kCols, sp, bp, yp, n); break;
    default: TORCH_CHECK(false, "gemv: weights must be float32, bfloat16 or int8");
  }
  return y;
}

}  // namespace exl3_cpu

TORCH_LIBRARY(exl3_cpu, m) {
  m.def("gemv(Tensor x, Tensor w, Tensor? scale, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(exl3_cpu, CPU, m) { m.impl("gemv", &exl3_cpu::gemv); }
