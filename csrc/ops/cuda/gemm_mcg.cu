// Fused decode + GEMM, mcg codebook (integer K).
#include "gemm_impl.cuh"

#define EXL3_GEMM_CASE_mcg(K2_)                                                         \
  case K2_:                                                                             \
    gemm::run_gemm<K2_, CB_MCG>(parts, rows, kb, splits, stream);    \
    return true;

EXL3_DEFINE_GEMM_LAUNCHER(mcg, CB_MCG, EXL3_FOR_INTEGER_K2)
