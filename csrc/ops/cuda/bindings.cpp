// Torch bindings for the EXL3 kernels: tensor checks, then the raw launchers (the fused
// decode-layer kernels: layer_bindings.cpp).
// Every op writes into a caller-provided output (the Python side allocates), runs on
// the current CUDA stream and raises on launch errors.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "bindings_util.h"
#include "exl3_ops.h"

namespace {

using namespace exl3_bind;

void check_trellis(const at::Tensor& trellis, int k2) {
  check_cuda(trellis, "trellis");
  EXL3_CHECK(trellis.scalar_type() == at::kShort && trellis.dim() == 3,
              "trellis must be int16 (kb, nb, words)");
  EXL3_CHECK(trellis.is_contiguous(), "trellis must be contiguous");
  EXL3_CHECK(trellis.size(2) == 8 * k2, "trellis has ", trellis.size(2), " words, k2=", k2,
              " needs ", 8 * k2);
  EXL3_CHECK(reinterpret_cast<uintptr_t>(trellis.data_ptr()) % 16 == 0,
              "trellis must be 16-byte aligned");
}

void decode(const at::Tensor& trellis, int64_t k2, int64_t cb, at::Tensor& out) {
  check_trellis(trellis, (int)k2);
  const int kb = (int)trellis.size(0), nb = (int)trellis.size(1);
  check_cuda(out, "out");
  EXL3_CHECK(out.scalar_type() == at::kHalf && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == 16 * kb && out.size(1) == 16 * nb,
              "out must be contiguous float16 (16*kb, 16*nb)");
  const c10::cuda::CUDAGuard guard(trellis.device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  check_launch(exl3::launch_decode(trellis.data_ptr(), out.data_ptr(), kb, nb, (int)k2, (int)cb,
                                   stream),
               "exl3 decode");
}

// decode with every value times scale (one float16 on the trellis's device).
void decode_scaled(const at::Tensor& trellis, int64_t k2, int64_t cb, at::Tensor& out,
                   const at::Tensor& scale) {
  check_trellis(trellis, (int)k2);
  const int kb = (int)trellis.size(0), nb = (int)trellis.size(1);
  check_cuda(out, "out");
  check_cuda(scale, "scale");
  EXL3_CHECK(out.scalar_type() == at::kHalf && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == 16 * kb && out.size(1) == 16 * nb,
              "out must be contiguous float16 (16*kb, 16*nb)");
  EXL3_CHECK(scale.scalar_type() == at::kHalf && scale.numel() == 1 &&
                  scale.device() == trellis.device(), "scale must be one float16 beside the trellis");
  const c10::cuda::CUDAGuard guard(trellis.device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  check_launch(exl3::launch_decode(trellis.data_ptr(), out.data_ptr(), kb, nb, (int)k2, (int)cb,
                                   stream, scale.data_ptr()),
               "exl3 decode scaled");
}

// One launch over parts with the same rows, kb, K and codebook (exl3_ops.h GemmParts),
// with `lora`'s product (none: x null) in the same launch.
void run_gemm_parts(const std::vector<at::Tensor>& xhs, const std::vector<at::Tensor>& trellises,
                    int64_t k2, int64_t cb, const std::vector<at::Tensor>& partials,
                    const exl3::GemmLora& lora) {
  const size_t n = xhs.size();
  EXL3_CHECK(n >= 1 && n <= (size_t)exl3::kMaxParts && trellises.size() == n &&
                  partials.size() == n, "1..", exl3::kMaxParts, " parts, one xh, trellis and partial each");
  exl3::GemmParts parts{};
  parts.count = (int)n;
  parts.lora = lora;
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
    EXL3_CHECK(trellis.size(0) == kb, "parts must share the input size (kb)");
    EXL3_CHECK(xh.scalar_type() == at::kHalf && xh.is_contiguous() && xh.dim() == 2 &&
                    xh.size(0) == rows && xh.size(1) == 16 * kb,
                "xh must be contiguous float16 (rows, 16*kb)");
    EXL3_CHECK(partial.scalar_type() == at::kFloat && partial.is_contiguous() &&
                    partial.dim() == 3 && partial.size(0) == splits && partial.size(1) == rows &&
                    partial.size(2) == 16 * nb,
                "partial must be contiguous float32 (splits, rows, 16*nb)");
    parts.part[p] = exl3::GemmPart{xh.data_ptr(), trellis.data_ptr(),
                                   partial.data_ptr<float>(), nb};
  }
  EXL3_CHECK(rows >= 1 && rows <= 64, "fused GEMM takes 1..64 rows, got ", rows);
  EXL3_CHECK(splits >= 1 && splits <= kb, "splits must be in 1..kb");
  const c10::cuda::CUDAGuard guard(xhs[0].device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  bool ok = false;
  if (cb == 2) ok = exl3::launch_gemm_mul1(parts, rows, kb, (int)k2, splits, stream);
  else if (cb == 1) ok = exl3::launch_gemm_mcg(parts, rows, kb, (int)k2, splits, stream);
  else if (cb == 0) ok = exl3::launch_gemm_3inst(parts, rows, kb, (int)k2, splits, stream);
  check_launch(ok, "exl3 gemm");
}

void gemm_parts(const std::vector<at::Tensor>& xhs, const std::vector<at::Tensor>& trellises,
                int64_t k2, int64_t cb, const std::vector<at::Tensor>& partials) {
  run_gemm_parts(xhs, trellises, k2, cb, partials, exl3::GemmLora{});
}

// gemm_parts plus low = x @ a^T in the same launch (exl3_ops.h GemmLora): x (rows, K) with
// unit column stride, a (rank, K) contiguous, low (rows, rank) contiguous, one dtype
// (float16 or bfloat16); rows those of the parts' xh. Every shape the kernel does not
// take is refused here, before the launch.
void gemm_parts_low(const std::vector<at::Tensor>& xhs, const std::vector<at::Tensor>& trellises,
                    int64_t k2, int64_t cb, const std::vector<at::Tensor>& partials,
                    const at::Tensor& x, const at::Tensor& a, const at::Tensor& low) {
  for (const auto* t : {&x, &a, &low}) check_cuda(*t, "gemm_parts_low: x, a and low");
  EXL3_CHECK(!xhs.empty(), "gemm_parts_low: at least one part");
  EXL3_CHECK(x.device() == xhs[0].device() && a.device() == x.device() &&
                  low.device() == x.device(), "gemm_parts_low: x, a, low on the parts' device");
  EXL3_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "gemm_parts_low: x must be float16 or bfloat16");
  EXL3_CHECK(a.scalar_type() == x.scalar_type() && low.scalar_type() == x.scalar_type(),
              "gemm_parts_low: x, a and low in one dtype");
  EXL3_CHECK(x.dim() == 2 && a.dim() == 2 && low.dim() == 2, "gemm_parts_low: 2-D x, a, low");
  const int64_t rows = x.size(0), k_dim = x.size(1), rank = a.size(0);
  EXL3_CHECK(rows == xhs[0].size(0), "gemm_parts_low: x has ", rows, " rows, the parts ",
              xhs[0].size(0));
  EXL3_CHECK(a.size(1) == k_dim, "gemm_parts_low: a has ", a.size(1), " columns, x ", k_dim);
  EXL3_CHECK(rank >= 1 && rank <= exl3::kGemmLoraMaxRank, "gemm_parts_low: rank ", rank,
              " outside 1..", exl3::kGemmLoraMaxRank);
  EXL3_CHECK(k_dim >= 8 && k_dim % 8 == 0 && x.stride(1) == 1 && x.stride(0) % 8 == 0 &&
                  x.stride(0) >= k_dim,
              "gemm_parts_low: K and x's row stride must be multiples of 8, unit column stride");
  EXL3_CHECK(a.is_contiguous() && low.is_contiguous() && low.size(0) == rows &&
                  low.size(1) == rank,
              "gemm_parts_low: a (rank, K) and low (rows, rank) contiguous");
  EXL3_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0,
              "gemm_parts_low: x and a must be 16-byte aligned");
  exl3::GemmLora lora{x.data_ptr(), x.stride(0), a.data_ptr(), low.data_ptr(), (int)k_dim,
                      (int)rank, dtype_code(x)};
  run_gemm_parts(xhs, trellises, k2, cb, partials, lora);
}

// Raises a RuntimeError in one of three ways (a device check of how refusals reach
// Python; test_gemm_lora.py runs each in a child process): 0 TORCH_CHECK with one
// literal, 1 TORCH_CHECK with formatted pieces (c10::str), 2 EXL3_CHECK with the same
// pieces (bindings_util.h).
void refusal_probe(int64_t kind) {
  const int64_t rank = 129;
  if (kind == 0) TORCH_CHECK(false, "refusal_probe: a literal");
  if (kind == 1) TORCH_CHECK(false, "refusal_probe: rank ", rank, " outside 1..", exl3::kGemmLoraMaxRank);
  EXL3_CHECK(false, "refusal_probe: rank ", rank, " outside 1..", exl3::kGemmLoraMaxRank);
}

void gemm_partial(const at::Tensor& xh, const at::Tensor& trellis, int64_t k2, int64_t cb,
                  at::Tensor& partial) {
  gemm_parts({xh}, {trellis}, k2, cb, {partial});
}

// x: (slices, rows, x_cols) with unit column stride; out: (rows, out_cols), unit column stride.
void hadamard(const at::Tensor& x, const c10::optional<at::Tensor>& pre,
              const c10::optional<at::Tensor>& post, const c10::optional<at::Tensor>& bias,
              at::Tensor& out, int64_t width) {
  check_cuda(x, "x");
  check_cuda(out, "out");
  EXL3_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be (slices, rows, cols), unit stride");
  EXL3_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(1),
              "out must be (rows, cols) with unit column stride");
  EXL3_CHECK(width % 128 == 0 && out.size(1) <= width && x.size(2) <= width,
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

// q/out: (B, H, D) half/bf16; k/v: pool storage (see exl3_ops.h); k_bits/v_bits 16 when
// the storage is the activation dtype (scales then unused).
void paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& k_scales,
                     const at::Tensor& v, const at::Tensor& v_scales, int64_t k_bits,
                     int64_t v_bits, const at::Tensor& page_table, const at::Tensor& lengths,
                     at::Tensor& out, int64_t page_size, int64_t kv_heads, int64_t window,
                     double softcap, double scale, const c10::optional<at::Tensor>& parts_acc,
                     const c10::optional<at::Tensor>& parts_ml) {
  check_contiguous(q, "q");
  check_contiguous(k, "k");
  check_contiguous(v, "v");
  check_contiguous(out, "out");
  check_contiguous(lengths, "lengths");
  check_cuda(page_table, "page_table");
  EXL3_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "q and out must be (B, H, D) of one dtype");
  EXL3_CHECK(page_table.scalar_type() == at::kLong && page_table.dim() == 2 &&
                  page_table.stride(1) == 1 && lengths.scalar_type() == at::kLong,
              "page_table (B, P) and lengths (B) must be int64");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  EXL3_CHECK(page_table.size(0) == batch && lengths.numel() == batch, "batch mismatch");
  const bool kq = k_bits < 16, vq = v_bits < 16;
  if (kq) {
    check_contiguous(k_scales, "k_scales");
    EXL3_CHECK(k.scalar_type() == at::kByte && k_scales.scalar_type() == at::kHalf &&
                    k.size(1) == kv_heads * dim / 8 * k_bits,
                "quantized keys: uint8 codes (slots, C/8*bits) and float16 scales");
  } else {
    EXL3_CHECK(k.scalar_type() == q.scalar_type() && k.dim() == 3 && k.size(1) == kv_heads &&
                    k.size(2) == dim, "keys must be (slots, kv_heads, D) in q's dtype");
  }
  if (vq) {
    check_contiguous(v_scales, "v_scales");
    EXL3_CHECK(v.scalar_type() == at::kByte && v_scales.scalar_type() == at::kHalf &&
                    v.size(1) == kv_heads * dim / 8 * v_bits,
                "quantized values: uint8 codes (slots, C/8*bits) and float16 scales");
  } else {
    EXL3_CHECK(v.scalar_type() == q.scalar_type() && v.dim() == 3 && v.size(1) == kv_heads &&
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
  // parts_acc/parts_ml given: the chunks' partial results stay there and the caller
  // combines them (layer_fold.cu combine_hadamard); with one chunk `out` is written.
  const bool caller_combines = parts_acc.has_value() || parts_ml.has_value();
  if (caller_combines) {
    EXL3_CHECK(parts_acc.has_value() && parts_ml.has_value(), "parts_acc and parts_ml come together");
    check_contiguous(*parts_acc, "parts_acc");
    check_contiguous(*parts_ml, "parts_ml");
    EXL3_CHECK(parts_acc->scalar_type() == at::kFloat && parts_ml->scalar_type() == at::kFloat &&
                    parts_acc->sizes() == at::IntArrayRef({batch, heads, chunks, dim}) &&
                    parts_ml->sizes() == at::IntArrayRef({batch, heads, chunks, 2}),
                "parts_acc (B, H, chunks, D) and parts_ml (B, H, chunks, 2) must be float32, "
                "chunks = pages * page_size / 64 rounded up");
    if (chunks > 1) {
      acc_ptr = parts_acc->data_ptr<float>();
      ml_ptr = parts_ml->data_ptr<float>();
    }
  } else if (chunks > 1) {
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
                   chunks, out.data_ptr(), stream, !caller_combines),
               "exl3 paged attention");
}

// x: (N, C) rows to quantize into codes/scales at `slots` (N) int64.
void kv_quant_write(const at::Tensor& x, const at::Tensor& slots, int64_t bits,
                    at::Tensor& codes, at::Tensor& scales) {
  check_cuda(x, "x");
  check_contiguous(slots, "slots");
  check_contiguous(codes, "codes");
  check_contiguous(scales, "scales");
  EXL3_CHECK(x.dim() == 2 && x.stride(1) == 1 && slots.scalar_type() == at::kLong &&
                  slots.numel() == x.size(0),
              "x must be (N, C) with unit column stride and slots (N) int64");
  const int64_t channels = x.size(1);
  EXL3_CHECK(codes.scalar_type() == at::kByte && codes.size(1) == channels / 8 * bits &&
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


}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "EXL3 CUDA kernels: trellis decode, fused decode+GEMM, 128-point Hadamard";
  m.def("decode", &decode, "trellis (kb, nb, 8*k2) int16 -> out (16kb, 16nb) float16",
        py::arg("trellis"), py::arg("k2"), py::arg("codebook"), py::arg("out"));
  m.def("decode_scaled", &decode_scaled, "decode, every value times a float16 scale tensor",
        py::arg("trellis"), py::arg("k2"), py::arg("codebook"), py::arg("out"),
        py::arg("scale"));
  m.def("gemm_partial", &gemm_partial,
        "xh (rows<=64, 16kb) float16 x decoded trellis -> partial (splits, rows, 16nb) float32",
        py::arg("xh"), py::arg("trellis"), py::arg("k2"), py::arg("codebook"),
        py::arg("partial"));
  m.def("gemm_parts", &gemm_parts,
        "gemm_partial for up to 4 parts (same rows, kb, K, codebook) in one launch",
        py::arg("xhs"), py::arg("trellises"), py::arg("k2"), py::arg("codebook"),
        py::arg("partials"));
  m.def("refusal_probe", &refusal_probe, "raise a RuntimeError (0 literal, 1 c10::str, 2 EXL3_CHECK)",
        py::arg("kind"));
  m.def("gemm_parts_low", &gemm_parts_low,
        "gemm_parts plus an adapted projection's low = x @ a^T in the same launch",
        py::arg("xhs"), py::arg("trellises"), py::arg("k2"), py::arg("codebook"),
        py::arg("partials"), py::arg("x"), py::arg("a"), py::arg("low"));
  exl3_bind::define_layer_ops(m);  // layer_bindings.cpp
  exl3_bind::define_moe_ops(m);    // moe_bindings.cpp
  m.def("gemm_variant", &exl3::gemm_variant,
        "the fused GEMM's build-time variant (EXL3_GEMM_VARIANT; 0 = default)");
  m.def("hadamard", &hadamard,
        "out = H128(sum_s x[s] * pre) * post + bias, per 128 columns over width",
        py::arg("x"), py::arg("pre"), py::arg("post"), py::arg("bias"), py::arg("out"),
        py::arg("width"));
  m.def("paged_attention", &paged_attention, "decode attention over a paged KV cache",
        py::arg("q"), py::arg("k"), py::arg("k_scales"), py::arg("v"), py::arg("v_scales"),
        py::arg("k_bits"), py::arg("v_bits"), py::arg("page_table"), py::arg("lengths"),
        py::arg("out"), py::arg("page_size"), py::arg("kv_heads"), py::arg("window"),
        py::arg("softcap"), py::arg("scale"), py::arg("parts_acc") = py::none(),
        py::arg("parts_ml") = py::none());
  m.def("kv_quant_write", &kv_quant_write, "quantize rows into a paged quantized KV cache",
        py::arg("x"), py::arg("slots"), py::arg("bits"), py::arg("codes"), py::arg("scales"));
}
