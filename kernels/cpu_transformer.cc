// Transformer kernels on the CPU. Inner loops are plain loops over contiguous floats that the
// compiler vectorizes; sums that decide a statistic (a row's mean and variance, a softmax's
// normalizer) are kept in double.
#include "kernels/cpu_transformer.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <vector>

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

}  // namespace

void LayerNormForward(const float* x, const float* w, const float* b, int rows, int c, float eps,
                      float* out, float* mean, float* rstd) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<size_t>(r) * c;
    double sum = 0.0;
    for (int i = 0; i < c; ++i) sum += xr[i];
    const double m = sum / c;
    double var = 0.0;
    for (int i = 0; i < c; ++i) {
      const double d = xr[i] - m;
      var += d * d;
    }
    const float s = static_cast<float>(1.0 / std::sqrt(var / c + eps));
    const float mf = static_cast<float>(m);
    float* o = out + static_cast<size_t>(r) * c;
    for (int i = 0; i < c; ++i) o[i] = (xr[i] - mf) * s * w[i] + b[i];
    mean[r] = mf;
    rstd[r] = s;
  }
}

void LayerNormBackward(const float* dout, const float* x, const float* w, const float* mean,
                       const float* rstd, int rows, int c, float* dx, float* dw, float* db) {
  for (int r = 0; r < rows; ++r) {
    const float* d = dout + static_cast<size_t>(r) * c;
    const float* xr = x + static_cast<size_t>(r) * c;
    const float m = mean[r], s = rstd[r];
    // The two reductions of the input gradient: mean(w*dout) and mean(w*dout*xhat).
    double dnorm_mean = 0.0, dnorm_xhat_mean = 0.0;
    for (int i = 0; i < c; ++i) {
      const float xhat = (xr[i] - m) * s;
      const float dnorm = w[i] * d[i];
      dnorm_mean += dnorm;
      dnorm_xhat_mean += static_cast<double>(dnorm) * xhat;
    }
    const float a = static_cast<float>(dnorm_mean / c);
    const float bterm = static_cast<float>(dnorm_xhat_mean / c);
    float* dxr = dx + static_cast<size_t>(r) * c;
    for (int i = 0; i < c; ++i) {
      const float xhat = (xr[i] - m) * s;
      if (db != nullptr) db[i] += d[i];
      if (dw != nullptr) dw[i] += xhat * d[i];
      dxr[i] += (w[i] * d[i] - a - xhat * bterm) * s;
    }
  }
}

void GeluTanhForward(const float* x, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) {
    const float v = x[i];
    out[i] = 0.5f * v * (1.0f + std::tanh(kGeluScale * (v + kGeluCubic * v * v * v)));
  }
}

void GeluTanhBackward(const float* x, const float* dout, size_t n, float* dx) {
  for (size_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float t = std::tanh(kGeluScale * (v + kGeluCubic * v * v * v));
    const float sech2 = 1.0f - t * t;
    const float local = 0.5f * (1.0f + t) +
                        0.5f * v * sech2 * kGeluScale * (1.0f + 3.0f * kGeluCubic * v * v);
    dx[i] = local * dout[i];
  }
}

void CausalAttentionForward(const float* qkv, int batch, int T, int c, int heads, float* out,
                            float* lse) {
  const int hs = c / heads;
  const size_t row = static_cast<size_t>(3) * c;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  std::vector<float> p(T);
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      for (int t = 0; t < T; ++t) {
        const float* q = qkv + (static_cast<size_t>(b) * T + t) * row + h * hs;
        float m = -INFINITY;
        for (int j = 0; j <= t; ++j) {
          const float* k = qkv + (static_cast<size_t>(b) * T + j) * row + c + h * hs;
          p[j] = Dot(q, k, hs) * scale;
          m = std::max(m, p[j]);
        }
        // Subtracting the maximum keeps every exponent <= 0: no overflow, and the sum >= 1.
        double sum = 0.0;
        for (int j = 0; j <= t; ++j) {
          p[j] = std::exp(p[j] - m);
          sum += p[j];
        }
        const float inv = static_cast<float>(1.0 / sum);
        float* o = out + (static_cast<size_t>(b) * T + t) * c + h * hs;
        std::fill(o, o + hs, 0.0f);
        for (int j = 0; j <= t; ++j) {
          const float* v = qkv + (static_cast<size_t>(b) * T + j) * row + 2 * c + h * hs;
          Axpy(p[j] * inv, v, o, hs);
        }
        lse[(static_cast<size_t>(b) * heads + h) * T + t] = m + static_cast<float>(std::log(sum));
      }
    }
  }
}

void CausalAttentionBackward(const float* dout, const float* qkv, const float* out,
                             const float* lse, int batch, int T, int c, int heads, float* dqkv) {
  const int hs = c / heads;
  const size_t row = static_cast<size_t>(3) * c;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  std::memset(dqkv, 0, static_cast<size_t>(batch) * T * row * sizeof(float));
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      for (int t = 0; t < T; ++t) {
        const size_t rt = (static_cast<size_t>(b) * T + t);
        const float* q = qkv + rt * row + h * hs;
        const float* dO = dout + rt * c + h * hs;
        const float* O = out + rt * c + h * hs;
        float* dq = dqkv + rt * row + h * hs;
        const float l = lse[(static_cast<size_t>(b) * heads + h) * T + t];
        // D = sum_j p_j (dO . v_j) = dO . O: the softmax's backward in one dot product.
        const float D = Dot(dO, O, hs);
        for (int j = 0; j <= t; ++j) {
          const size_t rj = static_cast<size_t>(b) * T + j;
          const float* k = qkv + rj * row + c + h * hs;
          const float* v = qkv + rj * row + 2 * c + h * hs;
          float* dk = dqkv + rj * row + c + h * hs;
          float* dv = dqkv + rj * row + 2 * c + h * hs;
          // The probability, recomputed from the saved log-sum-exp.
          const float p = std::exp(Dot(q, k, hs) * scale - l);
          Axpy(p, dO, dv, hs);
          const float ds = p * (Dot(dO, v, hs) - D) * scale;
          Axpy(ds, k, dq, hs);
          Axpy(ds, q, dk, hs);
        }
      }
    }
  }
}

void EmbeddingBackward(const int32_t* ids, const float* dx, int rows, int c, float* dtable) {
  for (int r = 0; r < rows; ++r) {
    Axpy(1.0f, dx + static_cast<size_t>(r) * c, dtable + static_cast<size_t>(ids[r]) * c, c);
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
    double sum = 0.0;
    for (int i = 0; i < v; ++i) {
      x[i] = std::exp(x[i] - max);
      sum += x[i];
    }
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
