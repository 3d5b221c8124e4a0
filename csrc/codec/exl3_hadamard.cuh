// The in-warp 128-point Hadamard butterfly shared by the Hadamard kernels
// (EXL3-FORMAT.md 4): lane l holds columns 4l..4l+3 of one 128-column block. Strides 1
// and 2 stay inside a lane; strides 4..64 pair lanes l and l^(stride/4). Unnormalised:
// multiply by kHadamardScale (1/sqrt(128)) for the orthonormal transform.
#pragma once

namespace exl3 {

constexpr float kHadamardScale = 0.08838834764831845f;  // 1 / sqrt(128)

__device__ __forceinline__ void hadamard128_warp(float (&v)[4], int lane) {
  const float t0 = v[0] + v[1], t1 = v[0] - v[1], t2 = v[2] + v[3], t3 = v[2] - v[3];
  v[0] = t0 + t2;
  v[2] = t0 - t2;
  v[1] = t1 + t3;
  v[3] = t1 - t3;
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const float p = __shfl_xor_sync(0xffffffffu, v[e], m);
      v[e] = upper ? p - v[e] : v[e] + p;
    }
  }
}

}  // namespace exl3
