// Torch bindings of the fused decode-layer kernels (layer_fused.cu, exl3_ops.h "Fused
// decode-layer kernels"): norm_hadamard, hadamard_out, glu_hadamard, with the optional
// LoRA update (LowRank) of the output kernels and the LoRA inputs they can write.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "bindings_util.h"
#include "exl3_ops.h"

namespace exl3_bind {

void define_fold_ops(pybind11::module_& m);

namespace {

using OptTensor = c10::optional<at::Tensor>;

// The LoRA update of an output kernel (exl3_ops.h LowRank) from its four optional
// tensors (all or none): low (rows, rank) and bt (rank, >= cols) in `dtype` (code), unit
// column stride; columns (rank,) and slots (>= rows,) contiguous int64.
exl3::LowRank low_rank(const OptTensor& low, const OptTensor& bt, const OptTensor& columns,
                       const OptTensor& slots, int64_t rows, int64_t cols, int dtype) {
  exl3::LowRank lora{};
  const int given = low.has_value() + bt.has_value() + columns.has_value() + slots.has_value();
  if (given == 0) return lora;
  EXL3_CHECK(given == 4, "lora_low, lora_bt, lora_columns and lora_slots come together");
  for (const auto* t : {&*low, &*bt, &*columns, &*slots}) check_cuda(*t, "lora tensors");
  EXL3_CHECK(low->dim() == 2 && low->size(0) == rows &&
                  (low->size(1) <= 1 || low->stride(1) == 1) && dtype_code(*low) == dtype,
              "lora_low must be (rows, rank) in the activation dtype, unit column stride");
  const int64_t rank = low->size(1);
  EXL3_CHECK(bt->dim() == 2 && bt->size(0) == rank && bt->size(1) >= cols &&
                  (bt->size(1) <= 1 || bt->stride(1) == 1) && dtype_code(*bt) == dtype,
              "lora_bt must be (rank, >= the parts' columns) in the activation dtype");
  EXL3_CHECK(columns->scalar_type() == at::kLong && columns->is_contiguous() &&
                  columns->numel() == rank, "lora_columns must be contiguous int64 (rank,)");
  EXL3_CHECK(slots->scalar_type() == at::kLong && slots->is_contiguous() &&
                  slots->numel() >= rows, "lora_slots must be contiguous int64 (>= rows,)");
  lora.low = low->data_ptr();
  lora.low_stride = low->stride(0);
  lora.bt = bt->data_ptr();
  lora.bt_stride = bt->stride(0);
  lora.columns = columns->data_ptr<int64_t>();
  lora.slots = slots->data_ptr<int64_t>();
  lora.rank = (int)rank;
  return lora;
}

// An optional (rows, cols) output in dtype (code) with unit column stride: its pointer.
void* optional_rows(const OptTensor& t, int64_t rows, int64_t cols, int dtype,
                    const char* name) {
  if (!t.has_value()) return nullptr;
  check_cuda(*t, name);
  EXL3_CHECK(t->dim() == 2 && t->size(0) == rows && t->size(1) == cols &&
                  (cols <= 1 || t->stride(1) == 1) && dtype_code(*t) == dtype,
              name, " must be (rows, ", cols, ") in the activation dtype, unit column stride");
  return t->data_ptr();
}

// x: (rows, x_cols), unit column stride; pres: float32 (>= width); outs: (rows, width) fp16;
// normed: (rows, x_cols) in x's dtype or none.
void norm_hadamard(const at::Tensor& x, const c10::optional<at::Tensor>& norm_weight,
                   double eps, bool unit_offset, const std::vector<at::Tensor>& pres,
                   const std::vector<at::Tensor>& outs, int64_t width, const OptTensor& normed) {
  check_cuda(x, "x");
  EXL3_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be (rows, cols) with unit column stride");
  const size_t n = pres.size();
  EXL3_CHECK(n >= 1 && n <= (size_t)exl3::kMaxParts && outs.size() == n, "1..4 parts");
  const float* pre_ptr[exl3::kMaxParts] = {};
  void* out_ptr[exl3::kMaxParts] = {};
  for (size_t p = 0; p < n; p++) {
    pre_ptr[p] = optional_vector(pres[p], width, "pre");
    const at::Tensor& out = outs[p];
    check_cuda(out, "out");
    EXL3_CHECK(out.scalar_type() == at::kHalf && out.is_contiguous() && out.dim() == 2 &&
                    out.size(0) == x.size(0) && out.size(1) == width,
                "out must be contiguous float16 (rows, width)");
  }
  for (size_t p = 0; p < n; p++) out_ptr[p] = outs[p].data_ptr();
  void* normed_ptr = optional_rows(normed, x.size(0), x.size(1), dtype_code(x), "normed");
  const c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  check_launch(exl3::launch_norm_hadamard(
                   dtype_code(x), x.data_ptr(), x.stride(0), (int)x.size(1), (int)width,
                   optional_vector(norm_weight, x.size(1), "norm_weight"), (float)eps,
                   unit_offset, (int)n, pre_ptr, out_ptr, (int)x.size(0), normed_ptr,
                   normed.has_value() ? normed->stride(0) : 0, stream),
               "exl3 norm hadamard");
}

// The key/value store of hadamard_out (exl3_ops.h KvStore): keys/values (slots, KV, D)
// contiguous in dtype, slots (>= rows,) int64, ranges 4 per part (k_lo, k_hi, v_lo, v_hi
// in the part's columns), each range inside the part's output and one pool row wide at most.
exl3::KvStore kv_store(const OptTensor& keys, const OptTensor& values, const OptTensor& slots,
                       const std::vector<int64_t>& ranges, const exl3::OutParts& parts,
                       int64_t rows, at::ScalarType dtype) {
  exl3::KvStore kv{};
  const int given = keys.has_value() + values.has_value() + slots.has_value();
  if (given == 0) return kv;
  EXL3_CHECK(given == 3, "kv_keys, kv_values and kv_slots come together");
  EXL3_CHECK(ranges.size() == 4 * (size_t)parts.count, "kv_ranges: 4 per part");
  for (const auto* t : {&*keys, &*values}) {
    check_contiguous(*t, "kv_keys/kv_values");
    EXL3_CHECK(t->scalar_type() == dtype && t->dim() == 3 && t->sizes() == keys->sizes(),
                "kv_keys and kv_values must be (slots, kv_heads, head_dim) in the outputs' dtype");
  }
  check_contiguous(*slots, "kv_slots");
  EXL3_CHECK(slots->scalar_type() == at::kLong && slots->numel() >= rows,
              "kv_slots must be contiguous int64 (>= rows,)");
  const int64_t row = keys->size(1) * keys->size(2);
  for (int p = 0; p < parts.count; p++) {
    const int64_t* r = &ranges[4 * p];
    for (int j = 0; j < 4; j += 2)
      EXL3_CHECK(0 <= r[j] && r[j] <= r[j + 1] && r[j + 1] <= parts.part[p].out_cols &&
                      r[j + 1] - r[j] <= row, "kv_ranges must lie in the part's columns");
    kv.k_lo[p] = (int)r[0];
    kv.k_hi[p] = (int)r[1];
    kv.v_lo[p] = (int)r[2];
    kv.v_hi[p] = (int)r[3];
  }
  kv.keys = keys->data_ptr();
  kv.values = values->data_ptr();
  kv.slots = slots->data_ptr<int64_t>();
  kv.row_stride = row;
  return kv;
}

// partials: (splits, rows, width) float32; outs: (rows, out_cols) column views in dtype;
// the LoRA tensors (low_rank above) cover the outs' columns in order.
void hadamard_out(const std::vector<at::Tensor>& partials,
                  const std::vector<c10::optional<at::Tensor>>& posts,
                  const std::vector<c10::optional<at::Tensor>>& biases,
                  const std::vector<at::Tensor>& outs, const std::vector<int64_t>& rope_cols,
                  const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& cos,
                  const c10::optional<at::Tensor>& sin, int64_t head_dim,
                  const OptTensor& lora_low, const OptTensor& lora_bt,
                  const OptTensor& lora_columns, const OptTensor& lora_slots,
                  const OptTensor& kv_keys, const OptTensor& kv_values,
                  const OptTensor& kv_slots, const std::vector<int64_t>& kv_ranges) {
  const size_t n = partials.size();
  EXL3_CHECK(n >= 1 && n <= (size_t)exl3::kMaxParts && posts.size() == n &&
                  biases.size() == n && outs.size() == n && rope_cols.size() == n,
              "1..4 parts, each with post, bias, out and rope_cols");
  exl3::OutParts parts{};
  parts.count = (int)n;
  const int64_t rows = partials[0].size(1);
  const auto dtype = outs[0].scalar_type();
  int64_t lora_cols = 0;
  for (size_t p = 0; p < n; p++) {
    const at::Tensor& partial = partials[p];
    const at::Tensor& out = outs[p];
    check_contiguous(partial, "partial");
    check_cuda(out, "out");
    const bool half = partial.scalar_type() == at::kHalf;
    EXL3_CHECK((partial.scalar_type() == at::kFloat || (half && partial.size(0) == 1)) &&
                    partial.dim() == 3 && partial.size(1) == rows,
                "partials must be float32 (splits, rows, width) or float16 (1, rows, width)");
    EXL3_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == rows &&
                    out.scalar_type() == dtype, "outs must be (rows, cols) of one dtype");
    const int64_t width = partial.size(2);
    parts.part[p] = exl3::OutPart{partial.data_ptr(), (int)partial.size(0), (int)width,
                                  optional_vector(posts[p], width, "post"),
                                  optional_vector(biases[p], out.size(1), "bias"),
                                  out.data_ptr(), out.stride(0), (int)out.size(1),
                                  (int)rope_cols[p], (int)lora_cols, half};
    lora_cols += out.size(1);
  }
  const exl3::LowRank lora = low_rank(lora_low, lora_bt, lora_columns, lora_slots, rows,
                                      lora_cols, dtype_code(outs[0]));
  const void* res_ptr = nullptr;
  int64_t res_stride = 0;
  if (residual.has_value()) {
    check_cuda(*residual, "residual");
    EXL3_CHECK(residual->dim() == 2 && residual->stride(1) == 1 && residual->size(0) == rows &&
                    residual->scalar_type() == dtype,
                "residual must be (rows, cols) in the outputs' dtype");
    for (size_t p = 0; p < n; p++)
      EXL3_CHECK(residual->size(1) >= outs[p].size(1), "residual narrower than an output");
    res_ptr = residual->data_ptr();
    res_stride = residual->stride(0);
  }
  const void* cos_ptr = nullptr;
  const void* sin_ptr = nullptr;
  if (cos.has_value() || sin.has_value()) {
    EXL3_CHECK(cos.has_value() && sin.has_value(), "cos and sin come together");
    for (const auto* t : {&*cos, &*sin}) {
      check_contiguous(*t, "cos/sin");
      EXL3_CHECK(t->scalar_type() == dtype && t->numel() == rows * head_dim,
                  "cos/sin must be (rows, head_dim) in the outputs' dtype");
    }
    cos_ptr = cos->data_ptr();
    sin_ptr = sin->data_ptr();
  }
  const exl3::KvStore kv = kv_store(kv_keys, kv_values, kv_slots, kv_ranges, parts, rows, dtype);
  EXL3_CHECK(kv.keys == nullptr || res_ptr == nullptr, "a key/value store takes no residual");
  const c10::cuda::CUDAGuard guard(partials[0].device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  check_launch(exl3::launch_hadamard_out(dtype_code(outs[0]), parts, (int)rows, res_ptr,
                                         res_stride, cos_ptr, sin_ptr, (int)head_dim, lora,
                                         stream, kv),
               "exl3 hadamard out");
}

// gate/up: (splits, rows, width) float32; out: (rows, width) float16; dtype: rounding;
// the LoRA tensors cover [gate | up] (2 * inter columns); product: (rows, inter) or none.
void glu_hadamard(const at::Tensor& gate, const at::Tensor& up,
                  const c10::optional<at::Tensor>& post_gate,
                  const c10::optional<at::Tensor>& post_up,
                  const c10::optional<at::Tensor>& bias_gate,
                  const c10::optional<at::Tensor>& bias_up, int64_t inter, int64_t act,
                  const at::Tensor& pre, at::Tensor& out, int64_t dtype,
                  const OptTensor& lora_low, const OptTensor& lora_bt,
                  const OptTensor& lora_columns, const OptTensor& lora_slots,
                  const OptTensor& product) {
  check_contiguous(gate, "gate");
  check_contiguous(up, "up");
  check_contiguous(out, "out");
  const bool half = gate.scalar_type() == at::kHalf;
  EXL3_CHECK((gate.scalar_type() == at::kFloat || (half && gate.size(0) == 1)) &&
                  gate.dim() == 3 && up.sizes() == gate.sizes() &&
                  up.scalar_type() == gate.scalar_type(),
              "gate and up must be float32 (splits, rows, width) or float16 (1, rows, width)");
  const int64_t rows = gate.size(1), width = gate.size(2);
  EXL3_CHECK(out.scalar_type() == at::kHalf && out.dim() == 2 && out.size(0) == rows &&
                  out.size(1) == width, "out must be contiguous float16 (rows, width)");
  const exl3::LowRank lora = low_rank(lora_low, lora_bt, lora_columns, lora_slots, rows,
                                      2 * inter, (int)dtype);
  void* product_ptr = optional_rows(product, rows, inter, (int)dtype, "product");
  const c10::cuda::CUDAGuard guard(gate.device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  check_launch(exl3::launch_glu_hadamard(
                   (int)dtype, gate.data_ptr(), up.data_ptr(), (int)gate.size(0),
                   (int)width, optional_vector(post_gate, width, "post_gate"),
                   optional_vector(post_up, width, "post_up"),
                   optional_vector(bias_gate, inter, "bias_gate"),
                   optional_vector(bias_up, inter, "bias_up"), (int)inter, (int)act,
                   optional_vector(pre, width, "pre"), out.data_ptr(), (int)rows, lora,
                   product_ptr, product.has_value() ? product->stride(0) : 0, stream, half),
               "exl3 glu hadamard");
}

// low = x @ a^T (lora_low.cu): x (rows, K) unit column stride, a (rank, K) contiguous, low
// (rows, rank) contiguous, all in one dtype; partial float32 (>= kLoraLowMaxSplits * rows
// * rank), ticket int32 (1,) holding 0. False: a shape the kernel does not take.
bool lora_low(const at::Tensor& x, const at::Tensor& a, const at::Tensor& low,
              const at::Tensor& partial, const at::Tensor& ticket) {
  for (const auto* t : {&x, &a, &low, &partial, &ticket}) check_cuda(*t, "lora_low tensors");
  const int64_t rows = x.size(0), rank = a.size(0);
  EXL3_CHECK(x.dim() == 2 && x.stride(1) == 1 && a.dim() == 2 && a.is_contiguous() &&
                  a.size(1) == x.size(1) && a.scalar_type() == x.scalar_type(),
              "lora_low: x (rows, K) unit column stride and a (rank, K) contiguous, one dtype");
  EXL3_CHECK(low.is_contiguous() && low.dim() == 2 && low.size(0) == rows &&
                  low.size(1) == rank && low.scalar_type() == x.scalar_type(),
              "lora_low: low must be contiguous (rows, rank) in x's dtype");
  EXL3_CHECK(partial.scalar_type() == at::kFloat && partial.is_contiguous() &&
                  partial.numel() >= exl3::kLoraLowMaxSplits * rows * rank,
              "lora_low: partial workspace too small");
  EXL3_CHECK(ticket.scalar_type() == at::kInt && ticket.numel() >= 1, "lora_low: ticket");
  if (x.scalar_type() != at::kHalf && x.scalar_type() != at::kBFloat16) return false;
  const c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  const bool ok = exl3::launch_lora_low(
      dtype_code(x), x.data_ptr(), x.stride(0), a.data_ptr(), (int)x.size(1), (int)rank,
      (int)rows, partial.data_ptr<float>(), reinterpret_cast<unsigned*>(ticket.data_ptr<int>()),
      low.data_ptr(), stream);
  if (ok) check_launch(true, "exl3 lora low");
  return ok;
}

// x: (rows, heads * head_dim) view in the activation dtype, unit column stride (q and k
// heads of a q|k|v output); weight (heads, head_dim) float32; cos/sin (rows, head_dim).
void qk_norm_rope(at::Tensor& x, int64_t heads, int64_t head_dim, const at::Tensor& weight,
                  double eps, const OptTensor& cos, const OptTensor& sin) {
  check_cuda(x, "x");
  EXL3_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == heads * head_dim,
              "x must be (rows, heads * head_dim) with unit column stride");
  check_contiguous(weight, "weight");
  EXL3_CHECK(weight.scalar_type() == at::kFloat && weight.numel() == heads * head_dim,
              "weight must be contiguous float32 (heads, head_dim)");
  EXL3_CHECK(cos.has_value() == sin.has_value(), "cos and sin come together");
  const void* cos_ptr = nullptr;
  const void* sin_ptr = nullptr;
  if (cos.has_value()) {
    check_contiguous(*cos, "cos");
    check_contiguous(*sin, "sin");
    EXL3_CHECK(cos->scalar_type() == x.scalar_type() && sin->scalar_type() == x.scalar_type() &&
                    cos->numel() == x.size(0) * head_dim && sin->numel() == cos->numel(),
                "cos/sin must be (rows, head_dim) in x's dtype");
    cos_ptr = cos->data_ptr();
    sin_ptr = sin->data_ptr();
  }
  const c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  check_launch(exl3::launch_qk_norm_rope(dtype_code(x), x.data_ptr(), x.stride(0), (int)heads,
                                         (int)head_dim, (int)x.size(0), weight.data_ptr<float>(),
                                         (float)eps, cos_ptr, sin_ptr, stream),
               "exl3 qk norm rope");
}

}  // namespace

void define_layer_ops(pybind11::module_& m) {
  m.def("lora_low", &lora_low, "low = x @ a^T for a decode step's rows (False: not taken)",
        py::arg("x"), py::arg("a"), py::arg("low"), py::arg("partial"), py::arg("ticket"));
  m.def("qk_norm_rope", &qk_norm_rope, "per-head RMSNorm of q and k, then rotary, in place",
        py::arg("x"), py::arg("heads"), py::arg("head_dim"), py::arg("weight"), py::arg("eps"),
        py::arg("cos"), py::arg("sin"));
  m.def("norm_hadamard", &norm_hadamard,
        "outs[p] = f16(H128(rmsnorm(x) * pres[p])) (norm optional)", py::arg("x"),
        py::arg("norm_weight"), py::arg("eps"), py::arg("unit_offset"), py::arg("pres"),
        py::arg("outs"), py::arg("width"), py::arg("normed"));
  m.def("hadamard_out", &hadamard_out,
        "split sum + H128 + post + bias (+ rotary, + residual) for up to 4 parts",
        py::arg("partials"), py::arg("posts"), py::arg("biases"), py::arg("outs"),
        py::arg("rope_cols"), py::arg("residual"), py::arg("cos"), py::arg("sin"),
        py::arg("head_dim"), py::arg("lora_low"), py::arg("lora_bt"), py::arg("lora_columns"),
        py::arg("lora_slots"), py::arg("kv_keys") = py::none(), py::arg("kv_values") = py::none(),
        py::arg("kv_slots") = py::none(), py::arg("kv_ranges") = std::vector<int64_t>{});
  m.def("glu_hadamard", &glu_hadamard,
        "act(gate) * up from their partials, then the down projection's input Hadamard",
        py::arg("gate"), py::arg("up"), py::arg("post_gate"), py::arg("post_up"),
        py::arg("bias_gate"), py::arg("bias_up"), py::arg("inter"), py::arg("act"),
        py::arg("pre"), py::arg("out"), py::arg("dtype"), py::arg("lora_low"),
        py::arg("lora_bt"), py::arg("lora_columns"), py::arg("lora_slots"), py::arg("product"));
  define_fold_ops(m);  // fold_bindings.cpp
}

}  // namespace exl3_bind
