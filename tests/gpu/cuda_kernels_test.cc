// Every CUDA kernel against its CPU twin on random data (label gpu; skipped without a device).
// Tolerances fit the arithmetic: relative error norms of 1e-5 where the summation order
// differs (GEMM, GPU fused multiply-adds), exact equality for the fixed-point conversions,
// whose bits must match the CPU's for deterministic mode to mix CPU and GPU workers.
#include "kernels/cuda_kernels.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu_kernels.h"
#include "kernels/cpu_transformer.h"
#include "kernels/cuda_transformer.h"
#include "kernels/gpu_check.h"
#include "kernels/phase_timer.h"

namespace lockstep::kernels {
namespace {

// Skips the test, with the reason, when this machine cannot run CUDA code.
#define LOCKSTEP_REQUIRE_GPU()                                                  \
  do {                                                                          \
    int count = 0;                                                              \
    const cudaError_t e = cudaGetDeviceCount(&count);                           \
    if (e != cudaSuccess || count == 0) {                                       \
      GTEST_SKIP() << "no usable GPU: "                                         \
                   << (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices"); \
    }                                                                           \
  } while (false)

template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(const std::vector<T>& host) : n_(host.size()) {
    EXPECT_EQ(cudaMalloc(&ptr_, std::max<size_t>(1, n_) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  explicit DeviceBuffer(size_t n) : DeviceBuffer(std::vector<T>(n)) {}
  ~DeviceBuffer() { cudaFree(ptr_); }
  T* get() { return ptr_; }
  std::vector<T> Read() const {
    std::vector<T> host(n_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  T* ptr_ = nullptr;
  size_t n_;
};

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

double RelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (double{got[i]} - want[i]) * (double{got[i]} - want[i]);
    norm += double{want[i]} * want[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

TEST(CudaKernelsTest, GemmMatchesCpuForEveryTransposition) {
  LOCKSTEP_REQUIRE_GPU();
  auto blas = cuda::Blas::Create(nullptr);
  ASSERT_TRUE(blas.ok()) << blas.status();
  const int m = 67, n = 45, k = 129;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      const int lda = ta ? m : k, ldb = tb ? k : n;
      std::vector<float> a = Random(static_cast<size_t>(m) * k, 1), b = Random(size_t{k} * n, 2);
      std::vector<float> c = Random(static_cast<size_t>(m) * n, 3), want = c;
      Gemm(ta, tb, m, n, k, 0.5f, a.data(), lda, b.data(), ldb, 0.25f, want.data(), n);
      DeviceBuffer<float> da(a), db(b), dc(c);
      ASSERT_TRUE(
          (*blas)
              ->Gemm(ta, tb, m, n, k, 0.5f, da.get(), lda, db.get(), ldb, 0.25f, dc.get(), n)
              .ok());
      EXPECT_LT(RelativeError(dc.Read(), want), 1e-5) << "trans_a " << ta << " trans_b " << tb;
    }
  }
}

// bfloat16 of x, rounded to nearest even (as __float2bfloat16_rn), back as a float.
float RoundToBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7fff + ((bits >> 16) & 1);
  bits &= 0xffff0000u;
  float y;
  std::memcpy(&y, &bits, sizeof(y));
  return y;
}

std::vector<float> RoundedToBf16(std::vector<float> v) {
  for (float& x : v) x = RoundToBf16(x);
  return v;
}

// bf16 products: the operands rounded to bfloat16, FP32 sums. Against the CPU's product of the
// rounded operands they agree to FP32 rounding; against the unrounded ones they differ by
// about bf16's precision (which shows the rounding happened); the caller's inputs are intact.
TEST(CudaKernelsTest, Bf16GemmMultipliesRoundedOperandsInFp32) {
  LOCKSTEP_REQUIRE_GPU();
  auto blas = cuda::Blas::Create(nullptr);
  ASSERT_TRUE(blas.ok()) << blas.status();
  ASSERT_TRUE((*blas)->SetPrecision(cuda::Blas::Precision::kBf16).ok());
  const int m = 67, n = 45, k = 129;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      // A leading dimension wider than the operand, so strided spans are converted too.
      const int lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 5;
      std::vector<float> a = Random(static_cast<size_t>(ta ? k : m) * lda, 1);
      std::vector<float> b = Random(static_cast<size_t>(tb ? n : k) * ldb, 2);
      std::vector<float> c = Random(static_cast<size_t>(m) * n, 3), want = c, exact = c;
      const std::vector<float> ra = RoundedToBf16(a), rb = RoundedToBf16(b);
      Gemm(ta, tb, m, n, k, 0.5f, ra.data(), lda, rb.data(), ldb, 0.25f, want.data(), n);
      Gemm(ta, tb, m, n, k, 0.5f, a.data(), lda, b.data(), ldb, 0.25f, exact.data(), n);
      DeviceBuffer<float> da(a), db(b), dc(c);
      ASSERT_TRUE(
          (*blas)
              ->Gemm(ta, tb, m, n, k, 0.5f, da.get(), lda, db.get(), ldb, 0.25f, dc.get(), n)
              .ok());
      const std::vector<float> got = dc.Read();
      EXPECT_LT(RelativeError(got, want), 1e-5) << "trans_a " << ta << " trans_b " << tb;
      const double off = RelativeError(got, exact);
      EXPECT_GT(off, 1e-4) << "no bf16 rounding seen";
      EXPECT_LT(off, 2e-2);
      EXPECT_EQ(da.Read(), a) << "the FP32 operand was changed";
    }
  }
  // LinearForward (cuBLASLt, bias epilogue) in bf16 too: an even and an odd width, a bias
  // aligned (fused) and not, ReLU (in the epilogue) and GELU (a kernel after it).
  const int rows = 96, out = 33;
  for (int in : {80, 81})
    for (int shift : {0, 1})
      for (Activation act : {Activation::kRelu, Activation::kGelu}) {
        const std::vector<float> x = Random(static_cast<size_t>(rows) * in, 4),
                                 w = Random(size_t{out} * in, 5, 0.1f),
                                 bias_storage = Random(out + 1, 6);
        const std::vector<float> bias(bias_storage.begin() + shift,
                                      bias_storage.begin() + shift + out);
        std::vector<float> z(static_cast<size_t>(rows) * out), want(z.size());
        const std::vector<float> rx = RoundedToBf16(x), rw = RoundedToBf16(w);
        Gemm(false, true, rows, out, in, 1.0f, rx.data(), in, rw.data(), in, 0.0f, z.data(), out);
        BiasActivationForward(bias.data(), rows, out, act, z.data(), want.data());
        DeviceBuffer<float> dx(x), dw(w), dbias(bias_storage), dz(z.size()), da(z.size());
        float* z_out = act == Activation::kGelu ? dz.get() : da.get();
        ASSERT_TRUE((*blas)
                        ->LinearForward(dx.get(), dw.get(), dbias.get() + shift, rows, in, out,
                                        act, z_out, da.get())
                        .ok());
        EXPECT_LT(RelativeError(da.Read(), want), 1e-5) << "in " << in << " shift " << shift;
        EXPECT_EQ(dw.Read(), w) << "the FP32 weights were changed";
      }
}

TEST(CudaKernelsTest, LinearForwardMatchesCpuForEachActivation) {
  LOCKSTEP_REQUIRE_GPU();
  auto blas = cuda::Blas::Create(nullptr);
  ASSERT_TRUE(blas.ok()) << blas.status();
  // One row (cuBLASLt's epilogues have had bugs there), and a bias both 16-byte aligned (the
  // fused epilogue) and not (the plain matmul plus a bias kernel).
  const int in = 80, out = 33;
  const std::vector<float> w = Random(size_t{out} * in, 5, 0.1f);
  const std::vector<float> bias_storage = Random(out + 1, 6);
  for (int rows : {96, 1})
    for (int shift : {0, 1})
      for (Activation act : {Activation::kIdentity, Activation::kRelu, Activation::kGelu}) {
        const std::vector<float> x = Random(static_cast<size_t>(rows) * in, 4);
        const std::vector<float> bias(bias_storage.begin() + shift,
                                      bias_storage.begin() + shift + out);
        std::vector<float> z(static_cast<size_t>(rows) * out), want(z.size());
        Gemm(false, true, rows, out, in, 1.0f, x.data(), in, w.data(), in, 0.0f, z.data(), out);
        BiasActivationForward(bias.data(), rows, out, act, z.data(), want.data());
        // The device bias sits `shift` floats into its allocation: misaligned when shift is 1.
        DeviceBuffer<float> dx(x), dw(w), dbias(bias_storage), dz(z.size()), da(z.size());
        float* z_out = act == Activation::kGelu ? dz.get() : da.get();
        ASSERT_TRUE((*blas)
                        ->LinearForward(dx.get(), dw.get(), dbias.get() + shift, rows, in, out, act,
                                        z_out, da.get())
                        .ok());
        EXPECT_LT(RelativeError(da.Read(), want), 1e-5)
            << "activation " << static_cast<int>(act) << " rows " << rows << " shift " << shift;
        if (act == Activation::kGelu) {
          EXPECT_LT(RelativeError(dz.Read(), z), 1e-5);  // z holds the pre-activation, bias added
        }
      }
}

TEST(CudaKernelsTest, ActivationBackwardAndBiasGradientMatchCpu) {
  LOCKSTEP_REQUIRE_GPU();
  const int rows = 300, cols = 77;
  const size_t n = size_t{rows} * cols;
  const std::vector<float> z = Random(n, 7), da = Random(n, 8);
  for (Activation act : {Activation::kIdentity, Activation::kRelu, Activation::kGelu}) {
    std::vector<float> want(n);
    ActivationBackward(act, z.data(), da.data(), want.data(), n);
    DeviceBuffer<float> dz_in(z), dda(da), ddz(n);
    ASSERT_TRUE(cuda::ActivationBackward(act, dz_in.get(), dda.get(), ddz.get(), n, nullptr).ok());
    EXPECT_LT(RelativeError(ddz.Read(), want), 1e-6) << static_cast<int>(act);
  }
  std::vector<float> want_db(cols);
  BiasGradient(da.data(), rows, cols, want_db.data());
  DeviceBuffer<float> dda(da), ddb(cols);
  ASSERT_TRUE(cuda::BiasGradient(dda.get(), rows, cols, ddb.get(), false, nullptr).ok());
  // Both sum in double (the GPU by fixed groups of rows): the same float but in rare near-ties
  // (a double rounding apart, about one element in a million at 300 rows).
  EXPECT_EQ(ddb.Read(), want_db);
  // Accumulating a second micro-batch adds its float sum, as on the CPU.
  BiasGradient(z.data(), rows, cols, want_db.data(), /*accumulate=*/true);
  DeviceBuffer<float> dz2(z);
  ASSERT_TRUE(cuda::BiasGradient(dz2.get(), rows, cols, ddb.get(), true, nullptr).ok());
  EXPECT_EQ(ddb.Read(), want_db);
}

TEST(CudaKernelsTest, SoftmaxCrossEntropyMatchesCpu) {
  LOCKSTEP_REQUIRE_GPU();
  const int rows = 513, classes = 10;
  const std::vector<float> logits = Random(size_t{rows} * classes, 9, 3.0f);
  std::vector<int32_t> labels(rows);
  for (int r = 0; r < rows; ++r) labels[r] = (r * 7) % classes;
  std::vector<float> want_d(logits.size());
  int64_t want_correct = 0;
  const double want_loss = SoftmaxCrossEntropy(logits.data(), labels.data(), rows, classes,
                                               1.0f / rows, want_d.data(), &want_correct);
  DeviceBuffer<float> dl(logits), dd(logits.size());
  DeviceBuffer<int32_t> dlab(labels), dcorrect(rows);
  DeviceBuffer<double> drow(rows), dsum(1);
  ASSERT_TRUE(cuda::SoftmaxCrossEntropy(dl.get(), dlab.get(), rows, classes, 1.0f / rows, dd.get(),
                                        drow.get(), dcorrect.get(), dsum.get(), false, nullptr)
                  .ok());
  EXPECT_NEAR(dsum.Read()[0], want_loss, 1e-6 * std::abs(want_loss));
  // accumulate_loss adds the sum: twice the loss after a second pass over the same rows.
  DeviceBuffer<double> dsum2(1);
  for (int pass = 0; pass < 2; ++pass) {
    ASSERT_TRUE(cuda::SoftmaxCrossEntropy(dl.get(), dlab.get(), rows, classes, 1.0f / rows,
                                          dd.get(), drow.get(), nullptr, dsum2.get(), pass > 0,
                                          nullptr)
                    .ok());
  }
  EXPECT_EQ(dsum2.Read()[0], dsum.Read()[0] + dsum.Read()[0]);
  EXPECT_LT(RelativeError(dd.Read(), want_d), 1e-5);
  int64_t correct = 0;
  for (int32_t c : dcorrect.Read()) correct += c;
  EXPECT_EQ(correct, want_correct);
}

TEST(CudaKernelsTest, OptimizerUpdatesMatchCpu) {
  LOCKSTEP_REQUIRE_GPU();
  const size_t n = 10'007;
  const std::vector<float> g = Random(n, 10, 0.01f), p0 = Random(n, 11);
  std::vector<float> p = p0, buf(n), m(n), v(n);
  DeviceBuffer<float> dp(p0), dg(g), dbuf(n);
  for (int step = 1; step <= 3; ++step) {
    SgdMomentumUpdate(p.data(), g.data(), buf.data(), n, 0.05f, 0.9f, 1e-4f);
    ASSERT_TRUE(
        cuda::SgdMomentumUpdate(dp.get(), dg.get(), dbuf.get(), n, 0.05f, 0.9f, 1e-4f, nullptr)
            .ok());
  }
  EXPECT_LT(RelativeError(dp.Read(), p), 1e-6);
  p = p0;
  DeviceBuffer<float> dp2(p0), dm(n), dv(n);
  for (int step = 1; step <= 3; ++step) {
    AdamWUpdate(p.data(), g.data(), m.data(), v.data(), n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, step);
    ASSERT_TRUE(cuda::AdamWUpdate(dp2.get(), dg.get(), dm.get(), dv.get(), n, 1e-3f, 0.9f, 0.999f,
                                  1e-8f, 0.01f, step, nullptr)
                    .ok());
  }
  EXPECT_LT(RelativeError(dp2.Read(), p), 1e-6);
}

TEST(CudaKernelsTest, FixedPointConversionsAreBitIdenticalToCpu) {
  LOCKSTEP_REQUIRE_GPU();
  const size_t n = 4099;
  std::vector<float> g = Random(n, 12, 0.3f), h = Random(n, 13, 0.3f);
  g[5] = std::nanf("");
  g[6] = 1e9f;  // beyond 2^(51-32)
  std::vector<int64_t> want(n);
  const int64_t want_rejected = StoreFixedPoint(g.data(), n, 32, want.data()) +
                                AccumulateFixedPoint(h.data(), n, 32, want.data());
  DeviceBuffer<float> dg(g), dh(h);
  DeviceBuffer<int64_t> dfixed(n);
  DeviceBuffer<unsigned long long> drejected(1);
  ASSERT_TRUE(cuda::StoreFixedPoint(dg.get(), n, 32, dfixed.get(), drejected.get(), nullptr).ok());
  ASSERT_TRUE(
      cuda::AccumulateFixedPoint(dh.get(), n, 32, dfixed.get(), drejected.get(), nullptr).ok());
  EXPECT_EQ(dfixed.Read(), want);
  EXPECT_EQ(static_cast<int64_t>(drejected.Read()[0]), want_rejected);

  want[7] = int64_t{1} << 60;  // the exact (slow) path on the CPU
  std::vector<float> want_f(n);
  FromFixedPoint(want.data(), n, 32, want_f.data());
  DeviceBuffer<int64_t> din(want);
  DeviceBuffer<float> dout(n);
  ASSERT_TRUE(cuda::FromFixedPoint(din.get(), n, 32, dout.get(), nullptr).ok());
  const std::vector<float> got = dout.Read();
  EXPECT_EQ(0, std::memcmp(got.data(), want_f.data(), n * sizeof(float)));
}

TEST(CudaKernelsTest, LossFixedPointIsBitIdenticalToCpu) {
  LOCKSTEP_REQUIRE_GPU();
  // Ordinary losses, a tie (x.5 after scaling rounds away from zero), and two rejections.
  // 0x1p-40 * 0.5 * 2^40 = 0.5: a tie, which llround takes away from zero (to 1), unlike the
  // gradients' round-half-even.
  const std::vector<double> losses = {2.302585092994046, 123.456, 0x1p-40, 1e300, std::nan("")};
  int64_t want = 11;
  int64_t want_rejected = 0;
  for (double loss : losses) want_rejected += AccumulateLossFixedPoint(loss, 0.5f, 40, &want);
  DeviceBuffer<double> dloss(losses);
  DeviceBuffer<int64_t> dacc(std::vector<int64_t>{11});
  DeviceBuffer<unsigned long long> drejected(1);
  for (size_t i = 0; i < losses.size(); ++i) {
    ASSERT_TRUE(cuda::AccumulateLossFixedPoint(dloss.get() + i, 0.5f, 40, dacc.get(),
                                               drejected.get(), nullptr)
                    .ok());
  }
  EXPECT_EQ(dacc.Read()[0], want);
  EXPECT_EQ(static_cast<int64_t>(drejected.Read()[0]), want_rejected);
  EXPECT_EQ(want_rejected, 2);
  int64_t tie = 0;
  AccumulateLossFixedPoint(0x1p-40, 0.5f, 40, &tie);
  EXPECT_EQ(tie, 1);
}

TEST(CudaKernelsTest, BucketPackingRoundTrips) {
  LOCKSTEP_REQUIRE_GPU();
  const std::vector<float> flat = Random(1000, 14);
  const cuda::Segments segments = {{10, 100}, {500, 3}, {900, 100}};
  DeviceBuffer<float> dflat(flat), dbucket(203), dback(1000);
  ASSERT_TRUE(cuda::PackBucket(dflat.get(), segments, dbucket.get(), nullptr).ok());
  ASSERT_TRUE(cuda::UnpackBucket(dbucket.get(), segments, dback.get(), nullptr).ok());
  const std::vector<float> bucket = dbucket.Read(), back = dback.Read();
  size_t at = 0;
  for (const auto& [offset, count] : segments) {
    for (size_t i = 0; i < count; ++i, ++at) {
      EXPECT_EQ(bucket[at], flat[offset + i]);
      EXPECT_EQ(back[offset + i], flat[offset + i]);
    }
  }
}

// The CPU optimizer's clipping (worker/step/optimizer.cc): the norm in double, the factor
// min(1, clip / (norm + 1e-6)), the gradient scaled only below 1. A length that does not fill
// the last of the 1,024 partial ranges, and one shorter than their count.
TEST(CudaKernelsTest, ClipByGlobalNormMatchesTheCpuOptimizer) {
  LOCKSTEP_REQUIRE_GPU();
  for (size_t n : {size_t{1000003}, size_t{300}}) {
    const std::vector<float> g = Random(n, 51);
    double sum = 0;
    for (float x : g) sum += static_cast<double>(x) * x;
    const double norm = std::sqrt(sum);
    for (float clip : {static_cast<float>(norm / 3), static_cast<float>(norm * 2)}) {
      const double factor = std::min(1.0, clip / (norm + 1e-6));
      std::vector<float> want = g;
      if (factor < 1.0) {
        for (float& x : want) x *= static_cast<float>(factor);
      }
      DeviceBuffer<float> dev_g(g);
      DeviceBuffer<double> workspace(cuda::kClipWorkspace + 1);
      ASSERT_TRUE(cuda::ClipByGlobalNorm(dev_g.get(), n, clip, workspace.get(), nullptr).ok());
      EXPECT_NEAR(workspace.Read()[0], norm, 1e-12 * norm) << "n " << n;
      const std::vector<float> got = dev_g.Read();
      if (factor < 1.0) {
        EXPECT_LT(RelativeError(got, want), 1e-7) << "n " << n << " clip " << clip;
      } else {
        EXPECT_EQ(got, g) << "a norm under the limit leaves the gradient as it was";
      }
    }
  }
  DeviceBuffer<double> workspace(cuda::kClipWorkspace + 1);
  EXPECT_TRUE(absl::IsInvalidArgument(
      cuda::ClipByGlobalNorm(nullptr, 0, 0.0f, workspace.get(), nullptr)));
}

// --- The GPT's kernels (cuda_transformer.h) against cpu_transformer.h ---

// Shapes with a ragged last warp (c not a multiple of 32) and more rows than one block holds.
TEST(CudaTransformerTest, LayerNormForwardAndBackwardMatchCpu) {
  LOCKSTEP_REQUIRE_GPU();
  for (const auto& [rows, c] : std::vector<std::pair<int, int>>{{37, 100}, {9, 768}, {1, 7}}) {
    // An offset mean, so the statistics' cancellation matters.
    std::vector<float> x = Random(size_t(rows) * c, 11, 3.0f);
    for (float& v : x) v += 50.0f;
    const std::vector<float> w = Random(c, 12), b = Random(c, 13), dout = Random(x.size(), 14);
    std::vector<float> out(x.size()), mean(rows), rstd(rows);
    LayerNormForward(x.data(), w.data(), b.data(), rows, c, 1e-5f, out.data(), mean.data(),
                     rstd.data());
    std::vector<float> dx = Random(x.size(), 15), dw = Random(c, 16), db = Random(c, 17);
    std::vector<float> dx_gpu_start = dx, dw_gpu_start = dw, db_gpu_start = db;
    LayerNormBackward(dout.data(), x.data(), w.data(), mean.data(), rstd.data(), rows, c,
                      dx.data(), dw.data(), db.data());

    DeviceBuffer<float> dev_x(x), dev_w(w), dev_b(b), dev_out(x.size()), dev_mean(rows),
        dev_rstd(rows), dev_dout(dout), dev_dx(dx_gpu_start), dev_dw(dw_gpu_start),
        dev_db(db_gpu_start);
    ASSERT_TRUE(cuda::LayerNormForward(dev_x.get(), dev_w.get(), dev_b.get(), rows, c, 1e-5f,
                                       dev_out.get(), dev_mean.get(), dev_rstd.get(), nullptr)
                    .ok());
    EXPECT_LT(RelativeError(dev_out.Read(), out), 1e-6) << rows << "x" << c;
    EXPECT_LT(RelativeError(dev_mean.Read(), mean), 1e-7);
    EXPECT_LT(RelativeError(dev_rstd.Read(), rstd), 1e-6);
    // The backward from the CPU's statistics, so only the backward's arithmetic is compared.
    DeviceBuffer<float> cpu_mean(mean), cpu_rstd(rstd);
    ASSERT_TRUE(cuda::LayerNormBackward(dev_dout.get(), dev_x.get(), dev_w.get(), cpu_mean.get(),
                                        cpu_rstd.get(), rows, c, dev_dx.get(), dev_dw.get(),
                                        dev_db.get(), nullptr)
                    .ok());
    EXPECT_LT(RelativeError(dev_dx.Read(), dx), 1e-5) << "dx adds onto what was there";
    EXPECT_LT(RelativeError(dev_dw.Read(), dw), 1e-5);
    EXPECT_LT(RelativeError(dev_db.Read(), db), 1e-5);
    // Onto a base in another buffer: the same bits as adding onto it in place.
    DeviceBuffer<float> base(dx_gpu_start), onto(Random(x.size(), 18));
    ASSERT_TRUE(cuda::LayerNormBackward(dev_dout.get(), dev_x.get(), dev_w.get(), cpu_mean.get(),
                                        cpu_rstd.get(), rows, c, base.get(), onto.get(), nullptr,
                                        nullptr, nullptr)
                    .ok());
    EXPECT_EQ(onto.Read(), dev_dx.Read());
    EXPECT_EQ(base.Read(), dx_gpu_start) << "the base is read, not written";
    // Without the parameter gradients only dx is written.
    DeviceBuffer<float> only_dx(dx_gpu_start);
    ASSERT_TRUE(cuda::LayerNormBackward(dev_dout.get(), dev_x.get(), dev_w.get(), cpu_mean.get(),
                                        cpu_rstd.get(), rows, c, only_dx.get(), nullptr, nullptr,
                                        nullptr)
                    .ok());
    EXPECT_LT(RelativeError(only_dx.Read(), dx), 1e-5);
  }
}

// Causal attention, forward and backward, against the CPU twin: sequences longer than one
// block of queries and not a multiple of the tiles, several heads and sequences, and the
// largest head size the kernel takes.
TEST(CudaTransformerTest, CausalAttentionMatchesCpu) {
  LOCKSTEP_REQUIRE_GPU();
  struct Shape {
    int batch, T, c, heads;
  };
  for (const Shape& sh : {Shape{2, 70, 64, 4}, Shape{1, 130, 256, 2}, Shape{3, 1, 12, 3}}) {
    const size_t rows = size_t(sh.batch) * sh.T;
    const std::vector<float> qkv = Random(rows * 3 * sh.c, 61), dout = Random(rows * sh.c, 62);
    std::vector<float> out(rows * sh.c), lse(size_t(sh.batch) * sh.heads * sh.T),
        dqkv(rows * 3 * sh.c);
    CausalAttentionForward(qkv.data(), sh.batch, sh.T, sh.c, sh.heads, out.data(), lse.data());
    CausalAttentionBackward(dout.data(), qkv.data(), out.data(), lse.data(), sh.batch, sh.T, sh.c,
                            sh.heads, dqkv.data());
    DeviceBuffer<float> dev_qkv(qkv), dev_out(out.size()), dev_lse(lse.size()), dev_dout(dout),
        dev_dqkv(Random(dqkv.size(), 63));  // garbage first: the backward overwrites
    ASSERT_TRUE(cuda::CausalAttentionForward(dev_qkv.get(), sh.batch, sh.T, sh.c, sh.heads,
                                             dev_out.get(), dev_lse.get(), nullptr)
                    .ok());
    const std::string shape = absl::StrCat(sh.batch, "x", sh.T, " c ", sh.c, " heads ", sh.heads);
    EXPECT_LT(RelativeError(dev_out.Read(), out), 1e-5) << shape;
    EXPECT_LT(RelativeError(dev_lse.Read(), lse), 1e-6) << shape;
    // The backward from the CPU's out and lse, so only its own arithmetic is compared.
    DeviceBuffer<float> cpu_out(out), cpu_lse(lse);
    ASSERT_TRUE(cuda::CausalAttentionBackward(dev_dout.get(), dev_qkv.get(), cpu_out.get(),
                                              cpu_lse.get(), sh.batch, sh.T, sh.c, sh.heads,
                                              dev_dqkv.get(), nullptr)
                    .ok());
    const std::vector<float> got = dev_dqkv.Read();
    EXPECT_LT(RelativeError(got, dqkv), 1e-5) << shape;
    // The same bits on a second run (no atomics).
    ASSERT_TRUE(cuda::CausalAttentionBackward(dev_dout.get(), dev_qkv.get(), cpu_out.get(),
                                              cpu_lse.get(), sh.batch, sh.T, sh.c, sh.heads,
                                              dev_dqkv.get(), nullptr)
                    .ok());
    EXPECT_EQ(dev_dqkv.Read(), got) << shape;
  }
  DeviceBuffer<float> scratch(size_t{3} * 258);
  EXPECT_TRUE(absl::IsInvalidArgument(cuda::CausalAttentionForward(
      scratch.get(), 1, 1, 258, 1, scratch.get(), scratch.get(), nullptr)))
      << "a head of 258 is over the kernel's limit";
  EXPECT_TRUE(absl::IsInvalidArgument(cuda::CausalAttentionForward(
      scratch.get(), 1, 1, 10, 3, scratch.get(), scratch.get(), nullptr)))
      << "3 heads do not divide 10 channels";
}

// What a bf16 kernel wrote, as floats (bfloat16 is the top half of a float's bits).
std::vector<float> Bf16Values(const std::vector<cuda::Bf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const uint32_t bits = uint32_t{v[i].bits} << 16;
    std::memcpy(&out[i], &bits, sizeof(bits));
  }
  return out;
}

std::vector<cuda::Bf16> ToBf16Values(const std::vector<float>& v) {
  std::vector<cuda::Bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const float r = RoundToBf16(v[i]);
    uint32_t bits;
    std::memcpy(&bits, &r, sizeof(bits));
    out[i].bits = static_cast<uint16_t>(bits >> 16);
  }
  return out;
}

// Attention on bf16 tensor cores (precision bf16) against the CPU twin on the same bf16 q/k/v:
// close to bf16's precision (the probabilities, dO and dS are rounded for the products, as in
// PyTorch's flash kernels), the lse to FP32's. Sequences of one row, of one tile, of several
// and not a multiple of the tile; every gradient element written (garbage first), the same
// bits on a second run (no atomics).
TEST(CudaTransformerTest, Bf16AttentionOnTensorCoresMatchesCpu) {
  LOCKSTEP_REQUIRE_GPU();
  struct Shape {
    int batch, T, c, heads;
  };
  // Heads of 24 (16-byte rows), 4 and 5 (rows that are not: element loads, also of dO), 64,
  // 40 and 96 (padded to 64 and 128), 128.
  for (const Shape& sh : {Shape{2, 70, 96, 4}, Shape{1, 130, 12, 3}, Shape{1, 67, 15, 3},
                          Shape{2, 200, 256, 4}, Shape{1, 100, 80, 2}, Shape{1, 129, 192, 2},
                          Shape{1, 129, 256, 2}, Shape{3, 1, 64, 1}, Shape{1, 64, 128, 2}}) {
    const size_t rows = size_t(sh.batch) * sh.T;
    const std::vector<float> qkv = RoundedToBf16(Random(rows * 3 * sh.c, 91));
    const std::vector<float> dout = Random(rows * sh.c, 92);
    std::vector<float> out(rows * sh.c), lse(size_t(sh.batch) * sh.heads * sh.T),
        dqkv(rows * 3 * sh.c);
    CausalAttentionForward(qkv.data(), sh.batch, sh.T, sh.c, sh.heads, out.data(), lse.data());
    CausalAttentionBackward(dout.data(), qkv.data(), out.data(), lse.data(), sh.batch, sh.T, sh.c,
                            sh.heads, dqkv.data());
    const std::string shape = absl::StrCat(sh.batch, "x", sh.T, " c ", sh.c, " heads ", sh.heads);
    DeviceBuffer<cuda::Bf16> dev_qkv(ToBf16Values(qkv)), dev_out(out.size());
    DeviceBuffer<float> dev_lse(Random(lse.size(), 93)), dev_dout(dout),
        dev_dqkv(Random(dqkv.size(), 94));
    ASSERT_TRUE(cuda::CausalAttentionForward(dev_qkv.get(), sh.batch, sh.T, sh.c, sh.heads,
                                             dev_out.get(), dev_lse.get(), nullptr)
                    .ok());
    EXPECT_LT(RelativeError(Bf16Values(dev_out.Read()), out), 1e-2) << shape;
    EXPECT_LT(RelativeError(dev_lse.Read(), lse), 1e-5) << shape;
    // The backward from the CPU's out (rounded, as it is stored) and lse.
    DeviceBuffer<cuda::Bf16> cpu_out(ToBf16Values(out));
    DeviceBuffer<float> cpu_lse(lse);
    ASSERT_TRUE(cuda::CausalAttentionBackward(dev_dout.get(), dev_qkv.get(), cpu_out.get(),
                                              cpu_lse.get(), sh.batch, sh.T, sh.c, sh.heads,
                                              dev_dqkv.get(), nullptr)
                    .ok());
    const std::vector<float> got = dev_dqkv.Read();
    const size_t c = sh.c;
    auto part_of = [&](const std::vector<float>& all, int part) {  // dQ, dK or dV
      std::vector<float> v;
      for (size_t r = 0; r < rows; ++r) {
        const auto from = all.begin() + r * 3 * c + part * c;
        v.insert(v.end(), from, from + c);
      }
      return v;
    };
    // Each part's error against the larger of its norm and dV's: with one key (T = 1) dQ and
    // dK are 0 up to rounding, and a relative error of rounding noise means nothing.
    auto norm = [](const std::vector<float>& v) {
      double sum = 0;
      for (float x : v) sum += double{x} * x;
      return std::sqrt(sum);
    };
    const double dv_norm = norm(part_of(dqkv, 2));
    for (int part = 0; part < 3; ++part) {
      const std::vector<float> g = part_of(got, part), want = part_of(dqkv, part);
      std::vector<float> diff(g.size());
      for (size_t i = 0; i < g.size(); ++i) diff[i] = g[i] - want[i];
      EXPECT_LT(norm(diff) / std::max(norm(want), dv_norm), 2e-2) << shape << " d" << "qkv"[part];
    }
    ASSERT_TRUE(cuda::CausalAttentionBackward(dev_dout.get(), dev_qkv.get(), cpu_out.get(),
                                              cpu_lse.get(), sh.batch, sh.T, sh.c, sh.heads,
                                              dev_dqkv.get(), nullptr)
                    .ok());
    EXPECT_EQ(dev_dqkv.Read(), got) << shape;
  }
}

// The benchmarks' phase timer: each span goes to the phase that opened it, in the order the
// phases were first marked, summed over collections; a span after Mark(nullptr) to nowhere.
TEST(CudaKernelsTest, PhaseTimerAddsSpansToTheirPhases) {
  LOCKSTEP_REQUIRE_GPU();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const size_t n = size_t{1} << 24;
  DeviceBuffer<float> values(n);
  DeviceBuffer<cuda::Bf16> rounded(n);
  {
    cuda::PhaseTimer timer(stream);
    for (int round = 0; round < 2; ++round) {
      timer.Mark("round");
      ASSERT_TRUE(cuda::RoundToBf16(values.get(), n, rounded.get(), stream).ok());
      timer.Mark("round twice");
      ASSERT_TRUE(cuda::RoundToBf16(values.get(), n, rounded.get(), stream).ok());
      ASSERT_TRUE(cuda::RoundToBf16(values.get(), n, rounded.get(), stream).ok());
      timer.Mark(nullptr);
      ASSERT_TRUE(cuda::RoundToBf16(values.get(), n, rounded.get(), stream).ok());  // untimed
      ASSERT_TRUE(timer.Collect().ok());
    }
    const auto& totals = timer.totals_ms();
    ASSERT_EQ(totals.size(), 2u);
    EXPECT_EQ(totals[0].first, "round");
    EXPECT_EQ(totals[1].first, "round twice");
    EXPECT_GT(totals[0].second, 0.0);
    EXPECT_GT(totals[1].second, 0.0);
  }
  cudaStreamDestroy(stream);
}

// The GPT's bf16 products with their bias in cuBLASLt's epilogue, against the same product
// without it plus the bias on the host: into bf16, into bf16 through GPT-2's tanh GELU with the
// pre-activation beside it, and onto an FP32 residual. A bias the epilogue cannot take (not
// 16-byte aligned) is declined, with nothing written; outside bf16, INVALID_ARGUMENT.
TEST(CudaKernelsTest, GemmBiasBf16FusesBiasGeluAndResidual) {
  LOCKSTEP_REQUIRE_GPU();
  auto blas = cuda::Blas::Create(nullptr);
  ASSERT_TRUE(blas.ok()) << blas.status();
  const int m = 40, n = 24, k = 72;
  const std::vector<float> a = RoundedToBf16(Random(size_t(m) * k, 101));
  const std::vector<float> w = RoundedToBf16(Random(size_t(k) * n, 102));
  const std::vector<float> bias = RoundedToBf16(Random(n + 8, 103));  // from 0 or 1: aligned or not
  const std::vector<float> residual = Random(size_t(m) * n, 104);
  DeviceBuffer<cuda::Bf16> a16(ToBf16Values(a)), w16(ToBf16Values(w)), bias16(ToBf16Values(bias));
  DeviceBuffer<float> bias32(bias), dev_residual(residual), product(size_t(m) * n);
  EXPECT_TRUE(absl::IsInvalidArgument(
      (*blas)
          ->GemmBiasBf16(m, n, k, a16.get(), w16.get(), bias16.get(), nullptr, product.get(),
                         true, nullptr)
          .status()))
      << "outside precision bf16";
  ASSERT_TRUE((*blas)->SetPrecision(cuda::Blas::Precision::kBf16).ok());
  const cuda::Bf16* a_in = a16.get();
  const cuda::Bf16* w_in = w16.get();
  ASSERT_TRUE(
      (*blas)->Gemm(false, false, m, n, k, 1.0f, a_in, k, w_in, n, 0.0f, product.get(), n).ok());
  const std::vector<float> ab = product.Read();
  std::vector<float> sum(ab.size()), gelu(ab.size()), onto(ab.size());
  for (size_t i = 0; i < ab.size(); ++i) {
    sum[i] = ab[i] + bias[i % n];
    const float x = sum[i];
    gelu[i] = 0.5f * x * (1.0f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    onto[i] = residual[i] + sum[i];
  }
  {
    DeviceBuffer<cuda::Bf16> c(size_t(m) * n);
    absl::StatusOr<bool> ran = (*blas)->GemmBiasBf16(m, n, k, a16.get(), w16.get(), bias16.get(),
                                                     nullptr, c.get(), true, nullptr);
    ASSERT_TRUE(ran.ok()) << ran.status();
    ASSERT_TRUE(*ran) << "an aligned bias in bf16 is the epilogue's case";
    EXPECT_LT(RelativeError(Bf16Values(c.Read()), sum), 1e-2) << "bias";
  }
  {
    DeviceBuffer<cuda::Bf16> c(size_t(m) * n), pre(size_t(m) * n);
    absl::StatusOr<bool> ran = (*blas)->GemmBiasBf16(m, n, k, a16.get(), w16.get(), bias16.get(),
                                                     nullptr, c.get(), true, pre.get());
    ASSERT_TRUE(ran.ok()) << ran.status();
    ASSERT_TRUE(*ran);
    EXPECT_LT(RelativeError(Bf16Values(pre.Read()), sum), 1e-2) << "the pre-activation";
    EXPECT_LT(RelativeError(Bf16Values(c.Read()), gelu), 1e-2) << "GELU (tanh)";
  }
  {
    DeviceBuffer<float> c(size_t(m) * n);
    absl::StatusOr<bool> ran = (*blas)->GemmBiasBf16(m, n, k, a16.get(), w16.get(), bias32.get(),
                                                     dev_residual.get(), c.get(), false, nullptr);
    ASSERT_TRUE(ran.ok()) << ran.status();
    ASSERT_TRUE(*ran);
    EXPECT_LT(RelativeError(c.Read(), onto), 1e-5) << "onto the FP32 residual";
    EXPECT_EQ(dev_residual.Read(), residual) << "the residual is read, not written";
  }
  {
    const std::vector<float> garbage = Random(size_t(m) * n, 105);
    DeviceBuffer<float> c(garbage);
    absl::StatusOr<bool> ran = (*blas)->GemmBiasBf16(m, n, k, a16.get(), w16.get(),
                                                     bias32.get() + 1, dev_residual.get(), c.get(),
                                                     false, nullptr);
    ASSERT_TRUE(ran.ok()) << ran.status();
    EXPECT_FALSE(*ran) << "a bias 4 bytes off its alignment";
    EXPECT_EQ(c.Read(), garbage);
  }
  EXPECT_TRUE(absl::IsInvalidArgument(
      (*blas)
          ->GemmBiasBf16(m, n, k, a16.get(), w16.get(), bias16.get(), dev_residual.get(),
                         product.get(), true, nullptr)
          .status()))
      << "a residual with a bf16 result";
}

// Precision "bf16"'s activations: each bf16 variant but attention's (tested above) writes the
// FP32 variant's output on the same (rounded) inputs, rounded to nearest even, bit for bit,
// and the FP32 values beside it (statistics, gradients) are the FP32 variant's bits; a bf16
// operand in a product is the FP32 operand it was rounded from; a product into bf16 is the
// FP32 product rounded (to bf16's precision: cuBLAS may pick another kernel for another output
// type); bf16 operands and results are refused outside precision bf16.
TEST(CudaTransformerTest, Bf16ActivationsAreTheFp32OutputsRounded) {
  LOCKSTEP_REQUIRE_GPU();
  const int rows = 37, c = 96;
  {
    std::vector<float> x = Random(size_t(rows) * c, 71, 3.0f);
    const std::vector<float> w = Random(c, 72), b = Random(c, 73);
    DeviceBuffer<float> dx(x), dw(w), db(b), out(x.size()), mean(rows), rstd(rows), mean16(rows),
        rstd16(rows);
    DeviceBuffer<cuda::Bf16> out16(x.size());
    ASSERT_TRUE(cuda::LayerNormForward(dx.get(), dw.get(), db.get(), rows, c, 1e-5f, out.get(),
                                       mean.get(), rstd.get(), nullptr)
                    .ok());
    ASSERT_TRUE(cuda::LayerNormForward(dx.get(), dw.get(), db.get(), rows, c, 1e-5f, out16.get(),
                                       mean16.get(), rstd16.get(), nullptr)
                    .ok());
    EXPECT_EQ(Bf16Values(out16.Read()), RoundedToBf16(out.Read())) << "LayerNorm";
    EXPECT_EQ(mean16.Read(), mean.Read());
    EXPECT_EQ(rstd16.Read(), rstd.Read());
  }
  {
    // The MLP: bias onto the bf16 pre-activation (stored rounded), the GELU of what is stored,
    // and the backward from it.
    const size_t n = size_t(rows) * 4 * c;
    const std::vector<float> pre = RoundedToBf16(Random(n, 74, 2.0f));
    const std::vector<float> bias = Random(4 * c, 75), dout = Random(n, 80);
    std::vector<float> summed(n);
    for (size_t i = 0; i < n; ++i) summed[i] = RoundToBf16(pre[i] + bias[i % (4 * c)]);
    DeviceBuffer<cuda::Bf16> pre16(ToBf16Values(pre)), out16(n);
    DeviceBuffer<float> dbias(bias), dsummed(summed), out(n), d32(dout), d16(dout);
    ASSERT_TRUE(cuda::BiasGeluTanhForward(dbias.get(), rows, 4 * c, pre16.get(), out16.get(),
                                          nullptr)
                    .ok());
    EXPECT_EQ(Bf16Values(pre16.Read()), summed) << "the pre-activation plus bias, rounded";
    ASSERT_TRUE(cuda::GeluTanhForward(dsummed.get(), n, out.get(), nullptr).ok());
    EXPECT_EQ(Bf16Values(out16.Read()), RoundedToBf16(out.Read())) << "GELU of what is stored";
    ASSERT_TRUE(cuda::GeluTanhBackward(dsummed.get(), d32.get(), n, d32.get(), nullptr).ok());
    ASSERT_TRUE(cuda::GeluTanhBackward(pre16.get(), d16.get(), n, d16.get(), nullptr).ok());
    EXPECT_EQ(d16.Read(), d32.Read()) << "GELU backward from the stored pre-activation";
    // A bias to start a product on, in bf16.
    DeviceBuffer<cuda::Bf16> start16(n);
    ASSERT_TRUE(cuda::StartWith(nullptr, dbias.get(), rows, 4 * c, start16.get(), nullptr).ok());
    std::vector<float> want_start(n);
    for (size_t i = 0; i < n; ++i) want_start[i] = RoundToBf16(bias[i % (4 * c)]);
    EXPECT_EQ(Bf16Values(start16.Read()), want_start);
  }
  {
    auto blas = cuda::Blas::Create(nullptr);
    ASSERT_TRUE(blas.ok()) << blas.status();
    const int m = 40, n = 24, k = 72;
    const std::vector<float> a = Random(size_t(m) * k, 78), b = Random(size_t(k) * n, 79);
    const std::vector<float> start = RoundedToBf16(Random(size_t(m) * n, 81));
    DeviceBuffer<float> da(a), db(b), c32(size_t(m) * n), c16(size_t(m) * n), sum32(start);
    DeviceBuffer<cuda::Bf16> a16(ToBf16Values(a)), out16(ToBf16Values(start));
    const cuda::Bf16* a16_in = a16.get();
    EXPECT_TRUE(absl::IsInvalidArgument(
        (*blas)->Gemm(false, false, m, n, k, 1.0f, a16_in, k, db.get(), n, 0.0f, c16.get(), n)))
        << "a bf16 operand outside precision bf16";
    EXPECT_TRUE(absl::IsInvalidArgument((*blas)->Gemm(false, false, m, n, k, 1.0f, da.get(), k,
                                                       db.get(), n, 0.0f, out16.get(), n)))
        << "a bf16 result outside precision bf16";
    ASSERT_TRUE((*blas)->SetPrecision(cuda::Blas::Precision::kBf16).ok());
    // A bf16 operand on either side, transposed or not, with a leading dimension wider than
    // its rows (elements are the unit) and from an odd offset (not 16-byte aligned, as the LM
    // head's chunks of rows can be): the product of the FP32 values it was rounded from.
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        for (int side = 0; side < 2; ++side) {
          const int lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 5, offset = 1;
          const std::vector<float> xa = Random(size_t(ta ? k : m) * lda + offset, 82);
          const std::vector<float> xb = Random(size_t(tb ? n : k) * ldb + offset, 83);
          DeviceBuffer<float> fa(xa), fb(xb), want(size_t(m) * n), got(size_t(m) * n);
          DeviceBuffer<cuda::Bf16> ha(ToBf16Values(xa)), hb(ToBf16Values(xb));
          const cuda::Blas::Operand oa = side == 0 ? cuda::Blas::Operand(ha.get() + offset)
                                                   : cuda::Blas::Operand(fa.get() + offset);
          const cuda::Blas::Operand ob = side == 1 ? cuda::Blas::Operand(hb.get() + offset)
                                                   : cuda::Blas::Operand(fb.get() + offset);
          ASSERT_TRUE((*blas)
                          ->Gemm(ta, tb, m, n, k, 1.0f, fa.get() + offset, lda, fb.get() + offset,
                                 ldb, 0.0f, want.get(), n)
                          .ok());
          ASSERT_TRUE((*blas)->Gemm(ta, tb, m, n, k, 1.0f, oa, lda, ob, ldb, 0.0f, got.get(), n)
                          .ok());
          // The bf16 operand's pointer differs in alignment from the scratch's: cuBLAS may
          // choose another kernel, so FP32 rounding of the sums, not bits.
          EXPECT_LT(RelativeError(got.Read(), want.Read()), 1e-5)
              << "trans_a " << ta << " trans_b " << tb << " bf16 side " << side;
        }
      }
    }
    ASSERT_TRUE((*blas)
                    ->Gemm(false, false, m, n, k, 1.0f, da.get(), k, db.get(), n, 0.0f, c32.get(),
                           n)
                    .ok());
    ASSERT_TRUE((*blas)
                    ->Gemm(false, false, m, n, k, 1.0f, a16_in, k, db.get(), n, 0.0f, c16.get(), n)
                    .ok());
    EXPECT_EQ(c16.Read(), c32.Read()) << "a bf16 operand is the FP32 one it was rounded from";
    // Onto a bf16 C (beta 1, as onto a bias): the FP32 sum, rounded once.
    ASSERT_TRUE((*blas)
                    ->Gemm(false, false, m, n, k, 1.0f, a16_in, k, db.get(), n, 1.0f,
                           sum32.get(), n)
                    .ok());
    ASSERT_TRUE((*blas)
                    ->Gemm(false, false, m, n, k, 1.0f, a16_in, k, db.get(), n, 1.0f,
                           out16.get(), n)
                    .ok());
    const std::vector<float> got = Bf16Values(out16.Read()), want = sum32.Read();
    EXPECT_LT(RelativeError(got, want), 4e-3) << "within bf16's rounding of the FP32 sum";
  }
}

TEST(CudaTransformerTest, GeluTanhMatchesCpu) {
  LOCKSTEP_REQUIRE_GPU();
  std::vector<float> x = Random(10007, 21, 3.0f);
  x[0] = 0.0f;
  x[1] = -30.0f;
  x[2] = 30.0f;
  const std::vector<float> dout = Random(x.size(), 22);
  std::vector<float> out(x.size()), dx(x.size());
  GeluTanhForward(x.data(), x.size(), out.data());
  GeluTanhBackward(x.data(), dout.data(), x.size(), dx.data());
  DeviceBuffer<float> dev_x(x), dev_out(x.size()), dev_d(dout);
  ASSERT_TRUE(cuda::GeluTanhForward(dev_x.get(), x.size(), dev_out.get(), nullptr).ok());
  EXPECT_LT(RelativeError(dev_out.Read(), out), 1e-6);
  // In place, as the step engine uses it (dx aliasing dout).
  ASSERT_TRUE(
      cuda::GeluTanhBackward(dev_x.get(), dev_d.get(), x.size(), dev_d.get(), nullptr).ok());
  EXPECT_LT(RelativeError(dev_d.Read(), dx), 1e-5);
}

// The embedding gradient is the CPU's bits: a small vocabulary (every id many times) and more
// ids than the classes a block takes (so most classes hold several), more rows than a chunk of
// staged ids, more columns than a block. The
// column sums add groups of rows in a fixed order: close to the CPU's, the same bits twice.
TEST(CudaTransformerTest, EmbeddingBackwardIsTheCpuBitsAndColumnSumsAreFixed) {
  LOCKSTEP_REQUIRE_GPU();
  for (const int vocab : {11, 300}) {
    const int rows = 2500, c = 300;
    std::vector<int32_t> ids(rows);
    std::mt19937 rng(31);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % vocab);
    const std::vector<float> dx = Random(size_t(rows) * c, 32);
    std::vector<float> table = Random(size_t(vocab) * c, 33), start = table;
    EmbeddingBackward(ids.data(), dx.data(), rows, c, table.data());
    DeviceBuffer<int32_t> dev_ids(ids);
    DeviceBuffer<float> dev_dx(dx), dev_table(start);
    ASSERT_TRUE(
        cuda::EmbeddingBackward(dev_ids.get(), dev_dx.get(), rows, c, dev_table.get(), nullptr)
            .ok());
    EXPECT_EQ(dev_table.Read(), table) << "vocabulary " << vocab;

    for (bool accumulate : {false, true}) {
      std::vector<float> sums = Random(c, 34), dev_start = sums;
      ColumnSums(dx.data(), rows, c, sums.data(), accumulate);
      DeviceBuffer<float> dev_sums(dev_start), again(dev_start);
      ASSERT_TRUE(
          cuda::ColumnSums(dev_dx.get(), rows, c, dev_sums.get(), accumulate, nullptr).ok());
      ASSERT_TRUE(cuda::ColumnSums(dev_dx.get(), rows, c, again.get(), accumulate, nullptr).ok());
      const std::vector<float> got = dev_sums.Read();
      EXPECT_LT(RelativeError(got, sums), 1e-5) << "accumulate " << accumulate;
      EXPECT_EQ(again.Read(), got) << "accumulate " << accumulate;
      // Rounding d to bf16 in the same pass changes nothing of the sums.
      DeviceBuffer<float> with_rounding(dev_start);
      DeviceBuffer<cuda::Bf16> rounded(dx.size());
      ASSERT_TRUE(cuda::ColumnSums(dev_dx.get(), rows, c, with_rounding.get(), accumulate,
                                   rounded.get(), nullptr)
                      .ok());
      EXPECT_EQ(with_rounding.Read(), got);
      EXPECT_EQ(Bf16Values(rounded.Read()), RoundedToBf16(dx));
    }
  }
}

// A GPT-2-sized vocabulary (more columns than a block has threads, by far), rows whose target
// is far below the maximum (its probability underflows to 0 in float; the loss must stay
// finite), and a row with a tied maximum (the first one counts).
TEST(CudaTransformerTest, SoftmaxCrossEntropyInPlaceMatchesCpu) {
  LOCKSTEP_REQUIRE_GPU();
  const int rows = 6, v = 50257;
  std::vector<float> logits = Random(size_t(rows) * v, 41, 2.0f);
  std::vector<int32_t> targets = {0, 17, v - 1, 4242, 300, 301};
  logits[size_t(1) * v + 17] = -200.0f;  // far below the row's maximum
  logits[size_t(4) * v + 300] = 40.0f;    // the target is the maximum: correct
  logits[size_t(5) * v + 299] = 40.0f;    // tied maximum before the target: not correct
  logits[size_t(5) * v + 301] = 40.0f;
  std::vector<float> cpu = logits;
  int64_t cpu_correct = 0;
  const float scale = 1.0f / rows;
  const double cpu_loss =
      SoftmaxCrossEntropyInPlace(cpu.data(), targets.data(), rows, v, scale, &cpu_correct);
  ASSERT_TRUE(std::isfinite(cpu_loss));

  DeviceBuffer<float> dev_logits(logits);
  DeviceBuffer<int32_t> dev_targets(targets), dev_row_correct(rows);
  DeviceBuffer<double> dev_row_loss(rows), dev_loss(std::vector<double>{100.0});
  DeviceBuffer<int64_t> dev_correct(std::vector<int64_t>{5});
  for (bool accumulate : {false, true}) {
    DeviceBuffer<float> fresh(logits);
    ASSERT_TRUE(cuda::SoftmaxCrossEntropyInPlace(fresh.get(), dev_targets.get(), rows, v, scale,
                                                 dev_row_loss.get(), dev_loss.get(), accumulate,
                                                 dev_row_correct.get(), dev_correct.get(),
                                                 nullptr)
                    .ok());
    EXPECT_LT(RelativeError(fresh.Read(), cpu), 1e-5) << "the gradient, in place";
  }
  // First call set the sum, the second added to it; the count was added to twice. The
  // device's expf is not the CPU's polynomial and its sum is taken online: the sums agree to
  // about 1e-8, and a wrong row, maximum or target would move them by O(1).
  const double loss = dev_loss.Read()[0];
  EXPECT_NEAR(loss, 2 * cpu_loss, 1e-7 * std::abs(2 * cpu_loss));
  const std::vector<double> row_loss = dev_row_loss.Read();
  for (int r = 0; r < rows; ++r) {
    std::vector<float> row(logits.begin() + size_t(r) * v, logits.begin() + size_t(r + 1) * v);
    const double want = SoftmaxCrossEntropyInPlace(row.data(), &targets[r], 1, v, scale, nullptr);
    EXPECT_NEAR(row_loss[r], want, 1e-7 * std::abs(want)) << "row " << r;
  }
  EXPECT_EQ(dev_correct.Read()[0], 5 + 2 * cpu_correct);
  EXPECT_EQ(cpu_correct, 1) << "the row with its target as the only maximum";
  const std::vector<int32_t> row_correct = dev_row_correct.Read();
  EXPECT_EQ(row_correct, (std::vector<int32_t>{0, 0, 0, 0, 1, 0})) << "random rows rarely hit";
  // Into bf16: the logits stay, the gradient is the in-place one rounded (the same float
  // arithmetic), the loss the same bits; with no gradient buffer only the loss is written.
  {
    DeviceBuffer<float> in_place(logits), kept(logits);
    DeviceBuffer<cuda::Bf16> grad16(logits.size());
    DeviceBuffer<double> loss32(1), loss16(1), loss_only(1);
    ASSERT_TRUE(cuda::SoftmaxCrossEntropyInPlace(in_place.get(), dev_targets.get(), rows, v, scale,
                                                 dev_row_loss.get(), loss32.get(), false, nullptr,
                                                 nullptr, nullptr)
                    .ok());
    ASSERT_TRUE(cuda::SoftmaxCrossEntropyInto(kept.get(), dev_targets.get(), rows, v, scale,
                                              grad16.get(), dev_row_loss.get(), loss16.get(),
                                              false, nullptr, nullptr, nullptr)
                    .ok());
    EXPECT_EQ(Bf16Values(grad16.Read()), RoundedToBf16(in_place.Read()));
    EXPECT_EQ(kept.Read(), logits) << "the logits are left as they are";
    EXPECT_EQ(loss16.Read(), loss32.Read());
    ASSERT_TRUE(cuda::SoftmaxCrossEntropyInto(kept.get(), dev_targets.get(), rows, v, scale,
                                              nullptr, dev_row_loss.get(), loss_only.get(), false,
                                              nullptr, nullptr, nullptr)
                    .ok());
    EXPECT_EQ(loss_only.Read(), loss32.Read()) << "a forward only";
    EXPECT_EQ(kept.Read(), logits);
  }
  // A count needs the per-row flags to count from.
  EXPECT_TRUE(absl::IsInvalidArgument(cuda::SoftmaxCrossEntropyInPlace(
      dev_logits.get(), dev_targets.get(), rows, v, scale, dev_row_loss.get(), dev_loss.get(),
      false, nullptr, dev_correct.get(), nullptr)));
}

// What a user sees with a bad device: the check macro's status names the call, the place
// and the library's message. Needs no GPU: without a driver CUDA reports that itself.
TEST(GpuCheckTest, StatusNamesCallFileAndLibraryMessage) {
  auto fails = []() -> absl::Status {
    LOCKSTEP_GPU_RETURN_IF_ERROR(cudaSetDevice(9999));
    return absl::OkStatus();
  };
  const absl::Status status = fails();
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("cudaSetDevice(9999) failed at"), std::string::npos) << status;
  EXPECT_NE(status.message().find("cuda_kernels_test.cc"), std::string::npos) << status;
  EXPECT_TRUE(absl::IsFailedPrecondition(status) || absl::IsInternal(status)) << status;
}

}  // namespace
}  // namespace lockstep::kernels
