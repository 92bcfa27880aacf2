// Transformer kernels on the CPU. Inner loops are plain loops over contiguous floats that the
// compiler vectorizes; sums that decide a statistic (a row's mean and variance, a softmax's
// normalizer) are kept in double.
#include "kernels/cpu_transformer.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu_kernels.h"

namespace lockstep::kernels {
namespace {

float Dot(const float* a, const float* b, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += alpha * x
void Axpy(float alpha, const float* x, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] += alpha * x[i];
}

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

// tanh(x) as a rational function of x (Eigen's minimax fit, odd numerator of degree 13 over an
// even denominator of degree 6), within a few float ulps of tanh on the clamped range and
// exactly +-1 beyond it; plain arithmetic, so the loops around it vectorize (libm's tanhf
// does not, and was a fifth of the step).
inline float FastTanh(float x) {
  constexpr float kClamp = 7.90531110763549805f;
  x = x > kClamp ? kClamp : x;
  x = x < -kClamp ? -kClamp : x;
  const float x2 = x * x;
  float p = -2.76076847742355e-16f;
  p = p * x2 + 2.00018790482477e-13f;
  p = p * x2 + -8.60467152213735e-11f;
  p = p * x2 + 5.12229709037114e-08f;
  p = p * x2 + 1.48572235717979e-05f;
  p = p * x2 + 6.37261928875436e-04f;
  p = p * x2 + 4.89352455891786e-03f;
  p = p * x;
  float q = 1.19825839466702e-06f;
  q = q * x2 + 1.18534705686654e-04f;
  q = q * x2 + 2.26843463243900e-03f;
  q = q * x2 + 4.89352518554385e-03f;
  return p / q;
}


// exp(x) as 2^n exp(r), n = round(x / ln 2), r = x - n ln 2 (in two parts), exp(r) by Cephes'
// degree-6 polynomial: within about 2 float ulps of exp on [-87, 88], and plain arithmetic that
// vectorizes (libm's expf is a call per value).
inline float FastExp(float x) {
  x = x > 88.37f ? 88.37f : x;
  x = x < -87.33f ? -87.33f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return e * scale;
}

// The sum of p[0, n) in double, in eight lanes (added in a fixed order at the end) so that the
// loop vectorizes instead of waiting on one chain of additions.
inline double SumInLanes(const float* p, int n) {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) lane[k] += static_cast<double>(p[i + k]);
  }
  for (; i < n; ++i) lane[0] += static_cast<double>(p[i]);
  return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
}

// p[i] = exp(p[i] - shift) for i < n; returns their sum in double.
__attribute__((target_clones("avx2", "default"))) double ExpShifted(float* p, int n, float shift) {
  for (int i = 0; i < n; ++i) p[i] = FastExp(p[i] - shift);
  return SumInLanes(p, n);
}

// The maximum of p[0, n) (n >= 1) in eight lanes, so it vectorizes; max is exact, so the
// result is the sequential one.
__attribute__((target_clones("avx2", "default"))) float MaxOf(const float* p, int n) {
  float lane[8];
  for (int k = 0; k < 8; ++k) lane[k] = p[0];
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int k = 0; k < 8; ++k) lane[k] = p[i + k] > lane[k] ? p[i + k] : lane[k];
  }
  float m = lane[0];
  for (int k = 1; k < 8; ++k) m = lane[k] > m ? lane[k] : m;
  for (; i < n; ++i) m = p[i] > m ? p[i] : m;
  return m;
}

}  // namespace

// Row statistics in double, in lanes (SumInLanes): a row's mean and variance decide every
// output of the row, and the lanes let the reductions vectorize.
__attribute__((target_clones("avx2", "default"))) void LayerNormForward(
    const float* x, const float* w, const float* b, int rows, int c, float eps, float* out,
    float* mean, float* rstd) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<size_t>(r) * c;
    const double m = SumInLanes(xr, c) / c;
    double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= c; i += 8) {
      for (int k = 0; k < 8; ++k) {
        const double d = xr[i + k] - m;
        lane[k] += d * d;
      }
    }
    for (; i < c; ++i) lane[0] += (xr[i] - m) * (xr[i] - m);
    const double var =
        ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
    const float s = static_cast<float>(1.0 / std::sqrt(var / c + eps));
    const float mf = static_cast<float>(m);
    float* o = out + static_cast<size_t>(r) * c;
    for (int j = 0; j < c; ++j) o[j] = (xr[j] - mf) * s * w[j] + b[j];
    mean[r] = mf;
    rstd[r] = s;
  }
}

__attribute__((target_clones("avx2", "default"))) void LayerNormBackward(
    const float* dout, const float* x, const float* w, const float* mean, const float* rstd,
    int rows, int c, float* dx, float* dw, float* db) {
  for (int r = 0; r < rows; ++r) {
    const float* d = dout + static_cast<size_t>(r) * c;
    const float* xr = x + static_cast<size_t>(r) * c;
    const float m = mean[r], s = rstd[r];
    // The two reductions of the input gradient: mean(w*dout) and mean(w*dout*xhat), in lanes.
    double lane_a[8] = {0, 0, 0, 0, 0, 0, 0, 0}, lane_b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= c; i += 8) {
      for (int k = 0; k < 8; ++k) {
        const float xhat = (xr[i + k] - m) * s;
        const float dnorm = w[i + k] * d[i + k];
        lane_a[k] += dnorm;
        lane_b[k] += static_cast<double>(dnorm) * xhat;
      }
    }
    for (; i < c; ++i) {
      const float xhat = (xr[i] - m) * s;
      const float dnorm = w[i] * d[i];
      lane_a[0] += dnorm;
      lane_b[0] += static_cast<double>(dnorm) * xhat;
    }
    auto total = [](const double* l) {
      return ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]));
    };
    const float a = static_cast<float>(total(lane_a) / c);
    const float bterm = static_cast<float>(total(lane_b) / c);
    float* dxr = dx + static_cast<size_t>(r) * c;
    for (int j = 0; j < c; ++j) {
      const float xhat = (xr[j] - m) * s;
      dxr[j] += (w[j] * d[j] - a - xhat * bterm) * s;
    }
    if (db != nullptr) {
      for (int j = 0; j < c; ++j) db[j] += d[j];
    }
    if (dw != nullptr) {
      for (int j = 0; j < c; ++j) dw[j] += (xr[j] - m) * s * d[j];
    }
  }
}

// Compiled for AVX2 and for the baseline; the clones compute the same IEEE operations per
// element (no contraction into FMA), so their results are the same bits.
__attribute__((target_clones("avx2", "default"))) void GeluTanhForward(const float* x, size_t n,
                                                                         float* out) {
  for (size_t i = 0; i < n; ++i) {
    const float v = x[i];
    out[i] = 0.5f * v * (1.0f + FastTanh(kGeluScale * (v + kGeluCubic * v * v * v)));
  }
}

__attribute__((target_clones("avx2", "default"))) void GeluTanhBackward(const float* x,
                                                                          const float* dout,
                                                                          size_t n, float* dx) {
  for (size_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float t = FastTanh(kGeluScale * (v + kGeluCubic * v * v * v));
    const float sech2 = 1.0f - t * t;
    const float local = 0.5f * (1.0f + t) +
                        0.5f * v * sech2 * kGeluScale * (1.0f + 3.0f * kGeluCubic * v * v);
    dx[i] = local * dout[i];
  }
}

__attribute__((target_clones("avx2", "default"))) void BiasGeluTanhForward(const float* bias,
                                                                             int rows, int cols,
                                                                             float* pre,
                                                                             float* out) {
  for (int r = 0; r < rows; ++r) {
    float* p = pre + static_cast<size_t>(r) * cols;
    float* o = out + static_cast<size_t>(r) * cols;
    for (int j = 0; j < cols; ++j) {
      const float v = p[j] + bias[j];
      p[j] = v;
      o[j] = 0.5f * v * (1.0f + FastTanh(kGeluScale * (v + kGeluCubic * v * v * v)));
    }
  }
}

__attribute__((target_clones("avx2", "default"))) void GeluTanhBackwardBiasGrad(
    const float* x, const float* dout, int rows, int cols, float* dx, float* db,
    bool accumulate) {
  if (db != nullptr && !accumulate) std::fill(db, db + cols, 0.0f);
  for (int r = 0; r < rows; ++r) {
    const size_t row = static_cast<size_t>(r) * cols;
    for (int j = 0; j < cols; ++j) {
      const float v = x[row + j];
      const float t = FastTanh(kGeluScale * (v + kGeluCubic * v * v * v));
      const float sech2 = 1.0f - t * t;
      const float local = 0.5f * (1.0f + t) +
                          0.5f * v * sech2 * kGeluScale * (1.0f + 3.0f * kGeluCubic * v * v);
      dx[row + j] = local * dout[row + j];
    }
    if (db != nullptr) {
      for (int j = 0; j < cols; ++j) db[j] += dx[row + j];
    }
  }
}

// Attention one (sequence, head) at a time, in blocks of query rows: block [r0, r1) attends to
// keys [0, r1), so its scores come from one matrix product and its outputs from another, and
// only that block's scores exist at once (at most T^2 floats, reused), never the whole
// batch's. Within the diagonal part the upper triangle is computed and masked: the products
// run at the SGEMM rate, and the blocks skip most of the masked half.
namespace {

constexpr int kQueryBlock = 32;

// The scratch of one block: scores/probabilities and their gradient.
std::vector<float>& Scratch(int which, size_t n) {
  thread_local std::vector<float> buffers[2];
  if (buffers[which].size() < n) buffers[which].resize(n);
  return buffers[which];
}

}  // namespace

void CausalAttentionForward(const float* qkv, int batch, int T, int c, int heads, float* out,
                            float* lse) {
  const int hs = c / heads;
  const int row = 3 * c;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  float* P = Scratch(0, static_cast<size_t>(T) * T).data();
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      const float* Q = qkv + static_cast<size_t>(b) * T * row + h * hs;
      const float* K = Q + c;
      const float* V = Q + 2 * c;
      float* O = out + static_cast<size_t>(b) * T * c + h * hs;
      float* l = lse + (static_cast<size_t>(b) * heads + h) * T;
      for (int r0 = 0; r0 < T; r0 += kQueryBlock) {
        const int r1 = std::min(T, r0 + kQueryBlock), m = r1 - r0;
        // Scores of rows [r0, r1) against keys [0, r1): m x r1, leading dimension r1.
        Gemm(false, true, m, r1, hs, scale, Q + static_cast<size_t>(r0) * row, row, K, row, 0.0f,
             P, r1);
        for (int t = r0; t < r1; ++t) {
          float* p = P + static_cast<size_t>(t - r0) * r1;
          const float mx = MaxOf(p, t + 1);
          // Subtracting the maximum keeps every exponent <= 0: no overflow, and the sum >= 1.
          const double sum = ExpShifted(p, t + 1, mx);
          const float inv = static_cast<float>(1.0 / sum);
          for (int j = 0; j <= t; ++j) p[j] *= inv;
          std::fill(p + t + 1, p + r1, 0.0f);
          l[t] = mx + static_cast<float>(std::log(sum));
        }
        Gemm(false, false, m, hs, r1, 1.0f, P, r1, V, row, 0.0f, O + static_cast<size_t>(r0) * c,
             c);
      }
    }
  }
}

void CausalAttentionBackward(const float* dout, const float* qkv, const float* out,
                             const float* lse, int batch, int T, int c, int heads, float* dqkv) {
  const int hs = c / heads;
  const int row = 3 * c;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  float* P = Scratch(0, static_cast<size_t>(T) * T).data();
  float* dS = Scratch(1, static_cast<size_t>(T) * T).data();
  // dK and dV gather contributions from every query block: they start at zero.
  std::memset(dqkv, 0, static_cast<size_t>(batch) * T * row * sizeof(float));
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      const size_t first = static_cast<size_t>(b) * T;
      const float* Q = qkv + first * row + h * hs;
      const float* K = Q + c;
      const float* V = Q + 2 * c;
      const float* dO = dout + first * c + h * hs;
      const float* O = out + first * c + h * hs;
      float* dQ = dqkv + first * row + h * hs;
      float* dK = dQ + c;
      float* dV = dQ + 2 * c;
      const float* l = lse + (static_cast<size_t>(b) * heads + h) * T;
      for (int r0 = 0; r0 < T; r0 += kQueryBlock) {
        const int r1 = std::min(T, r0 + kQueryBlock), m = r1 - r0;
        const float* Qb = Q + static_cast<size_t>(r0) * row;
        const float* dOb = dO + static_cast<size_t>(r0) * c;
        // The probabilities, recomputed from the saved log-sum-exps.
        Gemm(false, true, m, r1, hs, scale, Qb, row, K, row, 0.0f, P, r1);
        for (int t = r0; t < r1; ++t) {
          float* p = P + static_cast<size_t>(t - r0) * r1;
          ExpShifted(p, t + 1, l[t]);
          std::fill(p + t + 1, p + r1, 0.0f);
        }
        // dV[0, r1) += P^T dO; dP = dO V^T.
        Gemm(true, false, r1, hs, m, 1.0f, P, r1, dOb, c, 1.0f, dV, row);
        Gemm(false, true, m, r1, hs, 1.0f, dOb, c, V, row, 0.0f, dS, r1);
        // dS = P * (dP - D) * scale, with D = dO . O = sum_j p_j (dO . v_j): the softmax's
        // backward in one dot product per row.
        for (int t = r0; t < r1; ++t) {
          const float D = Dot(dO + static_cast<size_t>(t) * c, O + static_cast<size_t>(t) * c, hs);
          const float* p = P + static_cast<size_t>(t - r0) * r1;
          float* ds = dS + static_cast<size_t>(t - r0) * r1;
          for (int j = 0; j < r1; ++j) ds[j] = p[j] * (ds[j] - D) * scale;
        }
        // dQ[r0, r1) = dS K; dK[0, r1) += dS^T Q.
        Gemm(false, false, m, hs, r1, 1.0f, dS, r1, K, row, 0.0f,
             dQ + static_cast<size_t>(r0) * row, row);
        Gemm(true, false, r1, hs, m, 1.0f, dS, r1, Qb, row, 1.0f, dK, row);
      }
    }
  }
}

void EmbeddingBackward(const int32_t* ids, const float* dx, int rows, int c, float* dtable) {
  for (int r = 0; r < rows; ++r) {
    Axpy(1.0f, dx + static_cast<size_t>(r) * c, dtable + static_cast<size_t>(ids[r]) * c, c);
  }
}

__attribute__((target_clones("avx2", "default"))) void ColumnSums(const float* d, int rows,
                                                                    int cols, float* out,
                                                                    bool accumulate) {
  if (!accumulate) std::fill(out, out + cols, 0.0f);
  for (int r = 0; r < rows; ++r) {
    const float* x = d + static_cast<size_t>(r) * cols;
    for (int j = 0; j < cols; ++j) out[j] += x[j];
  }
}

double SoftmaxCrossEntropyInPlace(float* logits, const int32_t* targets, int rows, int v,
                                  float grad_scale, int64_t* correct) {
  double loss = 0.0;
  int64_t hits = 0;
  for (int r = 0; r < rows; ++r) {
    float* x = logits + static_cast<size_t>(r) * v;
    const int target = targets[r];
    assert(target >= 0 && target < v);
    int argmax = 0;
    for (int i = 1; i < v; ++i) {
      if (x[i] > x[argmax]) argmax = i;  // the first maximum, as torch.argmax
    }
    if (argmax == target) ++hits;
    const float max = x[argmax];
    const float at_target = x[target];
    const double sum = ExpShifted(x, v, max);
    // -log softmax[target] = log(sum) - (x_target - max), the difference in double.
    loss += std::log(sum) - (static_cast<double>(at_target) - max);
    const float s = static_cast<float>(static_cast<double>(grad_scale) / sum);
    for (int i = 0; i < v; ++i) x[i] *= s;
    x[target] -= grad_scale;
  }
  if (correct != nullptr) *correct += hits;
  return loss;
}

}  // namespace lockstep::kernels
