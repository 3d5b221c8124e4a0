// Plain launchers for the EXL3 CUDA kernels (raw pointers, no torch headers), so the
// .cu files compile fast and in parallel; bindings.cpp checks tensors and calls these.
// Each returns false for an unsupported (k2, codebook) pair; launch errors are left for
// the caller's cudaGetLastError check.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace exl3 {

// Element types of the Hadamard kernel's input and output.
enum DType : int { DT_HALF = 0, DT_BF16 = 1, DT_FLOAT = 2 };

// trellis: (kb, nb, 16*K) int16 -> out: (16*kb, 16*nb) float16, row-major; with `scale`
// (one float16 on the device, or null) every value times it, rounded once to float16.
bool launch_decode(const void* trellis, void* out, int kb, int nb, int k2, int cb,
                   cudaStream_t stream, const void* scale = nullptr);

// partial[s, r, n] = sum over the s-th run of input tiles of xh[r, k] * Ŵ[k, n].
// xh: (rows, 16*kb) float16; partial: (splits, rows, 16*nb) float32; rows <= 64.
// Up to kMaxParts parts with the same rows, kb, K and codebook run in one launch
// (q/k/v or gate/up: each its own xh, trellis, partial and nb).
constexpr int kMaxParts = 4;
struct GemmPart {
  const void* xh;
  const void* trellis;
  float* partial;
  int nb;
};
// The first LoRA product of an adapted projection run inside the same GEMM launch (its
// own blocks, beside the GEMM's, while the weights stream): low = x @ A^T rounded to
// dtype (DT_HALF or DT_BF16), x (rows, k_dim) with row stride x_stride, A (rank, k_dim)
// contiguous, low (rows, rank) contiguous; k_dim and x_stride multiples of 8, x and A
// 16-byte aligned, 1 <= rank <= kGemmLoraMaxRank. x == nullptr: no product.
constexpr int kGemmLoraMaxRank = 128;
struct GemmLora {
  const void* x;
  int64_t x_stride;
  const void* a;
  void* low;
  int k_dim;
  int rank;
  int dtype;
  int y0;  // set by the launcher: the grid rows from y0 on (at z = 0) make the product
};
struct GemmParts {
  GemmPart part[kMaxParts];
  int count;
  GemmLora lora;  // zero-initialised: none
};
// Whether `lora` is none or a product the GEMM launch takes (the launchers refuse others).
inline bool gemm_lora_ok(const GemmLora& lora) {
  if (lora.x == nullptr) return true;
  return lora.a != nullptr && lora.low != nullptr && (lora.dtype == DT_HALF ||
         lora.dtype == DT_BF16) && lora.rank >= 1 && lora.rank <= kGemmLoraMaxRank &&
         lora.k_dim >= 8 && lora.k_dim % 8 == 0 && lora.x_stride >= lora.k_dim &&
         lora.x_stride % 8 == 0 && reinterpret_cast<uintptr_t>(lora.x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(lora.a) % 16 == 0;
}
bool launch_gemm_mul1(const GemmParts& parts, int rows, int kb, int k2, int splits,
                      cudaStream_t stream);
bool launch_gemm_mcg(const GemmParts& parts, int rows, int kb, int k2, int splits,
                     cudaStream_t stream);
bool launch_gemm_3inst(const GemmParts& parts, int rows, int kb, int k2, int splits,
                       cudaStream_t stream);
// The fused GEMM with its own input side (gemm_pro.cuh, EXL3_LAYER_FOLD=pro): every block
// makes the float16 x of its run of tile rows in shared memory, bit for bit what
// launch_norm_hadamard (mode kProNorm) or launch_glu_hadamard (kProGlu) would write to
// the parts' xh (GemmPart.xh unused), then multiplies it. 1..kProMaxRows rows, no LoRA,
// no normed / product outputs, float32 partials in (glu). dtype: DT_HALF or DT_BF16.
constexpr int kProNorm = 0, kProGlu = 1, kProMaxRows = 8;
struct ProIn {
  int mode;
  int dtype;
  const float* pre[kMaxParts];  // suh of each part (glu: part 0's)
  // kProNorm: x (rows, x_cols) with row stride x_stride, norm_w float32 (x_cols) or null
  const void* x;
  int64_t x_stride;
  int x_cols;
  const float* norm_w;
  float eps;
  bool unit_offset;
  // kProGlu: gate/up float32 partials (g_splits, rows, 16 * kb), svh / bias of each or
  // null, inter logical columns, act 0 SiLU / 1 tanh-GELU
  const float* gate;
  const float* up;
  int g_splits;
  const float* post_gate;
  const float* post_up;
  const float* bias_gate;
  const float* bias_up;
  int inter;
  int act;
};
// false: not taken (a K, codebook, shape or row count it does not run; nothing launched).
bool launch_gemm_pro_mul1(const GemmParts& parts, const ProIn& in, int rows, int kb, int k2,
                          int splits, cudaStream_t stream);
bool launch_gemm_pro_mcg(const GemmParts& parts, const ProIn& in, int rows, int kb, int k2,
                         int splits, cudaStream_t stream);
bool launch_gemm_pro_3inst(const GemmParts& parts, const ProIn& in, int rows, int kb, int k2,
                           int splits, cudaStream_t stream);
// The fused GEMM's build-time variant (EXL3_GEMM_VARIANT, gemm_lean.cuh; default 4).
int gemm_variant();

// out[r, c] = (H128(sum_s x[s, r, :] * pre)[c]) * post[c] + bias[c] for c < out_cols,
// H128 applied per 128 columns over `width` columns (x columns >= x_cols read as 0).
// pre/post/bias may be null (float32, at least `width` entries).
bool launch_hadamard(int in_dtype, int out_dtype, const void* x, int64_t slice_stride,
                     int64_t row_stride, int nslices, int x_cols, int width, const float* pre,
                     const float* post, const float* bias, void* out, int64_t out_row_stride,
                     int out_cols, int rows, cudaStream_t stream);

// Decode attention over a paged KV cache (one query per row), see paged_attention.cu.
// q/out: (batch, heads, dim) in `dtype` (DT_HALF or DT_BF16); k/v: (slots, kv_heads, dim)
// in that dtype when k_bits/v_bits is 16, else bit-planed codes (slots, kv_heads*dim/8*bits)
// with float16 scales (slots, kv_heads*dim/32). page_table: (batch, pages) int64;
// lengths: (batch) int64 keys per row. part_acc (batch, heads, chunks, dim) and part_ml
// (batch, heads, chunks, 2) float32 are scratch when chunks > 1 (chunks * 64 positions
// must cover every row); dim 64, 128 or 256. window <= 0: none; softcap <= 0: none. False: unsupported shape.
bool launch_paged_attention(int dtype, const void* q, int batch, int heads, int kv_heads,
                            int dim, const void* k, const void* k_scales, int k_bits,
                            const void* v, const void* v_scales, int v_bits,
                            const int64_t* page_table, int pages, const int64_t* lengths,
                            int page_size, int window, float softcap, float scale,
                            float* part_acc, float* part_ml, int chunks, void* out,
                            cudaStream_t stream, bool combine = true);

// combine_hadamard (layer_fold.cu): the o projection's input side with the attention's
// chunk combine folded in. chunks > 1: a[r, c] = dtype(the combine of part_acc/part_ml
// (rows, heads, chunks, head_dim) / (.., 2) at head c / head_dim, as launch_paged_attention's
// second kernel makes it); chunks == 1: a = attended (rows, heads * head_dim) in dtype.
// out (rows, width) float16 = H128(a * pre), columns >= heads * head_dim zero.
// out_norm (layer_fold.cu): h (rows, cols; h_stride) = residual + dtype(H128(sum of the
// splits of partial (splits, rows, width)) * post + bias), as launch_hadamard_out with a
// residual, then outs[p] (rows, in_width) float16 = launch_norm_hadamard's outputs for h
// (norm_w float32 (cols), eps, unit_offset; pre[p] float32 (>= in_width)). counters:
// kOutNormMaxRows int32, zero before the first launch (the kernel leaves them zero).
constexpr int kOutNormMaxRows = 64;
constexpr int kOutNormMaxCols = 12288;  // h's row and the norm weight in shared memory (96 KB)
bool launch_out_norm(int dtype, const float* partial, int splits, int width, int cols,
                     const float* post, const float* bias, const void* residual,
                     int64_t residual_stride, void* h, int64_t h_stride, int rows,
                     const float* norm_w, float eps, bool unit_offset, int nparts,
                     const float* const* pre, void* const* out, int in_width, int* counters,
                     cudaStream_t stream);

bool launch_combine_hadamard(int dtype, const float* part_acc, const float* part_ml,
                             int chunks, const void* attended, int heads, int head_dim,
                             const float* pre, void* out, int rows, int width,
                             cudaStream_t stream);

// Quantize rows x (rows, channels; rows x_row_stride elements apart, unit channel stride)
// in `dtype` into a quantized cache at `slots`: codes
// (slots, channels/8*bits) uint8 bit-planes (bits == 8: one byte per channel), float16
// scales (slots, channels/32). Matches kv_quant.quantize_rows + pack_codes.
bool launch_kv_quant_write(int dtype, const void* x, int64_t x_row_stride,
                           const int64_t* slots, int rows,
                           int channels, int bits, void* codes, void* scales,
                           cudaStream_t stream);

// Fused decode-layer kernels (layer_fused.cu), rows <= 64, `dtype` the activations'.
//
// norm_hadamard: for each part p, out[p][r, :] = float16(H128(n(x[r]) * pre[p])) over
// `width` columns, n = RMSNorm with float32 weight norm_w (rounded to dtype as
// engine/layers/norm.py does; unit_offset: one rounding after the weight) or, with norm_w null,
// the identity. x: (rows, x_cols) with row stride; out[p]: (rows, width) contiguous.
// normed (optional): n(x) in dtype, (rows, x_cols) with normed_stride (a LoRA's input).
bool launch_norm_hadamard(int dtype, const void* x, int64_t row_stride, int x_cols,
                          int width, const float* norm_w, float eps, bool unit_offset,
                          int nparts, const float* const* pre, void* const* out, int rows,
                          void* normed, int64_t normed_stride, cudaStream_t stream);

// lora_low (lora_low.cu): low = x @ A^T rounded to dtype, x (rows, k_dim) with row stride
// x_stride, A (rank, k_dim) contiguous, low (rows, rank) contiguous; rows <= 64, rank
// <= 128, k_dim and x_stride multiples of 8, k_dim <= 32768. partial: float32 workspace
// of kLoraLowMaxSplits * rows * rank; ticket: one unsigned, 0 between launches (the
// kernel leaves it 0). Launches on one stream may share both. False: shape not taken.
constexpr int kLoraLowMaxSplits = 16, kLoraLowMaxRank = 128, kLoraLowMaxRows = 64;
bool launch_lora_low(int dtype, const void* x, int64_t x_stride, const void* a, int k_dim,
                     int rank, int rows, float* partial, unsigned* ticket, void* low,
                     cudaStream_t stream);

// A LoRA update for the rows of one output-kernel launch (engine/adapters/lora.py): row r
// of the part whose columns start at `offset` in bt gains, rounded to dtype,
//   delta[r, c] = sum over k with columns[k] == slots[r] of low[r, k] * bt[k, offset + c]
// (no update where slots[r] == 0), added to the part's rounded y = H128(...) * post + bias
// before rotary, the activation or the residual. low = x_in @ A^T: (rows, rank) in dtype;
// bt = B^T: (rank, sum of the parts' columns) in dtype; columns (rank,) and slots (rows,)
// the adapter slot of each rank column and row. low == nullptr: no update.
struct LowRank {
  const void* low;
  int64_t low_stride;
  const void* bt;
  int64_t bt_stride;
  const int64_t* columns;
  const int64_t* slots;
  int rank;
};

// hadamard_out: for each part, y = H128(sum of its splits) * post + bias rounded to
// dtype; columns below rope_cols rotated per head (rotate-half, cos/sin (rows, head_dim)
// in dtype; head_dim 64 or 128); plus residual (rows, *) when given; written to out
// (rows, out_cols) with out_row_stride. With lora.low set, each part's y gains its LoRA
// delta (columns from lora_offset of bt) right after the bias, before rotary/residual.
struct OutPart {
  const void* partial;  // (splits, rows, width) float32, or (1, rows, width) float16 (half)
  int splits;
  int width;
  const float* post;
  const float* bias;
  void* out;
  int64_t out_row_stride;
  int out_cols;
  int rope_cols;
  int lora_offset;  // first column of this part in LowRank::bt
  bool half;        // partial is float16, one split (a prompt's cuBLAS sums)
};
struct OutParts {
  OutPart part[kMaxParts];
  int count;
};
// KvStore (optional, keys null: none): the output kernel also stores a decode step's new
// keys and values in a float16/bfloat16 page pool (slots, row_stride elements per slot,
// the outputs' dtype): part p's columns [k_lo[p], k_hi[p]) of row r go to
// keys[slots[r] * row_stride + c - k_lo[p]], [v_lo[p], v_hi[p]) to values likewise, the
// same bits as the output (after rotary; no residual then). Empty ranges: lo = hi = 0.
struct KvStore {
  void* keys;
  void* values;
  const int64_t* slots;
  int64_t row_stride;
  int k_lo[kMaxParts], k_hi[kMaxParts], v_lo[kMaxParts], v_hi[kMaxParts];
};
bool launch_hadamard_out(int dtype, const OutParts& parts, int rows, const void* residual,
                         int64_t residual_stride, const void* cos, const void* sin,
                         int head_dim, const LowRank& lora, cudaStream_t stream,
                         const KvStore& kv = KvStore{});

// glu_hadamard: gate and up partials (splits, rows, width) -> their outputs as
// hadamard_out computes them (with lora.low set: plus their LoRA deltas, gate at bt
// columns [0, inter), up at [inter, 2 inter)), a = act(gate) * up (act 0: SiLU, 1: GELU
// tanh; columns >= inter are 0), then out = float16(H128(a * pre)) (rows, width): the
// next (down) projection's rotated input. product (optional): a in dtype, (rows, inter)
// with product_stride (the down projection's LoRA input).
// half: gate/up are float16 (1, rows, width) (a prompt's cuBLAS sums), else float32.
bool launch_glu_hadamard(int dtype, const void* gate, const void* up, int splits,
                         int width, const float* post_gate, const float* post_up,
                         const float* bias_gate, const float* bias_up, int inter, int act,
                         const float* pre, void* out, int rows, const LowRank& lora,
                         void* product, int64_t product_stride, cudaStream_t stream,
                         bool half = false);

// qk_norm_rope (qk_norm_rope.cu): in place on x (rows, heads * head_dim; row stride, unit
// column stride), per head h: RMSNorm with weight[h, :] (float32, (heads, head_dim)) as
// engine/layers/norm.py computes it for a 2-D weight, then, with cos/sin (rows, head_dim)
// in dtype, rotate-half rotary as ops/reference.py's apply_rotary. head_dim 64, 128, 256.
bool launch_qk_norm_rope(int dtype, void* x, int64_t row_stride, int heads, int head_dim,
                         int rows, const float* weight, float eps, const void* cos,
                         const void* sin, cudaStream_t stream);

// Mixture-of-experts decode (moe_decode.cu, moe_gemm_*.cu): the chosen experts of up to
// 64 rows without any host synchronisation (fixed shapes; the top-k ids never leave the
// device), reading only the chosen experts' weights. P = rows * top_k (token, expert)
// pairs; A = min(experts, P) expert slots. The plan (int32, moe_plan_words(P, A)) is
// [active count | slot_pair[P] | pair_slot[P] | slot_expert[P] | act_expert[A] |
// act_offset[A] | act_rows[A]]: pairs sorted by expert ("slots"; the order within an
// expert is arbitrary, each row's result does not depend on it), the experts that
// received pairs, where their slots start and how many there are.
inline int moe_plan_words(int pairs, int slots) { return 1 + 3 * pairs + 3 * slots; }

// chosen (P) int64 expert ids (clamped to 0..experts-1) -> plan. experts <= 1024.
bool launch_moe_route(const int64_t* chosen, int pairs, int experts, int* plan,
                      cudaStream_t stream);

// The router's softmax top-k (engine/layers/moe.py Router, scoring "softmax", no score
// bias or groups) fused with moe_route: logits (rows, experts <= 256) in dtype with row
// stride -> weights (rows, top_k) float32 (renormalised when `normalize`, times scale),
// chosen (rows, top_k) int64 and the plan. Ties go to the lower expert.
bool launch_moe_route_logits(int dtype, const void* logits, int64_t logit_stride, int rows,
                             int top_k, int experts, bool normalize, float scale,
                             float* weights, int64_t* chosen, int* plan, cudaStream_t stream);

// For each slot q (pair p = slot_pair[q], row p / top_k, expert e = slot_expert[q]) and
// part j: out[j][q, :] = float16(H128(x[row, :] * pre[j][e, :])) over `width` columns
// (x columns >= x_cols read as 0); pre[j]: (experts, width) float32.
bool launch_moe_in(int dtype, const void* x, int64_t row_stride, int x_cols, int width,
                   int top_k, const int* plan, int pairs, int nparts,
                   const float* const* pre, void* const* out, cudaStream_t stream);

// partial[j][s, q, n] = sum over the s-th run of tile rows of xh[j][q, k] * Ŵ_e[k, n] with
// e = slot_expert[q] and Ŵ_e the trellis at trellis[j][e] (a device array of pointers,
// (kb, nb[j], 16*K) int16 each). Up to 2 parts (gate, up) of the same kb, K and codebook.
// max_rows bounds the rows of one expert (the batch rows, <= 64): one launch per class of
// experts by rows (1-8, 9-32, 33-64) that max_rows reaches (moe_gemm_impl.cuh).
constexpr int kMoeMaxParts = 2;
struct MoeGemmPart {
  const int64_t* trellis;  // (experts,) device pointers
  const void* xh;          // (P, 16*kb) float16
  float* partial;          // (splits, P, 16*nb) float32
  int nb;
};
struct MoeGemmParts {
  MoeGemmPart part[kMoeMaxParts];
  int count;
};
// With `combine` (one part, max_rows <= 8; may be null) the GEMM also does moe_out's work:
// the last warp to finish a 128-column block of the output (a counter per block,
// combine->counters[width / 128], 0 before the first launch and set back to 0 by that
// warp) sums the splits of every pair, H128, * post[e], * weights, sums each row's
// experts and writes out (+ residual) as launch_moe_out rounds them.
struct MoeCombine {
  int* counters;          // [width / 128] int32
  const float* post;      // (experts, width) float32: the down projection's svh
  const float* weights;   // (rows, top_k) float32
  int top_k, rows, out_cols, dtype;
  void* out;              // (rows, out_cols) in dtype, row stride out_stride
  int64_t out_stride;
  const void* residual;   // (rows, out_cols) in dtype, row stride res_stride, or null
  int64_t res_stride;
};
bool launch_moe_gemm_mul1(const MoeGemmParts& parts, const int* plan, int pairs, int slots,
                          int max_rows, int kb, int k2, int splits, const MoeCombine* combine,
                          cudaStream_t stream);
bool launch_moe_gemm_mcg(const MoeGemmParts& parts, const int* plan, int pairs, int slots,
                         int max_rows, int kb, int k2, int splits, const MoeCombine* combine,
                         cudaStream_t stream);
bool launch_moe_gemm_3inst(const MoeGemmParts& parts, const int* plan, int pairs, int slots,
                           int max_rows, int kb, int k2, int splits, const MoeCombine* combine,
                           cudaStream_t stream);

// Per slot q (expert e): g, u = H128(split sums of gate/up) * post_gate/post_up[e] rounded
// to dtype, a = act(g) * u as glu_hadamard rounds it (0 at columns >= inter, the padding),
// out[q] = float16(H128(a * pre[e])) (the down projection's rotated input). post_*, pre:
// (experts, width) float32.
bool launch_moe_glu(int dtype, const float* gate, const float* up, int splits, int width,
                    int inter, const float* post_gate, const float* post_up, int act,
                    const float* pre,
                    const int* plan, int pairs, void* out, cudaStream_t stream);

// out[r, c] (c < out_cols, row stride out_row_stride, dtype) = sum over j < top_k of
// round(round(y_q[c]) * round(weights[r*top_k + j])) with q = pair_slot[r*top_k + j],
// y_q = H128(split sums of partial[:, q]) * post[e_q] (post: (experts, width) float32;
// weights float32), summed in float32 and rounded once; with a residual (rows, row stride
// res_row_stride, dtype; may be null) that rounded sum + residual[r, c], rounded again.
bool launch_moe_out(int dtype, const float* partial, int splits, int width, const float* post,
                    const float* weights, int top_k, const int* plan, int pairs, int rows,
                    void* out, int64_t out_row_stride, int out_cols, const void* residual,
                    int64_t res_row_stride, cudaStream_t stream);

// RMSNorm + the router's linear + softmax top-k (+ renormalise, scale) + the plan in one
// launch (moe_norm_route.cu), for up to 64 rows: normed[r] = norm(x[r]) * norm_w as
// engine/layers/norm.py RMSNorm rounds it (dtype; unit_offset: Gemma's float32 scale),
// logits[r, e] = dtype(normed[r] . router_w[e]) as float32 (router_w (experts <= 256,
// hidden) contiguous in dtype, no bias), then weights/chosen/plan as
// launch_moe_route_logits. `counter` (one int32, 0 before the first launch) counts the
// finished blocks; the last one routes and sets it back to 0. hidden % 8 == 0.
bool launch_moe_norm_route(int dtype, const void* x, int64_t row_stride, int rows,
                           int hidden, const float* norm_w, float eps, bool unit_offset,
                           const void* router_w, int experts, int top_k, bool normalize,
                           float scale, void* normed, float* logits, float* weights,
                           int64_t* chosen, int* plan, int* counter, cudaStream_t stream);

}  // namespace exl3
