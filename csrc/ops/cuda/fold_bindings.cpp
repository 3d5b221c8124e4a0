// Torch bindings of the decode layer's folds (layer_fold.cu, exl3_ops.h): combine_hadamard
// and out_norm (ops/layer_fold.py; the cache-store fold rides on hadamard_out), and the
// GEMMs that make their own input (gemm_pro.cuh; ops/gemm_pro.py): gemm_norm, gemm_glu.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "bindings_util.h"
#include "exl3_ops.h"

namespace exl3_bind {
namespace {

using OptTensor = c10::optional<at::Tensor>;

// part_acc/part_ml: (rows, heads, chunks, head_dim) / (.., 2) float32 (chunks > 1) or
// attended (rows, heads * head_dim) contiguous in dtype (code); out (rows, width) float16.
void combine_hadamard(const at::Tensor& part_acc, const at::Tensor& part_ml,
                      const at::Tensor& attended, const at::Tensor& pre, at::Tensor& out,
                      int64_t dtype) {
  check_contiguous(out, "out");
  EXL3_CHECK(out.scalar_type() == at::kHalf && out.dim() == 2, "out must be float16 (rows, width)");
  const int64_t rows = out.size(0), width = out.size(1);
  EXL3_CHECK(part_acc.dim() == 4 && part_acc.size(0) == rows && part_ml.dim() == 4 &&
                  part_ml.sizes() == at::IntArrayRef({rows, part_acc.size(1), part_acc.size(2), 2}),
              "part_acc (rows, heads, chunks, head_dim) and part_ml (.., 2)");
  const int64_t heads = part_acc.size(1), chunks = part_acc.size(2), dim = part_acc.size(3);
  check_contiguous(part_acc, "part_acc");
  check_contiguous(part_ml, "part_ml");
  EXL3_CHECK(part_acc.scalar_type() == at::kFloat && part_ml.scalar_type() == at::kFloat,
              "part_acc and part_ml must be float32");
  check_contiguous(attended, "attended");
  EXL3_CHECK(dtype_code(attended) == (int)dtype && attended.dim() == 2 &&
                  attended.size(0) == rows && attended.size(1) == heads * dim,
              "attended must be (rows, heads * head_dim) in dtype");
  const float* pre_ptr = optional_vector(pre, width, "pre");
  const c10::cuda::CUDAGuard guard(out.device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  check_launch(exl3::launch_combine_hadamard(
                   (int)dtype, part_acc.data_ptr<float>(), part_ml.data_ptr<float>(),
                   (int)chunks, attended.data_ptr(), (int)heads, (int)dim, pre_ptr,
                   out.data_ptr(), (int)rows, (int)width, stream),
               "exl3 combine hadamard");
}

// partial (splits, rows, width) float32; residual and h (rows, cols) in one dtype, unit
// column stride; norm_weight float32 (cols); pres float32 (>= in_width); outs (rows,
// in_width) float16 contiguous; counters int32 (>= 64) contiguous, zero.
void out_norm(const at::Tensor& partial, const OptTensor& post, const OptTensor& bias,
              const at::Tensor& residual, at::Tensor& h, const at::Tensor& norm_weight,
              double eps, bool unit_offset, const std::vector<at::Tensor>& pres,
              const std::vector<at::Tensor>& outs, int64_t in_width, at::Tensor& counters) {
  check_contiguous(partial, "partial");
  EXL3_CHECK(partial.scalar_type() == at::kFloat && partial.dim() == 3,
              "partial must be float32 (splits, rows, width)");
  const int64_t rows = partial.size(1), width = partial.size(2), cols = h.size(1);
  const at::Tensor* rows_args[] = {&residual, &h};
  for (const at::Tensor* t : rows_args) {
    check_cuda(*t, "residual/h");
    EXL3_CHECK(t->dim() == 2 && t->size(0) == rows && t->size(1) == cols && t->stride(1) == 1 &&
                    t->scalar_type() == h.scalar_type(),
                "residual and h must be (rows, cols) of one dtype, unit column stride");
  }
  check_contiguous(counters, "counters");
  EXL3_CHECK(counters.scalar_type() == at::kInt && counters.numel() >= exl3::kOutNormMaxRows,
              "counters must be int32 (>= 64)");
  const size_t n = pres.size();
  EXL3_CHECK(n >= 1 && n <= (size_t)exl3::kMaxParts && outs.size() == n, "1..4 parts");
  const float* pre_ptr[exl3::kMaxParts] = {};
  void* out_ptr[exl3::kMaxParts] = {};
  for (size_t p = 0; p < n; p++) {
    pre_ptr[p] = optional_vector(pres[p], in_width, "pre");
    check_contiguous(outs[p], "out");
    EXL3_CHECK(outs[p].scalar_type() == at::kHalf && outs[p].dim() == 2 &&
                    outs[p].size(0) == rows && outs[p].size(1) == in_width,
                "outs must be contiguous float16 (rows, in_width)");
    out_ptr[p] = outs[p].data_ptr();
  }
  const c10::cuda::CUDAGuard guard(h.device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  check_launch(exl3::launch_out_norm(
                   dtype_code(h), partial.data_ptr<float>(), (int)partial.size(0), (int)width,
                   (int)cols, optional_vector(post, width, "post"),
                   optional_vector(bias, cols, "bias"), residual.data_ptr(), residual.stride(0),
                   h.data_ptr(), h.stride(0), (int)rows, optional_vector(norm_weight, cols, "norm_weight"),
                   (float)eps, unit_offset, (int)n, pre_ptr, out_ptr, (int)in_width,
                   counters.data_ptr<int>(), stream),
               "exl3 out norm");
}

// The parts' trellises (kb, nb, 8*k2) int16 and float32 partials (splits, rows, 16*nb),
// one device, one kb; `parts` filled (xh unused). Returns (kb, splits).
std::pair<int, int> pro_parts(const std::vector<at::Tensor>& trellises, int64_t k2,
                              const std::vector<at::Tensor>& partials, int64_t rows,
                              exl3::GemmParts& parts) {
  const size_t n = trellises.size();
  EXL3_CHECK(n >= 1 && n <= (size_t)exl3::kMaxParts && partials.size() == n,
             "1..4 parts, one trellis and partial each");
  parts.count = (int)n;
  int kb = -1, splits = -1;
  for (size_t p = 0; p < n; p++) {
    const at::Tensor& t = trellises[p];
    const at::Tensor& partial = partials[p];
    check_contiguous(t, "trellis");
    check_contiguous(partial, "partial");
    EXL3_CHECK(t.scalar_type() == at::kShort && t.dim() == 3 && t.size(2) == 8 * k2 &&
                   reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
               "trellis must be 16-byte aligned int16 (kb, nb, 8*k2)");
    if (p == 0) {
      kb = (int)t.size(0);
      splits = (int)partial.size(0);
    }
    EXL3_CHECK(t.size(0) == kb && t.device() == trellises[0].device() &&
                   partial.device() == t.device(), "parts must share kb and the device");
    EXL3_CHECK(partial.scalar_type() == at::kFloat && partial.dim() == 3 &&
                   partial.size(0) == splits && partial.size(1) == rows &&
                   partial.size(2) == 16 * t.size(1),
               "partial must be float32 (splits, rows, 16*nb)");
    parts.part[p] = exl3::GemmPart{nullptr, t.data_ptr(), partial.data_ptr<float>(),
                                   (int)t.size(1)};
  }
  return {kb, splits};
}

bool launch_pro(int64_t cb, const exl3::GemmParts& parts, const exl3::ProIn& in, int rows,
                int kb, int64_t k2, int splits, const at::Tensor& on) {
  const c10::cuda::CUDAGuard guard(on.device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  bool ok = false;
  if (cb == 2) ok = exl3::launch_gemm_pro_mul1(parts, in, rows, kb, (int)k2, splits, stream);
  else if (cb == 1) ok = exl3::launch_gemm_pro_mcg(parts, in, rows, kb, (int)k2, splits, stream);
  else if (cb == 0) ok = exl3::launch_gemm_pro_3inst(parts, in, rows, kb, (int)k2, splits, stream);
  if (ok) check_launch(true, "exl3 gemm pro");
  return ok;
}

// partials[p] = norm_hadamard(x, ...)[p] @ W_p in one launch (False: not taken, nothing
// launched). x (rows, cols) float16/bfloat16, unit column stride; pres float32 (>= 16*kb).
bool gemm_norm(const at::Tensor& x, const OptTensor& norm_weight, double eps, bool unit_offset,
               const std::vector<at::Tensor>& pres, const std::vector<at::Tensor>& trellises,
               int64_t k2, int64_t cb, const std::vector<at::Tensor>& partials) {
  check_cuda(x, "x");
  EXL3_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be (rows, cols), unit column stride");
  EXL3_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
             "x must be float16 or bfloat16");
  exl3::GemmParts parts{};
  const auto [kb, splits] = pro_parts(trellises, k2, partials, x.size(0), parts);
  EXL3_CHECK(x.device() == trellises[0].device(), "x on the parts' device");
  EXL3_CHECK(pres.size() == trellises.size(), "one pre per part");
  exl3::ProIn in{};
  in.mode = exl3::kProNorm;
  in.dtype = dtype_code(x);
  for (size_t p = 0; p < pres.size(); p++) in.pre[p] = optional_vector(pres[p], 16 * kb, "pre");
  in.x = x.data_ptr();
  in.x_stride = x.stride(0);
  in.x_cols = (int)x.size(1);
  in.norm_w = optional_vector(norm_weight, x.size(1), "norm_weight");
  in.eps = (float)eps;
  in.unit_offset = unit_offset;
  return launch_pro(cb, parts, in, (int)x.size(0), kb, k2, splits, x);
}

// partial = glu_hadamard(gate, up, ...) @ W in one launch (False: not taken). gate/up
// float32 (g_splits, rows, 16*kb) contiguous; dtype the activation dtype's code.
bool gemm_glu(const at::Tensor& gate, const at::Tensor& up, const OptTensor& post_gate,
              const OptTensor& post_up, const OptTensor& bias_gate, const OptTensor& bias_up,
              int64_t inter, int64_t act, const at::Tensor& pre, int64_t dtype,
              const at::Tensor& trellis, int64_t k2, int64_t cb, const at::Tensor& partial) {
  check_contiguous(gate, "gate");
  check_contiguous(up, "up");
  EXL3_CHECK(gate.scalar_type() == at::kFloat && gate.dim() == 3 && up.sizes() == gate.sizes() &&
                 up.scalar_type() == at::kFloat,
             "gate and up must be float32 (splits, rows, width) of one shape");
  exl3::GemmParts parts{};
  const auto [kb, splits] = pro_parts({trellis}, k2, {partial}, gate.size(1), parts);
  const int64_t width = gate.size(2);
  EXL3_CHECK(width == 16 * kb, "gate/up width ", width, " must be the trellis input ", 16 * kb);
  EXL3_CHECK(gate.device() == trellis.device() && up.device() == gate.device(),
             "gate/up on the trellis' device");
  exl3::ProIn in{};
  in.mode = exl3::kProGlu;
  in.dtype = (int)dtype;
  in.pre[0] = optional_vector(pre, width, "pre");
  in.gate = gate.data_ptr<float>();
  in.up = up.data_ptr<float>();
  in.g_splits = (int)gate.size(0);
  in.post_gate = optional_vector(post_gate, width, "post_gate");
  in.post_up = optional_vector(post_up, width, "post_up");
  in.bias_gate = optional_vector(bias_gate, inter, "bias_gate");
  in.bias_up = optional_vector(bias_up, inter, "bias_up");
  in.inter = (int)inter;
  in.act = (int)act;
  return launch_pro(cb, parts, in, (int)gate.size(1), kb, k2, splits, gate);
}

}  // namespace

void define_fold_ops(pybind11::module_& m) {
  m.def("out_norm", &out_norm,
        "the o projection's output side + residual, then RMSNorm + suh + H128 of the next input",
        py::arg("partial"), py::arg("post"), py::arg("bias"), py::arg("residual"), py::arg("h"),
        py::arg("norm_weight"), py::arg("eps"), py::arg("unit_offset"), py::arg("pres"),
        py::arg("outs"), py::arg("in_width"), py::arg("counters"));
  m.def("combine_hadamard", &combine_hadamard,
        "the attention's chunk combine, then the o projection's suh + input Hadamard",
        py::arg("part_acc"), py::arg("part_ml"), py::arg("attended"), py::arg("pre"),
        py::arg("out"), py::arg("dtype"));
  m.def("gemm_norm", &gemm_norm,
        "RMSNorm + suh + H128 of x made inside the parts' fused GEMM (False: not taken)",
        py::arg("x"), py::arg("norm_weight"), py::arg("eps"), py::arg("unit_offset"),
        py::arg("pres"), py::arg("trellises"), py::arg("k2"), py::arg("cb"), py::arg("partials"));
  m.def("gemm_glu", &gemm_glu,
        "act(gate) * up + suh + H128 made inside the down projection's GEMM (False: not taken)",
        py::arg("gate"), py::arg("up"), py::arg("post_gate"), py::arg("post_up"),
        py::arg("bias_gate"), py::arg("bias_up"), py::arg("inter"), py::arg("act"), py::arg("pre"),
        py::arg("dtype"), py::arg("trellis"), py::arg("k2"), py::arg("cb"), py::arg("partial"));
}

}  // namespace exl3_bind
