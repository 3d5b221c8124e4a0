// Standalone trellis decode: Ŵ as a float16 matrix (for reconstruct + cuBLAS).
#include "exl3_ops.h"
#include "../../codec/exl3_trellis.cuh"

namespace exl3 {
namespace {

constexpr int kTilesPerBlock = 8;  // 8 warps: one row of 8 tiles = 16 rows x 128 columns

template <int K2, int CB>
__global__ void __launch_bounds__(256)
    decode_kernel(const uint32_t* __restrict__ trellis, __half* __restrict__ out, int kb_total,
                  int nb_total, const __half* __restrict__ scale) {
  constexpr int W = TileBits<K2>::kWords;
  // Rows padded by 16 bytes: keeps 16-byte alignment, spreads banks.
  __shared__ __align__(16) __half tile_s[16][kTilesPerBlock * 16 + 8];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int kb = blockIdx.y;
  const int nb = blockIdx.x * kTilesPerBlock + warp;
  if (nb < nb_total) {
    uint32_t a[4];
    decode_lane<K2, CB>(trellis + ((size_t)kb * nb_total + nb) * W, lane, a);
    const int r0 = 2 * (lane & 3);
    const int c0 = warp * 16 + (lane >> 2);
    __half2 v01 = bits_h2(a[0]), v45 = bits_h2(a[1]);
    __half2 v23 = bits_h2(a[2]), v67 = bits_h2(a[3]);
    if (scale != nullptr) {  // as float16 Ŵ times a float16 scale, one rounding each
      const __half2 s = __half2half2(*scale);
      v01 = __hmul2(v01, s);
      v45 = __hmul2(v45, s);
      v23 = __hmul2(v23, s);
      v67 = __hmul2(v67, s);
    }
    tile_s[r0][c0] = __low2half(v01);
    tile_s[r0 + 1][c0] = __high2half(v01);
    tile_s[r0 + 8][c0] = __low2half(v23);
    tile_s[r0 + 9][c0] = __high2half(v23);
    tile_s[r0][c0 + 8] = __low2half(v45);
    tile_s[r0 + 1][c0 + 8] = __high2half(v45);
    tile_s[r0 + 8][c0 + 8] = __low2half(v67);
    tile_s[r0 + 9][c0 + 8] = __high2half(v67);
  }
  __syncthreads();
  // 256 threads = 16 rows x 16 segments of 8 halves: one 16-byte store each.
  const int row = threadIdx.x >> 4;
  const int seg = threadIdx.x & 15;
  const int col = blockIdx.x * kTilesPerBlock * 16 + seg * 8;
  const size_t ncols = (size_t)nb_total * 16;
  if (col < (int)ncols) {
    const uint4 v = *reinterpret_cast<const uint4*>(&tile_s[row][seg * 8]);
    *reinterpret_cast<uint4*>(out + ((size_t)kb * 16 + row) * ncols + col) = v;
  }
}

template <int K2, int CB>
void run_decode(const void* trellis, void* out, int kb, int nb, cudaStream_t stream,
                const void* scale) {
  dim3 grid((nb + kTilesPerBlock - 1) / kTilesPerBlock, kb);
  decode_kernel<K2, CB><<<grid, 256, 0, stream>>>(static_cast<const uint32_t*>(trellis),
                                                  static_cast<__half*>(out), kb, nb,
                                                  static_cast<const __half*>(scale));
}

}  // namespace

bool launch_decode(const void* trellis, void* out, int kb, int nb, int k2, int cb,
                   cudaStream_t stream, const void* scale) {
  if (kb <= 0 || nb <= 0) return true;
#define EXL3_ALL_CB(K2_)                                           \
  case K2_:                                                        \
    if (cb == CB_MUL1) run_decode<K2_, CB_MUL1>(trellis, out, kb, nb, stream, scale);   \
    else if (cb == CB_MCG) run_decode<K2_, CB_MCG>(trellis, out, kb, nb, stream, scale); \
    else if (cb == CB_3INST) run_decode<K2_, CB_3INST>(trellis, out, kb, nb, stream, scale); \
    else return false;                                             \
    return true;
#define EXL3_MUL1_ONLY(K2_)                                        \
  case K2_:                                                        \
    if (cb != CB_MUL1) return false;                               \
    run_decode<K2_, CB_MUL1>(trellis, out, kb, nb, stream, scale);        \
    return true;
  switch (k2) {
    EXL3_FOR_INTEGER_K2(EXL3_ALL_CB)
    EXL3_FOR_HALF_K2(EXL3_MUL1_ONLY)
    default:
      return false;
  }
#undef EXL3_ALL_CB
#undef EXL3_MUL1_ONLY
}

}  // namespace exl3
