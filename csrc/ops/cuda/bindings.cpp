// Torch bindings for the EXL3 kernels: tensor checks, then the raw launchers.
// Every op writes into a caller-provided output (the Python side allocates), runs on
// the current CUDA stream and raises on launch errors.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "exl3_ops.h"

namespace {

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
}

void check_launch(bool ok, const char* what) {
  TORCH_CHECK(ok, what, ": unsupported arguments (bits/codebook/shape)");
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, what, ": ", cudaGetErrorString(err));
}

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return exl3::DT_HALF;
    case at::kBFloat16: return exl3::DT_BF16;
    case at::kFloat: return exl3::DT_FLOAT;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type());
  }
  return -1;
}

void check_trellis(const at::Tensor& trellis, int k2) {
  check_cuda(trellis, "trellis");
  TORCH_CHECK(trellis.scalar_type() == at::kShort && trellis.dim() == 3,
              "trellis must be int16 (kb, nb, words)");
  TORCH_CHECK(trellis.is_contiguous(), "trellis must be contiguous");
  TORCH_CHECK(trellis.size(2) == 8 * k2, "trellis has ", trellis.size(2), " words, k2=", k2,
              " needs ", 8 * k2);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(trellis.data_ptr()) % 16 == 0,
              "trellis must be 16-byte aligned");
}

void decode(const at::Tensor& trellis, int64_t k2, int64_t cb, at::Tensor& out) {
  check_trellis(trellis, (int)k2);
  const int kb = (int)trellis.size(0), nb = (int)trellis.size(1);
  check_cuda(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kHalf && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == 16 * kb && out.size(1) == 16 * nb,
              "out must be contiguous float16 (16*kb, 16*nb)");
  const c10::cuda::CUDAGuard guard(trellis.device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  check_launch(exl3::launch_decode(trellis.data_ptr(), out.data_ptr(), kb, nb, (int)k2, (int)cb,
                                   stream),
               "exl3 decode");
}

// One launch over parts with the same rows, kb, K and codebook (exl3_ops.h GemmParts).
void gemm_parts(const std::vector<at::Tensor>& xhs, const std::vector<at::Tensor>& trellises,
                int64_t k2, int64_t cb, const std::vector<at::Tensor>& partials) {
  const size_t n = xhs.size();
  TORCH_CHECK(n >= 1 && n <= (size_t)exl3::kMaxParts && trellises.size() == n &&
                  partials.size() == n, "1..", exl3::kMaxParts, " parts, one xh, trellis and partial each");
  exl3::GemmParts parts{};
  parts.count = (int)n;
  int kb = -1, rows = -1, splits = -1;
  for (size_t p = 0; p < n; p++) {
    const at::Tensor& xh = xhs[p];
    const at::Tensor& trellis = trellises[p];
    const at::Tensor& partial = partials[p];
    check_trellis(trellis, (int)k2);
    check_cuda(xh, "xh");
    check_cuda(partial, "partial");
    if (p == 0) {
      kb = (int)trellis.size(0);
      rows = (int)xh.size(0);
      splits = (int)partial.size(0);
    }
    const int nb = (int)trellis.size(1);
    TORCH_CHECK(trellis.size(0) == kb, "parts must share the input size (kb)");
    TORCH_CHECK(xh.scalar_type() == at::kHalf && xh.is_contiguous() && xh.dim() == 2 &&
                    xh.size(0) == rows && xh.size(1) == 16 * kb,
                "xh must be contiguous float16 (rows, 16*kb)");
    TORCH_CHECK(partial.scalar_type() == at::kFloat && partial.is_contiguous() &&
                    partial.dim() == 3 && partial.size(0) == splits && partial.size(1) == rows &&
                    partial.size(2) == 16 * nb,
                "partial must be contiguous float32 (splits, rows, 16*nb)");
    parts.part[p] = exl3::GemmPart{xh.data_ptr(), trellis.data_ptr(),
                                   partial.data_ptr<float>(), nb};
  }
  TORCH_CHECK(rows >= 1 && rows <= 64, "fused GEMM takes 1..64 rows, got ", rows);
  TORCH_CHECK(splits >= 1 && splits <= kb, "splits must be in 1..kb");
  const c10::cuda::CUDAGuard guard(xhs[0].device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  bool ok = false;
  if (cb == 2) ok = exl3::launch_gemm_mul1(parts, rows, kb, (int)k2, splits, stream);
  else if (cb == 1) ok = exl3::launch_gemm_mcg(parts, rows, kb, (int)k2, splits, stream);
  else if (cb == 0) ok = exl3::launch_gemm_3inst(parts, rows, kb, (int)k2, splits, stream);
  check_launch(ok, "exl3 gemm");
}

void gemm_partial(const at::Tensor& xh, const at::Tensor& trellis, int64_t k2, int64_t cb,
                  at::Tensor& partial) {
  gemm_parts({xh}, {trellis}, k2, cb, {partial});
}

const float* optional_vector(const c10::optional<at::Tensor>& t, int64_t width,
                             const char* name) {
  if (!t.has_value()) return nullptr;
  check_cuda(*t, name);
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() >= width,
              name, " must be contiguous float32 with at least ", width, " entries");
  return t->data_ptr<float>();
}

// x: (slices, rows, x_cols) with unit column stride; out: (rows, out_cols), unit column stride.
void hadamard(const at::Tensor& x, const c10::optional<at::Tensor>& pre,
              const c10::optional<at::Tensor>& post, const c10::optional<at::Tensor>& bias,
              at::Tensor& out, int64_t width) {
  check_cuda(x, "x");
  check_cuda(out, "out");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be (slices, rows, cols), unit stride");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(1),
              "out must be (rows, cols) with unit column stride");
  TORCH_CHECK(width % 128 == 0 && out.size(1) <= width && x.size(2) <= width,
              "width must be a multiple of 128 covering x and out");
  const c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  check_launch(
      exl3::launch_hadamard(dtype_code(x), dtype_code(out), x.data_ptr(), x.stride(0),
                            x.stride(1), (int)x.size(0), (int)x.size(2), (int)width,
                            optional_vector(pre, width, "pre"),
                            optional_vector(post, width, "post"),
                            optional_vector(bias, out.size(1), "bias"), out.data_ptr(),
                            out.stride(0), (int)out.size(1), (int)x.size(1), stream),
      "exl3 hadamard");
}

void check_contiguous(const at::Tensor& t, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// q/out: (B, H, D) half/bf16; k/v: pool storage (see exl3_ops.h); k_bits/v_bits 16 when
// the storage is the activation dtype (scales then unused).
void paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& k_scales,
                     const at::Tensor& v, const at::Tensor& v_scales, int64_t k_bits,
                     int64_t v_bits, const at::Tensor& page_table, const at::Tensor& lengths,
                     at::Tensor& out, int64_t page_size, int64_t kv_heads, int64_t window,
                     double softcap, double scale) {
  check_contiguous(q, "q");
  check_contiguous(k, "k");
  check_contiguous(v, "v");
  check_contiguous(out, "out");
  check_contiguous(lengths, "lengths");
  check_cuda(page_table, "page_table");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "q and out must be (B, H, D) of one dtype");
  TORCH_CHECK(page_table.scalar_type() == at::kLong && page_table.dim() == 2 &&
                  page_table.stride(1) == 1 && lengths.scalar_type() == at::kLong,
              "page_table (B, P) and lengths (B) must be int64");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  TORCH_CHECK(page_table.size(0) == batch && lengths.numel() == batch, "batch mismatch");
  const bool kq = k_bits < 16, vq = v_bits < 16;
  if (kq) {
    check_contiguous(k_scales, "k_scales");
    TORCH_CHECK(k.scalar_type() == at::kByte && k_scales.scalar_type() == at::kHalf &&
                    k.size(1) == kv_heads * dim / 8 * k_bits,
                "quantized keys: uint8 codes (slots, C/8*bits) and float16 scales");
  } else {
    TORCH_CHECK(k.scalar_type() == q.scalar_type() && k.dim() == 3 && k.size(1) == kv_heads &&
                    k.size(2) == dim, "keys must be (slots, kv_heads, D) in q's dtype");
  }
  if (vq) {
    check_contiguous(v_scales, "v_scales");
    TORCH_CHECK(v.scalar_type() == at::kByte && v_scales.scalar_type() == at::kHalf &&
                    v.size(1) == kv_heads * dim / 8 * v_bits,
                "quantized values: uint8 codes (slots, C/8*bits) and float16 scales");
  } else {
    TORCH_CHECK(v.scalar_type() == q.scalar_type() && v.dim() == 3 && v.size(1) == kv_heads &&
                    v.size(2) == dim, "values must be (slots, kv_heads, D) in q's dtype");
  }
  // Chunks of 64 positions covering every page of the table (fixed per table shape,
  // so a captured graph launches the same grid every step).
  const int64_t pages = page_table.size(1);
  const int chunks = (int)((pages * page_size + 63) / 64);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor part_acc, part_ml;
  float* acc_ptr = nullptr;
  float* ml_ptr = nullptr;
  if (chunks > 1) {
    auto options = q.options().dtype(at::kFloat);
    part_acc = at::empty({batch, heads, chunks, dim}, options);
    part_ml = at::empty({batch, heads, chunks, 2}, options);
    acc_ptr = part_acc.data_ptr<float>();
    ml_ptr = part_ml.data_ptr<float>();
  }
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  check_launch(exl3::launch_paged_attention(
                   dtype_code(q), q.data_ptr(), (int)batch, (int)heads, (int)kv_heads, (int)dim,
                   k.data_ptr(), kq ? k_scales.data_ptr() : nullptr, (int)k_bits, v.data_ptr(),
                   vq ? v_scales.data_ptr() : nullptr, (int)v_bits,
                   page_table.data_ptr<int64_t>(), (int)pages, lengths.data_ptr<int64_t>(),
                   (int)page_size, (int)window, (float)softcap, (float)scale, acc_ptr, ml_ptr,
                   chunks, out.data_ptr(), stream),
               "exl3 paged attention");
}

// x: (N, C) rows to quantize into codes/scales at `slots` (N) int64.
void kv_quant_write(const at::Tensor& x, const at::Tensor& slots, int64_t bits,
                    at::Tensor& codes, at::Tensor& scales) {
  check_cuda(x, "x");
  check_contiguous(slots, "slots");
  check_contiguous(codes, "codes");
  check_contiguous(scales, "scales");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && slots.scalar_type() == at::kLong &&
                  slots.numel() == x.size(0),
              "x must be (N, C) with unit column stride and slots (N) int64");
  const int64_t channels = x.size(1);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.size(1) == channels / 8 * bits &&
                  scales.scalar_type() == at::kHalf && scales.size(1) == channels / 32,
              "codes (slots, C/8*bits) uint8 and scales (slots, C/32) float16");
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  check_launch(exl3::launch_kv_quant_write(dtype_code(x), x.data_ptr(), x.stride(0),
                                           slots.data_ptr<int64_t>(), (int)x.size(0),
                                           (int)channels, (int)bits, codes.data_ptr(),
                                           scales.data_ptr(), stream),
               "exl3 kv quant write");
}


using OptTensor = c10::optional<at::Tensor>;

// The LoRA update of an output kernel (exl3_ops.h LowRank) from its four optional
// tensors (all or none): low (rows, rank) and bt (rank, >= cols) in `dtype` (code), unit
// column stride; columns (rank,) and slots (>= rows,) contiguous int64.
exl3::LowRank low_rank(const OptTensor& low, const OptTensor& bt, const OptTensor& columns,
                       const OptTensor& slots, int64_t rows, int64_t cols, int dtype) {
  exl3::LowRank lora{};
  const int given = low.has_value() + bt.has_value() + columns.has_value() + slots.has_value();
  if (given == 0) return lora;
  TORCH_CHECK(given == 4, "lora_low, lora_bt, lora_columns and lora_slots come together");
  for (const auto* t : {&*low, &*bt, &*columns, &*slots}) check_cuda(*t, "lora tensors");
  TORCH_CHECK(low->dim() == 2 && low->size(0) == rows &&
                  (low->size(1) <= 1 || low->stride(1) == 1) && dtype_code(*low) == dtype,
              "lora_low must be (rows, rank) in the activation dtype, unit column stride");
  const int64_t rank = low->size(1);
  TORCH_CHECK(bt->dim() == 2 && bt->size(0) == rank && bt->size(1) >= cols &&
                  (bt->size(1) <= 1 || bt->stride(1) == 1) && dtype_code(*bt) == dtype,
              "lora_bt must be (rank, >= the parts' columns) in the activation dtype");
  TORCH_CHECK(columns->scalar_type() == at::kLong && columns->is_contiguous() &&
                  columns->numel() == rank, "lora_columns must be contiguous int64 (rank,)");
  TORCH_CHECK(slots->scalar_type() == at::kLong && slots->is_contiguous() &&
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
  TORCH_CHECK(t->dim() == 2 && t->size(0) == rows && t->size(1) == cols &&
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
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be (rows, cols) with unit column stride");
  const size_t n = pres.size();
  TORCH_CHECK(n >= 1 && n <= (size_t)exl3::kMaxParts && outs.size() == n, "1..4 parts");
  const float* pre_ptr[exl3::kMaxParts] = {};
  void* out_ptr[exl3::kMaxParts] = {};
  for (size_t p = 0; p < n; p++) {
    pre_ptr[p] = optional_vector(pres[p], width, "pre");
    const at::Tensor& out = outs[p];
    check_cuda(out, "out");
    TORCH_CHECK(out.scalar_type() == at::kHalf && out.is_contiguous() && out.dim() == 2 &&
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

// partials: (splits, rows, width) float32; outs: (rows, out_cols) column views in dtype;
// the LoRA tensors (low_rank above) cover the outs' columns in order.
void hadamard_out(const std::vector<at::Tensor>& partials,
                  const std::vector<c10::optional<at::Tensor>>& posts,
                  const std::vector<c10::optional<at::Tensor>>& biases,
                  const std::vector<at::Tensor>& outs, const std::vector<int64_t>& rope_cols,
                  const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& cos,
                  const c10::optional<at::Tensor>& sin, int64_t head_dim,
                  const OptTensor& lora_low, const OptTensor& lora_bt,
                  const OptTensor& lora_columns, const OptTensor& lora_slots) {
  const size_t n = partials.size();
  TORCH_CHECK(n >= 1 && n <= (size_t)exl3::kMaxParts && posts.size() == n &&
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
    TORCH_CHECK(partial.scalar_type() == at::kFloat && partial.dim() == 3 &&
                    partial.size(1) == rows, "partials must be float32 (splits, rows, width)");
    TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == rows &&
                    out.scalar_type() == dtype, "outs must be (rows, cols) of one dtype");
    const int64_t width = partial.size(2);
    parts.part[p] = exl3::OutPart{partial.data_ptr<float>(), (int)partial.size(0), (int)width,
                                  optional_vector(posts[p], width, "post"),
                                  optional_vector(biases[p], out.size(1), "bias"),
                                  out.data_ptr(), out.stride(0), (int)out.size(1),
                                  (int)rope_cols[p], (int)lora_cols};
    lora_cols += out.size(1);
  }
  const exl3::LowRank lora = low_rank(lora_low, lora_bt, lora_columns, lora_slots, rows,
                                      lora_cols, dtype_code(outs[0]));
  const void* res_ptr = nullptr;
  int64_t res_stride = 0;
  if (residual.has_value()) {
    check_cuda(*residual, "residual");
    TORCH_CHECK(residual->dim() == 2 && residual->stride(1) == 1 && residual->size(0) == rows &&
                    residual->scalar_type() == dtype,
                "residual must be (rows, cols) in the outputs' dtype");
    for (size_t p = 0; p < n; p++)
      TORCH_CHECK(residual->size(1) >= outs[p].size(1), "residual narrower than an output");
    res_ptr = residual->data_ptr();
    res_stride = residual->stride(0);
  }
  const void* cos_ptr = nullptr;
  const void* sin_ptr = nullptr;
  if (cos.has_value() || sin.has_value()) {
    TORCH_CHECK(cos.has_value() && sin.has_value(), "cos and sin come together");
    for (const auto* t : {&*cos, &*sin}) {
      check_contiguous(*t, "cos/sin");
      TORCH_CHECK(t->scalar_type() == dtype && t->numel() == rows * head_dim,
                  "cos/sin must be (rows, head_dim) in the outputs' dtype");
    }
    cos_ptr = cos->data_ptr();
    sin_ptr = sin->data_ptr();
  }
  const c10::cuda::CUDAGuard guard(partials[0].device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  check_launch(exl3::launch_hadamard_out(dtype_code(outs[0]), parts, (int)rows, res_ptr,
                                         res_stride, cos_ptr, sin_ptr, (int)head_dim, lora,
                                         stream),
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
  TORCH_CHECK(gate.scalar_type() == at::kFloat && gate.dim() == 3 && up.sizes() == gate.sizes() &&
                  up.scalar_type() == at::kFloat, "gate and up must be float32 (splits, rows, width)");
  const int64_t rows = gate.size(1), width = gate.size(2);
  TORCH_CHECK(out.scalar_type() == at::kHalf && out.dim() == 2 && out.size(0) == rows &&
                  out.size(1) == width, "out must be contiguous float16 (rows, width)");
  const exl3::LowRank lora = low_rank(lora_low, lora_bt, lora_columns, lora_slots, rows,
                                      2 * inter, (int)dtype);
  void* product_ptr = optional_rows(product, rows, inter, (int)dtype, "product");
  const c10::cuda::CUDAGuard guard(gate.device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  check_launch(exl3::launch_glu_hadamard(
                   (int)dtype, gate.data_ptr<float>(), up.data_ptr<float>(), (int)gate.size(0),
                   (int)width, optional_vector(post_gate, width, "post_gate"),
                   optional_vector(post_up, width, "post_up"),
                   optional_vector(bias_gate, inter, "bias_gate"),
                   optional_vector(bias_up, inter, "bias_up"), (int)inter, (int)act,
                   optional_vector(pre, width, "pre"), out.data_ptr(), (int)rows, lora,
                   product_ptr, product.has_value() ? product->stride(0) : 0, stream),
               "exl3 glu hadamard");
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "EXL3 CUDA kernels: trellis decode, fused decode+GEMM, 128-point Hadamard";
  m.def("decode", &decode, "trellis (kb, nb, 8*k2) int16 -> out (16kb, 16nb) float16",
        py::arg("trellis"), py::arg("k2"), py::arg("codebook"), py::arg("out"));
  m.def("gemm_partial", &gemm_partial,
        "xh (rows<=64, 16kb) float16 x decoded trellis -> partial (splits, rows, 16nb) float32",
        py::arg("xh"), py::arg("trellis"), py::arg("k2"), py::arg("codebook"),
        py::arg("partial"));
  m.def("gemm_parts", &gemm_parts,
        "gemm_partial for up to 4 parts (same rows, kb, K, codebook) in one launch",
        py::arg("xhs"), py::arg("trellises"), py::arg("k2"), py::arg("codebook"),
        py::arg("partials"));
  m.def("norm_hadamard", &norm_hadamard,
        "outs[p] = f16(H128(rmsnorm(x) * pres[p])) (norm optional)", py::arg("x"),
        py::arg("norm_weight"), py::arg("eps"), py::arg("unit_offset"), py::arg("pres"),
        py::arg("outs"), py::arg("width"), py::arg("normed"));
  m.def("hadamard_out", &hadamard_out,
        "split sum + H128 + post + bias (+ rotary, + residual) for up to 4 parts",
        py::arg("partials"), py::arg("posts"), py::arg("biases"), py::arg("outs"),
        py::arg("rope_cols"), py::arg("residual"), py::arg("cos"), py::arg("sin"),
        py::arg("head_dim"), py::arg("lora_low"), py::arg("lora_bt"), py::arg("lora_columns"),
        py::arg("lora_slots"));
  m.def("glu_hadamard", &glu_hadamard,
        "act(gate) * up from their partials, then the down projection's input Hadamard",
        py::arg("gate"), py::arg("up"), py::arg("post_gate"), py::arg("post_up"),
        py::arg("bias_gate"), py::arg("bias_up"), py::arg("inter"), py::arg("act"),
        py::arg("pre"), py::arg("out"), py::arg("dtype"), py::arg("lora_low"),
        py::arg("lora_bt"), py::arg("lora_columns"), py::arg("lora_slots"), py::arg("product"));
  m.def("hadamard", &hadamard,
        "out = H128(sum_s x[s] * pre) * post + bias, per 128 columns over width",
        py::arg("x"), py::arg("pre"), py::arg("post"), py::arg("bias"), py::arg("out"),
        py::arg("width"));
  m.def("paged_attention", &paged_attention, "decode attention over a paged KV cache",
        py::arg("q"), py::arg("k"), py::arg("k_scales"), py::arg("v"), py::arg("v_scales"),
        py::arg("k_bits"), py::arg("v_bits"), py::arg("page_table"), py::arg("lengths"),
        py::arg("out"), py::arg("page_size"), py::arg("kv_heads"), py::arg("window"),
        py::arg("softcap"), py::arg("scale"));
  m.def("kv_quant_write", &kv_quant_write, "quantize rows into a paged quantized KV cache",
        py::arg("x"), py::arg("slots"), py::arg("bits"), py::arg("codes"), py::arg("scales"));
}
