// Shared pieces of the fused CPU decode ops: decode_ops.cpp defines the elementwise ops
// and attention, decode_layer.cpp chains them with the packed GEMV (gemv_cpu.h).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <tuple>

namespace exl3_cpu {

constexpr int kLanes = 16;

// Sums kept in 16 lanes so gcc vectorises them without fast-math (each lane adds in
// order; the lanes are added at the end).
inline float lane_dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float lane_dot(const float* a, const uint16_t* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * bf16_to_float(b[i + j]);
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * bf16_to_float(b[i]);
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

void check_float_rows(const at::Tensor& t, const char* what);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r,
                                                const at::Tensor& w, double eps);
at::Tensor& rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads);
at::Tensor silu_mul(const at::Tensor& gu);
// q [B, H, D] over a paged (k, v [slots, KV, D], slots [B, S]) or contiguous cache.
at::Tensor attend_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const c10::optional<at::Tensor>& slots,
                         const c10::optional<at::Tensor>& lengths, int64_t window);

}  // namespace exl3_cpu
