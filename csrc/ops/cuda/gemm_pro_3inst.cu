// The fused GEMM with its own input side (gemm_pro.cuh), 3inst codebook, K = 2..6.
#include "gemm_pro.cuh"

#define EXL3_PRO_CASE_3inst(K2_) \
  case K2_:                    \
    return gemm::pro::dispatch<K2_, CB_3INST>(parts, in, rows, kb, splits, stream);

EXL3_DEFINE_PRO_LAUNCHER(3inst, CB_3INST)
