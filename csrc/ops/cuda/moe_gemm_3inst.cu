// Indexed expert GEMM of the mixture-of-experts decode, 3inst codebook.
#include "moe_gemm_impl.cuh"

#define EXL3_MOE_GEMM_CASE_3inst(K2_)                                                     \
  case K2_:                                                                             \
    gemm::run_moe_gemm<K2_, CB_3INST>(parts, plan, pairs, slots, max_rows, kb, splits, \
                                     combine, stream); \
    return true;
#define EXL3_MOE_3INST_K2(X) EXL3_FOR_INTEGER_K2(X)

EXL3_DEFINE_MOE_GEMM_LAUNCHER(3inst, CB_3INST, EXL3_MOE_3INST_K2)
