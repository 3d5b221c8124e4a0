// Tail-biting Viterbi search for EXL3 trellis tiles on the CPU (EXL3-FORMAT.md 3, 5).
//
// Same algorithm and the same float arithmetic as the PyTorch reference
// (exl3cli/ops/viterbi.py), so both return the same states:
//   cost of state s at step i     C_i[s] = fma(-2 t_i, lut[s], lut[s]^2) + M_i[s >> k_i]
//   node cost entering step i+1   M_{i+1}[j] = min_h C_i[(h << (16 - k_{i+1})) | j]
// (lut[s]^2 is exact: a float16 value has 11 significant bits; fma and + round once
// each, as torch's addcmul and add do). Ties go to the lowest index, like argmin.
//
// The 65536 state costs are never stored: each step computes the next node costs
// straight from the LUT and the previous node costs. The LUT is read as float16
// (128 KB, L2-resident) and widened in registers. The trace-back needs, per step, which
// predecessor won each node; two ways to keep that, chosen by K:
// - history (K >= 2): every step's node costs (4 bytes per node) stay, and the
//   trace-back re-derives the winner, as the reference does. Cheapest in the hot loop.
// - back-pointers (K <= 1.5, most nodes): the loop also tracks the arg-min and stores
//   one byte per node; node costs live in two L2-resident buffers. The history would
//   be 32 MB per tile and pass there; the arg-min costs about what it saves.
// Two tiles are searched together where the loop allows, sharing the LUT loads.
//
// Parallel over tiles with at::parallel_for (OpenMP in torch's CPU builds), so the
// caller's torch.set_num_threads applies and no second OpenMP runtime is loaded.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace {

constexpr int kSteps = 256;
constexpr int kStates = 65536;
constexpr int kPad = 16;  // floats after each node array: SIMD loads may run past it
constexpr float kInf = std::numeric_limits<float>::infinity();

struct Tables {
  const float* lut;       // float32 values (the reference's LUT)
  const float* lut_sq;    // their squares
  const uint16_t* lut_h;  // the same values as float16 bits
};

inline float state_cost(const Tables& tb, float m2t, int s, const float* mprev, int kp) {
  return std::fma(m2t, tb.lut[s], tb.lut_sq[s]) + mprev[s >> kp];
}

// The vector operations the node-cost loop needs, per instruction set.
#if defined(__AVX512F__)
struct Vec {
  using V = __m512;
  using I = __m512i;
  static constexpr int kLanes = 16;
  static constexpr const char* kName = "avx512";
  static V set1(float x) { return _mm512_set1_ps(x); }
  static I iset1(int x) { return _mm512_set1_epi32(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V cost(V m2t, V l, V sq, V m) { return _mm512_add_ps(_mm512_fmadd_ps(m2t, l, sq), m); }
  static void lut(const Tables& tb, int s, V& l, V& sq) {
    l = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb.lut_h + s)));
    sq = _mm512_mul_ps(l, l);
  }
  // spread(m, spread_index(kp)): lane i gets m[i >> kp] (kp < 4): a load and a permute.
  static I spread_index(int kp) {
    const I lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_srlv_epi32(lane, _mm512_set1_epi32(kp));
  }
  static V spread(const float* m, I index) { return _mm512_permutexvar_ps(index, load(m)); }
  static void keep_min(V& acc, V c) { acc = _mm512_min_ps(acc, c); }
  // acc = min(acc, c); idx = h where c < acc (strictly: the first h wins ties).
  static void keep_argmin(V& acc, I& idx, V c, I h) {
    idx = _mm512_mask_mov_epi32(idx, _mm512_cmp_ps_mask(c, acc, _CMP_LT_OQ), h);
    acc = _mm512_min_ps(acc, c);
  }
  static void store_bytes(uint8_t* p, I idx) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(idx));
  }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Vec {
  using V = __m256;
  using I = __m256i;
  static constexpr int kLanes = 8;
  static constexpr const char* kName = "avx2";
  static V set1(float x) { return _mm256_set1_ps(x); }
  static I iset1(int x) { return _mm256_set1_epi32(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V cost(V m2t, V l, V sq, V m) { return _mm256_add_ps(_mm256_fmadd_ps(m2t, l, sq), m); }
  static void lut(const Tables& tb, int s, V& l, V& sq) {
    l = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tb.lut_h + s)));
    sq = _mm256_mul_ps(l, l);
  }
  static I spread_index(int kp) {
    const I lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_srlv_epi32(lane, _mm256_set1_epi32(kp));
  }
  static V spread(const float* m, I index) { return _mm256_permutevar8x32_ps(load(m), index); }
  static void keep_min(V& acc, V c) { acc = _mm256_min_ps(acc, c); }
  static void keep_argmin(V& acc, I& idx, V c, I h) {
    const V less = _mm256_cmp_ps(c, acc, _CMP_LT_OQ);
    idx = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(idx), _mm256_castsi256_ps(h), less));
    acc = _mm256_min_ps(acc, c);
  }
  static void store_bytes(uint8_t* p, I idx) {
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), idx);
    for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(lanes[i]);
  }
};
#else
// Plain C++ (any compiler): the same loop one state at a time.
struct Vec {
  using V = float;
  using I = int;
  static constexpr int kLanes = 1;
  static constexpr const char* kName = "scalar";
  static V set1(float x) { return x; }
  static I iset1(int x) { return x; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V cost(V m2t, V l, V sq, V m) { return std::fma(m2t, l, sq) + m; }
  static void lut(const Tables& tb, int s, V& l, V& sq) {
    l = tb.lut[s];
    sq = tb.lut_sq[s];
  }
  static I spread_index(int) { return 0; }
  static V spread(const float* m, I) { return *m; }
  static void keep_min(V& acc, V c) { acc = c < acc ? c : acc; }
  static void keep_argmin(V& acc, I& idx, V c, I h) {
    idx = c < acc ? h : idx;
    acc = c < acc ? c : acc;
  }
  static void store_bytes(uint8_t* p, I idx) { *p = static_cast<uint8_t>(idx); }
};
#endif

// For G tiles at once (sharing the LUT loads): mout[g][j] = min over h < 2^k of
// C_g[(h << (16 - k)) | j], with C_g from mprev[g] (indexed by s >> kp) and
// m2t[g] = -2 t; with kBack also back[g][j] = that h. kBroadcast: 2^kp >= lanes, so
// all lanes of a vector of states share one previous node.
template <int G, bool kBroadcast, bool kBack>
void node_costs(const Tables& tb, const float* m2t, const float* const* mprev, int kp, int k,
                float* const* mout, uint8_t* const* back) {
  using V = Vec::V;
  using I = Vec::I;
  constexpr int L = Vec::kLanes, kVecs = kBack ? 4 : 8, kBlock = kVecs * L;
  const int nodes = 1 << (16 - k), heads = 1 << k;
  const I index = Vec::spread_index(kp);
  V vm2t[G];
  for (int g = 0; g < G; ++g) vm2t[g] = Vec::set1(m2t[g]);
  for (int j0 = 0; j0 < nodes; j0 += kBlock) {
    V acc[G][kVecs];
    I idx[G][kVecs];
    for (int g = 0; g < G; ++g) {
      for (int v = 0; v < kVecs; ++v) {
        acc[g][v] = Vec::set1(kInf);
        idx[g][v] = Vec::iset1(0);
      }
    }
    for (int h = 0; h < heads; ++h) {
      const int s0 = (h << (16 - k)) | j0;
      const I hv = Vec::iset1(h);
      for (int v = 0; v < kVecs; ++v) {
        const int s = s0 + v * L;
        V l, sq;
        Vec::lut(tb, s, l, sq);
        for (int g = 0; g < G; ++g) {
          const V m = kBroadcast ? Vec::set1(mprev[g][s >> kp])
                                 : Vec::spread(mprev[g] + (s >> kp), index);
          const V c = Vec::cost(vm2t[g], l, sq, m);
          if (kBack) {
            Vec::keep_argmin(acc[g][v], idx[g][v], c, hv);
          } else {
            Vec::keep_min(acc[g][v], c);
          }
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      float* out = mout[g] + j0;  // a local pointer: stores cannot alias it
      for (int v = 0; v < kVecs; ++v) Vec::store(out + v * L, acc[g][v]);
      if (kBack) {
        for (int v = 0; v < kVecs; ++v) Vec::store_bytes(back[g] + j0 + v * L, idx[g][v]);
      }
    }
  }
}

template <int G, bool kBack>
void node_costs_any(const Tables& tb, const float* m2t, const float* const* mprev, int kp, int k,
                    float* const* mout, uint8_t* const* back) {
  if ((1 << kp) >= Vec::kLanes) {
    node_costs<G, true, kBack>(tb, m2t, mprev, kp, k, mout, back);
  } else {
    node_costs<G, false, kBack>(tb, m2t, mprev, kp, k, mout, back);
  }
}

// Per-tile working memory of one search (see the top comment for the two modes).
struct Work {
  float* nodes;   // history: 256 node arrays; back-pointers: 2 (ping-pong)
  uint8_t* back;  // back-pointers: 256 arrays of one byte per node
  int stride;     // floats per node array, bytes per back-pointer array
  float* costs(bool history, int pos) const {
    return nodes + static_cast<size_t>(history ? pos : (pos & 1)) * stride;
  }
};

// The state of the last walk position: least cost over all states (start_node < 0) or
// over the states that close the ring on start_node.
int final_state(const Tables& tb, float m2t, const float* mlast, int k_last, int k0,
                int start_node) {
  float best = kInf;
  int state = start_node < 0 ? 0 : start_node;  // argmin over all-inf picks index 0
  const int count = start_node < 0 ? kStates : (1 << k0);
  for (int i = 0; i < count; ++i) {
    const int s = start_node < 0 ? i : ((i << (16 - k0)) | start_node);
    const float c = state_cost(tb, m2t, s, mlast, k_last);
    if (c < best) {
      best = c;
      state = s;
    }
  }
  return state;
}

// One pass of G tiles over the walk order `steps`. With start_node[g] >= 0 the walk
// enters from that node and must close on it. Writes the states of walk positions
// >= first_kept to out[g][position].
template <int G, bool kBack>
void search(const Tables& tb, const float* const* targets, const int* steps, const int* kbits,
            const int* start_node, int first_kept, const Work* work, int64_t* const* out) {
  constexpr bool kHistory = !kBack;
  const int nodes0 = 1 << (16 - kbits[steps[0]]);
  for (int g = 0; g < G; ++g) {
    float* m0 = work[g].costs(kHistory, 0);
    std::fill(m0, m0 + nodes0, start_node[g] < 0 ? 0.0f : kInf);
    if (start_node[g] >= 0) m0[start_node[g]] = 0.0f;
  }
  for (int p = 1; p < kSteps; ++p) {
    const int prev = steps[p - 1];
    float m2t[G];
    const float* mprev[G];
    float* mout[G];
    uint8_t* back[G];
    for (int g = 0; g < G; ++g) {
      m2t[g] = -2.0f * targets[g][prev];
      mprev[g] = work[g].costs(kHistory, p - 1);
      mout[g] = work[g].costs(kHistory, p);
      back[g] = kBack ? work[g].back + static_cast<size_t>(p) * work[g].stride : nullptr;
    }
    node_costs_any<G, kBack>(tb, m2t, mprev, kbits[prev], kbits[steps[p]], mout, back);
  }
  const int last = steps[kSteps - 1];
  for (int g = 0; g < G; ++g) {
    int state = final_state(tb, -2.0f * targets[g][last], work[g].costs(kHistory, kSteps - 1),
                            kbits[last], kbits[steps[0]], start_node[g]);
    out[g][kSteps - 1] = state;
    for (int p = kSteps - 1; p > first_kept; --p) {
      const int k = kbits[steps[p]];
      const int node = state >> k;
      if (kBack) {
        state = (work[g].back[static_cast<size_t>(p) * work[g].stride + node] << (16 - k)) | node;
      } else {
        // Re-derive which predecessor gave this node its minimum.
        const int prev = steps[p - 1];
        const float m2t = -2.0f * targets[g][prev];
        const float* mprev = work[g].costs(true, p - 1);
        float best = kInf;
        int chosen = node;
        for (int h = 0; h < (1 << k); ++h) {
          const int s = (h << (16 - k)) | node;
          const float c = state_cost(tb, m2t, s, mprev, kbits[prev]);
          if (c < best) {
            best = c;
            chosen = s;
          }
        }
        state = chosen;
      }
      out[g][p - 1] = state;
    }
  }
}

template <int G, bool kBack>
void viterbi_tiles(const Tables& tb, const float* const* targets, const int* kbits,
                   const Work* work, int64_t* const* out) {
  int rotated[kSteps], natural[kSteps];
  for (int p = 0; p < kSteps; ++p) {
    rotated[p] = (p + kSteps / 2) % kSteps;
    natural[p] = p;
  }
  // Pass 1: free ends on the ring rotated by half a tile; step 255 sits at walk
  // position 127, far from both loose ends, and fixes the entry node.
  int64_t partial[G][kSteps];
  int64_t* partial_out[G];
  int start[G];
  for (int g = 0; g < G; ++g) {
    partial_out[g] = partial[g];
    start[g] = -1;
  }
  search<G, kBack>(tb, targets, rotated, kbits, start, kSteps / 2 - 1, work, partial_out);
  for (int g = 0; g < G; ++g) {
    start[g] = static_cast<int>(partial[g][kSteps / 2 - 1]) & ((1 << (16 - kbits[0])) - 1);
  }
  // Pass 2: the real ring, entered from that node and closed on it.
  search<G, kBack>(tb, targets, natural, kbits, start, 0, work, out);
}

// Tiles [begin, end) of a batch (targets tp, states sp, both 256 per tile).
template <bool kBack>
void viterbi_range(const Tables& tb, const float* tp, const int* kbits, int nodes_max,
                   int64_t* sp, int64_t begin, int64_t end) {
  // Two tiles at a time where that pays (history mode); back-pointer mode needs the
  // registers for the arg-min.
  constexpr int kGroup = kBack ? 1 : 2;
  const int stride = nodes_max + kPad;
  const size_t floats = kBack ? 2 * static_cast<size_t>(stride) : kSteps * static_cast<size_t>(stride);
  const size_t bytes = kBack ? kSteps * static_cast<size_t>(stride) : 0;
  // Kept per thread across calls: allocating and first touching up to 32 MB per call
  // would cost more than searching a few tiles. Never read before written.
  thread_local std::unique_ptr<float[]> float_buffer;
  thread_local std::unique_ptr<uint8_t[]> byte_buffer;
  thread_local size_t float_size = 0, byte_size = 0;
  if (float_size < kGroup * floats) {
    float_buffer.reset(new float[kGroup * floats]);
    float_size = kGroup * floats;
  }
  if (byte_size < kGroup * bytes) {
    byte_buffer.reset(new uint8_t[kGroup * bytes]);
    byte_size = kGroup * bytes;
  }
  Work work[kGroup];
  for (int g = 0; g < kGroup; ++g) {
    work[g] = Work{float_buffer.get() + g * floats, byte_buffer.get() + g * bytes, stride};
  }
  int64_t tile = begin;
  for (; tile + kGroup <= end; tile += kGroup) {
    const float* targets[kGroup];
    int64_t* out[kGroup];
    for (int g = 0; g < kGroup; ++g) {
      targets[g] = tp + (tile + g) * kSteps;
      out[g] = sp + (tile + g) * kSteps;
    }
    viterbi_tiles<kGroup, kBack>(tb, targets, kbits, work, out);
  }
  for (; tile < end; ++tile) {
    const float* targets[1] = {tp + tile * kSteps};
    int64_t* out[1] = {sp + tile * kSteps};
    viterbi_tiles<1, kBack>(tb, targets, kbits, work, out);
  }
}

// Back-pointers pay when the node arrays are large (see the top comment).
#ifndef EXL3_VITERBI_BACK_UP_TO_K
#define EXL3_VITERBI_BACK_UP_TO_K 1
#endif
constexpr int kBackPointersUpToK = EXL3_VITERBI_BACK_UP_TO_K;

void viterbi_batch(const Tables& tb, const float* tp, const int* kbits, int64_t* sp,
                   int64_t begin, int64_t end) {
  int kmin = 8;
  for (int i = 0; i < kSteps; ++i) kmin = std::min(kmin, kbits[i]);
  const int nodes_max = 1 << (16 - kmin);
  if (kmin <= kBackPointersUpToK) {
    viterbi_range<true>(tb, tp, kbits, nodes_max, sp, begin, end);
  } else {
    viterbi_range<false>(tb, tp, kbits, nodes_max, sp, begin, end);
  }
}

}  // namespace

#ifndef EXL3_VITERBI_NO_TORCH
#include <ATen/Parallel.h>
#include <torch/extension.h>

// targets (N, 256) float32, kbits (256,) int32, lut (65536,) float32 -> states (N, 256) int64
torch::Tensor viterbi_states(torch::Tensor targets, torch::Tensor kbits, torch::Tensor lut) {
  TORCH_CHECK(targets.device().is_cpu() && targets.scalar_type() == torch::kFloat32 &&
                  targets.dim() == 2 && targets.size(1) == kSteps,
              "targets must be a CPU float32 tensor (N, 256)");
  TORCH_CHECK(kbits.scalar_type() == torch::kInt32 && kbits.numel() == kSteps,
              "kbits must be int32 (256,)");
  TORCH_CHECK(lut.device().is_cpu() && lut.scalar_type() == torch::kFloat32 &&
                  lut.numel() == kStates, "lut must be a CPU float32 tensor (65536,)");
  targets = targets.contiguous();
  kbits = kbits.contiguous();
  lut = lut.contiguous();
  const int* kb = kbits.data_ptr<int>();
  for (int i = 0; i < kSteps; ++i) {
    TORCH_CHECK(kb[i] >= 1 && kb[i] <= 8, "bits per step must be 1..8");
  }
  const torch::Tensor lut_sq = lut * lut;  // exact: float16 values, 11 significant bits
  const torch::Tensor lut_h = lut.to(torch::kHalf);
  TORCH_CHECK(torch::equal(lut_h.to(torch::kFloat32), lut), "lut values must be float16 values");
  const Tables tb{lut.data_ptr<float>(), lut_sq.data_ptr<float>(),
                  reinterpret_cast<const uint16_t*>(lut_h.data_ptr<at::Half>())};
  const int64_t n = targets.size(0);
  auto states = torch::empty({n, kSteps}, torch::kInt64);
  const float* tp = targets.data_ptr<float>();
  int64_t* sp = states.data_ptr<int64_t>();
  {
    pybind11::gil_scoped_release no_gil;
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      viterbi_batch(tb, tp, kb, sp, begin, end);
    });
  }
  return states;
}

std::string simd_level() { return Vec::kName; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("viterbi_states", &viterbi_states, "EXL3 tail-biting Viterbi states (CPU)");
  m.def("simd_level", &simd_level, "which node-cost loop was compiled");
}
#endif  // EXL3_VITERBI_NO_TORCH
