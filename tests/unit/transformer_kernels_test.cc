// The transformer's CPU kernels against float64 references on random data: forward passes
// against the formulas evaluated in double (attention with the full T x T softmax), backward
// passes against central finite differences of the double forward, so the reference shares no
// code or algebra with the kernel. Errors are relative norms.
#include "kernels/cpu_transformer.h"

#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace lockstep::kernels {
namespace {

std::vector<float> Random(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

template <typename A, typename B>
double RelativeError(const A& got, const B& want) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    err += (double{got[i]} - want[i]) * (double{got[i]} - want[i]);
    norm += double{want[i]} * want[i];
  }
  return std::sqrt(err / std::max(norm, 1e-300));
}

// Central differences of the scalar f at every coordinate of x (double, h = 1e-5).
std::vector<double> NumericGradient(std::vector<double> x,
                                    const std::function<double(const std::vector<double>&)>& f) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i], h = 1e-5;
    x[i] = saved + h;
    const double up = f(x);
    x[i] = saved - h;
    const double down = f(x);
    x[i] = saved;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

std::vector<double> ToDouble(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// ---- LayerNorm

std::vector<double> LayerNormRef(const std::vector<double>& x, const std::vector<double>& w,
                                 const std::vector<double>& b, int rows, int c) {
  std::vector<double> out(x.size());
  for (int r = 0; r < rows; ++r) {
    double m = 0, var = 0;
    for (int i = 0; i < c; ++i) m += x[r * c + i];
    m /= c;
    for (int i = 0; i < c; ++i) var += (x[r * c + i] - m) * (x[r * c + i] - m);
    const double s = 1 / std::sqrt(var / c + 1e-5);
    for (int i = 0; i < c; ++i) out[r * c + i] = (x[r * c + i] - m) * s * w[i] + b[i];
  }
  return out;
}

// c = 24 fills the kernels' eight lanes exactly; 37 leaves a tail after them.
class LayerNormTest : public ::testing::TestWithParam<int> {};

TEST_P(LayerNormTest, MatchesFloat64) {
  const int rows = 6, c = GetParam();
  const auto x = Random(rows * c, 1, 3.0f), w = Random(c, 2), b = Random(c, 3);
  const auto dout = Random(rows * c, 4);
  std::vector<float> out(rows * c), mean(rows), rstd(rows);
  LayerNormForward(x.data(), w.data(), b.data(), rows, c, 1e-5f, out.data(), mean.data(),
                   rstd.data());
  EXPECT_LT(RelativeError(out, LayerNormRef(ToDouble(x), ToDouble(w), ToDouble(b), rows, c)),
            1e-6);
  // Gradients of L = sum(dout * LN(x)), with dx, dw and db ADDED to what is there.
  std::vector<float> dx(rows * c, 0.5f), dw(c, 0.25f), db(c, -1.0f);
  LayerNormBackward(dout.data(), x.data(), w.data(), mean.data(), rstd.data(), rows, c, dx.data(),
                    dw.data(), db.data());
  auto loss = [&](const std::vector<double>& xx, const std::vector<double>& ww,
                  const std::vector<double>& bb) {
    const auto o = LayerNormRef(xx, ww, bb, rows, c);
    double l = 0;
    for (size_t i = 0; i < o.size(); ++i) l += dout[i] * o[i];
    return l;
  };
  auto gx = NumericGradient(ToDouble(x), [&](const auto& v) { return loss(v, ToDouble(w), ToDouble(b)); });
  auto gw = NumericGradient(ToDouble(w), [&](const auto& v) { return loss(ToDouble(x), v, ToDouble(b)); });
  auto gb = NumericGradient(ToDouble(b), [&](const auto& v) { return loss(ToDouble(x), ToDouble(w), v); });
  for (auto& v : gx) v += 0.5;
  for (auto& v : gw) v += 0.25;
  for (auto& v : gb) v -= 1.0;
  EXPECT_LT(RelativeError(dx, gx), 1e-5);
  EXPECT_LT(RelativeError(dw, gw), 1e-5);
  EXPECT_LT(RelativeError(db, gb), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Widths, LayerNormTest, ::testing::Values(24, 37));

// ---- GELU

double GeluRef(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}

TEST(TransformerKernelsTest, GeluTanhMatchesFloat64) {
  auto x = Random(257, 5, 2.5f);
  // Beyond the tanh approximation's clamp, and around zero.
  for (float v : {-30.0f, -9.0f, -7.9f, -1e-4f, 0.0f, 3e-5f, 7.95f, 12.0f, 40.0f}) x.push_back(v);
  const auto dout = Random(x.size(), 6);
  std::vector<float> y(x.size()), dx(x.size());
  GeluTanhForward(x.data(), x.size(), y.data());
  std::vector<double> want(x.size()), grad(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    want[i] = GeluRef(x[i]);
    const double h = 1e-5;
    grad[i] = dout[i] * (GeluRef(x[i] + h) - GeluRef(x[i] - h)) / (2 * h);
  }
  EXPECT_LT(RelativeError(y, want), 1e-6);
  GeluTanhBackward(x.data(), dout.data(), x.size(), dx.data());
  EXPECT_LT(RelativeError(dx, grad), 1e-5);
  // In place, as the model calls it.
  std::vector<float> inplace = dout;
  GeluTanhBackward(x.data(), inplace.data(), x.size(), inplace.data());
  EXPECT_EQ(inplace, dx);
}

// ---- Causal attention

// The full computation: for each head, scores (T x T) masked above the diagonal, softmax, V.
std::vector<double> AttentionRef(const std::vector<double>& qkv, int B, int T, int C, int H) {
  const int hs = C / H;
  std::vector<double> out(static_cast<size_t>(B) * T * C, 0.0);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      for (int t = 0; t < T; ++t) {
        std::vector<double> s(t + 1);
        double m = -1e300, sum = 0;
        for (int j = 0; j <= t; ++j) {
          double d = 0;
          for (int i = 0; i < hs; ++i) {
            d += qkv[(b * T + t) * 3 * C + h * hs + i] * qkv[(b * T + j) * 3 * C + C + h * hs + i];
          }
          s[j] = d / std::sqrt(double(hs));
          m = std::max(m, s[j]);
        }
        for (int j = 0; j <= t; ++j) sum += std::exp(s[j] - m);
        for (int j = 0; j <= t; ++j) {
          const double p = std::exp(s[j] - m) / sum;
          for (int i = 0; i < hs; ++i) {
            out[(b * T + t) * C + h * hs + i] += p * qkv[(b * T + j) * 3 * C + 2 * C + h * hs + i];
          }
        }
      }
    }
  }
  return out;
}

// The fused passes compute what the separate kernels (checked against float64 above) do, to
// the bit: bias then GELU, and GELU's backward then the bias gradient's column sums.
TEST(TransformerKernelsTest, FusedBiasGeluEqualsTheSeparateKernels) {
  const int rows = 37, cols = 52;  // not a multiple of the vector width
  const auto x = Random(static_cast<size_t>(rows) * cols, 21, 2.5f), bias = Random(cols, 22);
  const auto dout = Random(x.size(), 23);
  std::vector<float> pre = x, out(x.size());
  kernels::BiasGeluTanhForward(bias.data(), rows, cols, pre.data(), out.data());
  std::vector<float> pre_ref = x, out_ref(x.size());
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < cols; ++j) pre_ref[static_cast<size_t>(r) * cols + j] += bias[j];
  }
  kernels::GeluTanhForward(pre_ref.data(), pre_ref.size(), out_ref.data());
  EXPECT_EQ(pre, pre_ref);
  EXPECT_EQ(out, out_ref);
  for (bool accumulate : {false, true}) {
    std::vector<float> dx(x.size()), db = Random(cols, 24), dx_ref(x.size()), db_ref = db;
    kernels::GeluTanhBackwardBiasGrad(pre.data(), dout.data(), rows, cols, dx.data(), db.data(),
                                      accumulate);
    kernels::GeluTanhBackward(pre.data(), dout.data(), dx_ref.size(), dx_ref.data());
    kernels::ColumnSums(dx_ref.data(), rows, cols, db_ref.data(), accumulate);
    EXPECT_EQ(dx, dx_ref);
    EXPECT_EQ(db, db_ref) << "accumulate " << accumulate;
    // In place (dx aliasing dout), and without a bias gradient (a frozen bias).
    std::vector<float> in_place = dout;
    kernels::GeluTanhBackwardBiasGrad(pre.data(), in_place.data(), rows, cols, in_place.data(),
                                      nullptr, accumulate);
    EXPECT_EQ(in_place, dx_ref);
  }
}

TEST(TransformerKernelsTest, CausalAttentionMatchesFloat64) {
  const int B = 2, T = 7, C = 12, H = 3;
  const auto qkv = Random(static_cast<size_t>(B) * T * 3 * C, 7, 1.5f);
  const auto dout = Random(static_cast<size_t>(B) * T * C, 8);
  std::vector<float> out(B * T * C), lse(B * H * T), dqkv(qkv.size(), 123.0f);
  CausalAttentionForward(qkv.data(), B, T, C, H, out.data(), lse.data());
  EXPECT_LT(RelativeError(out, AttentionRef(ToDouble(qkv), B, T, C, H)), 1e-6);
  CausalAttentionBackward(dout.data(), qkv.data(), out.data(), lse.data(), B, T, C, H,
                          dqkv.data());
  const auto g = NumericGradient(ToDouble(qkv), [&](const std::vector<double>& v) {
    const auto o = AttentionRef(v, B, T, C, H);
    double l = 0;
    for (size_t i = 0; i < o.size(); ++i) l += dout[i] * o[i];
    return l;
  });
  EXPECT_LT(RelativeError(dqkv, g), 1e-5) << "dqkv is overwritten, causal, per head";
  // The first position of each sequence attends only to itself: its output is its value.
  for (int i = 0; i < C; ++i) EXPECT_FLOAT_EQ(out[i], qkv[2 * C + i]);
}

// Sequences longer than one block of query rows (32), ending in a partial block.
TEST(TransformerKernelsTest, CausalAttentionAcrossQueryBlocksMatchesFloat64) {
  const int B = 1, T = 70, C = 4, H = 2;
  const auto qkv = Random(static_cast<size_t>(B) * T * 3 * C, 17, 1.5f);
  const auto dout = Random(static_cast<size_t>(B) * T * C, 18);
  std::vector<float> out(B * T * C), lse(B * H * T), dqkv(qkv.size(), 5.0f);
  CausalAttentionForward(qkv.data(), B, T, C, H, out.data(), lse.data());
  EXPECT_LT(RelativeError(out, AttentionRef(ToDouble(qkv), B, T, C, H)), 1e-6);
  CausalAttentionBackward(dout.data(), qkv.data(), out.data(), lse.data(), B, T, C, H,
                          dqkv.data());
  const auto g = NumericGradient(ToDouble(qkv), [&](const std::vector<double>& v) {
    const auto o = AttentionRef(v, B, T, C, H);
    double l = 0;
    for (size_t i = 0; i < o.size(); ++i) l += dout[i] * o[i];
    return l;
  });
  EXPECT_LT(RelativeError(dqkv, g), 1e-5);
}

TEST(TransformerKernelsTest, ColumnSumsMatchFloat64) {
  const int rows = 300, cols = 19;
  const auto d = Random(static_cast<size_t>(rows) * cols, 21);
  std::vector<double> want(cols, 0.0);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) want[c] += d[static_cast<size_t>(r) * cols + c];
  }
  std::vector<float> out(cols, 7.0f);
  ColumnSums(d.data(), rows, cols, out.data(), /*accumulate=*/false);
  EXPECT_LT(RelativeError(out, want), 1e-6);
  ColumnSums(d.data(), rows, cols, out.data(), /*accumulate=*/true);
  for (double& w : want) w *= 2;
  EXPECT_LT(RelativeError(out, want), 1e-6);
}

// ---- Embedding gradient and the LM head

TEST(TransformerKernelsTest, EmbeddingBackwardAddsRowsInOrder) {
  const int rows = 9, c = 5, vocab = 4;
  const int32_t ids[rows] = {3, 0, 3, 1, 1, 3, 0, 2, 3};
  const auto dx = Random(rows * c, 9);
  std::vector<float> table(vocab * c, 1.0f);
  EmbeddingBackward(ids, dx.data(), rows, c, table.data());
  std::vector<double> want(vocab * c, 1.0);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < c; ++i) want[ids[r] * c + i] += dx[r * c + i];
  }
  EXPECT_LT(RelativeError(table, want), 1e-6);
  std::vector<float> again(vocab * c, 1.0f);
  EmbeddingBackward(ids, dx.data(), rows, c, again.data());
  EXPECT_EQ(again, table) << "the same bits every time";
}

TEST(TransformerKernelsTest, SoftmaxCrossEntropyInPlaceMatchesFloat64) {
  const int rows = 5, v = 300;
  auto logits = Random(rows * v, 10, 4.0f);
  logits[7] = 80.0f;  // a large logit must not overflow anything
  const int32_t targets[rows] = {7, 0, 299, 150, 42};
  const float scale = 1.0f / 64;
  std::vector<double> want_grad(rows * v);
  double want_loss = 0;
  int64_t want_correct = 0;
  for (int r = 0; r < rows; ++r) {
    double m = -1e300, sum = 0;
    int argmax = 0;
    for (int i = 0; i < v; ++i) {
      m = std::max(m, double{logits[r * v + i]});
      if (logits[r * v + i] > logits[r * v + argmax]) argmax = i;
    }
    for (int i = 0; i < v; ++i) sum += std::exp(logits[r * v + i] - m);
    want_loss += std::log(sum) - (logits[r * v + targets[r]] - m);
    for (int i = 0; i < v; ++i) {
      want_grad[r * v + i] =
          scale * (std::exp(logits[r * v + i] - m) / sum - (i == targets[r] ? 1.0 : 0.0));
    }
    want_correct += argmax == targets[r];
  }
  int64_t correct = 3;  // added to
  const double loss =
      SoftmaxCrossEntropyInPlace(logits.data(), targets, rows, v, scale, &correct);
  EXPECT_NEAR(loss, want_loss, 1e-5 * want_loss);
  EXPECT_LT(RelativeError(logits, want_grad), 1e-6);
  EXPECT_EQ(correct, 3 + want_correct);
  EXPECT_GE(want_correct, 1) << "the row with the large logit predicts its target";
}

}  // namespace
}  // namespace lockstep::kernels
