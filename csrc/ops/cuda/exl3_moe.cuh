// The routing plan of the mixture-of-experts decode kernels (exl3_ops.h,
// "Mixture-of-experts decode"): one int32 buffer, viewed here.
#pragma once

namespace exl3 {

struct MoePlan {
  int* active;       // [1] experts that received pairs
  int* slot_pair;    // [P] the pair (row * top_k + j) at each sorted slot
  int* pair_slot;    // [P] inverse of slot_pair
  int* slot_expert;  // [P] the expert of each slot
  int* act_expert;   // [A] the active experts, ascending
  int* act_offset;   // [A] their first slot
  int* act_rows;     // [A] their slot counts
};

// `slots` (A) places the act_* arrays; kernels that read only the first four arrays may
// pass 0.
__host__ __device__ inline MoePlan moe_plan(int* plan, int pairs, int slots) {
  MoePlan v;
  v.active = plan;
  v.slot_pair = plan + 1;
  v.pair_slot = v.slot_pair + pairs;
  v.slot_expert = v.pair_slot + pairs;
  v.act_expert = v.slot_expert + pairs;
  v.act_offset = v.act_expert + slots;
  v.act_rows = v.act_offset + slots;
  return v;
}

}  // namespace exl3
