// Indexed expert GEMM of the mixture-of-experts decode, mul1 codebook.
#include "moe_gemm_impl.cuh"

#define EXL3_MOE_GEMM_CASE_mul1(K2_)                                                     \
  case K2_:                                                                             \
    gemm::run_moe_gemm<K2_, CB_MUL1>(parts, plan, pairs, slots, max_rows, kb, splits, \
                                     combine, stream); \
    return true;
#define EXL3_MOE_MUL1_K2(X) EXL3_FOR_INTEGER_K2(X) EXL3_FOR_HALF_K2(X)

EXL3_DEFINE_MOE_GEMM_LAUNCHER(mul1, CB_MUL1, EXL3_MOE_MUL1_K2)
