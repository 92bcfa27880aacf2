// CPU kernels: OpenBLAS for GEMM, plain loops for the rest, shaped so that g++ -O2 vectorizes
// the elementwise ones for generic x86-64 (see ForEachBlocked). Loops that call libm per element
// (GELU's erfc, softmax's exp, llround) stay scalar; they are not on the GEMM-bound hot path.
#include "kernels/cpu_kernels.h"

#include <cblas.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>

// The fixed-point conversions are exact integer and power-of-two arithmetic, so every
// instruction set computes the same bits: they are compiled for AVX-512, AVX2 and the
// baseline, and the loader picks the best one for the CPU. (The floating-point kernels are
// not: a fused multiply-add on one host and not on another would let ranks diverge.)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LOCKSTEP_EXACT_CLONES \
  __attribute__((target_clones("arch=skylake-avx512", "avx2", "default")))
#else
#define LOCKSTEP_EXACT_CLONES
#endif

namespace lockstep::kernels {
namespace {

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

// GELU written with erfc(-x/sqrt2) instead of 1 + erf(x/sqrt2): the two are equal, but for
// negative x the latter cancels to 0 (x < -5.9 in float) while erfc keeps full relative precision
// of the tiny result, at the same cost.
inline float Gelu(float x) { return 0.5f * x * std::erfc(-x * kInvSqrt2); }

// d/dx GELU = Phi(x) + x * phi(x), with Phi written through erfc for the same reason as above.
inline float GeluDerivative(float x) {
  return 0.5f * std::erfc(-x * kInvSqrt2) + x * kInvSqrt2Pi * std::exp(-0.5f * x * x);
}

// `v < 0 ? 0 : v` rather than std::max so that a NaN passes through, as torch.relu does; a NaN
// that the activation swallowed would hide divergence from the loss check.
inline float Relu(float x) { return x < 0.0f ? 0.0f : x; }

// The elementwise loops below run through ForEachBlocked. g++ 12 at -O2 uses the "very cheap"
// vectorizer cost model, which refuses any loop that would need a scalar epilogue or a runtime
// overlap check, i.e. every loop over a runtime n. A fixed 16-iteration inner body (64 bytes of
// floats) is vectorized under that model, and the __restrict parameters of the helpers below
// remove the overlap checks; the remainder of fewer than 16 elements runs scalar. The helpers are
// noinline because g++ forgets a parameter's restrict once the function is inlined into a caller
// whose pointers are not restrict, and the loop then goes scalar again.
constexpr size_t kBlock = 16;

template <typename Body>
inline void ForEachBlocked(size_t n, Body&& body) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t j = 0; j < kBlock; ++j) body(i + j);
  }
  for (; i < n; ++i) body(i);
}

template <typename Act>
[[gnu::noinline]] void BiasActRow(const float* __restrict bias, float* __restrict z,
                                  float* __restrict a, size_t n, Act act) {
  ForEachBlocked(n, [&](size_t i) {
    const float v = z[i] + bias[i];
    z[i] = v;
    a[i] = act(v);
  });
}

template <typename Act>
[[gnu::noinline]] void BiasActRowInPlace(const float* __restrict bias, float* __restrict z,
                                         size_t n, Act act) {
  ForEachBlocked(n, [&](size_t i) { z[i] = act(z[i] + bias[i]); });
}

// `op(z, da)` returns dz. Both operands are loaded unconditionally so that a select such as
// relu's stays branch-free and vectorizable.
template <typename Op>
[[gnu::noinline]] void Backward(const float* __restrict z, const float* __restrict da,
                                float* __restrict dz, size_t n, Op op) {
  ForEachBlocked(n, [&](size_t i) {
    const float zi = z[i];
    const float di = da[i];
    dz[i] = op(zi, di);
  });
}

template <typename Op>
[[gnu::noinline]] void BackwardInPlace(const float* __restrict z, float* __restrict d, size_t n,
                                       Op op) {
  ForEachBlocked(n, [&](size_t i) {
    const float zi = z[i];
    const float di = d[i];
    d[i] = op(zi, di);
  });
}

[[gnu::noinline]] void AccumulateRow(const float* __restrict row, double* __restrict acc,
                                     size_t n) {
  ForEachBlocked(n, [&](size_t j) { acc[j] += static_cast<double>(row[j]); });
}

[[gnu::noinline]] void ScaleInPlace(float* __restrict x, size_t n, float scale) {
  ForEachBlocked(n, [&](size_t i) { x[i] *= scale; });
}

[[gnu::noinline]] void SgdLoop(float* __restrict p, const float* __restrict g,
                               float* __restrict buf, size_t n, float lr, float momentum,
                               float weight_decay) {
  // Same operation order as torch.optim.SGD's single-tensor path.
  ForEachBlocked(n, [&](size_t i) {
    const float gi = g[i] + weight_decay * p[i];
    const float bi = momentum * buf[i] + gi;
    buf[i] = bi;
    p[i] -= lr * bi;
  });
}

[[gnu::noinline]] void AdamWLoop(float* __restrict p, const float* __restrict g,
                                 float* __restrict m, float* __restrict v, size_t n, float beta1,
                                 float beta2, float one_minus_b1, float one_minus_b2, float decay,
                                 float step_size, float bc2_sqrt, float eps) {
  // Operation order of torch.optim.AdamW's single-tensor path (its lerp for m agrees with the
  // form here to within rounding). v >= 0, so the sqrt never takes the errno path; building
  // this file with -fno-math-errno (kernels/CMakeLists.txt) lets the sqrt vectorize too.
  ForEachBlocked(n, [&](size_t i) {
    const float gi = g[i];
    const float mi = beta1 * m[i] + one_minus_b1 * gi;
    const float vi = beta2 * v[i] + one_minus_b2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    p[i] = p[i] * decay - step_size * (mi / denom);
  });
}

// Columns per block in BiasGradient: the float64 accumulators live on the stack (2 KiB) and in
// L1, and each row contributes one contiguous 1 KiB run per block.
constexpr int kBiasGradBlock = 256;
static_assert(kBiasGradBlock % kBlock == 0);

// 2^53: ToFixedPoint keeps |out| <= 2^53 - 1 = (2^63 - 1) / 1024 rounded down, which is what
// kMaxFixedPointAddends promises. Every double below 2^53 rounds to an integer below 2^53.
constexpr double kFixedPointLimit = 9007199254740992.0;
static_assert(kMaxFixedPointAddends * (kFixedPointLimit - 1) < 9223372036854775807.0);

}  // namespace

bool ParseActivation(std::string_view name, Activation* out) {
  if (name.empty() || name == "relu") {
    *out = Activation::kRelu;
  } else if (name == "gelu") {
    *out = Activation::kGelu;
  } else if (name == "identity") {
    *out = Activation::kIdentity;
  } else {
    return false;
  }
  return true;
}

void SetBlasThreads(int threads) { openblas_set_num_threads(threads); }

void Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    // Handled here rather than trusting every BLAS to accept lda = 0; beta == 0 overwrites
    // without reading C, the BLAS convention.
    for (int i = 0; i < m; ++i) {
      float* row = c + static_cast<size_t>(i) * ldc;
      for (int j = 0; j < n; ++j) row[j] = beta == 0.0f ? 0.0f : beta * row[j];
    }
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void BiasActivationForward(const float* bias, int rows, int cols, Activation act, float* z,
                           float* a) {
  for (int r = 0; r < rows; ++r) {
    float* zr = z + static_cast<size_t>(r) * cols;
    const size_t n = static_cast<size_t>(cols);
    // In place gets its own loop: restrict promises on z and a would be false for a == z.
    if (a == z) {
      switch (act) {
        case Activation::kIdentity:
          BiasActRowInPlace(bias, zr, n, [](float v) { return v; });
          break;
        case Activation::kRelu:
          BiasActRowInPlace(bias, zr, n, [](float v) { return Relu(v); });
          break;
        case Activation::kGelu:  // Forward-only use; the pre-activation is gone afterwards.
          BiasActRowInPlace(bias, zr, n, [](float v) { return Gelu(v); });
          break;
      }
      continue;
    }
    float* ar = a + static_cast<size_t>(r) * cols;
    switch (act) {
      case Activation::kIdentity:
        BiasActRow(bias, zr, ar, n, [](float v) { return v; });
        break;
      case Activation::kRelu:
        BiasActRow(bias, zr, ar, n, [](float v) { return Relu(v); });
        break;
      case Activation::kGelu:
        BiasActRow(bias, zr, ar, n, [](float v) { return Gelu(v); });
        break;
    }
  }
}

void ActivationBackward(Activation act, const float* z, const float* da, float* dz, size_t n) {
  // torch's threshold_backward: zero where z <= 0, so a NaN z passes the gradient on.
  const auto relu_backward = [](float zi, float di) { return zi <= 0.0f ? 0.0f : di; };
  const auto gelu_backward = [](float zi, float di) { return di * GeluDerivative(zi); };
  if (da == dz) {
    switch (act) {
      case Activation::kIdentity:
        break;
      case Activation::kRelu:
        BackwardInPlace(z, dz, n, relu_backward);
        break;
      case Activation::kGelu:
        BackwardInPlace(z, dz, n, gelu_backward);
        break;
    }
    return;
  }
  switch (act) {
    case Activation::kIdentity:
      Backward(z, da, dz, n, [](float, float di) { return di; });
      break;
    case Activation::kRelu:
      Backward(z, da, dz, n, relu_backward);
      break;
    case Activation::kGelu:
      Backward(z, da, dz, n, gelu_backward);
      break;
  }
}

void BiasGradient(const float* dz, int rows, int cols, float* db, bool accumulate) {
  // float64 accumulation instead of pairwise float: the sum runs over the batch, the loop stays
  // a contiguous row-by-row sweep that vectorizes (cvtps2pd + addpd), the cost is hidden behind
  // the memory traffic of reading dz once, and the error (~rows * 1e-16 relative) is far below
  // one float ulp, so the result is the correctly rounded sum except in rare near-tie cases.
  double acc[kBiasGradBlock];
  for (int c0 = 0; c0 < cols; c0 += kBiasGradBlock) {
    const size_t width = static_cast<size_t>(std::min(cols - c0, kBiasGradBlock));
    std::fill(acc, acc + width, 0.0);
    for (int r = 0; r < rows; ++r) {
      AccumulateRow(dz + static_cast<size_t>(r) * cols + c0, acc, width);
    }
    float* out = db + c0;
    if (accumulate) {
      for (size_t j = 0; j < width; ++j) out[j] += static_cast<float>(acc[j]);
    } else {
      for (size_t j = 0; j < width; ++j) out[j] = static_cast<float>(acc[j]);
    }
  }
}

double SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int rows, int classes,
                           float grad_scale, float* dlogits, int64_t* correct) {
  double loss_sum = 0.0;
  int64_t num_correct = 0;
  for (int r = 0; r < rows; ++r) {
    const float* x = logits + static_cast<size_t>(r) * classes;
    const int label = labels[r];
    assert(label >= 0 && label < classes);

    // Strict '>' keeps the first maximum, matching torch.argmax.
    int argmax = 0;
    float max = x[0];
    for (int c = 1; c < classes; ++c) {
      if (x[c] > max) {
        max = x[c];
        argmax = c;
      }
    }
    if (argmax == label) ++num_correct;

    // exp(x - max) <= 1 cannot overflow, and the max term contributes exactly 1, so the sum is
    // >= 1 and its log is finite. Each term is a float exp (0.5 ulp); the sum is kept in double so
    // that thousands of classes add no error beyond that.
    double sum = 0.0;
    if (dlogits != nullptr) {
      float* e = dlogits + static_cast<size_t>(r) * classes;
      for (int c = 0; c < classes; ++c) {
        e[c] = std::exp(x[c] - max);
        sum += e[c];
      }
      // One rounding for the scale instead of a division per element; softmax * grad_scale is
      // then within ~1.5 ulp. The label's -grad_scale is subtracted in float: when p is close to
      // 1 the subtraction is exact (Sterbenz), so nothing is lost beyond what float p holds.
      const float scale = static_cast<float>(static_cast<double>(grad_scale) / sum);
      ScaleInPlace(e, static_cast<size_t>(classes), scale);
      e[label] -= grad_scale;
    } else {
      for (int c = 0; c < classes; ++c) sum += std::exp(x[c] - max);
    }
    // -log softmax[label] = log(sum) - (x[label] - max), the difference taken in double so a
    // large logit (1000) does not cost the loss its low-order bits.
    loss_sum += std::log(sum) - (static_cast<double>(x[label]) - static_cast<double>(max));
  }
  if (correct != nullptr) *correct += num_correct;
  return loss_sum;
}

void SgdMomentumUpdate(float* p, const float* g, float* buf, size_t n, float lr, float momentum,
                       float weight_decay) {
  SgdLoop(p, g, buf, n, lr, momentum, weight_decay);
}

AdamWScalars ComputeAdamWScalars(float lr, float beta1, float beta2, float weight_decay,
                                 int64_t step) {
  const double t = static_cast<double>(step);
  const double lr_d = lr;
  return {static_cast<float>(1.0 - lr_d * weight_decay),
          static_cast<float>(1.0 - static_cast<double>(beta1)),
          static_cast<float>(1.0 - static_cast<double>(beta2)),
          static_cast<float>(lr_d / (1.0 - std::pow(double{beta1}, t))),
          static_cast<float>(std::sqrt(1.0 - std::pow(double{beta2}, t)))};
}

void AdamWUpdate(float* p, const float* g, float* m, float* v, size_t n, float lr, float beta1,
                 float beta2, float eps, float weight_decay, int64_t step) {
  assert(step >= 1);
  const AdamWScalars k = ComputeAdamWScalars(lr, beta1, beta2, weight_decay, step);
  AdamWLoop(p, g, m, v, n, beta1, beta2, k.one_minus_b1, k.one_minus_b2, k.decay, k.step_size,
            k.bc2_sqrt, eps);
}

int64_t ToFixedPoint(const float* g, size_t n, int frac_bits, int64_t* out) {
  assert(frac_bits >= 0 && frac_bits <= 62);
  // The product is exact in double (24-bit mantissa times a power of two in range), so the only
  // rounding is llround's, and the same g always gives the same integer on every rank.
  const double scale = std::ldexp(1.0, frac_bits);
  int64_t rejected = 0;
  for (size_t i = 0; i < n; ++i) {
    const double s = static_cast<double>(g[i]) * scale;
    // The negated form also catches NaN and +-inf.
    if (!(std::fabs(s) < kFixedPointLimit)) {
      out[i] = 0;
      ++rejected;
    } else {
      out[i] = std::llround(s);
    }
  }
  return rejected;
}

namespace {

// round(g * 2^frac_bits) into (kAccumulate) or over out[i]; see AccumulateFixedPoint.
template <bool kAccumulate>
__attribute__((always_inline)) inline int64_t FixedPointLoop(const float* g, size_t n,
                                                             int frac_bits, int64_t* out) {
  assert(frac_bits >= 0 && frac_bits <= 62);
  const double scale = std::ldexp(1.0, frac_bits);
  // For |x| < 2^51, x + 1.5 * 2^52 lands in [2^52, 2^53), where doubles are exactly the
  // integers: the addition rounds x to the nearest integer (ties to even) and the low mantissa
  // bits hold it, offset by the magic constant's own bits. Plain adds and integer subtracts,
  // so the loop vectorizes, unlike llround.
  constexpr double kMagic = 6755399441055744.0;  // 1.5 * 2^52
  constexpr double kLimit = 2251799813685248.0;  // 2^51
  int64_t magic_bits;
  std::memcpy(&magic_bits, &kMagic, sizeof(magic_bits));
  int64_t rejected = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = static_cast<double>(g[i]) * scale;
    // All-ones when |x| < 2^51; zero for larger values, NaN and +-inf, whose (meaningless)
    // bits are masked away. Integer masking instead of a select keeps the loop branch-free,
    // which is what lets the compiler vectorize it.
    const int64_t ok = -static_cast<int64_t>(std::fabs(x) < kLimit);
    const double t = x + kMagic;
    int64_t bits;
    std::memcpy(&bits, &t, sizeof(bits));
    if constexpr (kAccumulate) {
      out[i] += (bits - magic_bits) & ok;
    } else {
      out[i] = (bits - magic_bits) & ok;
    }
    rejected += 1 + ok;
  }
  return rejected;
}

}  // namespace

LOCKSTEP_EXACT_CLONES
int64_t AccumulateFixedPoint(const float* g, size_t n, int frac_bits, int64_t* acc) {
  return FixedPointLoop<true>(g, n, frac_bits, acc);
}

int64_t AccumulateLossFixedPoint(double loss_sum, float grad_scale, int frac_bits, int64_t* acc) {
  const double scaled = loss_sum * static_cast<double>(grad_scale) * std::ldexp(1.0, frac_bits);
  if (!std::isfinite(scaled) || std::abs(scaled) >= 0x1p51) return 1;
  *acc += std::llround(scaled);
  return 0;
}

LOCKSTEP_EXACT_CLONES
int64_t StoreFixedPoint(const float* g, size_t n, int frac_bits, int64_t* out) {
  return FixedPointLoop<false>(g, n, frac_bits, out);
}

LOCKSTEP_EXACT_CLONES
void FromFixedPoint(const int64_t* in, size_t n, int frac_bits, float* out) {
  assert(frac_bits >= 0 && frac_bits <= 62);
  const double scale = std::ldexp(1.0, -frac_bits);
  // int64 -> double has no vector instruction before AVX-512DQ, so when every value is in
  // [-2^51, 2^51) (the usual case) use the 1.5 * 2^52 trick backwards: integer add, then a
  // double subtract, both exact. One pass converts and notes whether any value was outside
  // (x + 2^51, as unsigned, has bits above 51); then the exact conversion redoes everything.
  // Same results either way.
  constexpr double kMagic = 6755399441055744.0;  // 1.5 * 2^52
  int64_t magic_bits;
  std::memcpy(&magic_bits, &kMagic, sizeof(magic_bits));
  uint64_t outside = 0;
  for (size_t i = 0; i < n; ++i) {
    outside |= (static_cast<uint64_t>(in[i]) + (uint64_t{1} << 51)) >> 52;
    const int64_t bits = in[i] + magic_bits;
    double d;
    std::memcpy(&d, &bits, sizeof(d));
    out[i] = static_cast<float>((d - kMagic) * scale);
  }
  if (outside == 0) return;
  for (size_t i = 0; i < n; ++i) {
    out[i] = static_cast<float>(static_cast<double>(in[i]) * scale);
  }
}

}  // namespace lockstep::kernels
