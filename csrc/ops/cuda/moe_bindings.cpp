// Torch bindings of the mixture-of-experts decode kernels (moe_decode.cu, moe_gemm_*.cu;
// exl3_ops.h "Mixture-of-experts decode"). Every op writes into caller-provided tensors,
// runs on the current CUDA stream and raises on bad arguments or launch errors.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "bindings_util.h"
#include "exl3_ops.h"

namespace exl3_bind {
namespace {

cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

// pairs P from the plan's length: 1 + 3P + 3 min(experts, P) words.
int64_t plan_pairs(const at::Tensor& plan, int64_t pairs) {
  check_contiguous(plan, "plan");
  EXL3_CHECK(plan.scalar_type() == at::kInt, "plan must be int32");
  return pairs;
}

void check_table(const at::Tensor& t, int64_t width, const char* name) {
  check_contiguous(t, name);
  EXL3_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(1) == width, name,
              " must be contiguous float32 (experts, ", width, ")");
}

void moe_route(const at::Tensor& chosen, int64_t experts, at::Tensor& plan) {
  check_contiguous(chosen, "chosen");
  EXL3_CHECK(chosen.scalar_type() == at::kLong, "chosen must be int64");
  const int64_t pairs = chosen.numel();
  const int64_t slots = std::min(experts, pairs);
  plan_pairs(plan, pairs);
  EXL3_CHECK(plan.numel() == exl3::moe_plan_words((int)pairs, (int)slots),
              "plan must hold 1 + 3 * pairs + 3 * min(experts, pairs) int32");
  const c10::cuda::CUDAGuard guard(chosen.device());
  check_launch(exl3::launch_moe_route(chosen.data_ptr<int64_t>(), (int)pairs, (int)experts,
                                      plan.data_ptr<int>(), stream_of(chosen)),
               "exl3 moe route");
}

void moe_route_logits(const at::Tensor& logits, int64_t top_k, bool normalize, double scale,
                      at::Tensor& weights, at::Tensor& chosen, at::Tensor& plan) {
  check_cuda(logits, "logits");
  EXL3_CHECK(logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be (rows, experts), unit column stride");
  const int64_t rows = logits.size(0), experts = logits.size(1), pairs = rows * top_k;
  check_contiguous(weights, "weights");
  check_contiguous(chosen, "chosen");
  EXL3_CHECK(weights.scalar_type() == at::kFloat && weights.numel() == pairs,
              "weights must be contiguous float32 (rows, top_k)");
  EXL3_CHECK(chosen.scalar_type() == at::kLong && chosen.numel() == pairs,
              "chosen must be contiguous int64 (rows, top_k)");
  plan_pairs(plan, pairs);
  EXL3_CHECK(plan.numel() == exl3::moe_plan_words((int)pairs, (int)std::min(experts, pairs)),
              "plan must hold 1 + 3 * pairs + 3 * min(experts, pairs) int32");
  const c10::cuda::CUDAGuard guard(logits.device());
  check_launch(exl3::launch_moe_route_logits(dtype_code(logits), logits.data_ptr(),
                                             logits.stride(0), (int)rows, (int)top_k,
                                             (int)experts, normalize, (float)scale,
                                             weights.data_ptr<float>(),
                                             chosen.data_ptr<int64_t>(), plan.data_ptr<int>(),
                                             stream_of(logits)),
               "exl3 moe route (logits)");
}

void moe_in(const at::Tensor& x, const at::Tensor& plan, int64_t top_k,
            const std::vector<at::Tensor>& pres, const std::vector<at::Tensor>& outs) {
  check_cuda(x, "x");
  EXL3_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be (rows, cols), unit column stride");
  const size_t n = pres.size();
  EXL3_CHECK(n >= 1 && n <= (size_t)exl3::kMoeMaxParts && outs.size() == n,
              "1..2 parts, one pre and out each");
  const int64_t pairs = x.size(0) * top_k;
  plan_pairs(plan, pairs);
  const int64_t width = outs[0].size(1);
  const float* pre[exl3::kMoeMaxParts] = {};
  void* out[exl3::kMoeMaxParts] = {};
  for (size_t p = 0; p < n; p++) {
    check_table(pres[p], width, "pre");
    check_contiguous(outs[p], "out");
    EXL3_CHECK(outs[p].scalar_type() == at::kHalf && outs[p].dim() == 2 &&
                    outs[p].size(0) == pairs && outs[p].size(1) == width,
                "out must be contiguous float16 (rows * top_k, width)");
    pre[p] = pres[p].data_ptr<float>();
    out[p] = outs[p].data_ptr();
  }
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(exl3::launch_moe_in(dtype_code(x), x.data_ptr(), x.stride(0), (int)x.size(1),
                                   (int)width, (int)top_k, plan.data_ptr<int>(), (int)pairs,
                                   (int)n, pre, out, stream_of(x)),
               "exl3 moe in");
}

void gemm_launch(const at::Tensor& plan, const std::vector<at::Tensor>& trellis_ptrs,
                 const std::vector<at::Tensor>& xhs, const std::vector<at::Tensor>& partials,
                 const std::vector<int64_t>& nbs, int64_t kb, int64_t k2, int64_t cb,
                 int64_t max_rows, int64_t slots, const exl3::MoeCombine* combine) {
  const size_t n = xhs.size();
  EXL3_CHECK(n >= 1 && n <= (size_t)exl3::kMoeMaxParts && trellis_ptrs.size() == n &&
                  partials.size() == n && nbs.size() == n,
              "1..2 parts, one trellis table, xh, partial and nb each");
  const int64_t pairs = xhs[0].size(0);
  plan_pairs(plan, pairs);
  const int64_t splits = partials[0].size(0);
  exl3::MoeGemmParts parts{};
  parts.count = (int)n;
  for (size_t p = 0; p < n; p++) {
    check_contiguous(trellis_ptrs[p], "trellis_ptrs");
    check_contiguous(xhs[p], "xh");
    check_contiguous(partials[p], "partial");
    EXL3_CHECK(trellis_ptrs[p].scalar_type() == at::kLong && trellis_ptrs[p].dim() == 1,
                "trellis_ptrs must be int64 (experts,)");
    EXL3_CHECK(xhs[p].scalar_type() == at::kHalf && xhs[p].dim() == 2 &&
                    xhs[p].size(0) == pairs && xhs[p].size(1) == 16 * kb,
                "xh must be contiguous float16 (pairs, 16*kb)");
    EXL3_CHECK(partials[p].scalar_type() == at::kFloat && partials[p].dim() == 3 &&
                    partials[p].size(0) == splits && partials[p].size(1) == pairs &&
                    partials[p].size(2) == 16 * nbs[p],
                "partial must be contiguous float32 (splits, pairs, 16*nb)");
    parts.part[p] = exl3::MoeGemmPart{trellis_ptrs[p].data_ptr<int64_t>(), xhs[p].data_ptr(),
                                      partials[p].data_ptr<float>(), (int)nbs[p]};
  }
  EXL3_CHECK(splits >= 1 && splits <= kb, "splits must be in 1..kb");
  EXL3_CHECK(slots >= 1 && slots <= pairs, "slots must be in 1..pairs");
  const c10::cuda::CUDAGuard guard(xhs[0].device());
  auto stream = stream_of(xhs[0]);
  bool ok = false;
  const int* pl = plan.data_ptr<int>();
  if (cb == 2)
    ok = exl3::launch_moe_gemm_mul1(parts, pl, (int)pairs, (int)slots, (int)max_rows, (int)kb,
                                    (int)k2, (int)splits, combine, stream);
  else if (cb == 1)
    ok = exl3::launch_moe_gemm_mcg(parts, pl, (int)pairs, (int)slots, (int)max_rows, (int)kb,
                                   (int)k2, (int)splits, combine, stream);
  else if (cb == 0)
    ok = exl3::launch_moe_gemm_3inst(parts, pl, (int)pairs, (int)slots, (int)max_rows,
                                     (int)kb, (int)k2, (int)splits, combine, stream);
  check_launch(ok, "exl3 moe gemm");
}

void moe_gemm(const at::Tensor& plan, const std::vector<at::Tensor>& trellis_ptrs,
              const std::vector<at::Tensor>& xhs, const std::vector<at::Tensor>& partials,
              const std::vector<int64_t>& nbs, int64_t kb, int64_t k2, int64_t cb,
              int64_t max_rows, int64_t slots) {
  gemm_launch(plan, trellis_ptrs, xhs, partials, nbs, kb, k2, cb, max_rows, slots, nullptr);
}

// The down projection's GEMM with moe_out's work at its end (exl3_ops.h MoeCombine):
// out (rows, cols) [+ residual] from partial's splits, post, weights and the plan.
void moe_gemm_combine(const at::Tensor& plan, const at::Tensor& trellis_ptrs,
                      const at::Tensor& xh, const at::Tensor& partial, int64_t nb, int64_t kb,
                      int64_t k2, int64_t cb, int64_t slots, const at::Tensor& post,
                      const at::Tensor& weights, int64_t top_k, at::Tensor& out,
                      const c10::optional<at::Tensor>& residual, at::Tensor& counters) {
  const int64_t width = 16 * nb, pairs = xh.size(0), rows = out.size(0);
  check_table(post, width, "post");
  check_contiguous(weights, "weights");
  check_contiguous(counters, "counters");
  check_cuda(out, "out");
  EXL3_CHECK(weights.scalar_type() == at::kFloat && weights.numel() == pairs,
              "weights must be float32 (rows, top_k)");
  EXL3_CHECK(out.dim() == 2 && out.stride(1) == 1 && rows * top_k == pairs && rows <= 8,
              "out must be (rows <= 8, cols), unit column stride, rows * top_k == pairs");
  EXL3_CHECK(counters.scalar_type() == at::kInt && counters.numel() >= width / 128,
              "counters must hold width / 128 int32");
  exl3::MoeCombine combine{};
  combine.counters = counters.data_ptr<int>();
  combine.post = post.data_ptr<float>();
  combine.weights = weights.data_ptr<float>();
  combine.top_k = (int)top_k;
  combine.rows = (int)rows;
  combine.out_cols = (int)out.size(1);
  combine.dtype = dtype_code(out);
  combine.out = out.data_ptr();
  combine.out_stride = out.stride(0);
  if (residual.has_value()) {
    check_cuda(*residual, "residual");
    EXL3_CHECK(residual->scalar_type() == out.scalar_type() && residual->dim() == 2 &&
                    residual->stride(1) == 1 && residual->size(0) == rows &&
                    residual->size(1) == out.size(1),
                "residual must be (rows, cols) of out's dtype, unit column stride");
    combine.residual = residual->data_ptr();
    combine.res_stride = residual->stride(0);
  }
  gemm_launch(plan, {trellis_ptrs}, {xh}, {partial}, {nb}, kb, k2, cb, rows, slots, &combine);
}

void moe_glu(const at::Tensor& gate, const at::Tensor& up, int64_t inter,
             const at::Tensor& post_gate, const at::Tensor& post_up, int64_t act, const at::Tensor& pre,
             const at::Tensor& plan, at::Tensor& out, int64_t dtype) {
  check_contiguous(gate, "gate");
  check_contiguous(up, "up");
  check_contiguous(out, "out");
  EXL3_CHECK(gate.scalar_type() == at::kFloat && gate.dim() == 3 && up.sizes() == gate.sizes() &&
                  up.scalar_type() == at::kFloat,
              "gate and up must be float32 (splits, pairs, width) of one shape");
  const int64_t pairs = gate.size(1), width = gate.size(2);
  plan_pairs(plan, pairs);
  for (const auto* t : {&post_gate, &post_up, &pre}) check_table(*t, width, "post/pre");
  EXL3_CHECK(out.scalar_type() == at::kHalf && out.dim() == 2 && out.size(0) == pairs &&
                  out.size(1) == width, "out must be contiguous float16 (pairs, width)");
  const c10::cuda::CUDAGuard guard(gate.device());
  check_launch(exl3::launch_moe_glu((int)dtype, gate.data_ptr<float>(), up.data_ptr<float>(),
                                    (int)gate.size(0), (int)width, (int)inter, post_gate.data_ptr<float>(),
                                    post_up.data_ptr<float>(), (int)act, pre.data_ptr<float>(),
                                    plan.data_ptr<int>(), (int)pairs, out.data_ptr(),
                                    stream_of(gate)),
               "exl3 moe glu");
}

void moe_out(const at::Tensor& partial, const at::Tensor& post, const at::Tensor& weights,
             const at::Tensor& plan, int64_t top_k, at::Tensor& out,
             const c10::optional<at::Tensor>& residual) {
  check_contiguous(partial, "partial");
  check_contiguous(weights, "weights");
  check_cuda(out, "out");
  EXL3_CHECK(partial.scalar_type() == at::kFloat && partial.dim() == 3,
              "partial must be float32 (splits, pairs, width)");
  const int64_t pairs = partial.size(1), width = partial.size(2);
  plan_pairs(plan, pairs);
  check_table(post, width, "post");
  EXL3_CHECK(weights.scalar_type() == at::kFloat && weights.numel() == pairs,
              "weights must be float32 (rows, top_k)");
  EXL3_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) * top_k == pairs,
              "out must be (rows, cols), unit column stride, rows * top_k == pairs");
  const void* res = nullptr;
  int64_t res_stride = 0;
  if (residual.has_value()) {
    check_cuda(*residual, "residual");
    EXL3_CHECK(residual->scalar_type() == out.scalar_type() && residual->dim() == 2 &&
                    residual->stride(1) == 1 && residual->size(0) == out.size(0) &&
                    residual->size(1) == out.size(1),
                "residual must be (rows, cols) of out's dtype, unit column stride");
    res = residual->data_ptr();
    res_stride = residual->stride(0);
  }
  const c10::cuda::CUDAGuard guard(partial.device());
  check_launch(exl3::launch_moe_out(dtype_code(out), partial.data_ptr<float>(),
                                    (int)partial.size(0), (int)width, post.data_ptr<float>(),
                                    weights.data_ptr<float>(), (int)top_k,
                                    plan.data_ptr<int>(), (int)pairs, (int)out.size(0),
                                    out.data_ptr(), out.stride(0), (int)out.size(1), res,
                                    res_stride, stream_of(partial)),
               "exl3 moe out");
}

void moe_norm_route(const at::Tensor& x, const at::Tensor& norm_w, double eps, bool unit_offset,
                    const at::Tensor& router_w, int64_t top_k, bool normalize, double scale,
                    at::Tensor& normed, at::Tensor& logits, at::Tensor& weights,
                    at::Tensor& chosen, at::Tensor& plan, at::Tensor& counter) {
  check_cuda(x, "x");
  EXL3_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be (rows, hidden), unit column stride");
  const int64_t rows = x.size(0), hidden = x.size(1);
  check_contiguous(router_w, "router_w");
  EXL3_CHECK(router_w.dim() == 2 && router_w.size(1) == hidden &&
                  router_w.scalar_type() == x.scalar_type(),
              "router_w must be contiguous (experts, hidden) in x's dtype");
  EXL3_CHECK(reinterpret_cast<uintptr_t>(router_w.data_ptr()) % 16 == 0,
              "router_w must be 16-byte aligned");
  const int64_t experts = router_w.size(0), pairs = rows * top_k;
  check_contiguous(norm_w, "norm_w");
  EXL3_CHECK(norm_w.scalar_type() == at::kFloat && norm_w.numel() == hidden,
              "norm_w must be contiguous float32 (hidden,)");
  for (const auto* t : {&normed, &logits, &weights, &chosen, &counter})
    check_contiguous(*t, "outputs");
  EXL3_CHECK(normed.scalar_type() == x.scalar_type() && normed.numel() == rows * hidden,
              "normed must be contiguous (rows, hidden) in x's dtype");
  EXL3_CHECK(logits.scalar_type() == at::kFloat && logits.numel() == rows * experts,
              "logits must be contiguous float32 (rows, experts)");
  EXL3_CHECK(weights.scalar_type() == at::kFloat && weights.numel() == pairs,
              "weights must be contiguous float32 (rows, top_k)");
  EXL3_CHECK(chosen.scalar_type() == at::kLong && chosen.numel() == pairs,
              "chosen must be contiguous int64 (rows, top_k)");
  EXL3_CHECK(counter.scalar_type() == at::kInt && counter.numel() == 1,
              "counter must be one int32");
  plan_pairs(plan, pairs);
  EXL3_CHECK(plan.numel() == exl3::moe_plan_words((int)pairs, (int)std::min(experts, pairs)),
              "plan must hold 1 + 3 * pairs + 3 * min(experts, pairs) int32");
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(exl3::launch_moe_norm_route(
                   dtype_code(x), x.data_ptr(), x.stride(0), (int)rows, (int)hidden,
                   norm_w.data_ptr<float>(), (float)eps, unit_offset, router_w.data_ptr(),
                   (int)experts, (int)top_k, normalize, (float)scale, normed.data_ptr(),
                   logits.data_ptr<float>(), weights.data_ptr<float>(),
                   chosen.data_ptr<int64_t>(), plan.data_ptr<int>(), counter.data_ptr<int>(),
                   stream_of(x)),
               "exl3 moe norm route");
}

}  // namespace

void define_moe_ops(pybind11::module_& m) {
  m.def("moe_route", &moe_route, "top-k expert ids (rows, k) int64 -> the routing plan",
        py::arg("chosen"), py::arg("experts"), py::arg("plan"));
  m.def("moe_route_logits", &moe_route_logits,
        "router softmax + top-k (+ renormalise, scale) fused with moe_route",
        py::arg("logits"), py::arg("top_k"), py::arg("normalize"), py::arg("scale"),
        py::arg("weights"), py::arg("chosen"), py::arg("plan"));
  m.def("moe_in", &moe_in, "x * suh[e] + input Hadamard per (slot, part)", py::arg("x"),
        py::arg("plan"), py::arg("top_k"), py::arg("pres"), py::arg("outs"));
  m.def("moe_gemm", &moe_gemm, "indexed expert GEMM over the plan's active experts",
        py::arg("plan"), py::arg("trellis_ptrs"), py::arg("xhs"), py::arg("partials"),
        py::arg("nbs"), py::arg("kb"), py::arg("k2"), py::arg("codebook"), py::arg("max_rows"),
        py::arg("slots"));
  m.def("moe_gemm_combine", &moe_gemm_combine,
        "the down projection's indexed GEMM with moe_out's weighted sum (+ residual) at its end",
        py::arg("plan"), py::arg("trellis_ptrs"), py::arg("xh"), py::arg("partial"),
        py::arg("nb"), py::arg("kb"), py::arg("k2"), py::arg("codebook"), py::arg("slots"),
        py::arg("post"), py::arg("weights"), py::arg("top_k"), py::arg("out"),
        py::arg("residual"), py::arg("counters"));
  m.def("moe_glu", &moe_glu, "gate/up outputs, act(g) * u, the down projection's input side",
        py::arg("gate"), py::arg("up"), py::arg("inter"), py::arg("post_gate"), py::arg("post_up"),
        py::arg("act"), py::arg("pre"), py::arg("plan"), py::arg("out"), py::arg("dtype"));
  m.def("moe_out", &moe_out, "down outputs times the routing weights, summed per row",
        py::arg("partial"), py::arg("post"), py::arg("weights"), py::arg("plan"),
        py::arg("top_k"), py::arg("out"), py::arg("residual") = py::none());
  m.def("moe_norm_route", &moe_norm_route,
        "RMSNorm + router linear + softmax top-k + the routing plan in one launch",
        py::arg("x"), py::arg("norm_w"), py::arg("eps"), py::arg("unit_offset"),
        py::arg("router_w"), py::arg("top_k"), py::arg("normalize"), py::arg("scale"),
        py::arg("normed"), py::arg("logits"), py::arg("weights"), py::arg("chosen"),
        py::arg("plan"), py::arg("counter"));
}

}  // namespace exl3_bind
