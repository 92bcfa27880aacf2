// Tests of kernels/cpu_kernels.h against float64 references computed here, on random data from a
// fixed-seed generator, with errors measured as relative L2 norms.
//
// Tolerances. float32 has unit roundoff u = 2^-24 ~ 6e-8, and each bound is a float error model
// with margin (errors observed with these seeds in parentheses):
// - Elementwise kernels round a handful of times per element, so the relative L2 error is a few
//   u: kElementwiseTol = 1e-6, ~16u (observed <= 5e-8).
// - Softmax exponentiates x - max rounded to float; for |x - max| up to ~16 that rounding becomes
//   up to ~16u relative error in exp: kSoftmaxTol = 3e-6 (observed < 1e-7).
// - GEMM sums k = 97 products in float; random-sign rounding errors grow like sqrt(k) * u ~ 6e-7:
//   kGemmTol = 5e-6 (observed <= 2e-7).
// - The optimizers compound a few roundings per step over kSteps steps: kOptimizerTol = 2e-6
//   (observed <= 1.1e-7).
// BiasGradient has its own, tighter bound (see there). Every bug these tests target (a wrong
// transpose or stride, a missing term, a sign, a skipped bias correction) gives an error of 1e-3
// or more.
#include <cblas.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/hash.h"
#include "kernels/cpu_kernels.h"

namespace lockstep::kernels {
namespace {

constexpr double kElementwiseTol = 1e-6;
constexpr double kSoftmaxTol = 3e-6;
constexpr double kGemmTol = 5e-6;
constexpr double kOptimizerTol = 2e-6;

// Fixed-seed mt19937 with our own mapping to [lo, hi): std::uniform_real_distribution is
// implementation-defined, so using it would make the data differ between standard libraries.
class TestRng {
 public:
  explicit TestRng(uint32_t seed) : gen_(seed) {}
  double Uniform(double lo, double hi) {
    return lo + (hi - lo) * (static_cast<double>(gen_()) * (1.0 / 4294967296.0));
  }
  // Modulo bias is irrelevant for picking test labels.
  int Index(int n) { return static_cast<int>(gen_() % static_cast<uint32_t>(n)); }

 private:
  std::mt19937 gen_;
};

std::vector<float> RandomFloats(TestRng& rng, size_t n, double lo, double hi) {
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(rng.Uniform(lo, hi));
  return v;
}

std::vector<double> ToDouble(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// ||x - ref|| / ||ref||; ref must not be all zeros.
double RelL2(const float* x, const double* ref, size_t n) {
  double diff = 0.0;
  double norm = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(x[i]) - ref[i];
    diff += d * d;
    norm += ref[i] * ref[i];
  }
  return std::sqrt(diff) / std::sqrt(norm);
}

double RelL2(const std::vector<float>& x, const std::vector<double>& ref) {
  EXPECT_EQ(x.size(), ref.size());
  return RelL2(x.data(), ref.data(), std::min(x.size(), ref.size()));
}

constexpr double kPi = 3.14159265358979323846;

double GeluRef(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }

double GeluDerivativeRef(double x) {
  return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) +
         x * std::exp(-0.5 * x * x) / std::sqrt(2 * kPi);
}

double ActivationRef(Activation act, double x) {
  switch (act) {
    case Activation::kIdentity:
      return x;
    case Activation::kRelu:
      return x > 0.0 ? x : 0.0;
    case Activation::kGelu:
      return GeluRef(x);
  }
  return 0.0;
}

double ActivationDerivativeRef(Activation act, double x) {
  switch (act) {
    case Activation::kIdentity:
      return 1.0;
    case Activation::kRelu:
      return x > 0.0 ? 1.0 : 0.0;
    case Activation::kGelu:
      return GeluDerivativeRef(x);
  }
  return 0.0;
}

std::string ActivationName(Activation act) {
  switch (act) {
    case Activation::kIdentity:
      return "Identity";
    case Activation::kRelu:
      return "Relu";
    case Activation::kGelu:
      return "Gelu";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// ParseActivation, SetBlasThreads

TEST(ParseActivationTest, KnownNames) {
  Activation act = Activation::kIdentity;
  ASSERT_TRUE(ParseActivation("gelu", &act));
  EXPECT_EQ(act, Activation::kGelu);
  ASSERT_TRUE(ParseActivation("relu", &act));
  EXPECT_EQ(act, Activation::kRelu);
  ASSERT_TRUE(ParseActivation("identity", &act));
  EXPECT_EQ(act, Activation::kIdentity);
  ASSERT_TRUE(ParseActivation("", &act));
  EXPECT_EQ(act, Activation::kRelu);
}

TEST(ParseActivationTest, UnknownNameFailsAndLeavesOutputAlone) {
  for (const char* name : {"tanh", "RELU", "gelu ", "relu6"}) {
    Activation act = Activation::kGelu;
    EXPECT_FALSE(ParseActivation(name, &act)) << name;
    EXPECT_EQ(act, Activation::kGelu) << name;
  }
}

TEST(SetBlasThreadsTest, ChangesOpenBlasThreadCount) {
  const int before = openblas_get_num_threads();
  SetBlasThreads(1);
  EXPECT_EQ(openblas_get_num_threads(), 1);
  SetBlasThreads(before);
  EXPECT_EQ(openblas_get_num_threads(), before);
}

// ---------------------------------------------------------------------------------------------
// Gemm

// Reads element (r, c) of op(X) where X is stored row-major with leading dimension ld.
double OpAt(const std::vector<float>& x, bool trans, int ld, int r, int c) {
  return trans ? x[static_cast<size_t>(c) * ld + r] : x[static_cast<size_t>(r) * ld + c];
}

class GemmTest : public testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(GemmTest, MatchesFloat64ReferenceWithAlphaBetaAndPaddedStrides) {
  const auto [trans_a, trans_b] = GetParam();
  // Non-square, none a multiple of a typical BLAS block, and padded leading dimensions so that
  // a kernel that ignores ld (or mixes up which dimension it strides) fails.
  const int m = 37, n = 23, k = 97;
  const int a_rows = trans_a ? k : m, a_cols = trans_a ? m : k;
  const int b_rows = trans_b ? n : k, b_cols = trans_b ? k : n;
  const int lda = a_cols + 3, ldb = b_cols + 5, ldc = n + 2;
  TestRng rng(1234);
  std::vector<float> a = RandomFloats(rng, static_cast<size_t>(a_rows) * lda, -1.0, 1.0);
  std::vector<float> b = RandomFloats(rng, static_cast<size_t>(b_rows) * ldb, -1.0, 1.0);
  std::vector<float> c = RandomFloats(rng, static_cast<size_t>(m) * ldc, -1.0, 1.0);
  const float alpha = 0.75f, beta = -0.5f;

  std::vector<double> ref(static_cast<size_t>(m) * n);
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double acc = 0.0;
      for (int p = 0; p < k; ++p) acc += OpAt(a, trans_a, lda, i, p) * OpAt(b, trans_b, ldb, p, j);
      ref[static_cast<size_t>(i) * n + j] =
          alpha * acc + beta * c[static_cast<size_t>(i) * ldc + j];
    }
  }
  const std::vector<float> c_before = c;
  Gemm(trans_a, trans_b, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);

  std::vector<float> got(static_cast<size_t>(m) * n);
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j)
      got[static_cast<size_t>(i) * n + j] = c[static_cast<size_t>(i) * ldc + j];
  }
  EXPECT_LT(RelL2(got, ref), kGemmTol);
  // The padding columns of C belong to the caller.
  for (int i = 0; i < m; ++i) {
    for (int j = n; j < ldc; ++j) {
      const size_t idx = static_cast<size_t>(i) * ldc + j;
      EXPECT_EQ(c[idx], c_before[idx]) << i << "," << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllTransposes, GemmTest,
                         testing::Combine(testing::Bool(), testing::Bool()),
                         [](const testing::TestParamInfo<GemmTest::ParamType>& info) {
                           return std::string(std::get<0>(info.param) ? "At" : "A") +
                                  (std::get<1>(info.param) ? "Bt" : "B");
                         });

TEST(GemmTest, BetaZeroOverwritesNaNInOutput) {
  const int m = 5, n = 7, k = 3;
  TestRng rng(99);
  std::vector<float> a = RandomFloats(rng, m * k, -1.0, 1.0);
  std::vector<float> b = RandomFloats(rng, k * n, -1.0, 1.0);
  std::vector<float> c(m * n, std::numeric_limits<float>::quiet_NaN());
  Gemm(false, false, m, n, k, 1.0f, a.data(), k, b.data(), n, 0.0f, c.data(), n);
  std::vector<double> ref(m * n);
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      for (int p = 0; p < k; ++p) ref[i * n + j] += double{a[i * k + p]} * b[p * n + j];
    }
  }
  EXPECT_LT(RelL2(c, ref), kGemmTol);
}

TEST(GemmTest, ZeroInnerDimensionOnlyScalesC) {
  const int m = 4, n = 6;
  TestRng rng(7);
  std::vector<float> c = RandomFloats(rng, m * n, -2.0, 2.0);
  std::vector<double> ref = ToDouble(c);
  for (double& x : ref) x *= 0.25;
  const float dummy = 1.0f;
  Gemm(false, false, m, n, /*k=*/0, 1.0f, &dummy, 1, &dummy, n, 0.25f, c.data(), n);
  EXPECT_LT(RelL2(c, ref), kElementwiseTol);
}

// ---------------------------------------------------------------------------------------------
// BiasActivationForward, ActivationBackward

class ActivationTest : public testing::TestWithParam<Activation> {};

// 13 x 70: 70 columns exercise both the 16-wide vector body and the scalar tail of each row.
constexpr int kActRows = 13;
constexpr int kActCols = 70;

TEST_P(ActivationTest, ForwardMatchesReference) {
  const Activation act = GetParam();
  TestRng rng(42);
  std::vector<float> bias = RandomFloats(rng, kActCols, -0.5, 0.5);
  std::vector<float> z = RandomFloats(rng, kActRows * kActCols, -4.0, 4.0);
  std::vector<double> z_ref(z.size()), a_ref(z.size());
  for (int r = 0; r < kActRows; ++r) {
    for (int c = 0; c < kActCols; ++c) {
      const size_t i = static_cast<size_t>(r) * kActCols + c;
      z_ref[i] = double{z[i]} + bias[c];
      a_ref[i] = ActivationRef(act, z_ref[i]);
    }
  }
  std::vector<float> a = RandomFloats(rng, z.size(), -1.0, 1.0);  // Garbage to be overwritten.
  BiasActivationForward(bias.data(), kActRows, kActCols, act, z.data(), a.data());
  EXPECT_LT(RelL2(z, z_ref), kElementwiseTol);
  EXPECT_LT(RelL2(a, a_ref), kElementwiseTol);
}

TEST_P(ActivationTest, ForwardInPlaceMatchesReference) {
  // Allowed for identity and relu in training; for GELU only as forward-only use.
  const Activation act = GetParam();
  TestRng rng(43);
  std::vector<float> bias = RandomFloats(rng, kActCols, -0.5, 0.5);
  std::vector<float> z = RandomFloats(rng, kActRows * kActCols, -4.0, 4.0);
  std::vector<double> a_ref(z.size());
  for (size_t i = 0; i < z.size(); ++i)
    a_ref[i] = ActivationRef(act, double{z[i]} + bias[i % kActCols]);
  BiasActivationForward(bias.data(), kActRows, kActCols, act, z.data(), z.data());
  EXPECT_LT(RelL2(z, a_ref), kElementwiseTol);
}

TEST_P(ActivationTest, BackwardMatchesAnalyticDerivative) {
  const Activation act = GetParam();
  TestRng rng(44);
  const size_t n = 1000 + 7;
  std::vector<float> z = RandomFloats(rng, n, -4.0, 4.0);
  z[3] = 0.0f;  // relu'(0) is 0 by convention (PyTorch's), and the reference says so too.
  std::vector<float> da = RandomFloats(rng, n, -1.0, 1.0);
  std::vector<double> ref(n);
  for (size_t i = 0; i < n; ++i) ref[i] = double{da[i]} * ActivationDerivativeRef(act, z[i]);

  std::vector<float> dz = RandomFloats(rng, n, -1.0, 1.0);
  ActivationBackward(act, z.data(), da.data(), dz.data(), n);
  EXPECT_LT(RelL2(dz, ref), kElementwiseTol);
  if (act == Activation::kRelu) {
    EXPECT_EQ(dz[3], 0.0f);
  }

  // In place: dz aliases da.
  ActivationBackward(act, z.data(), da.data(), da.data(), n);
  EXPECT_LT(RelL2(da, ref), kElementwiseTol);
}

INSTANTIATE_TEST_SUITE_P(AllActivations, ActivationTest,
                         testing::Values(Activation::kIdentity, Activation::kRelu,
                                         Activation::kGelu),
                         [](const testing::TestParamInfo<Activation>& info) {
                           return ActivationName(info.param);
                         });

TEST(GeluTest, AnalyticDerivativeMatchesFiniteDifference) {
  // Validates the derivative formula itself (the reference above and the kernel both use it):
  // a central difference in double has error ~h^2 * |f'''| + eps/h ~ 1e-10 at h = 1e-5.
  TestRng rng(45);
  const double h = 1e-5;
  std::vector<double> fd, analytic;
  std::vector<float> z = RandomFloats(rng, 500, -5.0, 5.0);
  for (float zf : z) {
    const double x = zf;
    fd.push_back((GeluRef(x + h) - GeluRef(x - h)) / (2 * h));
    analytic.push_back(GeluDerivativeRef(x));
  }
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < fd.size(); ++i) {
    diff += (analytic[i] - fd[i]) * (analytic[i] - fd[i]);
    norm += fd[i] * fd[i];
  }
  EXPECT_LT(std::sqrt(diff / norm), 1e-8);

  // And the float kernel against the finite difference directly.
  std::vector<float> ones(z.size(), 1.0f), dz(z.size());
  ActivationBackward(Activation::kGelu, z.data(), ones.data(), dz.data(), z.size());
  EXPECT_LT(RelL2(dz, fd), kElementwiseTol);
}

TEST(GeluTest, KeepsRelativePrecisionForLargeNegativeInputs) {
  // GELU(-8) = -8 * Phi(-8) ~ -5e-15; computing 1 + erf(x / sqrt2) in float would give exactly 0.
  const std::vector<float> x = {-4.0f, -6.0f, -8.0f, -9.5f};
  std::vector<float> bias(x.size(), 0.0f), z = x, a(x.size());
  BiasActivationForward(bias.data(), 1, static_cast<int>(x.size()), Activation::kGelu, z.data(),
                        a.data());
  std::vector<float> ones(x.size(), 1.0f), dz(x.size());
  ActivationBackward(Activation::kGelu, z.data(), ones.data(), dz.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double xd = x[i];
    const double ref = 0.5 * xd * std::erfc(-xd / std::sqrt(2.0));
    EXPECT_LT(std::fabs(a[i] - ref), 1e-5 * std::fabs(ref)) << x[i];
    const double dref =
        0.5 * std::erfc(-xd / std::sqrt(2.0)) + xd * std::exp(-0.5 * xd * xd) / std::sqrt(2 * kPi);
    EXPECT_LT(std::fabs(dz[i] - dref), 1e-4 * std::fabs(dref)) << x[i];
  }
}

TEST(ReluTest, PropagatesNaN) {
  // A NaN pre-activation must reach the loss check instead of being clamped to 0.
  std::vector<float> bias = {0.0f, 0.0f}, z = {std::nanf(""), -1.0f}, a(2);
  BiasActivationForward(bias.data(), 1, 2, Activation::kRelu, z.data(), a.data());
  EXPECT_TRUE(std::isnan(a[0]));
  EXPECT_EQ(a[1], 0.0f);
}

// ---------------------------------------------------------------------------------------------
// BiasGradient

TEST(BiasGradientTest, MatchesFloat64SumToFloatRounding) {
  // With float64 accumulation the only error left is the final rounding to float (<= u/2 per
  // element), so the bound is 1e-7 (observed 2.7e-8). A float accumulator fails it over 2000
  // rows (8e-7 here: the column sums cancel to ~sqrt(rows) while the partial sums wander), so
  // this checks the precision choice. 300 columns span a full 256-column block and a partial one.
  const int rows = 2000, cols = 300;
  TestRng rng(50);
  std::vector<float> dz = RandomFloats(rng, static_cast<size_t>(rows) * cols, -1.0, 1.0);
  std::vector<double> ref(cols, 0.0);
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) ref[c] += dz[static_cast<size_t>(r) * cols + c];
  }
  std::vector<float> db = RandomFloats(rng, cols, -1.0, 1.0);  // Must be overwritten.
  BiasGradient(dz.data(), rows, cols, db.data());
  EXPECT_LT(RelL2(db, ref), 1e-7);
}

TEST(BiasGradientTest, AccumulateAddsTheFloatSum) {
  const int rows = 37, cols = 300;
  TestRng rng(51);
  std::vector<float> dz = RandomFloats(rng, static_cast<size_t>(rows) * cols, -1.0, 1.0);
  std::vector<float> earlier = RandomFloats(rng, cols, -1.0, 1.0);
  std::vector<float> sum(cols), db = earlier;
  BiasGradient(dz.data(), rows, cols, sum.data());
  BiasGradient(dz.data(), rows, cols, db.data(), /*accumulate=*/true);
  for (int c = 0; c < cols; ++c) EXPECT_EQ(db[c], earlier[c] + sum[c]) << c;
}

TEST(BiasGradientTest, ZeroRowsGivesZero) {
  std::vector<float> db = {1.0f, -2.0f, 3.0f};
  const float unused = 1.0f;
  BiasGradient(&unused, 0, 3, db.data());
  EXPECT_EQ(db, std::vector<float>(3, 0.0f));
}

// ---------------------------------------------------------------------------------------------
// SoftmaxCrossEntropy

struct SoftmaxRef {
  double loss_sum = 0.0;
  std::vector<double> dlogits;
  int64_t correct = 0;
};

SoftmaxRef SoftmaxCrossEntropyRef(const std::vector<float>& logits,
                                  const std::vector<int32_t>& labels, int classes,
                                  double grad_scale) {
  SoftmaxRef out;
  out.dlogits.resize(logits.size());
  const int rows = static_cast<int>(labels.size());
  for (int r = 0; r < rows; ++r) {
    const float* x = logits.data() + static_cast<size_t>(r) * classes;
    const int argmax = static_cast<int>(std::max_element(x, x + classes) - x);  // First max.
    if (argmax == labels[r]) ++out.correct;
    double sum = 0.0;
    for (int c = 0; c < classes; ++c) sum += std::exp(double{x[c]} - x[argmax]);
    out.loss_sum += std::log(sum) - (double{x[labels[r]]} - x[argmax]);
    for (int c = 0; c < classes; ++c) {
      const double p = std::exp(double{x[c]} - x[argmax]) / sum;
      out.dlogits[static_cast<size_t>(r) * classes + c] =
          (p - (c == labels[r] ? 1.0 : 0.0)) * grad_scale;
    }
  }
  return out;
}

void CheckSoftmaxAgainstReference(const std::vector<float>& logits,
                                  const std::vector<int32_t>& labels, int classes,
                                  float grad_scale) {
  const int rows = static_cast<int>(labels.size());
  const SoftmaxRef ref = SoftmaxCrossEntropyRef(logits, labels, classes, grad_scale);
  std::vector<float> dlogits(logits.size(), 123.0f);
  int64_t correct = 5;  // Added to, not overwritten.
  const double loss = SoftmaxCrossEntropy(logits.data(), labels.data(), rows, classes, grad_scale,
                                          dlogits.data(), &correct);
  ASSERT_TRUE(std::isfinite(loss));
  EXPECT_LT(std::fabs(loss - ref.loss_sum), kSoftmaxTol * std::fabs(ref.loss_sum));
  EXPECT_LT(RelL2(dlogits, ref.dlogits), kSoftmaxTol);
  for (float g : dlogits) ASSERT_TRUE(std::isfinite(g));
  EXPECT_EQ(correct, 5 + ref.correct);

  // Without the optional outputs the loss is the same number.
  EXPECT_EQ(SoftmaxCrossEntropy(logits.data(), labels.data(), rows, classes, grad_scale, nullptr,
                                nullptr),
            loss);
}

TEST(SoftmaxCrossEntropyTest, MatchesReference) {
  const int rows = 37, classes = 10;
  TestRng rng(60);
  std::vector<float> logits = RandomFloats(rng, static_cast<size_t>(rows) * classes, -5.0, 5.0);
  std::vector<int32_t> labels(rows);
  for (int r = 0; r < rows; ++r) {
    const float* x = logits.data() + static_cast<size_t>(r) * classes;
    // Every third row labelled with its argmax so that the correct count is neither 0 nor rows.
    labels[r] = r % 3 == 0 ? static_cast<int32_t>(std::max_element(x, x + classes) - x)
                           : rng.Index(classes);
  }
  const SoftmaxRef ref = SoftmaxCrossEntropyRef(logits, labels, classes, 1.0);
  ASSERT_GT(ref.correct, 0);
  ASSERT_LT(ref.correct, rows);
  CheckSoftmaxAgainstReference(logits, labels, classes, 1.0f / 64);
}

TEST(SoftmaxCrossEntropyTest, ManyClasses) {
  const int rows = 6, classes = 1000;
  TestRng rng(61);
  std::vector<float> logits = RandomFloats(rng, static_cast<size_t>(rows) * classes, -8.0, 8.0);
  std::vector<int32_t> labels(rows);
  for (int32_t& l : labels) l = rng.Index(classes);
  CheckSoftmaxAgainstReference(logits, labels, classes, 0.5f);
}

TEST(SoftmaxCrossEntropyTest, LargeLogitsStayFinite) {
  const int classes = 10;
  TestRng rng(62);
  std::vector<float> logits = RandomFloats(rng, 4 * classes, 995.0, 1005.0);
  // A row spanning [-1000, 1000]: exp(1000) overflows float and double alike without the shift,
  // and labelling the -1000 entry gives a loss of ~2000.
  for (int c = 0; c < classes; ++c) logits[3 * classes + c] = c % 2 == 0 ? 1000.0f : -1000.0f;
  const std::vector<int32_t> labels = {2, 7, 0, 1};
  CheckSoftmaxAgainstReference(logits, labels, classes, 1.0f);
  const double loss = SoftmaxCrossEntropy(logits.data() + 3 * classes, &labels[3], 1, classes, 1.0f,
                                          nullptr, nullptr);
  EXPECT_NEAR(loss, 2000.0 + std::log(5.0), 1e-3);
}

TEST(SoftmaxCrossEntropyTest, ArgmaxTieCountsFirstMaximum) {
  // Rows 0 and 2 are labelled with the first of two equal maxima, row 1 with the second.
  const int rows = 3, classes = 6;
  TestRng rng(63);
  std::vector<float> logits = RandomFloats(rng, rows * classes, -1.0, 1.0);
  for (int r = 0; r < rows; ++r) {
    logits[r * classes + 2] = 3.0f;
    logits[r * classes + 5] = 3.0f;
  }
  const std::vector<int32_t> labels = {2, 5, 2};
  int64_t correct = 0;
  SoftmaxCrossEntropy(logits.data(), labels.data(), rows, classes, 1.0f, nullptr, &correct);
  EXPECT_EQ(correct, 2);
}

// ---------------------------------------------------------------------------------------------
// Optimizers

constexpr int kSteps = 5;
constexpr size_t kParams = 1000 + 9;  // Vector body plus a scalar tail.

TEST(SgdMomentumUpdateTest, SeveralStepsMatchReference) {
  for (const float momentum : {0.9f, 0.0f}) {
    SCOPED_TRACE(momentum);
    const float lr = 0.1f, weight_decay = 0.01f;
    TestRng rng(70);
    std::vector<float> p = RandomFloats(rng, kParams, -1.0, 1.0);
    std::vector<float> buf(kParams, 0.0f);  // Zero is the documented initial state.
    std::vector<double> p_ref = ToDouble(p), buf_ref(kParams, 0.0);
    for (int step = 0; step < kSteps; ++step) {
      std::vector<float> g = RandomFloats(rng, kParams, -1.0, 1.0);
      for (size_t i = 0; i < kParams; ++i) {
        const double gi = double{g[i]} + double{weight_decay} * p_ref[i];
        buf_ref[i] = double{momentum} * buf_ref[i] + gi;
        p_ref[i] -= double{lr} * buf_ref[i];
      }
      SgdMomentumUpdate(p.data(), g.data(), buf.data(), kParams, lr, momentum, weight_decay);
    }
    EXPECT_LT(RelL2(p, p_ref), kOptimizerTol);
    EXPECT_LT(RelL2(buf, buf_ref), kOptimizerTol);
  }
}

TEST(AdamWUpdateTest, SeveralStepsMatchReference) {
  const float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.01f;
  TestRng rng(80);
  std::vector<float> p = RandomFloats(rng, kParams, -1.0, 1.0);
  std::vector<float> m(kParams, 0.0f), v(kParams, 0.0f);
  std::vector<double> p_ref = ToDouble(p), m_ref(kParams, 0.0), v_ref(kParams, 0.0);
  for (int64_t step = 1; step <= kSteps; ++step) {
    std::vector<float> g = RandomFloats(rng, kParams, -1.0, 1.0);
    const double bc1 = 1.0 - std::pow(double{beta1}, step);
    const double bc2 = 1.0 - std::pow(double{beta2}, step);
    for (size_t i = 0; i < kParams; ++i) {
      p_ref[i] *= 1.0 - double{lr} * weight_decay;
      m_ref[i] = beta1 * m_ref[i] + (1.0 - beta1) * g[i];
      v_ref[i] = beta2 * v_ref[i] + (1.0 - beta2) * double{g[i]} * g[i];
      p_ref[i] -= lr * (m_ref[i] / bc1) / (std::sqrt(v_ref[i] / bc2) + eps);
    }
    AdamWUpdate(p.data(), g.data(), m.data(), v.data(), kParams, lr, beta1, beta2, eps,
                weight_decay, step);
  }
  EXPECT_LT(RelL2(p, p_ref), kOptimizerTol);
  EXPECT_LT(RelL2(m, m_ref), kOptimizerTol);
  EXPECT_LT(RelL2(v, v_ref), kOptimizerTol);
}

TEST(AdamWUpdateTest, FirstStepMovesEachParameterByLearningRate) {
  // With bias correction, step 1 gives m_hat / sqrt(v_hat) = sign(g): every parameter moves by
  // lr (to within eps / |g|). Without the correction the move would be lr * 0.1 / sqrt(0.001).
  const float lr = 1e-3f;
  TestRng rng(81);
  std::vector<float> p = RandomFloats(rng, kParams, -1.0, 1.0);
  std::vector<float> g = RandomFloats(rng, kParams, 0.1, 1.0);
  const std::vector<float> p0 = p;
  std::vector<float> m(kParams, 0.0f), v(kParams, 0.0f);
  AdamWUpdate(p.data(), g.data(), m.data(), v.data(), kParams, lr, 0.9f, 0.999f, 1e-8f, 0.0f, 1);
  for (size_t i = 0; i < kParams; ++i) {
    EXPECT_NEAR(p0[i] - p[i], lr, 1e-6) << i;
  }
}

// ---------------------------------------------------------------------------------------------
// Fixed point

TEST(FixedPointTest, RoundTripIsExactWhenResolutionAllows) {
  // frac_bits = 32 and |g| in [2^-8, 4): the float's ulp is >= 2^-31, so g * 2^32 is an integer
  // and the round trip must give g back bit for bit.
  TestRng rng(90);
  std::vector<float> g = RandomFloats(rng, 1000, 1.0 / 256, 4.0);
  for (size_t i = 0; i < g.size(); i += 2) g[i] = -g[i];
  std::vector<int64_t> q(g.size());
  EXPECT_EQ(ToFixedPoint(g.data(), g.size(), 32, q.data()), 0);
  std::vector<float> back(g.size());
  FromFixedPoint(q.data(), q.size(), 32, back.data());
  EXPECT_EQ(back, g);
}

TEST(FixedPointTest, CoarseResolutionRoundsToNearest) {
  // frac_bits = 8: error at most half a step (2^-9), and quantization really happens.
  TestRng rng(91);
  std::vector<float> g = RandomFloats(rng, 1000, -3.0, 3.0);
  std::vector<int64_t> q(g.size());
  EXPECT_EQ(ToFixedPoint(g.data(), g.size(), 8, q.data()), 0);
  std::vector<float> back(g.size());
  FromFixedPoint(q.data(), q.size(), 8, back.data());
  size_t changed = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    EXPECT_LE(std::fabs(double{back[i]} - g[i]), 1.0 / 512) << g[i];
    EXPECT_EQ(q[i], std::llround(double{g[i]} * 256)) << g[i];
    if (back[i] != g[i]) ++changed;
  }
  EXPECT_GT(changed, g.size() / 2);
}

TEST(FixedPointTest, TiesRoundAwayFromZero) {
  const std::vector<float> g = {0.5f, -0.5f, 1.5f, 2.5f, -2.5f, 0.25f};
  std::vector<int64_t> q(g.size());
  ASSERT_EQ(ToFixedPoint(g.data(), g.size(), 0, q.data()), 0);
  EXPECT_EQ(q, (std::vector<int64_t>{1, -1, 2, 3, -3, 0}));
}

TEST(FixedPointTest, IntegerSumIsIndependentOfOrder) {
  // 64 ranks of gradients spanning six orders of magnitude. The int64 sums must be identical in
  // every order and equal to the exact sum; float sums of the same data are not.
  const int ranks = 64, frac_bits = 24;
  const size_t n = 500;
  TestRng rng(92);
  std::vector<std::vector<float>> grads(ranks);
  std::vector<std::vector<int64_t>> fixed(ranks, std::vector<int64_t>(n));
  for (int r = 0; r < ranks; ++r) {
    grads[r] = RandomFloats(rng, n, -1.0, 1.0);
    for (float& x : grads[r]) x *= static_cast<float>(std::pow(10.0, rng.Uniform(-3.0, 3.0)));
    ASSERT_EQ(ToFixedPoint(grads[r].data(), n, frac_bits, fixed[r].data()), 0);
  }
  std::vector<int> order(ranks);
  for (int r = 0; r < ranks; ++r) order[r] = r;
  auto sum_in_order = [&](const std::vector<int>& ord, std::vector<int64_t>* isum,
                          std::vector<float>* fsum) {
    isum->assign(n, 0);
    fsum->assign(n, 0.0f);
    for (int r : ord) {
      for (size_t i = 0; i < n; ++i) {
        (*isum)[i] += fixed[r][i];
        (*fsum)[i] += grads[r][i];
      }
    }
  };
  std::vector<int64_t> isum_fwd, isum_other;
  std::vector<float> fsum_fwd, fsum_other;
  sum_in_order(order, &isum_fwd, &fsum_fwd);

  size_t float_mismatches = 0;
  std::mt19937 shuffle_gen(93);
  for (int trial = 0; trial < 4; ++trial) {
    if (trial == 0) {
      std::reverse(order.begin(), order.end());
    } else {
      std::shuffle(order.begin(), order.end(), shuffle_gen);
    }
    sum_in_order(order, &isum_other, &fsum_other);
    EXPECT_EQ(isum_other, isum_fwd) << "trial " << trial;
    for (size_t i = 0; i < n; ++i) float_mismatches += fsum_other[i] != fsum_fwd[i];
  }
  EXPECT_GT(float_mismatches, 0u) << "test data too easy: float sums were order independent";

  // The reduced value equals the exact sum to within one rounding step per addend.
  std::vector<float> reduced(n);
  FromFixedPoint(isum_fwd.data(), n, frac_bits, reduced.data());
  for (size_t i = 0; i < n; ++i) {
    long double exact = 0.0L;
    for (int r = 0; r < ranks; ++r) exact += grads[r][i];
    const double tol = ranks * std::ldexp(1.0, -frac_bits - 1) + std::fabs(double(exact)) * 1e-7;
    EXPECT_NEAR(reduced[i], static_cast<double>(exact), tol) << i;
  }
}

TEST(FixedPointTest, RejectsNonFiniteAndOutOfRangeAndZeroesThem) {
  // frac_bits = 30: the cap is |g| * 2^30 < 2^53, i.e. |g| < 2^23 = 8388608.
  const int frac_bits = 30;
  const float kInf = std::numeric_limits<float>::infinity();
  const float just_below = std::nextafter(8388608.0f, 0.0f);  // 2^23 - 0.5
  const std::vector<float> g = {1.25f,       std::nanf(""), kInf,        -kInf, 8388608.0f,
                                -8388608.0f, just_below,    -just_below, 1e30f, -3.0f};
  std::vector<int64_t> q(g.size(), 77);
  EXPECT_EQ(ToFixedPoint(g.data(), g.size(), frac_bits, q.data()), 6);
  const int64_t two30 = int64_t{1} << 30;
  const int64_t max_ok = (int64_t{1} << 53) - (int64_t{1} << 29);
  EXPECT_EQ(q,
            (std::vector<int64_t>{5 * two30 / 4, 0, 0, 0, 0, 0, max_ok, -max_ok, 0, -3 * two30}));
}

TEST(FixedPointTest, MaxAddendsOfLargestAcceptedValueDoNotOverflow) {
  const int frac_bits = 30;
  const float largest = std::nextafter(8388608.0f, 0.0f);
  for (const float sign : {1.0f, -1.0f}) {
    const float x = sign * largest;
    int64_t q = 0;
    ASSERT_EQ(ToFixedPoint(&x, 1, frac_bits, &q), 0);
    int64_t sum = 0;
    bool overflow = false;
    for (int i = 0; i < kMaxFixedPointAddends; ++i)
      overflow |= __builtin_add_overflow(sum, q, &sum);
    EXPECT_FALSE(overflow);
    float back = 0.0f;
    FromFixedPoint(&sum, 1, frac_bits, &back);
    EXPECT_EQ(back, sign * largest * kMaxFixedPointAddends);
  }
}

TEST(FixedPointTest, LossRoundsHalfAwayFromZeroAndRejectsOutOfRange) {
  int64_t acc = 5;
  EXPECT_EQ(AccumulateLossFixedPoint(2.5, 1.0f, 0, &acc), 0);  // 2.5 -> 3
  EXPECT_EQ(acc, 8);
  EXPECT_EQ(AccumulateLossFixedPoint(-2.5, 1.0f, 0, &acc), 0);  // -2.5 -> -3
  EXPECT_EQ(acc, 5);
  EXPECT_EQ(AccumulateLossFixedPoint(3.0, 0.25f, 40, &acc), 0);  // 0.75 * 2^40, exact
  EXPECT_EQ(acc, 5 + (int64_t{3} << 38));
  acc = 7;
  EXPECT_EQ(AccumulateLossFixedPoint(0x1p51, 1.0f, 0, &acc), 1);
  EXPECT_EQ(AccumulateLossFixedPoint(std::nan(""), 1.0f, 40, &acc), 1);
  EXPECT_EQ(AccumulateLossFixedPoint(1.0, std::numeric_limits<float>::infinity(), 40, &acc), 1);
  EXPECT_EQ(acc, 7);  // rejections add nothing
}

TEST(FixedPointTest, FromFixedPointScales) {
  const std::vector<int64_t> in = {int64_t{1} << 40, -(int64_t{3} << 20), 12345, 0};
  std::vector<float> out(in.size());
  FromFixedPoint(in.data(), in.size(), 20, out.data());
  EXPECT_EQ(out,
            (std::vector<float>{1048576.0f, -3.0f, static_cast<float>(12345.0 / 1048576.0), 0.0f}));
}

// ---------------------------------------------------------------------------------------------
// Fnv1a64

TEST(Fnv1a64Test, KnownVectors) {
  EXPECT_EQ(Fnv1a64("", 0), 0xcbf29ce484222325ULL);
  EXPECT_EQ(Fnv1a64(nullptr, 0), 0xcbf29ce484222325ULL);
  EXPECT_EQ(Fnv1a64("a", 1), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(Fnv1a64("foobar", 6), 0x85944171f73967e8ULL);
}

TEST(Fnv1a64Test, SensitiveToEveryBitOfFloatBuffers) {
  TestRng rng(100);
  std::vector<float> p = RandomFloats(rng, 257, -1.0, 1.0);
  const uint64_t h = Fnv1a64(p.data(), p.size() * sizeof(float));
  EXPECT_EQ(Fnv1a64(p.data(), p.size() * sizeof(float)), h);
  std::vector<float> q = p;
  q[200] = std::nextafter(q[200], 2.0f);  // One ulp.
  EXPECT_NE(Fnv1a64(q.data(), q.size() * sizeof(float)), h);
  const float pos = 0.0f, neg = -0.0f;
  EXPECT_NE(Fnv1a64(&pos, sizeof(pos)), Fnv1a64(&neg, sizeof(neg)));
}

}  // namespace
}  // namespace lockstep::kernels

namespace lockstep::kernels {
namespace {

TEST(AccumulateFixedPointTest, MatchesRoundHalfEvenAndCountsRejects) {
  std::mt19937 rng(123);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  const int frac = 40;
  std::vector<float> g(1000);
  for (float& v : g) v = u(rng) * std::pow(10.0f, static_cast<float>(rng() % 7) - 5.0f);
  g[0] = std::ldexp(1.0f, -41);         // exactly half a step: ties to even gives 0
  g[1] = 3.0f * std::ldexp(1.0f, -41);  // 1.5 steps: ties to even gives 2
  g[2] = std::numeric_limits<float>::quiet_NaN();
  g[3] = std::numeric_limits<float>::infinity();
  g[4] = 4096.0f;  // >= 2^(51-40): out of range
  std::vector<int64_t> acc(g.size(), 7);
  const int64_t rejected = AccumulateFixedPoint(g.data(), g.size(), frac, acc.data());
  EXPECT_EQ(rejected, 3);
  EXPECT_EQ(acc[0], 7);
  EXPECT_EQ(acc[1], 9);
  EXPECT_EQ(acc[2], 7);
  EXPECT_EQ(acc[3], 7);
  EXPECT_EQ(acc[4], 7);
  for (size_t i = 5; i < g.size(); ++i) {
    const double want = std::nearbyint(std::ldexp(static_cast<double>(g[i]), frac));
    ASSERT_EQ(acc[i], 7 + static_cast<int64_t>(want)) << i << " g=" << g[i];
  }
  // Accumulating in any order gives the same integers.
  std::vector<int64_t> a(3, 0), b(3, 0);
  const float x[3] = {0.1f, -2.5e-3f, 1e-7f}, y[3] = {-0.3f, 7.0f, 3e-9f};
  AccumulateFixedPoint(x, 3, frac, a.data());
  AccumulateFixedPoint(y, 3, frac, a.data());
  AccumulateFixedPoint(y, 3, frac, b.data());
  AccumulateFixedPoint(x, 3, frac, b.data());
  EXPECT_EQ(a, b);
}

TEST(AccumulateFixedPointTest, StoreIsAccumulateIntoZero) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-5.0f, 5.0f);
  std::vector<float> g(777);
  for (float& v : g) v = u(rng);
  g[3] = std::numeric_limits<float>::quiet_NaN();
  g[9] = 1e9f;  // out of range for frac 40
  std::vector<int64_t> stored(g.size(), -99), accumulated(g.size(), 0);
  const int64_t rejected_store = StoreFixedPoint(g.data(), g.size(), 40, stored.data());
  const int64_t rejected_acc = AccumulateFixedPoint(g.data(), g.size(), 40, accumulated.data());
  EXPECT_EQ(rejected_store, 2);
  EXPECT_EQ(rejected_store, rejected_acc);
  EXPECT_EQ(stored, accumulated);  // rejected entries become 0, not the old -99
}

TEST(AccumulateFixedPointTest, FromFixedPointHandlesSmallAndLargeSums) {
  // All below 2^51 (the fast path) and one above (the exact slow path) give the same values
  // as a plain double conversion.
  const std::vector<int64_t> small = {0, 1, -1, 123456789, -(int64_t{1} << 50)};
  std::vector<int64_t> large = small;
  large.push_back(int64_t{1} << 60);
  for (const auto& in : {small, large}) {
    std::vector<float> out(in.size());
    FromFixedPoint(in.data(), in.size(), 40, out.data());
    for (size_t i = 0; i < in.size(); ++i) {
      EXPECT_EQ(out[i], static_cast<float>(std::ldexp(static_cast<double>(in[i]), -40))) << i;
    }
  }
}

}  // namespace
}  // namespace lockstep::kernels
