// Indexed expert GEMM of the mixture-of-experts decode, mcg codebook.
#include "moe_gemm_impl.cuh"

#define EXL3_MOE_GEMM_CASE_mcg(K2_)                                                     \
  case K2_:                                                                             \
    gemm::run_moe_gemm<K2_, CB_MCG>(parts, plan, pairs, slots, max_rows, kb, splits, \
                                     combine, stream); \
    return true;
#define EXL3_MOE_MCG_K2(X) EXL3_FOR_INTEGER_K2(X)

EXL3_DEFINE_MOE_GEMM_LAUNCHER(mcg, CB_MCG, EXL3_MOE_MCG_K2)
