// Shared by the torch bindings (bindings.cpp, layer_bindings.cpp): tensor checks and the
// launch check; define_layer_ops adds the fused decode-layer ops to the module.
#pragma once

#include <torch/extension.h>

#include "exl3_ops.h"

namespace exl3_bind {

inline void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
}

inline void check_launch(bool ok, const char* what) {
  TORCH_CHECK(ok, what, ": unsupported arguments (bits/codebook/shape)");
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, what, ": ", cudaGetErrorString(err));
}

inline int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return exl3::DT_HALF;
    case at::kBFloat16: return exl3::DT_BF16;
    case at::kFloat: return exl3::DT_FLOAT;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type());
  }
  return -1;
}

inline const float* optional_vector(const c10::optional<at::Tensor>& t, int64_t width,
                                    const char* name) {
  if (!t.has_value()) return nullptr;
  check_cuda(*t, name);
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() >= width,
              name, " must be contiguous float32 with at least ", width, " entries");
  return t->data_ptr<float>();
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// The fused decode-layer ops (layer_bindings.cpp).
void define_layer_ops(pybind11::module_& m);
// The mixture-of-experts decode ops (moe_bindings.cpp).
void define_moe_ops(pybind11::module_& m);

}  // namespace exl3_bind
