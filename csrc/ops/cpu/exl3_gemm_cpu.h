// The EXL3 CPU linear of exl3_gemm_cpu.cpp, for the ops that chain it (exl3_layer_cpu.cpp).
#pragma once

#include <ATen/ATen.h>

namespace exl3_cpu {

// y [M, n] = svh * H(H(x * suh) @ Ŵ) + bias, Ŵ decoded from trellis_t (nb, kb, words).
at::Tensor exl3_linear(const at::Tensor& x, const at::Tensor& trellis_t, const at::Tensor& suh,
                       const at::Tensor& svh, const c10::optional<at::Tensor>& bias,
                       double k_bits, int64_t codebook, int64_t n,
                       const c10::optional<at::Tensor>& lut);

}  // namespace exl3_cpu
