// CPU compute kernels for the training step: GEMM (OpenBLAS), bias + activation, softmax
// cross-entropy, the SGD and AdamW updates, and the fixed-point conversion used by deterministic
// gradient reduction. These are the reference twins of the CUDA kernels in this folder.
//
// Conventions for every function here: matrices are row-major, pointers are non-owning and must
// be valid for the sizes given, buffers of different arguments must not overlap unless a comment
// says they may. Apart from OpenBLAS's own buffers nothing allocates, and nothing keeps state
// between calls except the BLAS thread count. Concurrent calls on disjoint buffers are safe (the
// pthread OpenBLAS that Debian ships accepts concurrent callers; each Gemm may then start its own
// BLAS threads, so callers that are already parallel should SetBlasThreads(1)). None of them
// fails; precondition violations are programmer errors (assert in debug builds).
#ifndef LOCKSTEP_KERNELS_CPU_KERNELS_H_
#define LOCKSTEP_KERNELS_CPU_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace lockstep::kernels {

// GELU is the exact erf form, 0.5 * x * (1 + erf(x / sqrt(2))), which is PyTorch's default
// (approximate="none"); the tanh approximation is not offered.
enum class Activation { kIdentity, kRelu, kGelu };

// Parses "relu", "gelu" or "identity" (case-sensitive); the empty string means relu. Returns
// false and leaves *out untouched on any other name.
bool ParseActivation(std::string_view name, Activation* out);

// Sets the number of threads OpenBLAS uses for every later call in this process
// (openblas_set_num_threads). threads <= 0 is passed through, which OpenBLAS reads as "all
// cores". Not safe to call while another thread is inside Gemm.
void SetBlasThreads(int threads);

// C = alpha * op(A) * op(B) + beta * C, row-major, op(X) = X^T when the flag is set.
// op(A) is m x k, op(B) is k x n, C is m x n. Leading dimensions are row strides of the matrices
// as stored: lda >= (trans_a ? m : k), ldb >= (trans_b ? k : n), ldc >= n. When beta == 0, C is
// overwritten and may hold garbage (BLAS semantics). Returns immediately when m or n is 0; when
// k is 0 only the beta scaling happens.
// Calls cblas_sgemm (OpenBLAS), which may use several threads; see SetBlasThreads.
void Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc);

// For a rows x cols matrix: z[r][c] += bias[c]; a[r][c] = act(z[r][c]).
// z keeps the pre-activation for ActivationBackward. a may equal z (in place) for kIdentity
// and kRelu: relu(z) <= 0 exactly where z <= 0, so passing the output as z to ActivationBackward
// gives the same gradient. For kGelu, a == z still computes the forward correctly but leaves z
// holding the activation, so a training step must pass a separate buffer (ActivationBackward
// needs the pre-activation). Partial overlap is never allowed.
void BiasActivationForward(const float* bias, int rows, int cols, Activation act, float* z,
                           float* a);

// dz[i] = da[i] * act'(z[i]) for i in [0, n), where z is the pre-activation written by
// BiasActivationForward. relu'(0) is taken as 0, as PyTorch does. dz may alias da (same
// pointer), not partially overlap it; z must not overlap dz.
void ActivationBackward(Activation act, const float* z, const float* da, float* dz, size_t n);

// db[c] = sum over r of dz[r][c] for a rows x cols matrix; overwrites db, or with `accumulate`
// adds the (float) sum to it (gradient accumulation over micro-batches). Accumulates in float64,
// so the result is the correctly rounded float of a sum whose error is far below one float ulp
// for any realistic batch size.
void BiasGradient(const float* dz, int rows, int cols, float* db, bool accumulate = false);

// Fused softmax cross-entropy over `rows` samples of `classes` logits each (row-major).
// Returns the SUM over rows of -log softmax(logits[r])[labels[r]], in double; 0 for rows == 0.
// If dlogits != nullptr, writes dlogits = (softmax(logits) - onehot(labels)) * grad_scale
// (rows x classes; pass grad_scale = 1/global_batch for a mean loss). If correct != nullptr, adds
// (does not overwrite) the number of rows whose argmax (the first maximum) equals the label.
// The row maximum is subtracted before exponentiating, so any finite logits give a finite loss
// and gradient. Requires classes >= 1 and every label in [0, classes): the caller validates them.
// dlogits must not overlap logits.
double SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int rows, int classes,
                           float grad_scale, float* dlogits, int64_t* correct);

// One step of PyTorch's torch.optim.SGD with dampening 0 and no Nesterov, over n parameters:
//   g' = g + weight_decay * p;  buf = momentum * buf + g';  p -= lr * buf.
// buf must start zeroed, which makes the first step give buf = g' exactly as PyTorch does. With
// momentum == 0 this is plain SGD (buf just holds g'). p, g and buf must not overlap.
void SgdMomentumUpdate(float* p, const float* g, float* buf, size_t n, float lr, float momentum,
                       float weight_decay);

// One step of PyTorch's torch.optim.AdamW (amsgrad off) over n parameters; `step` is the 1-based
// step count t after incrementing, so the first call passes 1:
//   p *= 1 - lr * weight_decay
//   m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g * g
//   p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// m and v must start zeroed. The scalar factors are computed in double, like PyTorch's Python
// floats. p, g, m and v must not overlap.
void AdamWUpdate(float* p, const float* g, float* m, float* v, size_t n, float lr, float beta1,
                 float beta2, float eps, float weight_decay, int64_t step);

// The per-step scalars of that update, computed in double and rounded once to float, as
// PyTorch does with its Python floats (1 - beta2^t in float would keep few digits for
// beta2 = 0.999 and small t). Shared with the CUDA twin so both use the same numbers.
struct AdamWScalars {
  float decay;         // 1 - lr * weight_decay
  float one_minus_b1;  // 1 - beta1
  float one_minus_b2;  // 1 - beta2
  float step_size;     // lr / (1 - beta1^t)
  float bc2_sqrt;      // sqrt(1 - beta2^t)
};
AdamWScalars ComputeAdamWScalars(float lr, float beta1, float beta2, float weight_decay,
                                 int64_t step);

// Number of fixed-point values that can be summed without overflowing int64: ToFixedPoint
// keeps every |out[i]| <= 2^53 - 1, and 1024 * (2^53 - 1) < 2^63 - 1.
inline constexpr int kMaxFixedPointAddends = 1024;

// Deterministic-mode gradient conversion: out[i] = llround(g[i] * 2^frac_bits) (ties away from
// zero). Integer sums of the outputs are exact and therefore independent of summation order,
// which is what makes the reduction bitwise reproducible across ranks and topologies.
//
// Representable range: for a given frac_bits, g is accepted iff it is finite and
// |g| * 2^frac_bits < 2^53, i.e. |g| < 2^(53 - frac_bits), and is quantized with a step of
// 2^-frac_bits (values below 2^-(frac_bits + 1) in magnitude become 0). The 2^53 cap (= 2^(63 -
// 10)) leaves 10 bits of headroom so that up to kMaxFixedPointAddends outputs sum without
// overflow; it also keeps the scaled value exactly representable in double. Example: frac_bits =
// 32 accepts |g| < 2^21 with resolution 2.3e-10. Requires 0 <= frac_bits <= 62; the scaling by
// 2^frac_bits is exact in double over that whole range.
//
// Returns the number of entries that were rejected (non-finite or out of range); those entries
// are written as 0 so the caller can still reduce them and decide what to do with the count.
int64_t ToFixedPoint(const float* g, size_t n, int frac_bits, int64_t* out);

// acc[i] += round(g[i] * 2^frac_bits) (ties to even), for accumulating one micro-shard's
// gradient in fixed point. Values that are not finite or whose scaled magnitude is 2^51 or more
// (|g| >= 2^(51 - frac_bits)) add nothing and are counted in the return value. Same bits on
// every machine for the same inputs; vectorizes (the rounding uses the 1.5 * 2^52 trick).
// Up to kMaxFixedPointAddends accumulations into one acc cannot overflow int64.
int64_t AccumulateFixedPoint(const float* g, size_t n, int frac_bits, int64_t* acc);

// out[i] = round(g[i] * 2^frac_bits), exactly what AccumulateFixedPoint adds to a zeroed acc
// (same rounding, same rejections, same count), without reading out first: a micro-shard's
// first gradient needs no zeroed buffer.
int64_t StoreFixedPoint(const float* g, size_t n, int frac_bits, int64_t* out);

// A micro-shard's loss in deterministic mode: adds llround(loss_sum * grad_scale * 2^frac_bits)
// (ties away from zero) to *acc; a result that is not finite or not below 2^51 in magnitude adds
// nothing and returns 1 (else 0), like a rejected gradient value.
int64_t AccumulateLossFixedPoint(double loss_sum, float grad_scale, int frac_bits, int64_t* acc);

// Inverse of ToFixedPoint: out[i] = float(double(in[i]) * 2^-frac_bits). Exact for any sum of
// up to kMaxFixedPointAddends ToFixedPoint outputs up to the final rounding to float (and the
// int64 -> double rounding, which only matters above 2^53). Requires 0 <= frac_bits <= 62.
void FromFixedPoint(const int64_t* in, size_t n, int frac_bits, float* out);


}  // namespace lockstep::kernels

#endif  // LOCKSTEP_KERNELS_CPU_KERNELS_H_
