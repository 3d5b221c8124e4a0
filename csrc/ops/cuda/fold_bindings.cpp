// Torch bindings of the decode layer's folds (layer_fold.cu, exl3_ops.h): combine_hadamard
// and out_norm (ops/layer_fold.py; the cache-store fold rides on hadamard_out).
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
}

}  // namespace exl3_bind
