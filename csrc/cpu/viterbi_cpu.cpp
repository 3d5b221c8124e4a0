// Tail-biting Viterbi search for EXL3 trellis tiles on the CPU (EXL3-FORMAT.md 3, 5).
//
// Same algorithm and the same float arithmetic as the PyTorch reference
// (exl3cli/engine/quant/viterbi.py), so both return the same states:
//   cost of state s at step i   C_i[s] = fma(-2 t_i, lut[s], lut[s]^2) + M_i[s >> k_i]
//   node cost entering step i+1 M_{i+1}[j] = min_h C_i[(h << (16 - k_{i+1})) | j]
// (lut[s]^2 is exact: a float16 value has 11 significant bits). The 65536 state costs
// are never stored: each step computes the next node costs straight from the LUT and
// the previous node costs, so the working set is the LUT (512 KB with the squares)
// plus a few KB of node costs. Every step's node costs are kept (they are the
// history the trace-back re-derives its choices from, as the reference does).
// Ties go to the lowest index everywhere, like torch's argmin.
//
// Parallel over tiles with at::parallel_for (OpenMP in torch's CPU builds), so the
// caller's torch.set_num_threads applies and no second OpenMP runtime is loaded.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int kSteps = 256;
constexpr int kStates = 65536;
constexpr int kPad = 16;  // floats after each node array: SIMD loads may run past it
constexpr float kInf = std::numeric_limits<float>::infinity();

struct Tables {
  const float* lut;
  const float* lut_sq;
};

inline float state_cost(const Tables& tb, float m2t, int s, const float* mprev, int kp) {
  return std::fma(m2t, tb.lut[s], tb.lut_sq[s]) + mprev[s >> kp];
}

// A few vector operations per instruction set; the node-cost loop below is written
// once against them. Lanes is the vector width in floats (1: plain C++).
#if defined(__AVX512F__)
struct Vec {
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr const char* kName = "avx512";
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  // Lane i gets m[i >> kp] (kp < 4): a 16-float load then a permute.
  static V spread(const float* m, int kp) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_permutexvar_ps(_mm512_srlv_epi32(lane, _mm512_set1_epi32(kp)), load(m));
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec {
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr const char* kName = "avx2";
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V spread(const float* m, int kp) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_permutevar8x32_ps(load(m), _mm256_srlv_epi32(lane, _mm256_set1_epi32(kp)));
  }
};
#else
struct Vec {
  using V = float;
  static constexpr int kLanes = 1;
  static constexpr const char* kName = "scalar";
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V fma(V a, V b, V c) { return std::fma(a, b, c); }
  static V add(V a, V b) { return a + b; }
  static V min(V a, V b) { return b < a ? b : a; }
  static V spread(const float* m, int) { return *m; }
};
#endif

// For G tiles at once (sharing the LUT loads): mout[g][j] = min over h < 2^k of
// C_g[(h << (16 - k)) | j], C_g from mprev[g] (indexed by s >> kp) and m2t[g] = -2 t.
// kBroadcast: 2^kp >= lanes, so one vector of states shares one previous node.
template <int G, bool kBroadcast>
void node_costs(const Tables& tb, const float* m2t, const float* const* mprev, int kp, int k,
                float* const* mout) {
  using V = Vec::V;
  constexpr int L = Vec::kLanes, kVecs = 8, kBlock = kVecs * L;
  const int nodes = 1 << (16 - k), heads = 1 << k;
  V vm2t[G];
  for (int g = 0; g < G; ++g) vm2t[g] = Vec::set1(m2t[g]);
  for (int j0 = 0; j0 < nodes; j0 += kBlock) {
    V acc[G][kVecs];
    for (int g = 0; g < G; ++g)
      for (int v = 0; v < kVecs; ++v) acc[g][v] = Vec::set1(kInf);
    for (int h = 0; h < heads; ++h) {
      const int s0 = (h << (16 - k)) | j0;
      for (int v = 0; v < kVecs; ++v) {
        const int s = s0 + v * L;
        const V l = Vec::load(tb.lut + s);
        const V sq = Vec::load(tb.lut_sq + s);
        for (int g = 0; g < G; ++g) {
          const V m = kBroadcast ? Vec::set1(mprev[g][s >> kp]) : Vec::spread(mprev[g] + (s >> kp), kp);
          acc[g][v] = Vec::min(acc[g][v], Vec::add(Vec::fma(vm2t[g], l, sq), m));
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int v = 0; v < kVecs; ++v) Vec::store(mout[g] + j0 + v * L, acc[g][v]);
  }
}

template <int G>
void node_costs_any(const Tables& tb, const float* m2t, const float* const* mprev, int kp, int k,
                    float* const* mout) {
  if ((1 << kp) >= Vec::kLanes) {
    node_costs<G, true>(tb, m2t, mprev, kp, k, mout);
  } else {
    node_costs<G, false>(tb, m2t, mprev, kp, k, mout);
  }
}

// Lowest state with the least final cost over all 65536 states.
int best_final_state(const Tables& tb, float m2t, const float* mlast, int k) {
  float best = kInf;
  int best_state = 0;
  for (int s = 0; s < kStates; ++s) {
    const float c = state_cost(tb, m2t, s, mlast, k);
    if (c < best) {
      best = c;
      best_state = s;
    }
  }
  return best_state;
}

// One pass over the walk order `steps`. With start_node >= 0 the walk enters from that
// node and must close on it. Writes the states of walk positions >= first_kept to
// out_states[position] and returns nothing. `hist` holds 256 node arrays of `stride`.
void search(const Tables& tb, const float* targets, const int* steps, const int* kbits,
            int start_node, int first_kept, float* hist, int stride, int64_t* out_states) {
  const int k0 = kbits[steps[0]];
  const int nodes0 = 1 << (16 - k0);
  float* m0 = hist;
  if (start_node < 0) {
    std::fill(m0, m0 + nodes0, 0.0f);
  } else {
    std::fill(m0, m0 + nodes0, kInf);
    m0[start_node] = 0.0f;
  }
  for (int p = 1; p < kSteps; ++p) {
    const int prev = steps[p - 1];
    node_costs(tb, -2.0f * targets[prev], hist + (p - 1) * stride, kbits[prev],
               kbits[steps[p]], hist + p * stride);
  }
  const int last = steps[kSteps - 1];
  const float m2t_last = -2.0f * targets[last];
  const float* mlast = hist + (kSteps - 1) * stride;
  int state;
  if (start_node < 0) {
    state = best_final_state(tb, m2t_last, mlast, kbits[last]);
  } else {
    float best = kInf;
    state = start_node;  // (h = 0) when every closing state is unreachable
    for (int h = 0; h < (1 << k0); ++h) {
      const int s = (h << (16 - k0)) | start_node;
      const float c = state_cost(tb, m2t_last, s, mlast, kbits[last]);
      if (c < best) {
        best = c;
        state = s;
      }
    }
  }
  out_states[kSteps - 1] = state;
  // Trace back: re-derive which predecessor gave each kept node its minimum.
  for (int p = kSteps - 1; p > first_kept; --p) {
    const int k = kbits[steps[p]];
    const int prev = steps[p - 1];
    const int kp = kbits[prev];
    const float m2t = -2.0f * targets[prev];
    const float* mprev = hist + (p - 1) * stride;
    const int node = state >> k;
    float best = kInf;
    int chosen = node;
    for (int h = 0; h < (1 << k); ++h) {
      const int s = (h << (16 - k)) | node;
      const float c = state_cost(tb, m2t, s, mprev, kp);
      if (c < best) {
        best = c;
        chosen = s;
      }
    }
    state = chosen;
    out_states[p - 1] = state;
  }
}

void viterbi_tile(const Tables& tb, const float* targets, const int* kbits, float* hist,
                  int stride, int64_t* out) {
  int rotated[kSteps], natural[kSteps];
  for (int p = 0; p < kSteps; ++p) {
    rotated[p] = (p + kSteps / 2) % kSteps;
    natural[p] = p;
  }
  // Pass 1: free ends on the ring rotated by half a tile; step 255 sits at walk
  // position 127, far from both loose ends, and fixes the entry node.
  int64_t partial[kSteps];
  search(tb, targets, rotated, kbits, -1, kSteps / 2 - 1, hist, stride, partial);
  const int start_node = static_cast<int>(partial[kSteps / 2 - 1]) & ((1 << (16 - kbits[0])) - 1);
  // Pass 2: the real ring, entered from that node and closed on it.
  search(tb, targets, natural, kbits, start_node, 0, hist, stride, out);
}

}  // namespace

// targets (N, 256) float32, kbits (256,) int32, lut (65536,) float32 -> states (N, 256) int64
torch::Tensor viterbi_states(torch::Tensor targets, torch::Tensor kbits, torch::Tensor lut) {
  TORCH_CHECK(targets.device().is_cpu() && targets.scalar_type() == torch::kFloat32 &&
                  targets.dim() == 2 && targets.size(1) == kSteps,
              "targets must be a CPU float32 tensor (N, 256)");
  TORCH_CHECK(kbits.scalar_type() == torch::kInt32 && kbits.numel() == kSteps,
              "kbits must be int32 (256,)");
  TORCH_CHECK(lut.scalar_type() == torch::kFloat32 && lut.numel() == kStates,
              "lut must be float32 (65536,)");
  targets = targets.contiguous();
  kbits = kbits.contiguous().cpu();
  lut = lut.contiguous().cpu();
  const int* kb = kbits.data_ptr<int>();
  int kmin = 16;
  for (int i = 0; i < kSteps; ++i) {
    TORCH_CHECK(kb[i] >= 1 && kb[i] <= 8, "bits per step must be 1..8");
    kmin = std::min(kmin, kb[i]);
  }
  const torch::Tensor lut_sq = lut * lut;  // exact: float16 values, 11 significant bits
  const Tables tb{lut.data_ptr<float>(), lut_sq.data_ptr<float>()};
  const int64_t n = targets.size(0);
  auto states = torch::empty({n, kSteps}, torch::kInt64);
  const float* tp = targets.data_ptr<float>();
  int64_t* sp = states.data_ptr<int64_t>();
  const int stride = (1 << (16 - kmin)) + kPad;

  {
    pybind11::gil_scoped_release no_gil;
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> hist(static_cast<size_t>(kSteps) * stride, 0.0f);
      for (int64_t tile = begin; tile < end; ++tile) {
        viterbi_tile(tb, tp + tile * kSteps, kb, hist.data(), stride, sp + tile * kSteps);
      }
    });
  }
  return states;
}

std::string simd_level() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("viterbi_states", &viterbi_states, "EXL3 tail-biting Viterbi states (CPU)");
  m.def("simd_level", &simd_level, "which node-cost loop was compiled");
}
