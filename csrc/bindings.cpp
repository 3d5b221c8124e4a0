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

void gemm_partial(const at::Tensor& xh, const at::Tensor& trellis, int64_t k2, int64_t cb,
                  at::Tensor& partial) {
  check_trellis(trellis, (int)k2);
  const int kb = (int)trellis.size(0), nb = (int)trellis.size(1);
  check_cuda(xh, "xh");
  TORCH_CHECK(xh.scalar_type() == at::kHalf && xh.is_contiguous() && xh.dim() == 2 &&
                  xh.size(1) == 16 * kb,
              "xh must be contiguous float16 (rows, 16*kb)");
  const int rows = (int)xh.size(0);
  TORCH_CHECK(rows >= 1 && rows <= 32, "fused GEMM takes 1..32 rows, got ", rows);
  check_cuda(partial, "partial");
  TORCH_CHECK(partial.scalar_type() == at::kFloat && partial.is_contiguous() &&
                  partial.dim() == 3 && partial.size(1) == rows && partial.size(2) == 16 * nb,
              "partial must be contiguous float32 (splits, rows, 16*nb)");
  const int splits = (int)partial.size(0);
  TORCH_CHECK(splits >= 1 && splits <= kb, "splits must be in 1..kb");
  const c10::cuda::CUDAGuard guard(xh.device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  bool ok = false;
  if (cb == 2) ok = exl3::launch_gemm_mul1(xh.data_ptr(), trellis.data_ptr(),
                                           partial.data_ptr<float>(), rows, kb, nb, (int)k2,
                                           splits, stream);
  else if (cb == 1) ok = exl3::launch_gemm_mcg(xh.data_ptr(), trellis.data_ptr(),
                                               partial.data_ptr<float>(), rows, kb, nb, (int)k2,
                                               splits, stream);
  else if (cb == 0) ok = exl3::launch_gemm_3inst(xh.data_ptr(), trellis.data_ptr(),
                                                 partial.data_ptr<float>(), rows, kb, nb,
                                                 (int)k2, splits, stream);
  check_launch(ok, "exl3 gemm");
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "EXL3 CUDA kernels: trellis decode, fused decode+GEMM, 128-point Hadamard";
  m.def("decode", &decode, "trellis (kb, nb, 8*k2) int16 -> out (16kb, 16nb) float16",
        py::arg("trellis"), py::arg("k2"), py::arg("codebook"), py::arg("out"));
  m.def("gemm_partial", &gemm_partial,
        "xh (rows<=32, 16kb) float16 x decoded trellis -> partial (splits, rows, 16nb) float32",
        py::arg("xh"), py::arg("trellis"), py::arg("k2"), py::arg("codebook"),
        py::arg("partial"));
  m.def("hadamard", &hadamard,
        "out = H128(sum_s x[s] * pre) * post + bias, per 128 columns over width",
        py::arg("x"), py::arg("pre"), py::arg("post"), py::arg("bias"), py::arg("out"),
        py::arg("width"));
}
