// Fused decode + GEMM, 3inst codebook (integer K).
#include "gemm_impl.cuh"

#define EXL3_GEMM_CASE_3inst(K2_)                                                       \
  case K2_:                                                                             \
    gemm::run_gemm<K2_, CB_3INST>(parts, rows, kb, splits, stream);  \
    return true;

EXL3_DEFINE_GEMM_LAUNCHER(3inst, CB_3INST, EXL3_FOR_INTEGER_K2)
