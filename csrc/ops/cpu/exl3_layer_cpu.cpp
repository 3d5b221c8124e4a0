// A decoder layer's decode step in two calls with EXL3 weights kept compressed (float32
// CPU path; the twins are exl3cli/ops/cpu_exl3_layer.py's references):
//   exl3_norm_qkv_rope(...)  rms_norm -> q|k|v parts (exl3_linear each) -> rotary
//   (the cache write and attend_decode run between the two, from Python)
//   exl3_out_mlp(...)        x + o(attn) -> rms_norm -> gate|up -> silu_mul -> down, + x
// decode_layer.cpp does the same for packed dense weights. A projection is one or more
// parts (fused q/k/v, gate/up) whose outputs are side by side; the parts of the layer come
// as flat lists, `counts` says how many belong to each projection in order.
#include "decode_ops.h"
#include "exl3_gemm_cpu.h"

#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace {

struct Parts {
  at::TensorList trellis, suh, svh;
  const c10::List<c10::optional<at::Tensor>>& bias;
  at::ArrayRef<double> k;
  at::IntArrayRef n;
  int64_t codebook;
  const c10::optional<at::Tensor>& lut;

  // x @ parts [begin, end), outputs concatenated (one parallel region for all of them).
  at::Tensor project(const at::Tensor& x, int64_t begin, int64_t end) const {
    c10::SmallVector<exl3_cpu::Exl3Part, 4> parts;
    c10::SmallVector<c10::optional<at::Tensor>, 4> biases;  // the list hands out copies
    for (int64_t i = begin; i < end; ++i) biases.push_back(bias.get(i));
    for (int64_t i = begin; i < end; ++i) {
      const c10::optional<at::Tensor>& b = biases[i - begin];
      parts.push_back({&trellis[i], &suh[i], &svh[i], b.has_value() && b->defined() ? &*b : nullptr,
                       k[i], n[i]});
    }
    return exl3_cpu::exl3_linear_parts(x, parts.data(), end - begin, codebook, lut);
  }
};

void check_parts(const Parts& p, at::IntArrayRef counts, int64_t projections, const char* what) {
  const size_t size = p.trellis.size();
  TORCH_CHECK(p.suh.size() == size && p.svh.size() == size && p.bias.size() == size &&
                  p.k.size() == size && p.n.size() == size,
              what, ": one suh, svh, bias, k and n per trellis");
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == projections, what, ": ", projections,
              " projection counts expected");
  int64_t sum = 0;
  for (int64_t c : counts) {
    TORCH_CHECK(c >= 1, what, ": every projection has a part");
    sum += c;
  }
  TORCH_CHECK(sum == static_cast<int64_t>(size), what, ": counts do not add up to the parts");
}

// rms_norm(x) through parts [begin, end) of p (q|k|v), heads 0..rot_heads-1 rotated.
at::Tensor qkv_rope(const Parts& p, int64_t begin, int64_t end, const at::Tensor& x,
                    const at::Tensor& norm_w, double eps, const at::Tensor& cos,
                    const at::Tensor& sin, int64_t head_dim, int64_t rot_heads) {
  TORCH_CHECK(x.dim() == 2 && head_dim > 0, "exl3_norm_qkv_rope: x must be [M, E]");
  at::Tensor qkv = p.project(exl3_cpu::rms_norm(x, norm_w, eps), begin, end);
  TORCH_CHECK(qkv.size(1) % head_dim == 0, "exl3_norm_qkv_rope: outputs whole heads");
  at::Tensor heads = qkv.view({x.size(0), qkv.size(1) / head_dim, head_dim});
  exl3_cpu::rotary_(heads, cos, sin, rot_heads);
  return qkv;
}

// x + o(attn) -> rms_norm -> gate|up -> silu_mul -> down, + the residual; the projections
// are parts [o0, o1), [o1, g1), [g1, d1) of p.
at::Tensor out_mlp(const Parts& p, int64_t o0, int64_t o1, int64_t g1, int64_t d1,
                   const at::Tensor& x, const at::Tensor& attn, const at::Tensor& norm_w,
                   double eps) {
  TORCH_CHECK(x.dim() == 2, "exl3_out_mlp: x must be [M, E]");
  auto [mid, normed] = exl3_cpu::add_rms_norm(x, p.project(attn, o0, o1), norm_w, eps);
  at::Tensor down = p.project(exl3_cpu::silu_mul(p.project(normed, o1, g1)), g1, d1);
  TORCH_CHECK(down.sizes() == mid.sizes(), "exl3_out_mlp: down must give [M, E]");
  float* dp = down.data_ptr<float>();
  const float* mp = mid.data_ptr<float>();
  for (int64_t i = 0, total = down.numel(); i < total; ++i) dp[i] += mp[i];
  return down;
}

at::Tensor exl3_norm_qkv_rope(const at::Tensor& x, const at::Tensor& norm_w, double eps,
                              at::TensorList trellis, at::TensorList suh, at::TensorList svh,
                              const c10::List<c10::optional<at::Tensor>>& bias,
                              at::ArrayRef<double> k, at::IntArrayRef n, int64_t codebook,
                              const c10::optional<at::Tensor>& lut, const at::Tensor& cos,
                              const at::Tensor& sin, int64_t head_dim, int64_t rot_heads) {
  const Parts p{trellis, suh, svh, bias, k, n, codebook, lut};
  check_parts(p, {static_cast<int64_t>(trellis.size())}, 1, "exl3_norm_qkv_rope");
  return qkv_rope(p, 0, trellis.size(), x, norm_w, eps, cos, sin, head_dim, rot_heads);
}

at::Tensor exl3_out_mlp(const at::Tensor& x, const at::Tensor& attn, const at::Tensor& norm_w,
                        double eps, at::TensorList trellis, at::TensorList suh,
                        at::TensorList svh, const c10::List<c10::optional<at::Tensor>>& bias,
                        at::ArrayRef<double> k, at::IntArrayRef n, int64_t codebook,
                        const c10::optional<at::Tensor>& lut, at::IntArrayRef counts) {
  const Parts p{trellis, suh, svh, bias, k, n, codebook, lut};
  check_parts(p, counts, 3, "exl3_out_mlp");
  const int64_t o1 = counts[0], g1 = o1 + counts[1], d1 = g1 + counts[2];
  return out_mlp(p, 0, o1, g1, d1, x, attn, norm_w, eps);
}

// A decode step of a whole stack of plain layers (decode rows only: one new token per
// sequence, M sequences): per layer, qkv_rope, the new keys/values written to the paged
// cache at write_slots, attend_decode over decode_slots/lengths, out_mlp. norms: 2 per
// layer (input, post-attention); counts: 4 per layer (parts of qkv, o, gate|up, down);
// windows: per layer (0: none). The caller advances the cache afterwards.
at::Tensor exl3_decode_stack(const at::Tensor& x_in, at::TensorList norms, at::ArrayRef<double> eps,
                             at::TensorList trellis, at::TensorList suh, at::TensorList svh,
                             const c10::List<c10::optional<at::Tensor>>& bias,
                             at::ArrayRef<double> k, at::IntArrayRef n, at::IntArrayRef counts,
                             int64_t codebook, const c10::optional<at::Tensor>& lut,
                             const at::Tensor& cos, const at::Tensor& sin, int64_t head_dim,
                             int64_t heads, int64_t kv_heads, at::TensorList keys,
                             at::TensorList values, const at::Tensor& write_slots,
                             const at::Tensor& decode_slots, const at::Tensor& lengths,
                             at::IntArrayRef windows) {
  const Parts p{trellis, suh, svh, bias, k, n, codebook, lut};
  const int64_t layers = static_cast<int64_t>(keys.size());
  TORCH_CHECK(values.size() == keys.size() && static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(eps.size()) == 2 * layers &&
                  static_cast<int64_t>(windows.size()) == layers,
              "exl3_decode_stack: per layer one keys, values and window, two norms and eps");
  check_parts(p, counts, 4 * layers, "exl3_decode_stack");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "exl3_decode_stack: x must be float32 [M, E]");
  const int64_t M = x_in.size(0), q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  const at::Tensor slots = write_slots.contiguous();
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == M,
              "exl3_decode_stack: one int64 write slot per row");
  const int64_t* sp = slots.data_ptr<int64_t>();
  at::Tensor x = x_in.contiguous();
  int64_t part = 0;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t q1 = part + counts[4 * l], o1 = q1 + counts[4 * l + 1],
                  g1 = o1 + counts[4 * l + 2], d1 = g1 + counts[4 * l + 3];
    at::Tensor qkv = qkv_rope(p, part, q1, x, norms[2 * l], eps[2 * l], cos, sin, head_dim,
                              heads + kv_heads);
    TORCH_CHECK(qkv.size(1) == q_width + 2 * kv_width, "exl3_decode_stack: layer ", l,
                " gives ", qkv.size(1), " q|k|v columns");
    const at::Tensor& kc = keys[l];
    const at::Tensor& vc = values[l];
    TORCH_CHECK(kc.scalar_type() == at::kFloat && kc.is_contiguous() && vc.is_contiguous() &&
                    kc.dim() == 3 && kc.size(1) * kc.size(2) == kv_width && kc.sizes() == vc.sizes(),
                "exl3_decode_stack: keys/values must be contiguous float32 [slots, KV, D]");
    const float* qp = qkv.data_ptr<float>();
    float *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) {
      TORCH_CHECK(sp[m] >= 0 && sp[m] < kc.size(0), "exl3_decode_stack: write slot out of range");
      const float* row = qp + m * qkv.size(1);
      std::memcpy(kp + sp[m] * kv_width, row + q_width, kv_width * sizeof(float));
      std::memcpy(vp + sp[m] * kv_width, row + q_width + kv_width, kv_width * sizeof(float));
    }
    const at::Tensor query = qkv.narrow(1, 0, q_width).contiguous().view({M, heads, head_dim});
    const at::Tensor attn = exl3_cpu::attend_decode(query, kc, vc, decode_slots, lengths, windows[l]);
    x = out_mlp(p, q1, o1, g1, d1, x, attn.view({M, q_width}), norms[2 * l + 1], eps[2 * l + 1]);
    part = d1;
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl3_cpu, m) {
  m.def("exl3_norm_qkv_rope(Tensor x, Tensor norm_w, float eps, Tensor[] trellis, "
        "Tensor[] suh, Tensor[] svh, Tensor?[] bias, float[] k, int[] n, int codebook, "
        "Tensor? lut, Tensor cos, Tensor sin, int head_dim, int rot_heads) -> Tensor");
  m.def("exl3_out_mlp(Tensor x, Tensor attn, Tensor norm_w, float eps, Tensor[] trellis, "
        "Tensor[] suh, Tensor[] svh, Tensor?[] bias, float[] k, int[] n, int codebook, "
        "Tensor? lut, int[] counts) -> Tensor");
  m.def("exl3_decode_stack(Tensor x, Tensor[] norms, float[] eps, Tensor[] trellis, "
        "Tensor[] suh, Tensor[] svh, Tensor?[] bias, float[] k, int[] n, int[] counts, "
        "int codebook, Tensor? lut, Tensor cos, Tensor sin, int head_dim, int heads, "
        "int kv_heads, Tensor[] keys, Tensor[] values, Tensor write_slots, "
        "Tensor decode_slots, Tensor lengths, int[] windows) -> Tensor");
}

TORCH_LIBRARY_IMPL(exl3_cpu, CPU, m) {
  m.impl("exl3_norm_qkv_rope", &exl3_norm_qkv_rope);
  m.impl("exl3_out_mlp", &exl3_out_mlp);
  m.impl("exl3_decode_stack", &exl3_decode_stack);
}
