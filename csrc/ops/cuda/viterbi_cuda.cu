// Tail-biting Viterbi search for EXL3 trellis tiles on a CUDA GPU (EXL3-FORMAT.md 3, 5).
//
// Same algorithm and float arithmetic as the PyTorch reference
// (exl3cli/ops/viterbi.py) and the CPU kernel (csrc/ops/cpu/viterbi_cpu.cpp):
//   C_i[s]     = fma(-2 t_i, lut[s], lut[s]^2) + M_i[s >> k_i]   (two roundings)
//   M_{i+1}[j] = min_h C_i[(h << (16 - k_{i+1})) | j]            (first h on ties)
// so it returns the same states.
//
// Memory plan (why not 65536 float costs in shared memory: 256 KB > 227 KB): the state
// costs are never stored. A state's cost is its own error plus the cost of the node it
// was entered from, so each step computes the next node costs M_{i+1} straight from
// the LUT and M_i, which is 2^(16-K) floats (K=1: 128 KB, K=2: 64 KB, K=4: 16 KB).
// M is updated in place: every thread first computes its nodes' new costs into
// registers (at most 32 per thread with 1024 threads), the block syncs, then writes.
// The LUT sits in shared memory as float16 (128 KB) when it fits next to M (K >= 2);
// at K = 1 (and 1.5) it is read from global memory (L1/L2-resident, 256 KB float32).
// The arg-min of every node at every step (which h) goes to a uint8 back-pointer
// array in global memory (256 x 2^(16-K) bytes per block: K=4 1 MB), and one thread
// walks it back. One 1024-thread block per tile, persistent over tiles.
// Tiles come in up to kMaxSegments consecutive segments, each with its own bits per
// step (the tensors of one LDLQ block quantized at different K in one launch); a
// tile's search reads only its own segment's bits, so it returns the same states as
// a launch of that segment alone.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace exl3_viterbi {

constexpr int kThreads = 1024;
constexpr int kSteps = 256;
constexpr int kStates = 65536;
constexpr int kMaxNodesPerThread = 32768 / kThreads;  // K = 1
constexpr int kMaxSegments = 4;

struct Params {
  const float* targets;  // (n, 256) step order
  const float* lut;      // (65536,) float32
  const __half* lut_h;   // (65536,) float16, same values
  uint8_t* back;         // (grid, 256, nodes_max) scratch
  int64_t* states;       // (n, 256) out
  int n;
  int nodes_max;
  int segments;
  int seg_end[kMaxSegments];  // tiles [seg_end[s-1], seg_end[s]) use kbits[s]
  unsigned char kbits[kMaxSegments][kSteps];
};

template <bool kSharedLut>
__device__ __forceinline__ float lut_value(const Params& p, const __half* lut_s, int s) {
  if (kSharedLut) return __half2float(lut_s[s]);
  return __ldg(p.lut + s);
}

template <bool kSharedLut>
__device__ __forceinline__ float state_cost(const Params& p, const __half* lut_s, float m2t,
                                            int s, const float* m, int kp) {
  const float l = lut_value<kSharedLut>(p, lut_s, s);
  // l*l is exact (11 significant bits); fma and add round once each, like torch.
  return __fadd_rn(__fmaf_rn(m2t, l, __fmul_rn(l, l)), m[s >> kp]);
}

// Lexicographic (cost, index) minimum over the block; the winner's index is returned
// to every thread. `red_v`/`red_i` hold 32 entries each.
__device__ int block_argmin(float v, int idx, float* red_v, int* red_i) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_down_sync(0xffffffffu, v, off);
    const int oi = __shfl_down_sync(0xffffffffu, idx, off);
    if (ov < v || (ov == v && oi < idx)) {
      v = ov;
      idx = oi;
    }
  }
  __syncthreads();  // red_* may still be read from a previous call
  if (lane == 0) {
    red_v[warp] = v;
    red_i[warp] = idx;
  }
  __syncthreads();
  if (warp == 0) {
    v = red_v[lane];
    idx = red_i[lane];
    for (int off = 16; off > 0; off >>= 1) {
      const float ov = __shfl_down_sync(0xffffffffu, v, off);
      const int oi = __shfl_down_sync(0xffffffffu, idx, off);
      if (ov < v || (ov == v && oi < idx)) {
        v = ov;
        idx = oi;
      }
    }
    if (lane == 0) red_i[0] = idx;
  }
  __syncthreads();
  return red_i[0];
}

// One pass over the 256 steps in walk order (rotated by `offset`). With start_node >= 0
// the walk enters from that node and closes on it. Traces back to walk position
// first_kept; writes those states to out_states[walk position] when out_states is set.
// Returns (to every thread) the state at walk position first_kept.
template <bool kSharedLut>
__device__ int search(const Params& p, const unsigned char* kbits, const __half* lut_s,
                      const float* tgt, float* m, uint8_t* back, int offset, int start_node,
                      int first_kept, int64_t* out_states, float* red_v, int* red_i) {
  const int tid = threadIdx.x;
  const int k0 = kbits[offset & 255];
  const int nodes0 = 1 << (16 - k0);
  for (int j = tid; j < nodes0; j += kThreads) {
    m[j] = (start_node < 0 || j == start_node) ? 0.0f : __int_as_float(0x7f800000);
  }
  __syncthreads();
  for (int pos = 1; pos < kSteps; ++pos) {
    const int step = (pos + offset) & 255, prev = (pos - 1 + offset) & 255;
    const int k = kbits[step], kp = kbits[prev];
    const int nodes = 1 << (16 - k), heads = 1 << k, shift = 16 - k;
    const float m2t = __fmul_rn(-2.0f, tgt[prev]);
    const bool record = pos > first_kept;
    uint8_t* back_pos = back + static_cast<size_t>(pos) * p.nodes_max;
    // The shared-LUT variant runs only at K >= 2: at most 16 nodes per thread.
    constexpr int kPer = kSharedLut ? kMaxNodesPerThread / 2 : kMaxNodesPerThread;
    float fresh[kPer];
#pragma unroll
    for (int r = 0; r < kPer; ++r) {
      const int j = tid + r * kThreads;
      fresh[r] = 0.0f;
      if (j < nodes) {
        float best = __int_as_float(0x7f800000);
        int arg = 0;
        for (int h = 0; h < heads; ++h) {
          const float c = state_cost<kSharedLut>(p, lut_s, m2t, (h << shift) | j, m, kp);
          if (c < best) {
            best = c;
            arg = h;
          }
        }
        fresh[r] = best;
        if (record) back_pos[j] = static_cast<uint8_t>(arg);
      }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kPer; ++r) {
      const int j = tid + r * kThreads;
      if (j < nodes) m[j] = fresh[r];
    }
    __syncthreads();
  }

  // Final state: the least cost over all states (free end) or over the states that
  // close the ring on start_node.
  const int last = (kSteps - 1 + offset) & 255;
  const int k_last = kbits[last];
  const float m2t_last = __fmul_rn(-2.0f, tgt[last]);
  float best = __int_as_float(0x7f800000);
  int best_state = 0x7fffffff;
  if (start_node < 0) {
    for (int s = tid; s < kStates; s += kThreads) {
      const float c = state_cost<kSharedLut>(p, lut_s, m2t_last, s, m, k_last);
      if (c < best) {
        best = c;
        best_state = s;
      }
    }
  } else {
    for (int h = tid; h < (1 << k0); h += kThreads) {
      const int s = (h << (16 - k0)) | start_node;
      const float c = state_cost<kSharedLut>(p, lut_s, m2t_last, s, m, k_last);
      if (c < best) {
        best = c;
        best_state = s;
      }
    }
  }
  int state = block_argmin(best, best_state, red_v, red_i);
  // Every closing state unreachable cannot happen (the start node is finite), but keep
  // the state well defined: h = 0, as torch's argmin over all-inf picks index 0.
  if (state == 0x7fffffff) state = start_node < 0 ? 0 : start_node;

  // Trace back (one thread; the back-pointers were written before the barriers above).
  if (tid == 0) {
    if (out_states) out_states[kSteps - 1] = state;
    for (int pos = kSteps - 1; pos > first_kept; --pos) {
      const int k = kbits[(pos + offset) & 255];
      const int node = state >> k;
      const int h = back[static_cast<size_t>(pos) * p.nodes_max + node];
      state = (h << (16 - k)) | node;
      if (out_states) out_states[pos - 1] = state;
    }
    red_i[1] = state;
  }
  __syncthreads();
  const int kept = red_i[1];
  __syncthreads();
  return kept;
}

template <bool kSharedLut>
__global__ void __launch_bounds__(kThreads, 1) viterbi_kernel(const Params p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* m = reinterpret_cast<float*>(smem_raw);  // nodes_max
  float* tgt = m + p.nodes_max;                   // 256
  float* red_v = tgt + kSteps;                    // 32
  int* red_i = reinterpret_cast<int*>(red_v + 32);  // 32
  __half* lut_s = reinterpret_cast<__half*>(red_i + 32);  // 65536 when kSharedLut

  if (kSharedLut) {
    const uint4* src = reinterpret_cast<const uint4*>(p.lut_h);
    uint4* dst = reinterpret_cast<uint4*>(lut_s);
    for (int i = threadIdx.x; i < kStates * 2 / 16; i += kThreads) dst[i] = src[i];
  }
  uint8_t* back = p.back + static_cast<size_t>(blockIdx.x) * kSteps * p.nodes_max;
  for (int tile = blockIdx.x; tile < p.n; tile += gridDim.x) {
    __syncthreads();  // the previous tile is done with tgt
    for (int i = threadIdx.x; i < kSteps; i += kThreads) tgt[i] = p.targets[tile * kSteps + i];
    __syncthreads();
    int seg = 0;
    while (seg + 1 < p.segments && tile >= p.seg_end[seg]) ++seg;
    const unsigned char* kbits = p.kbits[seg];
    // Pass 1: free ends on the ring rotated by half a tile; step 255 (walk position
    // 127) fixes the entry node.
    const int s255 = search<kSharedLut>(p, kbits, lut_s, tgt, m, back, kSteps / 2, -1,
                                        kSteps / 2 - 1, nullptr, red_v, red_i);
    const int start_node = s255 & ((1 << (16 - kbits[0])) - 1);
    // Pass 2: the real ring, entered from that node and closed on it.
    search<kSharedLut>(p, kbits, lut_s, tgt, m, back, 0, start_node, 0,
                       p.states + static_cast<size_t>(tile) * kSteps, red_v, red_i);
  }
}

size_t shared_bytes(int nodes_max, bool shared_lut) {
  size_t bytes = (static_cast<size_t>(nodes_max) + kSteps + 32) * 4 + 32 * 4;
  if (shared_lut) bytes += kStates * 2;
  return bytes;
}

// Launches on `stream`; returns a CUDA error code (cudaSuccess when queued).
cudaError_t launch(const Params& p, int grid, cudaStream_t stream) {
  const bool shared_lut = p.nodes_max <= 16384;  // K >= 2: M (64 KB) + LUT (128 KB)
  const size_t bytes = shared_bytes(p.nodes_max, shared_lut);
  cudaError_t err;
  if (shared_lut) {
    err = cudaFuncSetAttribute(viterbi_kernel<true>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    if (err != cudaSuccess) return err;
    viterbi_kernel<true><<<grid, kThreads, bytes, stream>>>(p);
  } else {
    err = cudaFuncSetAttribute(viterbi_kernel<false>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    if (err != cudaSuccess) return err;
    viterbi_kernel<false><<<grid, kThreads, bytes, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace exl3_viterbi

#ifndef EXL3_VITERBI_NO_TORCH
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

// targets (N, 256) float32 CUDA, kbits: per segment 256 ints (bits per step), counts:
// tiles per segment (summing to N), lut float32 + float16 (65536,) on the same device
// -> states (N, 256) int64.
torch::Tensor viterbi_states_cuda(torch::Tensor targets,
                                  std::vector<std::vector<int64_t>> kbits,
                                  std::vector<int64_t> counts,
                                  torch::Tensor lut, torch::Tensor lut_h) {
  using namespace exl3_viterbi;
  TORCH_CHECK(targets.is_cuda() && targets.scalar_type() == torch::kFloat32 &&
                  targets.dim() == 2 && targets.size(1) == kSteps,
              "targets must be a CUDA float32 tensor (N, 256)");
  TORCH_CHECK(!kbits.empty() && static_cast<int>(kbits.size()) <= kMaxSegments &&
                  kbits.size() == counts.size(),
              (std::string("kbits and counts: one entry per segment, 1..") +
               std::to_string(kMaxSegments) + " segments").c_str());
  TORCH_CHECK(lut.is_cuda() && lut.scalar_type() == torch::kFloat32 && lut.numel() == kStates &&
                  lut.device() == targets.device(), "lut must be float32 (65536,) on targets' device");
  TORCH_CHECK(lut_h.is_cuda() && lut_h.scalar_type() == torch::kHalf &&
                  lut_h.numel() == kStates && lut_h.device() == targets.device(),
              "lut_h must be float16 (65536,) on targets' device");
  TORCH_CHECK(targets.size(0) < (1LL << 31) / kSteps, "too many tiles for one call");
  const c10::cuda::CUDAGuard guard(targets.device());
  targets = targets.contiguous();
  lut = lut.contiguous();
  lut_h = lut_h.contiguous();
  const int n = static_cast<int>(targets.size(0));
  auto states = torch::empty({n, kSteps}, targets.options().dtype(torch::kInt64));
  if (n == 0) return states;

  Params p{};
  int kmin = 8;
  int64_t end = 0;
  p.segments = static_cast<int>(kbits.size());
  for (int s = 0; s < p.segments; ++s) {
    TORCH_CHECK(static_cast<int>(kbits[s].size()) == kSteps, "kbits must have 256 entries");
    TORCH_CHECK(counts[s] >= 0, "segment tile counts must be >= 0");
    end += counts[s];
    p.seg_end[s] = static_cast<int>(end);
    for (int i = 0; i < kSteps; ++i) {
      TORCH_CHECK(kbits[s][i] >= 1 && kbits[s][i] <= 8, "bits per step must be 1..8");
      p.kbits[s][i] = static_cast<unsigned char>(kbits[s][i]);
      kmin = kbits[s][i] < kmin ? static_cast<int>(kbits[s][i]) : kmin;
    }
  }
  TORCH_CHECK(end == targets.size(0), "segment tile counts must sum to the tiles given");
  p.nodes_max = 1 << (16 - kmin);
  int sms = 0;
  TORCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount,
                                     targets.device().index()) == cudaSuccess,
              "cannot read the SM count");
  const int grid = n < sms ? n : sms;  // one block per SM (shared memory allows one)
  auto back = torch::empty({static_cast<int64_t>(grid) * kSteps * p.nodes_max},
                           targets.options().dtype(torch::kUInt8));
  p.targets = targets.data_ptr<float>();
  p.lut = lut.data_ptr<float>();
  p.lut_h = reinterpret_cast<const __half*>(lut_h.data_ptr<at::Half>());
  p.back = back.data_ptr<uint8_t>();
  p.states = states.data_ptr<int64_t>();
  p.n = n;
  const cudaError_t err = launch(p, grid, c10::cuda::getCurrentCUDAStream().stream());
  // One plain string, never formatted pieces (bindings_util.h EXL3_CHECK says why).
  TORCH_CHECK(err == cudaSuccess,
              (std::string("viterbi kernel launch: ") + cudaGetErrorString(err)).c_str());
  return states;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("viterbi_states", &viterbi_states_cuda, "EXL3 tail-biting Viterbi states (CUDA)");
}
#endif
