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

#include <torch/library.h>

#include <vector>

namespace {

struct Parts {
  at::TensorList trellis, suh, svh;
  const c10::List<c10::optional<at::Tensor>>& bias;
  at::ArrayRef<double> k;
  at::IntArrayRef n;
  int64_t codebook;
  const c10::optional<at::Tensor>& lut;

  // x @ parts [begin, end), outputs concatenated.
  at::Tensor project(const at::Tensor& x, int64_t begin, int64_t end) const {
    auto one = [&](int64_t i) {
      const c10::optional<at::Tensor> b = bias.get(i);
      return exl3_cpu::exl3_linear(x, trellis[i], suh[i], svh[i], b, k[i], codebook, n[i], lut);
    };
    if (end - begin == 1) return one(begin);
    int64_t total = 0;
    for (int64_t i = begin; i < end; ++i) total += n[i];
    at::Tensor out = at::empty({x.size(0), total}, x.options());
    int64_t start = 0;
    for (int64_t i = begin; i < end; ++i) {
      out.narrow(1, start, n[i]).copy_(one(i));
      start += n[i];
    }
    return out;
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

at::Tensor exl3_norm_qkv_rope(const at::Tensor& x, const at::Tensor& norm_w, double eps,
                              at::TensorList trellis, at::TensorList suh, at::TensorList svh,
                              const c10::List<c10::optional<at::Tensor>>& bias,
                              at::ArrayRef<double> k, at::IntArrayRef n, int64_t codebook,
                              const c10::optional<at::Tensor>& lut, const at::Tensor& cos,
                              const at::Tensor& sin, int64_t head_dim, int64_t rot_heads) {
  const Parts p{trellis, suh, svh, bias, k, n, codebook, lut};
  check_parts(p, {static_cast<int64_t>(trellis.size())}, 1, "exl3_norm_qkv_rope");
  TORCH_CHECK(x.dim() == 2 && head_dim > 0, "exl3_norm_qkv_rope: x must be [M, E]");
  at::Tensor qkv = p.project(exl3_cpu::rms_norm(x, norm_w, eps), 0, trellis.size());
  TORCH_CHECK(qkv.size(1) % head_dim == 0, "exl3_norm_qkv_rope: outputs whole heads");
  at::Tensor heads = qkv.view({x.size(0), qkv.size(1) / head_dim, head_dim});
  exl3_cpu::rotary_(heads, cos, sin, rot_heads);
  return qkv;
}

at::Tensor exl3_out_mlp(const at::Tensor& x, const at::Tensor& attn, const at::Tensor& norm_w,
                        double eps, at::TensorList trellis, at::TensorList suh,
                        at::TensorList svh, const c10::List<c10::optional<at::Tensor>>& bias,
                        at::ArrayRef<double> k, at::IntArrayRef n, int64_t codebook,
                        const c10::optional<at::Tensor>& lut, at::IntArrayRef counts) {
  const Parts p{trellis, suh, svh, bias, k, n, codebook, lut};
  check_parts(p, counts, 3, "exl3_out_mlp");
  TORCH_CHECK(x.dim() == 2, "exl3_out_mlp: x must be [M, E]");
  const int64_t o_end = counts[0], gu_end = o_end + counts[1], d_end = gu_end + counts[2];
  auto [mid, normed] = exl3_cpu::add_rms_norm(x, p.project(attn, 0, o_end), norm_w, eps);
  at::Tensor down = p.project(exl3_cpu::silu_mul(p.project(normed, o_end, gu_end)), gu_end, d_end);
  TORCH_CHECK(down.sizes() == mid.sizes(), "exl3_out_mlp: down must give [M, E]");
  float* dp = down.data_ptr<float>();
  const float* mp = mid.data_ptr<float>();
  for (int64_t i = 0, total = down.numel(); i < total; ++i) dp[i] += mp[i];
  return down;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exl3_cpu, m) {
  m.def("exl3_norm_qkv_rope(Tensor x, Tensor norm_w, float eps, Tensor[] trellis, "
        "Tensor[] suh, Tensor[] svh, Tensor?[] bias, float[] k, int[] n, int codebook, "
        "Tensor? lut, Tensor cos, Tensor sin, int head_dim, int rot_heads) -> Tensor");
  m.def("exl3_out_mlp(Tensor x, Tensor attn, Tensor norm_w, float eps, Tensor[] trellis, "
        "Tensor[] suh, Tensor[] svh, Tensor?[] bias, float[] k, int[] n, int codebook, "
        "Tensor? lut, int[] counts) -> Tensor");
}

TORCH_LIBRARY_IMPL(exl3_cpu, CPU, m) {
  m.impl("exl3_norm_qkv_rope", &exl3_norm_qkv_rope);
  m.impl("exl3_out_mlp", &exl3_out_mlp);
}
