// A decoder layer's decode step in three calls, and the tied lm head (float32 CPU path;
// exl3cli/ops/cpu_kernels.py has the PyTorch twin of each):
//   norm_qkv_rope(...)   rms_norm -> qkv GEMV -> rotary of the q and k heads
//   (the cache write and attend_decode run between the two, from Python)
//   out_mlp(...)         x + o(attn) -> rms_norm -> gate_up -> silu_mul -> down, + residual
//   gemv_rows(x, w)      x @ w.T for a row-major (N, K) w: the tied embedding as lm head
// The GEMVs are the packed kernel of gemv_cpu.cpp; the rest is decode_ops.cpp.
#include "decode_ops.h"
#include "gemv_cpu.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using exl3_cpu::lane_dot;

// y [M, N] = x [M, K] @ w.T for row-major w [N, K] (float32 or bfloat16): the tied
// embedding used as the lm head without a second, repacked copy. The rows of w are one
// sequential stream; parallel over blocks of 64 rows.
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// y[n..n+4) for one row of x: four rows of w (one contiguous stretch) read in order,
// prefetched 4 KB ahead (twice the speed of the hardware prefetcher alone for bf16).
template <typename T>
void dot4(const float* x, const T* w, int64_t K, float* y) {
  __m512 a[4];
  for (int r = 0; r < 4; ++r) {
    const T* wr = w + r * K;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      const char* ahead = reinterpret_cast<const char*>(wr + k) + 4096;
      _mm_prefetch(ahead, _MM_HINT_T0);
      if (sizeof(T) == 4) _mm_prefetch(ahead + 64, _MM_HINT_T0);
      acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), load16(wr + k), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), load16(wr + k + 16), acc1);
    }
    for (; k < K; k += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), load16(wr + k), acc0);
    a[r] = _mm512_add_ps(acc0, acc1);
  }
  for (int r = 0; r < 4; ++r) y[r] = _mm512_reduce_add_ps(a[r]);
}
#endif

template <typename T>
void gemv_rows_typed(const float* x, int64_t M, int64_t K, const T* w, int64_t N, float* y) {
  at::parallel_for(0, (N + 63) / 64, 1, [&](int64_t begin, int64_t end) {
    int64_t n = begin * 64;
    const int64_t stop = std::min(N, end * 64);
#if defined(__AVX512F__)
    if (K % 16 == 0) {
      float four[4];
      for (; n + 4 <= stop; n += 4)
        for (int64_t m = 0; m < M; ++m) {
          dot4(x + m * K, w + n * K, K, four);
          for (int j = 0; j < 4; ++j) y[m * N + n + j] = four[j];
        }
    }
#endif
    for (; n < stop; ++n)
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = lane_dot(x + m * K, w + n * K, K);
  });
}

at::Tensor gemv_rows(const at::Tensor& x, const at::Tensor& w) {
  exl3_cpu::check_float_rows(x, "gemv_rows x");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.size(1) == x.size(1) && w.is_contiguous(),
              "gemv_rows: x [M, K], w [N, K] contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (w.scalar_type() == at::kFloat) {
    gemv_rows_typed(x.data_ptr<float>(), M, K, w.data_ptr<float>(), N, y.data_ptr<float>());
  } else {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, "gemv_rows: w must be float32 or bfloat16");
    gemv_rows_typed(x.data_ptr<float>(), M, K, reinterpret_cast<const uint16_t*>(w.data_ptr()),
                    N, y.data_ptr<float>());
  }
  return y;
}

at::Tensor norm_qkv_rope(const at::Tensor& x, const at::Tensor& norm_w, double eps,
                         const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                         const c10::optional<at::Tensor>& bias, int64_t n, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t head_dim, int64_t rot_heads) {
  TORCH_CHECK(x.dim() == 2 && head_dim > 0 && n % head_dim == 0,
              "norm_qkv_rope: x must be [M, E], outputs whole heads");
  at::Tensor qkv = exl3_cpu::gemv(exl3_cpu::rms_norm(x, norm_w, eps), w, scale, bias, n);
  at::Tensor heads = qkv.view({x.size(0), n / head_dim, head_dim});
  exl3_cpu::rotary_(heads, cos, sin, rot_heads);
  return qkv;
}

at::Tensor out_mlp(const at::Tensor& x, const at::Tensor& attn, const at::Tensor& o_w,
                   const c10::optional<at::Tensor>& o_s, const c10::optional<at::Tensor>& o_b,
                   const at::Tensor& norm_w, double eps, const at::Tensor& gu_w,
                   const c10::optional<at::Tensor>& gu_s, const c10::optional<at::Tensor>& gu_b,
                   int64_t gu_n, const at::Tensor& d_w, const c10::optional<at::Tensor>& d_s,
                   const c10::optional<at::Tensor>& d_b) {
  TORCH_CHECK(x.dim() == 2, "out_mlp: x must be [M, E]");
  const int64_t E = x.size(1);
  auto [mid, normed] = exl3_cpu::add_rms_norm(x, exl3_cpu::gemv(attn, o_w, o_s, o_b, E), norm_w, eps);
  at::Tensor down = exl3_cpu::gemv(exl3_cpu::silu_mul(exl3_cpu::gemv(normed, gu_w, gu_s, gu_b, gu_n)),
                                   d_w, d_s, d_b, E);
  float* dp = down.data_ptr<float>();
  const float* mp = mid.data_ptr<float>();
  for (int64_t i = 0, total = down.numel(); i < total; ++i) dp[i] += mp[i];
  return down;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl3_cpu, m) {
  m.def("gemv_rows(Tensor x, Tensor w) -> Tensor");
  m.def("norm_qkv_rope(Tensor x, Tensor norm_w, float eps, Tensor w, Tensor? scale, "
        "Tensor? bias, int n, Tensor cos, Tensor sin, int head_dim, int rot_heads) -> Tensor");
  m.def("out_mlp(Tensor x, Tensor attn, Tensor o_w, Tensor? o_s, Tensor? o_b, Tensor norm_w, "
        "float eps, Tensor gu_w, Tensor? gu_s, Tensor? gu_b, int gu_n, Tensor d_w, Tensor? d_s, "
        "Tensor? d_b) -> Tensor");
}

TORCH_LIBRARY_IMPL(exl3_cpu, CPU, m) {
  m.impl("gemv_rows", &gemv_rows);
  m.impl("norm_qkv_rope", &norm_qkv_rope);
  m.impl("out_mlp", &out_mlp);
}
