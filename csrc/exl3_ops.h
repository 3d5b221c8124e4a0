// Plain launchers for the EXL3 CUDA kernels (raw pointers, no torch headers), so the
// .cu files compile fast and in parallel; bindings.cpp checks tensors and calls these.
// Each returns false for an unsupported (k2, codebook) pair; launch errors are left for
// the caller's cudaGetLastError check.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace exl3 {

// Element types of the Hadamard kernel's input and output.
enum DType : int { DT_HALF = 0, DT_BF16 = 1, DT_FLOAT = 2 };

// trellis: (kb, nb, 16*K) int16 -> out: (16*kb, 16*nb) float16, row-major.
bool launch_decode(const void* trellis, void* out, int kb, int nb, int k2, int cb,
                   cudaStream_t stream);

// partial[s, r, n] = sum over the s-th run of input tiles of xh[r, k] * Ŵ[k, n].
// xh: (rows, 16*kb) float16; partial: (splits, rows, 16*nb) float32; rows <= 32.
bool launch_gemm_mul1(const void* xh, const void* trellis, float* partial, int rows, int kb,
                      int nb, int k2, int splits, cudaStream_t stream);
bool launch_gemm_mcg(const void* xh, const void* trellis, float* partial, int rows, int kb,
                     int nb, int k2, int splits, cudaStream_t stream);
bool launch_gemm_3inst(const void* xh, const void* trellis, float* partial, int rows, int kb,
                       int nb, int k2, int splits, cudaStream_t stream);

// out[r, c] = (H128(sum_s x[s, r, :] * pre)[c]) * post[c] + bias[c] for c < out_cols,
// H128 applied per 128 columns over `width` columns (x columns >= x_cols read as 0).
// pre/post/bias may be null (float32, at least `width` entries).
bool launch_hadamard(int in_dtype, int out_dtype, const void* x, int64_t slice_stride,
                     int64_t row_stride, int nslices, int x_cols, int width, const float* pre,
                     const float* post, const float* bias, void* out, int64_t out_row_stride,
                     int out_cols, int rows, cudaStream_t stream);

}  // namespace exl3
