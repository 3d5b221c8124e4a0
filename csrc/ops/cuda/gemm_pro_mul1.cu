// The fused GEMM with its own input side (gemm_pro.cuh), mul1 codebook, K = 2..6.
#include "gemm_pro.cuh"

#define EXL3_PRO_CASE_mul1(K2_) \
  case K2_:                    \
    return gemm::pro::dispatch<K2_, CB_MUL1>(parts, in, rows, kb, splits, stream);

EXL3_DEFINE_PRO_LAUNCHER(mul1, CB_MUL1)
