// The packed decode GEMV of gemv_cpu.cpp, for other CPU ops that chain it (decode_ops.cpp).
#pragma once

#include <ATen/ATen.h>

namespace exl3_cpu {

// y (M, n) = x (M, K) @ W over the first n columns of the blocked W (ceil(n/32), K, 32),
// float32/bfloat16/int8 (int8 with per-column scale), plus bias; float32.
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale,
                const c10::optional<at::Tensor>& bias, int64_t n);

}  // namespace exl3_cpu
