// CUDA twins of the CPU transformer kernels; see cuda_transformer.h.
//
// Layout of the work:
// - LayerNorm: one warp per row (8 rows per 256-thread block). Each lane strides the row by 32,
//   the warp reduces in double with a fixed butterfly, so a row's statistics are the same bits
//   on every run. Products are written with explicit round-to-nearest intrinsics (__fmul_rn,
//   __fadd_rn) where the CPU twin rounds each operation, so nvcc does not contract them into
//   fused multiply-adds and the outputs stay within an ulp or two of the CPU's.
// - Sums over rows (dw, db, column sums): a block of 32 columns by 32 row groups, each group's
//   rows in order, then the groups in order (kernels/cuda_reduce.h); a warp reads 32
//   neighbouring columns of a row, coalesced. The embedding table: a block per 256 columns and class of ids, rows in order
//   (the CPU's bits). No atomics anywhere.
// - Softmax cross-entropy: one block per row (vocabularies of 50,000 and more), two reads of
//   the row (an online sum of exponentials beside the first argmax, then the gradient), block
//   trees for the maximum and the sum (in double), then one thread adds the rows' losses in
//   row order.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda_flash_attention.h"
#include "kernels/cuda_launch.h"
#include "kernels/cuda_reduce.h"
#include "kernels/cuda_transformer.h"

namespace lockstep::kernels::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = kThreads / kWarp;

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi), as on the CPU
constexpr float kGeluCubic = 0.044715f;

// FP32 or bfloat16 storage of an activation (kernels/bf16.h): stores round to nearest even.
__device__ inline void Store(float* p, float v) { *p = v; }
__device__ inline void Store(Bf16* p, float v) {
  p->bits = __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
__device__ inline float Load(const float* p) { return *p; }
__device__ inline float Load(const Bf16* p) {
  return __bfloat162float(__ushort_as_bfloat16(p->bits));
}

__device__ double WarpSum(double v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;  // every lane holds the same total (the butterfly is symmetric)
}

template <typename Out>
__global__ void LayerNormForwardKernel(const float* x, const float* w, const float* b, int rows,
                                       int c, float eps, Out* out, float* mean, float* rstd) {
  const int r = blockIdx.x * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;  // whole warps leave together: r is the same across a warp
  const float* xr = x + static_cast<size_t>(r) * c;
  double sum = 0;
  for (int j = lane; j < c; j += kWarp) sum += static_cast<double>(xr[j]);
  const double m = WarpSum(sum) / c;
  double sq = 0;
  for (int j = lane; j < c; j += kWarp) {
    const double d = static_cast<double>(xr[j]) - m;
    sq += d * d;
  }
  const double var = WarpSum(sq) / c;
  const float s = static_cast<float>(1.0 / sqrt(var + static_cast<double>(eps)));
  const float mf = static_cast<float>(m);
  Out* o = out + static_cast<size_t>(r) * c;
  for (int j = lane; j < c; j += kWarp) {
    Store(o + j, __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(xr[j], mf), s), w[j]), b[j]));
  }
  if (lane == 0) {
    mean[r] = mf;
    rstd[r] = s;
  }
}

// The input gradient, a warp per row: the row's two reductions, mean(w * dout) and
// mean(w * dout * xhat), then dx = base + (w * dout - a - xhat * b) * rstd (base may be dx).
__global__ void LayerNormBackwardInputKernel(const float* dout, const float* x, const float* w,
                                             const float* mean, const float* rstd, int rows, int c,
                                             const float* base, float* dx) {
  const int r = blockIdx.x * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const size_t row = static_cast<size_t>(r) * c;
  const float m = mean[r], s = rstd[r];
  double sum_a = 0, sum_b = 0;
  for (int j = lane; j < c; j += kWarp) {
    const float xhat = __fmul_rn(__fsub_rn(x[row + j], m), s);
    const float dnorm = __fmul_rn(w[j], dout[row + j]);
    sum_a += static_cast<double>(dnorm);
    sum_b += static_cast<double>(dnorm) * xhat;
  }
  const float a = static_cast<float>(WarpSum(sum_a) / c);
  const float bterm = static_cast<float>(WarpSum(sum_b) / c);
  for (int j = lane; j < c; j += kWarp) {
    const float xhat = __fmul_rn(__fsub_rn(x[row + j], m), s);
    const float g = __fsub_rn(__fsub_rn(__fmul_rn(w[j], dout[row + j]), a), __fmul_rn(xhat, bterm));
    dx[row + j] = __fadd_rn(base[row + j], __fmul_rn(g, s));
  }
}

// LayerNorm's dw and db and the bias gradients sum over the rows in kernels/cuda_reduce.h's
// fixed order (and onto what was there when accumulating).

__global__ void __launch_bounds__(kSumColumns * kSumGroups)
    LayerNormBackwardParamsKernel(const float* dout, const float* x, const float* mean,
                                  const float* rstd, int rows, int c, float* dw, float* db) {
  const int j = blockIdx.x * kSumColumns + threadIdx.x;
  float sum_w = 0.0f, sum_b = 0.0f;
  if (j < c) {
#pragma unroll 8
    for (int r = threadIdx.y; r < rows; r += kSumGroups) {
      const size_t i = static_cast<size_t>(r) * c + j;
      const float d = dout[i];
      sum_b = __fadd_rn(sum_b, d);
      sum_w = __fadd_rn(sum_w, __fmul_rn(__fmul_rn(__fsub_rn(x[i], mean[r]), rstd[r]), d));
    }
  }
  sum_w = AddGroups(sum_w);
  sum_b = AddGroups(sum_b);
  if (threadIdx.y != 0 || j >= c) return;
  if (dw != nullptr) dw[j] = __fadd_rn(dw[j], sum_w);
  if (db != nullptr) db[j] = __fadd_rn(db[j], sum_b);
}

__device__ float GeluTanh(float v) {
  return 0.5f * v * (1.0f + tanhf(kGeluScale * (v + kGeluCubic * v * v * v)));
}

__global__ void GeluTanhForwardKernel(const float* x, size_t n, float* out) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    out[i] = GeluTanh(x[i]);
  }
}

template <typename In>
__global__ void GeluTanhBackwardKernel(const In* x, const float* dout, size_t n, float* dx) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float v = Load(x + i);
    const float t = tanhf(kGeluScale * (v + kGeluCubic * v * v * v));
    const float sech2 = 1.0f - t * t;
    const float local =
        0.5f * (1.0f + t) + 0.5f * v * sech2 * kGeluScale * (1.0f + 3.0f * kGeluCubic * v * v);
    dx[i] = local * dout[i];  // read before written: dx may alias dout
  }
}

// The GELU is of the stored pre-activation (rounded, in bf16), which is what its backward reads.
template <typename Pre, typename Out>
__global__ void BiasGeluTanhForwardKernel(const float* bias, int rows, int cols, Pre* pre,
                                          Out* out) {
  const size_t n = static_cast<size_t>(rows) * cols;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    Store(pre + i, __fadd_rn(Load(pre + i), bias[i % cols]));
    Store(out + i, GeluTanh(Load(pre + i)));
  }
}

__global__ void GatherTokensKernel(const int32_t* tokens, int token_stride, int n, int t,
                                   int offset, int32_t* ids) {
  const size_t rows = static_cast<size_t>(n) * t;
  for (size_t r = blockIdx.x * blockDim.x + threadIdx.x; r < rows;
       r += static_cast<size_t>(gridDim.x) * blockDim.x) {
    ids[r] = tokens[(r / t) * token_stride + r % t + offset];
  }
}

__global__ void PositionsKernel(int rows, int t, int32_t* ids) {
  for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += gridDim.x * blockDim.x) {
    ids[r] = r % t;
  }
}

__global__ void EmbeddingForwardKernel(const int32_t* ids, const float* wte, const float* wpe,
                                       int rows, int t, int c, float* out) {
  const size_t n = static_cast<size_t>(rows) * c;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const size_t r = i / c, k = i % c;
    out[i] = __fadd_rn(wte[static_cast<size_t>(ids[r]) * c + k], wpe[(r % t) * c + k]);
  }
}

template <typename Out>
__global__ void StartWithKernel(const float* residual, const float* bias, int rows, int cols,
                                Out* out) {
  const size_t n = static_cast<size_t>(rows) * cols;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    Store(out + i,
          residual == nullptr ? bias[i % cols] : __fadd_rn(residual[i], bias[i % cols]));
  }
}

// dtable[ids[r]] += dx[r] with each table row's sums in row order (the CPU's bits) and
// without atomics: block (x, y) takes columns [256 x, 256 x + 256) of the ids with
// id % kEmbeddingClasses == y; its threads walk all the rows (their ids staged in shared memory)
// and add the rows of their class. Frequent tokens spread over the classes.
constexpr int kEmbeddingClasses = 128;
constexpr int kIdChunk = 1024;

__global__ void EmbeddingBackwardKernel(const int32_t* ids, const float* dx, int rows, int c,
                                        float* dtable) {
  __shared__ int32_t chunk[kIdChunk];
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  const int32_t id_class = blockIdx.y;
  for (int first = 0; first < rows; first += kIdChunk) {
    const int n = min(kIdChunk, rows - first);
    __syncthreads();  // the previous chunk is no longer read
    for (int i = threadIdx.x; i < n; i += blockDim.x) chunk[i] = ids[first + i];
    __syncthreads();
    if (j >= c) continue;
    for (int i = 0; i < n; ++i) {
      const int32_t id = chunk[i];
      if (id % kEmbeddingClasses != id_class) continue;
      float* t = dtable + static_cast<size_t>(id) * c + j;
      *t = __fadd_rn(*t, dx[static_cast<size_t>(first + i) * c + j]);
    }
  }
}

// With `rounded`, each value read is also written there rounded to bf16 (the same pass).
__global__ void __launch_bounds__(kSumColumns * kSumGroups)
    ColumnSumsKernel(const float* d, int rows, int cols, float* out, bool accumulate,
                     Bf16* rounded) {
  const int j = blockIdx.x * kSumColumns + threadIdx.x;
  float sum = 0.0f;
  if (j < cols) {
#pragma unroll 8
    for (int r = threadIdx.y; r < rows; r += kSumGroups) {
      const size_t i = static_cast<size_t>(r) * cols + j;
      const float v = d[i];
      if (rounded != nullptr) Store(rounded + i, v);
      sum = __fadd_rn(sum, v);
    }
  }
  sum = AddGroups(sum);
  if (threadIdx.y != 0 || j >= cols) return;
  out[j] = accumulate ? __fadd_rn(out[j], sum) : sum;
}

// --- Causal attention ---
// Row r = b*T + t of qkv holds [q (c) | k (c) | v (c)], head h at offset h*hs of each.
constexpr int kQueryRows = 64;  // threads of the forward and dQ blocks: one query row each
constexpr int kKeyRows = 64;    // threads of the dK/dV blocks: one key row each
constexpr int kTile = 32;       // rows of a tile held in shared memory

struct AttentionShape {
  int T, c, heads, hs;
  float scale;  // 1 / sqrt(hs)
  __device__ size_t Row(int b, int t) const { return static_cast<size_t>(b) * T + t; }
  template <typename T>
  __device__ const T* Q(const T* qkv, int b, int t, int h) const {
    return qkv + Row(b, t) * 3 * c + static_cast<size_t>(h) * hs;
  }
  template <typename T>
  __device__ const T* K(const T* qkv, int b, int t, int h) const {
    return Q(qkv, b, t, h) + c;
  }
  template <typename T>
  __device__ const T* V(const T* qkv, int b, int t, int h) const {
    return Q(qkv, b, t, h) + 2 * static_cast<size_t>(c);
  }
  __device__ size_t Lse(int b, int h, int t) const {
    return (static_cast<size_t>(b) * heads + h) * T + t;
  }
};

template <typename B>
__device__ float Dot(const float* a, const B* b, int n) {
  float sum = 0.0f;
  for (int d = 0; d < n; ++d) sum += a[d] * Load(b + d);
  return sum;
}

// Rows [first, first + kTile) of K and V (or Q and dO in the dK/dV pass) into shared tiles;
// rows at or past T are not loaded (and never read). All of the block's threads take part.
template <typename Source>
__device__ void LoadTile(int first, int T, int hs, float (*tile)[kMaxAttentionHead],
                         Source row_of) {
  for (int e = threadIdx.x; e < kTile * hs; e += blockDim.x) {
    const int row = e / hs, d = e % hs;
    if (first + row < T) tile[row][d] = Load(row_of(first + row) + d);
  }
}

template <typename In, typename Out>
__global__ void AttentionForwardKernel(const In* qkv, AttentionShape s, Out* out, float* lse) {
  __shared__ float keys[kTile][kMaxAttentionHead];
  __shared__ float values[kTile][kMaxAttentionHead];
  const int b = blockIdx.z, h = blockIdx.y;
  const int first_query = blockIdx.x * kQueryRows;
  const int t = first_query + threadIdx.x;
  const bool valid = t < s.T;
  const int last_key = min(s.T - 1, first_query + kQueryRows - 1);
  float q[kMaxAttentionHead], acc[kMaxAttentionHead];
  if (valid) {
    const In* qt = s.Q(qkv, b, t, h);
    for (int d = 0; d < s.hs; ++d) {
      q[d] = Load(qt + d);
      acc[d] = 0.0f;
    }
  }
  float m = -INFINITY, l = 0.0f;
  for (int j0 = 0; j0 <= last_key; j0 += kTile) {
    __syncthreads();  // the previous tile is no longer read
    LoadTile(j0, s.T, s.hs, keys, [&](int j) { return s.K(qkv, b, j, h); });
    LoadTile(j0, s.T, s.hs, values, [&](int j) { return s.V(qkv, b, j, h); });
    __syncthreads();
    if (!valid) continue;
    for (int jj = 0; jj < kTile && j0 + jj <= t; ++jj) {
      const float score = Dot(q, keys[jj], s.hs) * s.scale;
      const float m_new = fmaxf(m, score);
      const float alpha = expf(m - m_new);  // 0 on the first key (m = -inf)
      const float p = expf(score - m_new);
      l = l * alpha + p;
      for (int d = 0; d < s.hs; ++d) acc[d] = acc[d] * alpha + p * values[jj][d];
      m = m_new;
    }
  }
  if (!valid) return;
  Out* o = out + s.Row(b, t) * s.c + static_cast<size_t>(h) * s.hs;
  const float inv = 1.0f / l;
  for (int d = 0; d < s.hs; ++d) Store(o + d, acc[d] * inv);
  lse[s.Lse(b, h, t)] = m + logf(l);
}

// dK and dV: thread j owns key row j of its block and walks the queries i >= j in tiles
// (queries, their dO, lse and D_i = dO_i . O_i in shared memory).
template <typename In, typename Out>
__global__ void AttentionBackwardKeysKernel(const float* dout, const In* qkv, const Out* out,
                                            const float* lse, AttentionShape s, float* dqkv) {
  __shared__ float queries[kTile][kMaxAttentionHead];
  __shared__ float grads[kTile][kMaxAttentionHead];
  __shared__ float tile_lse[kTile], tile_d[kTile];
  const int b = blockIdx.z, h = blockIdx.y;
  const int first_key = blockIdx.x * kKeyRows;
  const int j = first_key + threadIdx.x;
  const bool valid = j < s.T;
  float k[kMaxAttentionHead], v[kMaxAttentionHead], dk[kMaxAttentionHead], dv[kMaxAttentionHead];
  if (valid) {
    const In* kj = s.K(qkv, b, j, h);
    const In* vj = s.V(qkv, b, j, h);
    for (int d = 0; d < s.hs; ++d) {
      k[d] = Load(kj + d);
      v[d] = Load(vj + d);
      dk[d] = 0.0f;
      dv[d] = 0.0f;
    }
  }
  auto dout_row = [&](int i) { return dout + s.Row(b, i) * s.c + static_cast<size_t>(h) * s.hs; };
  for (int i0 = first_key; i0 < s.T; i0 += kTile) {
    __syncthreads();
    LoadTile(i0, s.T, s.hs, queries, [&](int i) { return s.Q(qkv, b, i, h); });
    LoadTile(i0, s.T, s.hs, grads, dout_row);
    if (threadIdx.x < kTile && i0 + static_cast<int>(threadIdx.x) < s.T) {
      const int i = i0 + threadIdx.x;
      tile_lse[threadIdx.x] = lse[s.Lse(b, h, i)];
      const Out* oi = out + s.Row(b, i) * s.c + static_cast<size_t>(h) * s.hs;
      tile_d[threadIdx.x] = Dot(dout_row(i), oi, s.hs);
    }
    __syncthreads();
    if (!valid) continue;
    for (int ii = 0; ii < kTile && i0 + ii < s.T; ++ii) {
      if (i0 + ii < j) continue;  // query i sees keys j <= i only
      const float p = expf(Dot(queries[ii], k, s.hs) * s.scale - tile_lse[ii]);
      const float dp = Dot(grads[ii], v, s.hs);
      const float ds = p * (dp - tile_d[ii]) * s.scale;
      for (int d = 0; d < s.hs; ++d) {
        dv[d] += p * grads[ii][d];
        dk[d] += ds * queries[ii][d];
      }
    }
  }
  if (!valid) return;
  float* g = dqkv + s.Row(b, j) * 3 * s.c + static_cast<size_t>(h) * s.hs;
  for (int d = 0; d < s.hs; ++d) {
    g[s.c + d] = dk[d];
    g[2 * s.c + d] = dv[d];
  }
}

// dQ: thread i owns query row i of its block and walks the keys j <= i in tiles.
template <typename In, typename Out>
__global__ void AttentionBackwardQueriesKernel(const float* dout, const In* qkv, const Out* out,
                                               const float* lse, AttentionShape s, float* dqkv) {
  __shared__ float keys[kTile][kMaxAttentionHead];
  __shared__ float values[kTile][kMaxAttentionHead];
  const int b = blockIdx.z, h = blockIdx.y;
  const int first_query = blockIdx.x * kQueryRows;
  const int i = first_query + threadIdx.x;
  const bool valid = i < s.T;
  const int last_key = min(s.T - 1, first_query + kQueryRows - 1);
  float q[kMaxAttentionHead], go[kMaxAttentionHead], dq[kMaxAttentionHead];
  float row_lse = 0.0f, row_d = 0.0f;
  if (valid) {
    const In* qi = s.Q(qkv, b, i, h);
    const float* gi = dout + s.Row(b, i) * s.c + static_cast<size_t>(h) * s.hs;
    const Out* oi = out + s.Row(b, i) * s.c + static_cast<size_t>(h) * s.hs;
    for (int d = 0; d < s.hs; ++d) {
      q[d] = Load(qi + d);
      go[d] = gi[d];
      dq[d] = 0.0f;
    }
    row_lse = lse[s.Lse(b, h, i)];
    row_d = Dot(gi, oi, s.hs);
  }
  for (int j0 = 0; j0 <= last_key; j0 += kTile) {
    __syncthreads();
    LoadTile(j0, s.T, s.hs, keys, [&](int j) { return s.K(qkv, b, j, h); });
    LoadTile(j0, s.T, s.hs, values, [&](int j) { return s.V(qkv, b, j, h); });
    __syncthreads();
    if (!valid) continue;
    for (int jj = 0; jj < kTile && j0 + jj <= i; ++jj) {
      const float p = expf(Dot(q, keys[jj], s.hs) * s.scale - row_lse);
      const float ds = p * (Dot(go, values[jj], s.hs) - row_d) * s.scale;
      for (int d = 0; d < s.hs; ++d) dq[d] += ds * keys[jj][d];
    }
  }
  if (!valid) return;
  float* g = dqkv + s.Row(b, i) * 3 * s.c + static_cast<size_t>(h) * s.hs;
  for (int d = 0; d < s.hs; ++d) g[d] = dq[d];
}

static_assert(kKeyRows >= kTile, "a tile's lse and D are loaded by one thread per row");

absl::Status CheckAttentionShape(int batch, int T, int c, int heads, AttentionShape* shape) {
  if (batch < 0 || T < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("causal attention: ", batch, " sequences of ", T, " tokens"));
  }
  if (c <= 0 || heads <= 0 || c % heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("causal attention: ", heads, " heads do not divide ", c, " channels"));
  }
  const int hs = c / heads;
  if (hs > kMaxAttentionHead) {
    return absl::InvalidArgumentError(absl::StrCat("causal attention: head size ", hs,
                                                   " is over the kernel's ", kMaxAttentionHead));
  }
  if (batch > 65535 || heads > 65535) {
    return absl::InvalidArgumentError("causal attention: more than 65,535 sequences or heads");
  }
  // The CPU twin's scale, computed as it does (in float).
  *shape = {T, c, heads, hs, 1.0f / std::sqrt(static_cast<float>(hs))};
  return absl::OkStatus();
}

// A block's first maximum: the larger value, and of equal values the smaller index (as
// torch.argmax and the CPU twin). Fixed tree over the block's threads.
__device__ void BlockArgMax(float* value, int* index) {
  __shared__ float values[kThreads];
  __shared__ int indices[kThreads];
  values[threadIdx.x] = *value;
  indices[threadIdx.x] = *index;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const float v = values[threadIdx.x + stride];
      const int i = indices[threadIdx.x + stride];
      const float u = values[threadIdx.x];
      const int k = indices[threadIdx.x];
      if (v > u || (v == u && i < k)) {
        values[threadIdx.x] = v;
        indices[threadIdx.x] = i;
      }
    }
    __syncthreads();
  }
  *value = values[0];
  *index = indices[0];
  __syncthreads();  // the arrays are reused by the next call
}

__device__ double BlockSum(double v) {
  __shared__ double sums[kThreads];
  sums[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) sums[threadIdx.x] += sums[threadIdx.x + stride];
    __syncthreads();
  }
  const double total = sums[0];
  __syncthreads();
  return total;
}

// One block per row, in two reads of the row. The first finds the first maximum and, per
// thread, an online sum of exponentials: exp(x - the thread's running maximum) in float (the
// device's expf), summed in double and rescaled in double when that maximum grows; the block
// takes each thread's sum to the row's maximum and adds them in a fixed tree. The second
// writes grad_scale * (softmax - onehot(target)) into grad (over the logits in place, or in
// bf16), or nothing when grad is null (a forward only).
template <typename Out>
__global__ void SoftmaxCrossEntropyKernel(float* logits, const int32_t* targets, int v,
                                          float grad_scale, Out* grad, double* row_loss,
                                          int32_t* row_correct) {
  const int r = blockIdx.x;
  const float* x = logits + static_cast<size_t>(r) * v;
  const int target = targets[r];
  float best = -INFINITY;
  int best_index = v;  // no element yet: loses every comparison
  double sum = 0;      // of exp(x - best) over this thread's elements
  for (int i = threadIdx.x; i < v; i += kThreads) {
    const float xi = x[i];
    if (xi > best || best_index == v) {  // strided in increasing i: the first maximum stays
      sum = best_index == v ? 1.0 : sum * exp(static_cast<double>(best) - xi) + 1.0;
      best = xi;
      best_index = i;
    } else {
      sum += static_cast<double>(expf(xi - best));
    }
  }
  const float my_best = best;
  const bool mine = best_index != v;  // this thread saw an element
  BlockArgMax(&best, &best_index);
  const float max = best;
  // Read before the second pass may overwrite it (BlockSum waits for every thread).
  const float at_target = threadIdx.x == 0 ? x[target] : 0.0f;
  sum = BlockSum(mine ? sum * exp(static_cast<double>(my_best) - max) : 0.0);
  // -log softmax[target] = log(sum) - (x_target - max), the difference in double.
  const float scale = static_cast<float>(static_cast<double>(grad_scale) / sum);
  if (threadIdx.x == 0) {
    row_loss[r] = log(sum) - (static_cast<double>(at_target) - max);
    if (row_correct != nullptr) row_correct[r] = best_index == target ? 1 : 0;
  }
  if (grad == nullptr) return;
  Out* g = grad + static_cast<size_t>(r) * v;
  for (int i = threadIdx.x; i < v; i += kThreads) {
    const float p = expf(x[i] - max) * scale;
    Store(g + i, i == target ? p - grad_scale : p);
  }
}

// The rows' losses added in row order (the same bits every run), and the correct rows counted.
// The block stages the rows in shared memory a chunk at a time (coalesced, all loads in
// flight at once) and one thread adds them in order, so the serial part never waits on global
// memory.
__global__ void SumRowsKernel(const double* row_loss, const int32_t* row_correct, int rows,
                              double* loss_sum, bool accumulate, int64_t* correct) {
  __shared__ double losses[kThreads];
  __shared__ int32_t hits_of[kThreads];
  double sum = 0;
  int64_t hits = 0;
  for (int first = 0; first < rows; first += kThreads) {
    const int r = first + threadIdx.x;
    __syncthreads();  // the previous chunk is added
    if (r < rows) {
      losses[threadIdx.x] = row_loss[r];
      hits_of[threadIdx.x] = row_correct != nullptr ? row_correct[r] : 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const int n = min(kThreads, rows - first);
      for (int i = 0; i < n; ++i) {
        sum += losses[i];
        hits += hits_of[i];
      }
    }
  }
  if (threadIdx.x != 0) return;
  *loss_sum = accumulate ? *loss_sum + sum : sum;
  if (correct != nullptr) *correct += hits;
}

__global__ void AddScaledKernel(const double* value, double scale, bool accumulate, double* out) {
  if (blockIdx.x == 0 && threadIdx.x == 0) *out = (accumulate ? *out : 0.0) + *value * scale;
}

}  // namespace

absl::Status AddScaled(const double* value, double scale, bool accumulate, double* out,
                       cudaStream_t stream) {
  AddScaledKernel<<<1, 1, 0, stream>>>(value, scale, accumulate, out);
  return LaunchStatus("AddScaledKernel");
}

namespace {

template <typename Out>
absl::Status LayerNormForwardAs(const float* x, const float* w, const float* b, int rows, int c,
                                float eps, Out* out, float* mean, float* rstd,
                                cudaStream_t stream) {
  if (rows <= 0 || c <= 0) return absl::OkStatus();
  const int blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  LayerNormForwardKernel<<<blocks, kThreads, 0, stream>>>(x, w, b, rows, c, eps, out, mean, rstd);
  return LaunchStatus("LayerNormForwardKernel");
}

template <typename In, typename Out>
absl::Status CausalAttentionForwardAs(const In* qkv, int batch, int T, int c, int heads,
                                      Out* out, float* lse, cudaStream_t stream) {
  AttentionShape shape;
  LOCKSTEP_RETURN_IF_ERROR(CheckAttentionShape(batch, T, c, heads, &shape));
  if (batch == 0 || T == 0) return absl::OkStatus();
  const dim3 grid((T + kQueryRows - 1) / kQueryRows, heads, batch);
  AttentionForwardKernel<<<grid, kQueryRows, 0, stream>>>(qkv, shape, out, lse);
  return LaunchStatus("AttentionForwardKernel");
}

template <typename In, typename Out>
absl::Status CausalAttentionBackwardAs(const float* dout, const In* qkv, const Out* out,
                                       const float* lse, int batch, int T, int c, int heads,
                                       float* dqkv, cudaStream_t stream) {
  AttentionShape shape;
  LOCKSTEP_RETURN_IF_ERROR(CheckAttentionShape(batch, T, c, heads, &shape));
  if (batch == 0 || T == 0) return absl::OkStatus();
  const dim3 keys((T + kKeyRows - 1) / kKeyRows, heads, batch);
  AttentionBackwardKeysKernel<<<keys, kKeyRows, 0, stream>>>(dout, qkv, out, lse, shape, dqkv);
  LOCKSTEP_RETURN_IF_ERROR(LaunchStatus("AttentionBackwardKeysKernel"));
  const dim3 queries((T + kQueryRows - 1) / kQueryRows, heads, batch);
  AttentionBackwardQueriesKernel<<<queries, kQueryRows, 0, stream>>>(dout, qkv, out, lse, shape,
                                                                     dqkv);
  return LaunchStatus("AttentionBackwardQueriesKernel");
}

template <typename Pre, typename Out>
absl::Status BiasGeluTanhForwardAs(const float* bias, int rows, int cols, Pre* pre, Out* out,
                                   cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return absl::OkStatus();
  BiasGeluTanhForwardKernel<<<Blocks(size_t(rows) * cols), kThreads, 0, stream>>>(bias, rows, cols,
                                                                                  pre, out);
  return LaunchStatus("BiasGeluTanhForwardKernel");
}

template <typename In>
absl::Status GeluTanhBackwardAs(const In* x, const float* dout, size_t n, float* dx,
                                cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  GeluTanhBackwardKernel<<<Blocks(n), kThreads, 0, stream>>>(x, dout, n, dx);
  return LaunchStatus("GeluTanhBackwardKernel");
}

template <typename Out>
absl::Status StartWithAs(const float* residual, const float* bias, int rows, int cols, Out* out,
                         cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return absl::OkStatus();
  StartWithKernel<<<Blocks(size_t(rows) * cols), kThreads, 0, stream>>>(residual, bias, rows, cols,
                                                                        out);
  return LaunchStatus("StartWithKernel");
}

}  // namespace

absl::Status LayerNormForward(const float* x, const float* w, const float* b, int rows, int c,
                              float eps, float* out, float* mean, float* rstd,
                              cudaStream_t stream) {
  return LayerNormForwardAs(x, w, b, rows, c, eps, out, mean, rstd, stream);
}

absl::Status LayerNormForward(const float* x, const float* w, const float* b, int rows, int c,
                              float eps, Bf16* out, float* mean, float* rstd,
                              cudaStream_t stream) {
  return LayerNormForwardAs(x, w, b, rows, c, eps, out, mean, rstd, stream);
}

absl::Status LayerNormBackward(const float* dout, const float* x, const float* w, const float* mean,
                               const float* rstd, int rows, int c, float* dx, float* dw, float* db,
                               cudaStream_t stream) {
  return LayerNormBackward(dout, x, w, mean, rstd, rows, c, dx, dx, dw, db, stream);
}

absl::Status LayerNormBackward(const float* dout, const float* x, const float* w, const float* mean,
                               const float* rstd, int rows, int c, const float* base, float* dx,
                               float* dw, float* db, cudaStream_t stream) {
  if (rows <= 0 || c <= 0) return absl::OkStatus();
  const int blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  LayerNormBackwardInputKernel<<<blocks, kThreads, 0, stream>>>(dout, x, w, mean, rstd, rows, c,
                                                                base, dx);
  LOCKSTEP_RETURN_IF_ERROR(LaunchStatus("LayerNormBackwardInputKernel"));
  if (dw == nullptr && db == nullptr) return absl::OkStatus();
  LayerNormBackwardParamsKernel<<<(c + kSumColumns - 1) / kSumColumns,
                                  dim3(kSumColumns, kSumGroups), 0, stream>>>(dout, x, mean, rstd,
                                                                              rows, c, dw, db);
  return LaunchStatus("LayerNormBackwardParamsKernel");
}

absl::Status CausalAttentionForward(const float* qkv, int batch, int T, int c, int heads,
                                    float* out, float* lse, cudaStream_t stream) {
  return CausalAttentionForwardAs(qkv, batch, T, c, heads, out, lse, stream);
}

absl::Status CausalAttentionForward(const Bf16* qkv, int batch, int T, int c, int heads,
                                    Bf16* out, float* lse, cudaStream_t stream) {
  AttentionShape s;
  LOCKSTEP_RETURN_IF_ERROR(CheckAttentionShape(batch, T, c, heads, &s));
  if (batch == 0 || T == 0) return absl::OkStatus();
  return FlashAttentionForward(qkv, {batch, T, c, heads, s.hs, s.scale}, out, lse, stream);
}

absl::Status CausalAttentionBackward(const float* dout, const float* qkv, const float* out,
                                     const float* lse, int batch, int T, int c, int heads,
                                     float* dqkv, cudaStream_t stream) {
  return CausalAttentionBackwardAs(dout, qkv, out, lse, batch, T, c, heads, dqkv, stream);
}

absl::Status CausalAttentionBackward(const float* dout, const Bf16* qkv, const Bf16* out,
                                     const float* lse, int batch, int T, int c, int heads,
                                     float* dqkv, cudaStream_t stream) {
  AttentionShape s;
  LOCKSTEP_RETURN_IF_ERROR(CheckAttentionShape(batch, T, c, heads, &s));
  if (batch == 0 || T == 0) return absl::OkStatus();
  return FlashAttentionBackward(dout, qkv, out, lse, {batch, T, c, heads, s.hs, s.scale}, dqkv,
                                stream);
}

absl::Status GeluTanhForward(const float* x, size_t n, float* out, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  GeluTanhForwardKernel<<<Blocks(n), kThreads, 0, stream>>>(x, n, out);
  return LaunchStatus("GeluTanhForwardKernel");
}

absl::Status GeluTanhBackward(const float* x, const float* dout, size_t n, float* dx,
                              cudaStream_t stream) {
  return GeluTanhBackwardAs(x, dout, n, dx, stream);
}

absl::Status BiasGeluTanhForward(const float* bias, int rows, int cols, float* pre, float* out,
                                 cudaStream_t stream) {
  return BiasGeluTanhForwardAs(bias, rows, cols, pre, out, stream);
}

absl::Status BiasGeluTanhForward(const float* bias, int rows, int cols, Bf16* pre, Bf16* out,
                                 cudaStream_t stream) {
  return BiasGeluTanhForwardAs(bias, rows, cols, pre, out, stream);
}

absl::Status GeluTanhBackward(const Bf16* x, const float* dout, size_t n, float* dx,
                              cudaStream_t stream) {
  return GeluTanhBackwardAs(x, dout, n, dx, stream);
}

absl::Status StartWith(const float* residual, const float* bias, int rows, int cols, Bf16* out,
                       cudaStream_t stream) {
  return StartWithAs(residual, bias, rows, cols, out, stream);
}

absl::Status GatherTokens(const int32_t* tokens, int token_stride, int n, int t, int offset,
                          int32_t* ids, cudaStream_t stream) {
  if (n <= 0 || t <= 0) return absl::OkStatus();
  if (offset < 0 || t + offset > token_stride) {
    return absl::InvalidArgumentError(absl::StrCat("GatherTokens: ", t, " tokens from offset ",
                                                   offset, " do not fit windows of ",
                                                   token_stride));
  }
  GatherTokensKernel<<<Blocks(size_t(n) * t), kThreads, 0, stream>>>(tokens, token_stride, n, t,
                                                                     offset, ids);
  return LaunchStatus("GatherTokensKernel");
}

absl::Status Positions(int rows, int t, int32_t* ids, cudaStream_t stream) {
  if (rows <= 0) return absl::OkStatus();
  if (t <= 0) return absl::InvalidArgumentError("Positions: t must be > 0");
  PositionsKernel<<<Blocks(rows), kThreads, 0, stream>>>(rows, t, ids);
  return LaunchStatus("PositionsKernel");
}

absl::Status EmbeddingForward(const int32_t* ids, const float* wte, const float* wpe, int rows,
                              int t, int c, float* out, cudaStream_t stream) {
  if (rows <= 0 || c <= 0) return absl::OkStatus();
  if (t <= 0) return absl::InvalidArgumentError("EmbeddingForward: t must be > 0");
  EmbeddingForwardKernel<<<Blocks(size_t(rows) * c), kThreads, 0, stream>>>(ids, wte, wpe, rows, t,
                                                                            c, out);
  return LaunchStatus("EmbeddingForwardKernel");
}

absl::Status StartWith(const float* residual, const float* bias, int rows, int cols, float* out,
                       cudaStream_t stream) {
  return StartWithAs(residual, bias, rows, cols, out, stream);
}

absl::Status EmbeddingBackward(const int32_t* ids, const float* dx, int rows, int c, float* dtable,
                               cudaStream_t stream) {
  if (rows <= 0 || c <= 0) return absl::OkStatus();
  const dim3 grid((c + kThreads - 1) / kThreads, kEmbeddingClasses);
  EmbeddingBackwardKernel<<<grid, kThreads, 0, stream>>>(ids, dx, rows, c, dtable);
  return LaunchStatus("EmbeddingBackwardKernel");
}

absl::Status ColumnSums(const float* d, int rows, int cols, float* out, bool accumulate,
                        cudaStream_t stream) {
  return ColumnSums(d, rows, cols, out, accumulate, nullptr, stream);
}

absl::Status ColumnSums(const float* d, int rows, int cols, float* out, bool accumulate,
                        Bf16* rounded, cudaStream_t stream) {
  if (cols <= 0) return absl::OkStatus();
  ColumnSumsKernel<<<(cols + kSumColumns - 1) / kSumColumns, dim3(kSumColumns, kSumGroups), 0,
                     stream>>>(d, std::max(rows, 0), cols, out, accumulate, rounded);
  return LaunchStatus("ColumnSumsKernel");
}

namespace {

template <typename Out>
absl::Status SoftmaxCrossEntropyAs(const float* logits, const int32_t* targets, int rows, int v,
                                   float grad_scale, Out* grad, double* row_loss,
                                   double* loss_sum, bool accumulate, int32_t* row_correct,
                                   int64_t* correct, cudaStream_t stream) {
  if (v <= 0) return absl::InvalidArgumentError("softmax cross-entropy over 0 classes");
  if (correct != nullptr && row_correct == nullptr) {
    return absl::InvalidArgumentError(
        "softmax cross-entropy: counting correct rows needs row_correct");
  }
  if (rows > 0) {
    // The kernel writes through grad only; in place, grad is the logits.
    SoftmaxCrossEntropyKernel<<<rows, kThreads, 0, stream>>>(
        const_cast<float*>(logits), targets, v, grad_scale, grad, row_loss, row_correct);
    LOCKSTEP_RETURN_IF_ERROR(LaunchStatus("SoftmaxCrossEntropyKernel"));
  }
  SumRowsKernel<<<1, kThreads, 0, stream>>>(row_loss,
                                            correct != nullptr ? row_correct : nullptr,
                                            std::max(rows, 0), loss_sum, accumulate, correct);
  return LaunchStatus("SumRowsKernel");
}

}  // namespace

absl::Status SoftmaxCrossEntropyInPlace(float* logits, const int32_t* targets, int rows, int v,
                                        float grad_scale, double* row_loss, double* loss_sum,
                                        bool accumulate, int32_t* row_correct, int64_t* correct,
                                        cudaStream_t stream) {
  return SoftmaxCrossEntropyAs(logits, targets, rows, v, grad_scale, logits, row_loss, loss_sum,
                               accumulate, row_correct, correct, stream);
}

absl::Status SoftmaxCrossEntropyInto(const float* logits, const int32_t* targets, int rows, int v,
                                     float grad_scale, Bf16* grad, double* row_loss,
                                     double* loss_sum, bool accumulate, int32_t* row_correct,
                                     int64_t* correct, cudaStream_t stream) {
  return SoftmaxCrossEntropyAs(logits, targets, rows, v, grad_scale, grad, row_loss, loss_sum,
                               accumulate, row_correct, correct, stream);
}

}  // namespace lockstep::kernels::cuda
