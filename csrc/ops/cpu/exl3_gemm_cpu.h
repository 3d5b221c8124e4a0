// The EXL3 CPU linear of exl3_gemm_cpu.cpp, for the ops that chain it (exl3_layer_cpu.cpp).
#pragma once

#include <ATen/ATen.h>

namespace exl3_cpu {

// y [M, n] = svh * H(H(x * suh) @ Ŵ) + bias, Ŵ decoded from trellis_t (nb, kb, words).
at::Tensor exl3_linear(const at::Tensor& x, const at::Tensor& trellis_t, const at::Tensor& suh,
                       const at::Tensor& svh, const c10::optional<at::Tensor>& bias,
                       double k_bits, int64_t codebook, int64_t n,
                       const c10::optional<at::Tensor>& lut);

// One part of a projection whose parts share an input (q|k|v, gate|up): bias may be null.
struct Exl3Part {
  const at::Tensor* trellis_t;
  const at::Tensor* suh;
  const at::Tensor* svh;
  const at::Tensor* bias;
  double k_bits;
  int64_t n;
};

// [exl3_linear(x, part) for each part] side by side, [M, sum of n]: decode rows (M <= 8)
// run every part's product in one parallel region; the same values as part by part.
at::Tensor exl3_linear_parts(const at::Tensor& x, const Exl3Part* parts, int64_t count,
                             int64_t codebook, const c10::optional<at::Tensor>& lut);

}  // namespace exl3_cpu
