// The fused GEMM with its own input side (gemm_pro.cuh), mcg codebook, K = 2..6.
#include "gemm_pro.cuh"

#define EXL3_PRO_CASE_mcg(K2_) \
  case K2_:                    \
    return gemm::pro::dispatch<K2_, CB_MCG>(parts, in, rows, kb, splits, stream);

EXL3_DEFINE_PRO_LAUNCHER(mcg, CB_MCG)
