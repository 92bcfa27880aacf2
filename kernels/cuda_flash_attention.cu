// Causal attention on bf16 tensor cores; see cuda_flash_attention.h.
//
// Shared memory of a block: the tiles of 64 rows (bf16, the head padded to D columns plus 8,
// which staggers the rows across banks), and per warp its 16 x 64 scores (FP32), their bf16
// probabilities (or dS) and a 16 x D FP32 staging area. Every WMMA pointer is 32-byte aligned
// and every leading dimension a multiple of 16 bytes, as load/store_matrix_sync require: each
// region's size is a multiple of 32 bytes, rows start at multiples of 16 elements' worth and
// fragments at column multiples of 16.
//
// A warp's lanes work on its 16 rows in pairs: lanes 2r and 2r+1 own row r, each every other
// column of it, and combine with one shuffle. WMMA stores and loads are warp-wide, so a __syncwarp
// separates them from the lanes' own reads and writes of the same memory.
#include <cuda_bf16.h>
#include <mma.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "common/status_macros.h"
#include "kernels/cuda_flash_attention.h"
#include "kernels/cuda_launch.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "bf16 tensor-core attention needs sm_80 or newer: set CMAKE_CUDA_ARCHITECTURES"
#endif

namespace lockstep::kernels::cuda {
namespace {

namespace wmma = nvcuda::wmma;
using bf16 = __nv_bfloat16;

constexpr int kRows = 64;  // rows of a block and of a tile
constexpr int kWarps = kRows / 16;
constexpr int kBlockThreads = kWarps * 32;
constexpr int kScoreLd = kRows + 4;  // floats of a scores row
// Exponentials are taken base 2 (exp2f is one special-function instruction, expf several):
// scores scaled by log2(e) as well, lse kept in base 2 inside the kernels.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kProbLd = kRows + 8;   // bf16 values of a probabilities row

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using FragBt = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Sizes for a head padded to D columns (32, 64 or 128).
template <int D>
struct Layout {
  static constexpr int kLd = D + 8;      // bf16 values of a tile row
  static constexpr int kOutLd = D + 4;   // floats of a staging row
  static constexpr size_t kTile = size_t{kRows} * kLd * sizeof(bf16);
  static constexpr size_t kScores = size_t{16} * kScoreLd * sizeof(float);
  static constexpr size_t kProbs = size_t{16} * kProbLd * sizeof(bf16);
  static constexpr size_t kStage = size_t{16} * kOutLd * sizeof(float);
  static constexpr size_t kRowStats = 2 * kRows * sizeof(float);  // lse and D of a tile
  // Forward: Q, K, V tiles; per warp scores, probabilities and the running output.
  static constexpr size_t kForwardWarp = kScores + kProbs + kStage;
  static constexpr size_t kForward = 3 * kTile + kWarps * kForwardWarp;
  // dK/dV: K, V, Q, dO tiles, the row stats; per warp S^T and dP^T (the staging area at the
  // end), P^T and dS^T.
  static constexpr size_t kKeysWarp = 2 * kScores + 2 * kProbs;
  static constexpr size_t kKeys = 4 * kTile + kRowStats + kWarps * kKeysWarp;
  // dQ: Q, dO, K, V tiles, the row stats; per warp S and dP (the staging area), dS.
  static constexpr size_t kQueriesWarp = 2 * kScores + kProbs;
  static constexpr size_t kQueries = 4 * kTile + kRowStats + kWarps * kQueriesWarp;
  static_assert(kTile % 32 == 0 && kScores % 32 == 0 && kProbs % 32 == 0 && kStage % 32 == 0 &&
                    kRowStats % 32 == 0,
                "WMMA needs 32-byte aligned fragments");
  static_assert(kStage <= 2 * kScores, "the staging area fits in a warp's two score buffers");
};

struct Args {
  int T, c, heads, hs;
  float scale;
  bool vectors;       // q/k/v rows 16-byte aligned and hs a multiple of 8: uint4 loads
  bool dout_vectors;  // dO rows 16-byte aligned and hs a multiple of 4: float4 loads
  __device__ size_t Row(int b, int t) const { return static_cast<size_t>(b) * T + t; }
  __device__ size_t Lse(int b, int h, int t) const {
    return (static_cast<size_t>(b) * heads + h) * T + t;
  }
  __device__ size_t Head(int h) const { return static_cast<size_t>(h) * hs; }
};

// Rows [first, first + kRows) of a tile from row(t) (hs bf16 values each): rows at or past T
// and columns at or past hs are zeros, which add nothing to any product.
template <int D, typename Row>
__device__ void LoadTile(Row row, int first, int T, int hs, bool vectors, bf16* tile) {
  constexpr int kLd = Layout<D>::kLd;
  if (vectors) {
    constexpr int kChunks = D / 8;
    for (int e = threadIdx.x; e < kRows * kChunks; e += kBlockThreads) {
      const int r = e / kChunks, d = (e % kChunks) * 8;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (first + r < T && d < hs) v = *reinterpret_cast<const uint4*>(row(first + r) + d);
      *reinterpret_cast<uint4*>(tile + r * kLd + d) = v;
    }
  } else {
    for (int e = threadIdx.x; e < kRows * D; e += kBlockThreads) {
      const int r = e / D, d = e % D;
      tile[r * kLd + d] = first + r < T && d < hs ? row(first + r)[d] : __ushort_as_bfloat16(0);
    }
  }
}

// The same from FP32 rows (dO), rounded to nearest even.
template <int D, typename Row>
__device__ void LoadTileRounded(Row row, int first, int T, int hs, bool vectors, bf16* tile) {
  constexpr int kLd = Layout<D>::kLd;
  if (vectors) {
    constexpr int kChunks = D / 4;
    for (int e = threadIdx.x; e < kRows * kChunks; e += kBlockThreads) {
      const int r = e / kChunks, d = (e % kChunks) * 4;
      float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (first + r < T && d < hs) v = *reinterpret_cast<const float4*>(row(first + r) + d);
      __nv_bfloat162* to = reinterpret_cast<__nv_bfloat162*>(tile + r * kLd + d);
      to[0] = __floats2bfloat162_rn(v.x, v.y);
      to[1] = __floats2bfloat162_rn(v.z, v.w);
    }
  } else {
    for (int e = threadIdx.x; e < kRows * D; e += kBlockThreads) {
      const int r = e / D, d = e % D;
      tile[r * kLd + d] = __float2bfloat16_rn(first + r < T && d < hs ? row(first + r)[d] : 0.0f);
    }
  }
}

// lse (in base 2) and D = dO . O of rows [first, first + kRows), in FP32 from dO rounded to
// bf16 (the dO the products see, so that dS sums to zero over a row as it should) and O as
// stored; two threads a row, rows past T get zeros. All of the block's threads take part.
template <typename GradRow, typename OutRow>
__device__ void LoadRowStats(GradRow grad_row, OutRow out_row, const float* lse, size_t lse_first,
                             int first, int T, int hs, float* tile_lse, float* tile_d) {
  static_assert(kBlockThreads == 2 * kRows, "two threads a row");
  const int r = threadIdx.x / 2, part = threadIdx.x % 2;
  const int i = first + r;
  float dot = 0.0f;
  if (i < T) {
    const float* g = grad_row(i);
    const bf16* o = out_row(i);
    for (int d = part; d < hs; d += 2) {
      dot += __bfloat162float(__float2bfloat16_rn(g[d])) * __bfloat162float(o[d]);
    }
  }
  dot += __shfl_xor_sync(0xffffffffu, dot, 1);
  if (part == 0) {
    tile_d[r] = dot;
    tile_lse[r] = i < T ? lse[lse_first + r] * kLog2e : 0.0f;  // base 2
  }
}

// acc (16 x 64) = A (16 x D rows at a, row-major) times B^T, B being 64 x D rows at b: the dot
// products of the warp's 16 rows with the tile's 64, stored FP32 at out (ld kScoreLd).
template <int D>
__device__ void RowDots(const bf16* a, const bf16* b, float* out) {
  constexpr int kLd = Layout<D>::kLd;
  for (int n = 0; n < kRows / 16; ++n) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int k = 0; k < D / 16; ++k) {
      FragA fa;
      FragBt fb;
      wmma::load_matrix_sync(fa, a + k * 16, kLd);
      wmma::load_matrix_sync(fb, b + n * 16 * kLd + k * 16, kLd);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out + n * 16, acc, kScoreLd, wmma::mem_row_major);
  }
}

// The same with the warp's 16 rows already in fragments (loaded once per block by LoadRows).
template <int D>
__device__ void RowDots(const FragA* fa, const bf16* b, float* out) {
  constexpr int kLd = Layout<D>::kLd;
  for (int n = 0; n < kRows / 16; ++n) {
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      FragBt fb;
      wmma::load_matrix_sync(fb, b + n * 16 * kLd + k * 16, kLd);
      wmma::mma_sync(acc, fa[k], fb, acc);
    }
    wmma::store_matrix_sync(out + n * 16, acc, kScoreLd, wmma::mem_row_major);
  }
}

template <int D>
__device__ void LoadRows(const bf16* a, FragA* fa) {
#pragma unroll
  for (int k = 0; k < D / 16; ++k) wmma::load_matrix_sync(fa[k], a + k * 16, Layout<D>::kLd);
}

// acc[n] += P (16 x 64 bf16 at p, ld kProbLd) times the tile (64 x D at tile), for D / 16
// column fragments.
template <int D>
__device__ void AccumulateProducts(const bf16* p, const bf16* tile, FragC* acc) {
  constexpr int kLd = Layout<D>::kLd;
  for (int k = 0; k < kRows / 16; ++k) {
    FragA fa;
    wmma::load_matrix_sync(fa, p + k * 16, kProbLd);
    for (int n = 0; n < D / 16; ++n) {
      FragB fb;
      wmma::load_matrix_sync(fb, tile + k * 16 * kLd + n * 16, kLd);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

// The warp's 16 x hs gradient (D / 16 fragments) into dqkv's rows from first (those below T),
// at column offset `column`, through the staging area; coalesced across the warp.
template <int D>
__device__ void StoreRows(const FragC* acc, float* stage, int first, const Args& a, int b,
                          size_t column, float* dqkv) {
  constexpr int kOutLd = Layout<D>::kOutLd;
  __syncwarp();  // the lanes are done with what the staging area held
  for (int n = 0; n < D / 16; ++n) {
    wmma::store_matrix_sync(stage + n * 16, acc[n], kOutLd, wmma::mem_row_major);
  }
  __syncwarp();
  const int lane = threadIdx.x % 32;
  for (int e = lane; e < 16 * a.hs; e += 32) {
    const int r = e / a.hs, d = e % a.hs;
    if (first + r < a.T) dqkv[a.Row(b, first + r) * 3 * a.c + column + d] = stage[r * kOutLd + d];
  }
}

template <int D>
__global__ void __launch_bounds__(kBlockThreads)
    FlashForwardKernel(const bf16* qkv, Args a, bf16* out, float* lse) {
  using L = Layout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* q_tile = reinterpret_cast<bf16*>(smem);
  bf16* k_tile = reinterpret_cast<bf16*>(smem + L::kTile);
  bf16* v_tile = reinterpret_cast<bf16*>(smem + 2 * L::kTile);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned char* mine = smem + 3 * L::kTile + warp * L::kForwardWarp;
  float* scores = reinterpret_cast<float*>(mine);
  bf16* probs = reinterpret_cast<bf16*>(mine + L::kScores);
  float* acc_out = reinterpret_cast<float*>(mine + L::kScores + L::kProbs);

  const int b = blockIdx.z, h = blockIdx.y;
  const int tile = gridDim.x - 1 - blockIdx.x;  // the rows with the most keys start first
  const int first = tile * kRows;
  auto q_row = [&](int t) { return qkv + a.Row(b, t) * 3 * a.c + a.Head(h); };
  auto k_row = [&](int t) { return q_row(t) + a.c; };
  auto v_row = [&](int t) { return q_row(t) + 2 * static_cast<size_t>(a.c); };
  LoadTile<D>(q_row, first, a.T, a.hs, a.vectors, q_tile);
  for (int e = lane; e < 16 * L::kOutLd; e += 32) acc_out[e] = 0.0f;

  const int row = lane / 2, half = lane % 2;
  const int t = first + warp * 16 + row;  // this lane pair's query
  float m = -INFINITY, l = 0.0f;
  // A lane pair's two lanes take alternate columns (neighbouring banks).
  float* srow = scores + row * kScoreLd + half;
  bf16* prow = probs + row * kProbLd + half;
  float* orow = acc_out + row * L::kOutLd + half;
  const float scale2 = a.scale * kLog2e;
  FragA my_queries[D / 16];
  for (int kt = 0; kt <= tile; ++kt) {
    __syncthreads();  // the previous K and V (and at first Q) are written or no longer read
    LoadTile<D>(k_row, kt * kRows, a.T, a.hs, a.vectors, k_tile);
    LoadTile<D>(v_row, kt * kRows, a.T, a.hs, a.vectors, v_tile);
    __syncthreads();
    if (kt == 0) LoadRows<D>(q_tile + warp * 16 * L::kLd, my_queries);
    RowDots<D>(my_queries, k_tile, scores);
    __syncwarp();
    // The online softmax. Key kt * 64 is at or before every query of this block (and before
    // T), so each row sees at least one key of every tile and m_new is finite. Only the
    // diagonal tile (the block's own, which also holds the keys past T) masks anything.
    const int key0 = kt * kRows + half;
    const bool diagonal = kt == tile;
    auto visible = [&](int j) { return !diagonal || (key0 + j <= t && key0 + j < a.T); };
    float raw_max = -INFINITY;
    for (int j = 0; j < kRows; j += 2) {
      if (visible(j)) raw_max = fmaxf(raw_max, srow[j]);
    }
    raw_max = fmaxf(raw_max, __shfl_xor_sync(0xffffffffu, raw_max, 1));
    const float m_new = fmaxf(m, raw_max * scale2);  // scale2 > 0: the scaled maximum
    const float alpha = exp2f(m - m_new);  // 0 on the first tile (m = -inf)
    float sum = 0.0f;
    for (int j = 0; j < kRows; j += 2) {
      const float p = visible(j) ? exp2f(fmaf(srow[j], scale2, -m_new)) : 0.0f;
      sum += p;
      prow[j] = __float2bfloat16_rn(p);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * alpha + sum;
    m = m_new;
    // Rows whose maximum stayed keep their output as it is (alpha is exactly 1); the warp
    // skips the pass when all 16 did.
    if (__any_sync(0xffffffffu, alpha != 1.0f)) {
      for (int d = 0; d < D; d += 2) orow[d] *= alpha;
    }
    __syncwarp();
    FragC acc[D / 16];
    for (int n = 0; n < D / 16; ++n) {
      wmma::load_matrix_sync(acc[n], acc_out + n * 16, L::kOutLd, wmma::mem_row_major);
    }
    AccumulateProducts<D>(probs, v_tile, acc);
    for (int n = 0; n < D / 16; ++n) {
      wmma::store_matrix_sync(acc_out + n * 16, acc[n], L::kOutLd, wmma::mem_row_major);
    }
    __syncwarp();
  }
  const float inv = 1.0f / l;
  for (int d = 0; d < D; d += 2) orow[d] *= inv;
  if (half == 0 && t < a.T) lse[a.Lse(b, h, t)] = m * kLn2 + logf(l);  // natural, as the CPU
  __syncwarp();
  const int warp_first = first + warp * 16;
  for (int e = lane; e < 16 * a.hs; e += 32) {
    const int r = e / a.hs, d = e % a.hs;
    if (warp_first + r < a.T) {
      out[a.Row(b, warp_first + r) * a.c + a.Head(h) + d] =
          __float2bfloat16_rn(acc_out[r * L::kOutLd + d]);
    }
  }
}

// dK and dV of a tile of 64 keys, over the query tiles from its own to the last.
template <int D>
__global__ void __launch_bounds__(kBlockThreads)
    FlashKeysKernel(const float* dout, const bf16* qkv, const bf16* out, const float* lse, Args a,
                    float* dqkv) {
  using L = Layout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* k_tile = reinterpret_cast<bf16*>(smem);
  bf16* v_tile = reinterpret_cast<bf16*>(smem + L::kTile);
  bf16* q_tile = reinterpret_cast<bf16*>(smem + 2 * L::kTile);
  bf16* g_tile = reinterpret_cast<bf16*>(smem + 3 * L::kTile);
  float* tile_lse = reinterpret_cast<float*>(smem + 4 * L::kTile);
  float* tile_d = tile_lse + kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned char* mine = smem + 4 * L::kTile + L::kRowStats + warp * L::kKeysWarp;
  float* scores = reinterpret_cast<float*>(mine);  // S^T, then the staging area
  float* dprobs = reinterpret_cast<float*>(mine + L::kScores);
  bf16* probs = reinterpret_cast<bf16*>(mine + 2 * L::kScores);
  bf16* dscores = reinterpret_cast<bf16*>(mine + 2 * L::kScores + L::kProbs);

  const int b = blockIdx.z, h = blockIdx.y;
  const int tile = blockIdx.x;  // the keys seen by the most queries start first
  const int first = tile * kRows;
  const int tiles = gridDim.x;
  auto q_row = [&](int t) { return qkv + a.Row(b, t) * 3 * a.c + a.Head(h); };
  auto k_row = [&](int t) { return q_row(t) + a.c; };
  auto v_row = [&](int t) { return q_row(t) + 2 * static_cast<size_t>(a.c); };
  auto g_row = [&](int t) { return dout + a.Row(b, t) * a.c + a.Head(h); };
  auto o_row = [&](int t) { return out + a.Row(b, t) * a.c + a.Head(h); };
  LoadTile<D>(k_row, first, a.T, a.hs, a.vectors, k_tile);
  LoadTile<D>(v_row, first, a.T, a.hs, a.vectors, v_tile);

  FragC dk[D / 16], dv[D / 16];
  for (int n = 0; n < D / 16; ++n) {
    wmma::fill_fragment(dk[n], 0.0f);
    wmma::fill_fragment(dv[n], 0.0f);
  }
  const int row = lane / 2, half = lane % 2;
  const int j = first + warp * 16 + row;  // this lane pair's key
  const float scale2 = a.scale * kLog2e;
  const bf16* my_keys = k_tile + warp * 16 * L::kLd;
  const bf16* my_values = v_tile + warp * 16 * L::kLd;
  for (int qt = tile; qt < tiles; ++qt) {
    __syncthreads();  // the previous Q, dO and row stats are no longer read
    LoadTile<D>(q_row, qt * kRows, a.T, a.hs, a.vectors, q_tile);
    LoadTileRounded<D>(g_row, qt * kRows, a.T, a.hs, a.dout_vectors, g_tile);
    LoadRowStats(g_row, o_row, lse, a.Lse(b, h, qt * kRows), qt * kRows, a.T, a.hs, tile_lse,
                 tile_d);
    __syncthreads();
    RowDots<D>(my_keys, q_tile, scores);     // S^T: keys x queries
    RowDots<D>(my_values, g_tile, dprobs);   // dP^T = V dO^T
    __syncwarp();
    for (int col = half; col < kRows; col += 2) {  // alternate columns per lane
      const int i = qt * kRows + col;
      const bool visible = i >= j && i < a.T && j < a.T;
      const float p =
          visible ? exp2f(fmaf(scores[row * kScoreLd + col], scale2, -tile_lse[col])) : 0.0f;
      const float ds = p * (dprobs[row * kScoreLd + col] - tile_d[col]) * a.scale;
      probs[row * kProbLd + col] = __float2bfloat16_rn(p);
      dscores[row * kProbLd + col] = __float2bfloat16_rn(ds);
    }
    __syncwarp();
    AccumulateProducts<D>(probs, g_tile, dv);    // dV += P^T dO
    AccumulateProducts<D>(dscores, q_tile, dk);  // dK += dS^T Q
  }
  const int warp_first = first + warp * 16;
  StoreRows<D>(dk, scores, warp_first, a, b, a.c + a.Head(h), dqkv);
  StoreRows<D>(dv, scores, warp_first, a, b, 2 * static_cast<size_t>(a.c) + a.Head(h), dqkv);
}

// dQ of a tile of 64 queries, over the key tiles up to its own.
template <int D>
__global__ void __launch_bounds__(kBlockThreads)
    FlashQueriesKernel(const float* dout, const bf16* qkv, const bf16* out, const float* lse,
                       Args a, float* dqkv) {
  using L = Layout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* q_tile = reinterpret_cast<bf16*>(smem);
  bf16* g_tile = reinterpret_cast<bf16*>(smem + L::kTile);
  bf16* k_tile = reinterpret_cast<bf16*>(smem + 2 * L::kTile);
  bf16* v_tile = reinterpret_cast<bf16*>(smem + 3 * L::kTile);
  float* tile_lse = reinterpret_cast<float*>(smem + 4 * L::kTile);
  float* tile_d = tile_lse + kRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned char* mine = smem + 4 * L::kTile + L::kRowStats + warp * L::kQueriesWarp;
  float* scores = reinterpret_cast<float*>(mine);  // S, then the staging area
  float* dprobs = reinterpret_cast<float*>(mine + L::kScores);
  bf16* dscores = reinterpret_cast<bf16*>(mine + 2 * L::kScores);

  const int b = blockIdx.z, h = blockIdx.y;
  const int tile = gridDim.x - 1 - blockIdx.x;  // the queries with the most keys start first
  const int first = tile * kRows;
  auto q_row = [&](int t) { return qkv + a.Row(b, t) * 3 * a.c + a.Head(h); };
  auto k_row = [&](int t) { return q_row(t) + a.c; };
  auto v_row = [&](int t) { return q_row(t) + 2 * static_cast<size_t>(a.c); };
  auto g_row = [&](int t) { return dout + a.Row(b, t) * a.c + a.Head(h); };
  auto o_row = [&](int t) { return out + a.Row(b, t) * a.c + a.Head(h); };
  LoadTile<D>(q_row, first, a.T, a.hs, a.vectors, q_tile);
  LoadTileRounded<D>(g_row, first, a.T, a.hs, a.dout_vectors, g_tile);
  LoadRowStats(g_row, o_row, lse, a.Lse(b, h, first), first, a.T, a.hs, tile_lse, tile_d);

  FragC dq[D / 16];
  for (int n = 0; n < D / 16; ++n) wmma::fill_fragment(dq[n], 0.0f);
  const int row = lane / 2, half = lane % 2;
  const int local = warp * 16 + row;
  const int i = first + local;  // this lane pair's query
  const float scale2 = a.scale * kLog2e;
  FragA my_queries[D / 16], my_grads[D / 16];
  for (int kt = 0; kt <= tile; ++kt) {
    __syncthreads();  // the previous K and V (and at first Q, dO, stats) are done
    LoadTile<D>(k_row, kt * kRows, a.T, a.hs, a.vectors, k_tile);
    LoadTile<D>(v_row, kt * kRows, a.T, a.hs, a.vectors, v_tile);
    __syncthreads();
    if (kt == 0) {
      LoadRows<D>(q_tile + warp * 16 * L::kLd, my_queries);
      LoadRows<D>(g_tile + warp * 16 * L::kLd, my_grads);
    }
    RowDots<D>(my_queries, k_tile, scores);  // S = Q K^T
    RowDots<D>(my_grads, v_tile, dprobs);    // dP = dO V^T
    __syncwarp();
    const float row_lse = tile_lse[local], row_d = tile_d[local];
    for (int col = half; col < kRows; col += 2) {  // alternate columns per lane
      const int key = kt * kRows + col;
      const bool visible = key <= i && key < a.T && i < a.T;
      const float p =
          visible ? exp2f(fmaf(scores[row * kScoreLd + col], scale2, -row_lse)) : 0.0f;
      const float ds = p * (dprobs[row * kScoreLd + col] - row_d) * a.scale;
      dscores[row * kProbLd + col] = __float2bfloat16_rn(ds);
    }
    __syncwarp();
    AccumulateProducts<D>(dscores, k_tile, dq);  // dQ += dS K
  }
  StoreRows<D>(dq, scores, first + warp * 16, a, b, a.Head(h), dqkv);
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

Args MakeArgs(const FlashAttentionShape& s, const Bf16* qkv, const float* dout) {
  Args a;
  a.T = s.T;
  a.c = s.c;
  a.heads = s.heads;
  a.hs = s.hs;
  a.scale = s.scale;
  a.vectors = s.hs % 8 == 0 && s.c % 8 == 0 && Aligned16(qkv);
  a.dout_vectors = dout != nullptr && s.hs % 4 == 0 && s.c % 4 == 0 && Aligned16(dout);
  return a;
}

// Launches kernel over (tiles, heads, batch) with `bytes` of dynamic shared memory (more than
// the default 48 KiB, so the kernel is allowed it first).
template <typename Kernel, typename... Params>
absl::Status Launch(Kernel kernel, const char* name, size_t bytes, const FlashAttentionShape& s,
                    cudaStream_t stream, Params... params) {
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  const dim3 grid((s.T + kRows - 1) / kRows, s.heads, s.batch);
  kernel<<<grid, kBlockThreads, bytes, stream>>>(params...);
  return LaunchStatus(name);
}

template <int D>
absl::Status Forward(const Bf16* qkv, const FlashAttentionShape& s, Bf16* out, float* lse,
                     cudaStream_t stream) {
  return Launch(FlashForwardKernel<D>, "FlashForwardKernel", Layout<D>::kForward, s, stream,
                reinterpret_cast<const bf16*>(qkv), MakeArgs(s, qkv, nullptr),
                reinterpret_cast<bf16*>(out), lse);
}

template <int D>
absl::Status Backward(const float* dout, const Bf16* qkv, const Bf16* out, const float* lse,
                      const FlashAttentionShape& s, float* dqkv, cudaStream_t stream) {
  const Args args = MakeArgs(s, qkv, dout);
  const bf16* q = reinterpret_cast<const bf16*>(qkv);
  const bf16* o = reinterpret_cast<const bf16*>(out);
  LOCKSTEP_RETURN_IF_ERROR(Launch(FlashKeysKernel<D>, "FlashKeysKernel", Layout<D>::kKeys, s,
                                  stream, dout, q, o, lse, args, dqkv));
  return Launch(FlashQueriesKernel<D>, "FlashQueriesKernel", Layout<D>::kQueries, s, stream, dout,
                q, o, lse, args, dqkv);
}

}  // namespace

absl::Status FlashAttentionForward(const Bf16* qkv, const FlashAttentionShape& shape, Bf16* out,
                                   float* lse, cudaStream_t stream) {
  if (shape.hs <= 32) return Forward<32>(qkv, shape, out, lse, stream);
  if (shape.hs <= 64) return Forward<64>(qkv, shape, out, lse, stream);
  return Forward<128>(qkv, shape, out, lse, stream);
}

absl::Status FlashAttentionBackward(const float* dout, const Bf16* qkv, const Bf16* out,
                                    const float* lse, const FlashAttentionShape& shape,
                                    float* dqkv, cudaStream_t stream) {
  if (shape.hs <= 32) return Backward<32>(dout, qkv, out, lse, shape, dqkv, stream);
  if (shape.hs <= 64) return Backward<64>(dout, qkv, out, lse, shape, dqkv, stream);
  return Backward<128>(dout, qkv, out, lse, shape, dqkv, stream);
}

}  // namespace lockstep::kernels::cuda
