// Shared by the torch bindings (bindings.cpp, layer_bindings.cpp): tensor checks and the
// launch check; define_layer_ops adds the fused decode-layer ops to the module.
#pragma once

#include <torch/extension.h>

#include <string>
#include <type_traits>

#include "exl3_ops.h"

namespace exl3_bind {

// Refusals of the bindings: EXL3_CHECK(cond, pieces...) raises a RuntimeError whose
// message is the pieces (strings, integers, floats, dtypes) joined here with std::string
// and std::to_string, then handed to TORCH_CHECK as one plain string. TORCH_CHECK with
// several pieces formats them with c10::str (an ostringstream in this library) and
// throws through torchCheckFail's std::string overload: on the H200 (runs 26, 30 and the
// issue-16 run) the refusals of that kind seen ended the process with SIGSEGV, while
// those with a single literal reached Python (refusal_probe, bench/diag/refusal_paths.py,
// tells the two paths apart on a device).
namespace detail {
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, double v) { s += std::to_string(v); }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void append(std::string& s, T v) {
  s += std::to_string(v);
}
}  // namespace detail

template <typename... Args>
[[noreturn]] inline void refuse(const Args&... args) {
  std::string message;
  (detail::append(message, args), ...);
  const char* text = message.c_str();
  TORCH_CHECK(false, text);
  __builtin_unreachable();
}

}  // namespace exl3_bind

#define EXL3_CHECK(cond, ...)                                      \
  do {                                                             \
    if (C10_UNLIKELY(!(cond))) ::exl3_bind::refuse(__VA_ARGS__);   \
  } while (0)

namespace exl3_bind {

inline void check_cuda(const at::Tensor& t, const char* name) {
  EXL3_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
}

inline void check_launch(bool ok, const char* what) {
  EXL3_CHECK(ok, what, ": unsupported arguments (bits/codebook/shape)");
  const cudaError_t err = cudaGetLastError();
  EXL3_CHECK(err == cudaSuccess, what, ": ", cudaGetErrorString(err));
}

inline int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return exl3::DT_HALF;
    case at::kBFloat16: return exl3::DT_BF16;
    case at::kFloat: return exl3::DT_FLOAT;
    default: EXL3_CHECK(false, "unsupported dtype ", t.scalar_type());
  }
  return -1;
}

inline const float* optional_vector(const c10::optional<at::Tensor>& t, int64_t width,
                                    const char* name) {
  if (!t.has_value()) return nullptr;
  check_cuda(*t, name);
  EXL3_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() >= width,
              name, " must be contiguous float32 with at least ", width, " entries");
  return t->data_ptr<float>();
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  check_cuda(t, name);
  EXL3_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// The fused decode-layer ops (layer_bindings.cpp).
void define_layer_ops(pybind11::module_& m);
// The mixture-of-experts decode ops (moe_bindings.cpp).
void define_moe_ops(pybind11::module_& m);

}  // namespace exl3_bind
