// Fused float32 ops for CPU decode (exl3cli/ops/cpu_kernels.py has the PyTorch twin of each).
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
// decode_layer.cpp chains them with the GEMVs of a layer.
#include "decode_ops.h"
#include "decode_pool.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using exl3_cpu::check_float_rows;
using exl3_cpu::kLanes;
using exl3_cpu::lane_dot;

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

}  // namespace

namespace exl3_cpu {

void check_float_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, what, ": float32 CPU tensor");
  TORCH_CHECK(t.is_contiguous(), what, ": must be contiguous");
}

// Rows in parallel only for prompts: a grain of 64 rows keeps decode on the caller.
void rms_rows(const float* x, const float* w, float* y, int64_t rows, int64_t dim, double eps) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * dim;
      float* yr = y + r * dim;
      const float inv = 1.f / std::sqrt(lane_dot(xr, xr, dim) / static_cast<float>(dim) +
                                        static_cast<float>(eps));
      for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * inv * w[i];
    }
  });
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
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gr = g + r * width;
      const float* ur = gr + inter;
      float* yr = yp + r * inter;
      for (int64_t i = 0; i < inter; ++i) yr[i] = gr[i] / (1.f + fast_exp(-gr[i])) * ur[i];
    }
  });
  return y;
}

}  // namespace exl3_cpu

namespace exl3_cpu {

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
    const int64_t* sl = slot_t.data_ptr<int64_t>();
    bool in_range = true;  // the kernel indexes the store with these unchecked
    for (int64_t i = 0, n = slot_t.numel(); i < n; ++i) in_range &= sl[i] >= 0 && sl[i] < k.size(0);
    TORCH_CHECK(in_range, "attend_decode: slot out of range");
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
  // Keys and values are read position by position, all kv heads of a position together
  // (one contiguous row of a page), so the history streams through once in order.
  const int64_t kh = paged ? D : sh;  // offset between kv heads of one position
  // Split-K: each row's positions lo..len-1 go in chunks of kChunk, one task per (row,
  // chunk, head), so one decode row fills the threads even below kChunk positions (a
  // head's arithmetic does not depend on the split). A task keeps per-head max m, sum l of
  // exp(score - m) and the unnormalized sum of exp * v; the merge rescales by exp(m - M).
  constexpr int64_t kChunk = 128;
  std::vector<int64_t> first(B + 1, 0);  // task index of row b's first chunk
  for (int64_t b = 0; b < B; ++b) {
    const int64_t lo = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
    first[b + 1] = first[b] + std::max<int64_t>(1, (lens[b] - lo + kChunk - 1) / kChunk);
  }
  const int64_t tasks = first[B];
  std::vector<float> part_m(tasks * H), part_l(tasks * H), part_acc(tasks * H * D);
  auto tasks_of = [&](int64_t begin, int64_t end) {
    float p[kChunk];
    for (int64_t u = begin; u < end; ++u) {
      const int64_t t = u / H, h = u % H;
      const int64_t b = std::upper_bound(first.begin(), first.end(), t) - first.begin() - 1;
      const int64_t len = lens[b];
      const int64_t lo0 = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t c0 = lo0 + (t - first[b]) * kChunk;
      const int64_t c1 = std::min<int64_t>(len, c0 + kChunk);
      auto base = [&](int64_t s) -> int64_t {  // offset of kv head 0 at position s
        return paged ? slp[b * S + s] * KV * D : b * sb + s * ss;
      };
      const float* qb = qp + b * H * D;
      float* acc = part_acc.data() + t * H * D;
      std::fill(acc + h * D, acc + (h + 1) * D, 0.f);
      for (int64_t hq = h; hq < h + 1; ++hq) {
        const int64_t count = c1 - c0;
        const int64_t off = (hq / G) * kh;
        float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
        if (count > 0) {
          for (int64_t s = c0; s < c1; ++s) p[s - c0] = dot(qb + hq * D, kp + base(s) + off, D) * scale;
          mx = lane_max(p, count);
          for (int64_t i = 0; i < count; ++i) p[i] = fast_exp(p[i] - mx);
          sum = lane_sum(p, count);
          float* a = acc + hq * D;
          for (int64_t s = c0; s < c1; ++s) {
            const float w = p[s - c0];
            const float* vr = vp + base(s) + off;
            for (int64_t d = 0; d < D; ++d) a[d] += w * vr[d];
          }
        }
        part_m[t * H + hq] = mx;
        part_l[t * H + hq] = sum;
      }
    }
  };
  if (decode_pool_enabled() && !at::in_parallel_region() && at::get_num_threads() > 1) {
    auto one = [&](int64_t u) { tasks_of(u, u + 1); };
    pool_for(tasks * H, at::get_num_threads(), one);
  } else {
    at::parallel_for(0, tasks * H, 1, tasks_of);
  }
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t hq = 0; hq < H; ++hq) {
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t t = first[b]; t < first[b + 1]; ++t) M = std::max(M, part_m[t * H + hq]);
      float* o = op + (b * H + hq) * D;
      std::fill(o, o + D, 0.f);
      float L = 0.f;
      for (int64_t t = first[b]; t < first[b + 1]; ++t) {
        if (part_l[t * H + hq] == 0.f) continue;
        const float f = first[b + 1] - first[b] == 1 ? 1.f : fast_exp(part_m[t * H + hq] - M);
        L += f * part_l[t * H + hq];
        const float* a = part_acc.data() + (t * H + hq) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += f * a[d];
      }
      const float inv = L > 0.f ? 1.f / L : 0.f;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
  return out;
}

}  // namespace exl3_cpu

TORCH_LIBRARY_FRAGMENT(exl3_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor r, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin, int heads) -> Tensor(a!)");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("attend_decode(Tensor q, Tensor k, Tensor v, Tensor? slots, Tensor? lengths, "
        "int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(exl3_cpu, CPU, m) {
  m.impl("rms_norm", &exl3_cpu::rms_norm);
  m.impl("add_rms_norm", &exl3_cpu::add_rms_norm);
  m.impl("rotary_", &exl3_cpu::rotary_);
  m.impl("silu_mul", &exl3_cpu::silu_mul);
  m.impl("attend_decode", &exl3_cpu::attend_decode);
}
