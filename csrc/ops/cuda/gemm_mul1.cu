// Fused decode + GEMM, mul1 codebook (integer and half-integer K).
#include "gemm_impl.cuh"

#define EXL3_GEMM_CASE_mul1(K2_)                                                        \
  case K2_:                                                                             \
    gemm::run_gemm<K2_, CB_MUL1>(parts, rows, kb, splits, stream);   \
    return true;
#define EXL3_MUL1_K2(X) EXL3_FOR_INTEGER_K2(X) EXL3_FOR_HALF_K2(X)

EXL3_DEFINE_GEMM_LAUNCHER(mul1, CB_MUL1, EXL3_MUL1_K2)

// Which build-time variant of the fused GEMM this extension runs (gemm_lean.cuh).
namespace exl3 {
int gemm_variant() { return EXL3_GEMM_VARIANT; }
}  // namespace exl3
