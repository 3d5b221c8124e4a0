// Fused float32 ops for CPU decode (exl3cli/cpu_kernels.py has the PyTorch twin of each).
//
// A decode step of a small model is a few thousand tiny torch ops: RMSNorm alone is six
// (pow, mean, add, rsqrt, mul, mul), rotary five, decode attention a gather, two bmm, a
// mask and a softmax. Each costs dispatch and allocation far above its arithmetic, so
// these ops do one pass each:
//   rms_norm(x, w, eps)               y = x * rsqrt(mean(x^2) + eps) * w, rows of x
//   add_rms_norm(x, r, w, eps)        (s = x + r, rms_norm(s))
//   rotary_(x, cos, sin, heads)       rotate heads 0..heads-1 of x [N, H, D] in place
//   silu_mul(gu)                      silu(gu[:, :I]) * gu[:, I:]
//   attend_decode(q, k, v, slots, lengths, window)   one query per row over a cache
//   gemv_rows(x, w)                   x @ w.T for (N, K) row-major w (the tied lm head)
// Loops are written with 16-lane accumulator arrays so gcc vectorises them without
// fast-math (each lane sums in order; the lanes are added at the end).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;

inline float lane_dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float lane_dot(const float* a, const uint16_t* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * bf16_to_float(b[i + j]);
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * bf16_to_float(b[i]);
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

// exp for softmax and SiLU: Cody-Waite reduction to [-ln2/2, ln2/2], degree-6
// polynomial (~2 ulp), written with plain arithmetic so loops over it vectorise.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.3888949e-3f;
  p = p * r + 8.3333404e-3f;
  p = p * r + 4.1666500e-2f;
  p = p * r + 1.6666667e-1f;
  p = p * r + 0.5f;
  p = p * r * r + r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

inline float lane_sum(const float* a, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j];
  float s = 0.f;
  for (; i < n; ++i) s += a[i];
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

inline float lane_max(const float* a, int64_t n) {
  float acc[kLanes];
  for (int j = 0; j < kLanes; ++j) acc[j] = -INFINITY;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] = acc[j] > a[i + j] ? acc[j] : a[i + j];
  float m = -INFINITY;
  for (; i < n; ++i) m = std::max(m, a[i]);
  for (int j = 0; j < kLanes; ++j) m = std::max(m, acc[j]);
  return m;
}

// dot(q, k) over D channels (AVX-512: four 16-wide FMAs and one tree reduction).
inline float dot(const float* q, const float* k, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
    for (int64_t c = 16; c < D; c += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(k + c), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  return lane_dot(q, k, D);
}

void check_float_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, what, ": float32 CPU tensor");
  TORCH_CHECK(t.is_contiguous(), what, ": must be contiguous");
}

void rms_rows(const float* x, const float* w, float* y, int64_t rows, int64_t dim, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    const float inv = 1.f / std::sqrt(lane_dot(xr, xr, dim) / static_cast<float>(dim) +
                                      static_cast<float>(eps));
    for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * inv * w[i];
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_float_rows(x, "rms_norm x");
  check_float_rows(w, "rms_norm weight");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(w.numel() == dim, "rms_norm: weight size must equal the last dimension");
  at::Tensor y = at::empty_like(x);
  rms_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), x.numel() / dim,
           dim, eps);
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r,
                                                const at::Tensor& w, double eps) {
  check_float_rows(x, "add_rms_norm x");
  check_float_rows(r, "add_rms_norm residual");
  check_float_rows(w, "add_rms_norm weight");
  TORCH_CHECK(x.sizes() == r.sizes(), "add_rms_norm: x and residual shapes differ");
  const int64_t dim = x.size(-1);
  TORCH_CHECK(w.numel() == dim, "add_rms_norm: weight size must equal the last dimension");
  at::Tensor s = at::empty_like(x), y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *rp = r.data_ptr<float>();
  float* sp = s.data_ptr<float>();
  for (int64_t i = 0, n = x.numel(); i < n; ++i) sp[i] = xp[i] + rp[i];
  rms_rows(sp, w.data_ptr<float>(), y.data_ptr<float>(), x.numel() / dim, dim, eps);
  return {s, y};
}

// x [N, H, D] (D contiguous, rows of any stride); cos/sin [N, D] contiguous. Pairs
// (i, i + D/2): first half x1*c - x2*s, second half x2*c + x1*s (the reference's
// x*cos + cat(-x2, x1)*sin).
at::Tensor& rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3,
              "rotary_: x must be float32 [N, H, D]");
  TORCH_CHECK(x.stride(2) == 1, "rotary_: last dimension must be contiguous");
  check_float_rows(cos, "rotary_ cos");
  check_float_rows(sin, "rotary_ sin");
  const int64_t n = x.size(0), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0 && dim <= 512 && heads <= x.size(1),
              "rotary_: needs an even head_dim <= 512 and heads <= H");
  TORCH_CHECK(cos.numel() == n * dim && sin.numel() == n * dim, "rotary_: cos/sin must be [N, D]");
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t) {
    const float* c = cp + t * dim;
    const float* s = sp + t * dim;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = xp + t * x.stride(0) + h * x.stride(1);
      float lo[256], hi[256];
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i] * c[i], b = -v[i + half] * s[i];
        const float e = v[i + half] * c[i + half], f = v[i] * s[i + half];
        lo[i] = a + b;
        hi[i] = e + f;
      }
      std::memcpy(v, lo, half * sizeof(float));
      std::memcpy(v + half, hi, half * sizeof(float));
    }
  }
  return x;
}

at::Tensor silu_mul(const at::Tensor& gu) {
  check_float_rows(gu, "silu_mul");
  const int64_t width = gu.size(-1), inter = width / 2, rows = gu.numel() / width;
  TORCH_CHECK(width % 2 == 0, "silu_mul: last dimension must be even");
  auto sizes = gu.sizes().vec();
  sizes.back() = inter;
  at::Tensor y = at::empty(sizes, gu.options());
  const float* g = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* gr = g + r * width;
    const float* ur = gr + inter;
    float* yr = yp + r * inter;
    for (int64_t i = 0; i < inter; ++i) yr[i] = gr[i] / (1.f + fast_exp(-gr[i])) * ur[i];
  }
  return y;
}

// One query per row b: q [B, H, D]. Contiguous cache (slots undefined): k, v [B, KV, S, D]
// with D contiguous (strided views are fine). Paged cache: k, v [slots, KV, D] contiguous
// and slots [B, S] int64 naming row b's key positions 0..S-1. Row b attends to keys
// lo..len-1 with len = lengths[b] (S without lengths) and lo = max(0, len - window).
at::Tensor attend_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& slots,
                         const c10::optional<at::Tensor>& lengths, int64_t window) {
  check_float_rows(q, "attend_decode query");
  TORCH_CHECK(q.dim() == 3, "attend_decode: query must be [B, H, D]");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
              k.sizes() == v.sizes() && k.strides() == v.strides(),
              "attend_decode: keys and values must be float32 of one layout");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const bool paged = slots.has_value() && slots->defined();
  at::Tensor slot_t;
  int64_t S, KV, sb, sh, ss;  // strides of the key rows (contiguous mode)
  if (paged) {
    TORCH_CHECK(k.dim() == 3 && k.is_contiguous() && k.size(2) == D, "attend_decode: paged k [N, KV, D]");
    slot_t = slots->contiguous();
    TORCH_CHECK(slot_t.scalar_type() == at::kLong && slot_t.dim() == 2 && slot_t.size(0) == B,
                "attend_decode: slots must be int64 [B, S]");
    S = slot_t.size(1), KV = k.size(1), sb = 0, sh = D, ss = 0;
  } else {
    TORCH_CHECK(k.dim() == 4 && k.size(0) == B && k.size(3) == D && k.stride(3) == 1,
                "attend_decode: k must be [B, KV, S, D] with D contiguous");
    S = k.size(2), KV = k.size(1), sb = k.stride(0), sh = k.stride(1), ss = k.stride(2);
  }
  TORCH_CHECK(KV > 0 && H % KV == 0, "attend_decode: heads must be a multiple of kv heads");
  std::vector<int64_t> lens(B, S);
  if (lengths.has_value() && lengths->defined()) {
    at::Tensor l = lengths->to(at::kLong).contiguous();
    TORCH_CHECK(l.numel() == B, "attend_decode: lengths must be [B]");
    for (int64_t b = 0; b < B; ++b) lens[b] = std::min<int64_t>(l.data_ptr<int64_t>()[b], S);
  }
  const int64_t G = H / KV;
  at::Tensor out = at::empty({B, H, D}, q.options());
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int64_t* slp = paged ? slot_t.data_ptr<int64_t>() : nullptr;
  float* op = out.data_ptr<float>();
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(static_cast<size_t>(G * S));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KV, h = task % KV;
      const int64_t len = lens[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      auto row = [&](int64_t s) -> int64_t {  // element offset of key s of (b, h)
        return paged ? slp[b * S + s] * KV * D + h * D : b * sb + h * sh + s * ss;
      };
      const float* qg = qp + (b * H + h * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* qh = qg + g * D;
        float* pg = p.data() + g * S;
        for (int64_t s = lo; s < len; ++s) pg[s] = dot(qh, kp + row(s), D) * scale;
      }
      for (int64_t g = 0; g < G; ++g) {
        float* pg = p.data() + g * S + lo;
        const int64_t count = len - lo;
        const float mx = lane_max(pg, count);
        for (int64_t s = 0; s < count; ++s) pg[s] = fast_exp(pg[s] - mx);
        const float inv = count > 0 ? 1.f / lane_sum(pg, count) : 0.f;
        for (int64_t s = 0; s < count; ++s) pg[s] *= inv;
      }
      // Weighted sum of values, 16 channels at a time so the sums stay in registers.
      for (int64_t g = 0; g < G; ++g) {
        const float* pg = p.data() + g * S;
        float* og = op + (b * H + h * G + g) * D;
        for (int64_t d0 = 0; d0 < D; d0 += kLanes) {
          const int64_t width = std::min<int64_t>(kLanes, D - d0);
          // Four partial sums (keys s, s+1, s+2, s+3) so the adds do not wait on
          // each other.
#if defined(__AVX512F__)
          if (width == kLanes) {
            __m512 v0 = _mm512_setzero_ps(), v1 = v0, v2 = v0, v3 = v0;
            int64_t s = lo;
            for (; s + 4 <= len; s += 4) {
              v0 = _mm512_fmadd_ps(_mm512_set1_ps(pg[s]), _mm512_loadu_ps(vp + row(s) + d0), v0);
              v1 = _mm512_fmadd_ps(_mm512_set1_ps(pg[s + 1]), _mm512_loadu_ps(vp + row(s + 1) + d0), v1);
              v2 = _mm512_fmadd_ps(_mm512_set1_ps(pg[s + 2]), _mm512_loadu_ps(vp + row(s + 2) + d0), v2);
              v3 = _mm512_fmadd_ps(_mm512_set1_ps(pg[s + 3]), _mm512_loadu_ps(vp + row(s + 3) + d0), v3);
            }
            for (; s < len; ++s)
              v0 = _mm512_fmadd_ps(_mm512_set1_ps(pg[s]), _mm512_loadu_ps(vp + row(s) + d0), v0);
            _mm512_storeu_ps(og + d0, _mm512_add_ps(_mm512_add_ps(v0, v1), _mm512_add_ps(v2, v3)));
            continue;
          }
#endif
          float a[4][kLanes] = {};
          int64_t s = lo;
          if (width == kLanes) {
            for (; s + 4 <= len; s += 4)
              for (int u = 0; u < 4; ++u) {
                const float* vr = vp + row(s + u) + d0;
                const float w = pg[s + u];
                for (int j = 0; j < kLanes; ++j) a[u][j] += w * vr[j];
              }
          }
          for (; s < len; ++s) {
            const float* vr = vp + row(s) + d0;
            for (int64_t j = 0; j < width; ++j) a[0][j] += pg[s] * vr[j];
          }
          for (int j = 0; j < kLanes; ++j) a[0][j] = (a[0][j] + a[1][j]) + (a[2][j] + a[3][j]);
          std::memcpy(og + d0, a[0], width * sizeof(float));
        }
      }
    }
  });
  return out;
}

// y [M, N] = x [M, K] @ w.T for row-major w [N, K] (float32 or bfloat16): the tied
// embedding used as the lm head without a second, repacked copy. Four rows of w per
// pass (four independent sums), parallel over blocks of 64 rows.
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// y[m][n..n+4) for one row of x: four rows of w streamed side by side.
template <typename T>
void dot4(const float* x, const T* w, int64_t K, float* y) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t k = 0; k < K; k += 16) {
    __m512 xv = _mm512_loadu_ps(x + k);
    a0 = _mm512_fmadd_ps(xv, load16(w + k), a0);
    a1 = _mm512_fmadd_ps(xv, load16(w + K + k), a1);
    a2 = _mm512_fmadd_ps(xv, load16(w + 2 * K + k), a2);
    a3 = _mm512_fmadd_ps(xv, load16(w + 3 * K + k), a3);
  }
  y[0] = _mm512_reduce_add_ps(a0);
  y[1] = _mm512_reduce_add_ps(a1);
  y[2] = _mm512_reduce_add_ps(a2);
  y[3] = _mm512_reduce_add_ps(a3);
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
  check_float_rows(x, "gemv_rows x");
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl3_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor r, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin, int heads) -> Tensor(a!)");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("attend_decode(Tensor q, Tensor k, Tensor v, Tensor? slots, Tensor? lengths, "
        "int window) -> Tensor");
  m.def("gemv_rows(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(exl3_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("silu_mul", &silu_mul);
  m.impl("attend_decode", &attend_decode);
  m.impl("gemv_rows", &gemv_rows);
}
