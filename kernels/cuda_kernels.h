// CUDA twins of cpu_kernels.h for the GPU worker: matrix products through cuBLAS and cuBLASLt
// (bias and ReLU fused in the epilogue), bias + activation, fused softmax cross-entropy forward
// and backward, fused SGD-momentum and AdamW updates over all parameters, the fixed-point
// conversions of deterministic mode, and gradient bucket packing.
//
// Same conventions as the CPU twins (row-major, non-owning device pointers, same formulas and
// argument meanings), plus: everything is enqueued on the given stream and returns without
// waiting; a Status reports launch and library errors (kernels/gpu_check.h), never a crash.
// tests/gpu/cuda_kernels_test.cc compares every function with its CPU twin on random data.
#ifndef LOCKSTEP_KERNELS_CUDA_KERNELS_H_
#define LOCKSTEP_KERNELS_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/bf16.h"
#include "kernels/cpu_kernels.h"

namespace lockstep::kernels::cuda {

// cuBLAS and cuBLASLt handles and the cuBLASLt workspace, bound to one stream. Not thread-safe:
// one per worker (per device), used from the thread that owns the stream.
class Blas {
 public:
  static absl::StatusOr<std::unique_ptr<Blas>> Create(cudaStream_t stream);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  // The arithmetic of the products (FP32 by default, so results match the CPU twin to FP32
  // rounding of the summation order):
  //  - kTf32: TF32 tensor cores for FP32 operands, about 8x the FP32 rate on Hopper, 10-bit
  //    mantissas in the products (PyTorch's allow_tf32);
  //  - kBf16: each product's FP32 operands rounded to bfloat16 (8-bit mantissas, to nearest
  //    even) into scratch memory the Blas owns (an Operand already in bfloat16 is used as it
  //    is), multiplied on bf16 tensor cores with FP32 sums, into an FP32 result (or a bf16 one,
  //    rounded once). The caller's FP32 buffers are never rounded in place: master weights,
  //    gradients and optimizer state stay FP32.
  enum class Precision { kFp32, kTf32, kBf16 };
  absl::Status SetPrecision(Precision precision);
  absl::Status SetTf32(bool on) { return SetPrecision(on ? Precision::kTf32 : Precision::kFp32); }
  // "fp32", "tf32" or "bf16" (a job's `precision`); INVALID_ARGUMENT otherwise.
  static absl::StatusOr<Precision> ParsePrecision(const std::string& name);

  bool bf16() const { return bf16_; }
  // kBf16: grows both operand slots to `count` values now (no-op otherwise, or when they hold
  // as many). A slot that grows inside a backward frees its old buffer, and cudaFree waits
  // for the whole device, NCCL's collectives included: a model sizes them before its first
  // product, for the largest operand of its forward and backward.
  absl::Status ReserveBf16(size_t count);

  // An operand of Gemm: FP32 values (rounded into the scratch under kBf16), or values stored
  // in bfloat16 already (a bf16 activation: used as they are, so the product is the same as
  // with the FP32 values they were rounded from; kBf16 only, else INVALID_ARGUMENT).
  struct Operand {
    Operand(const float* values) : f32(values) {}  // implicit: FP32 call sites stay as they are
    Operand(const Bf16* values) : bf16(values) {}
    const float* f32 = nullptr;
    const Bf16* bf16 = nullptr;
  };

  // Twin of kernels::Gemm: C = alpha * op(A) * op(B) + beta * C, row-major, in the precision
  // set (FP32 unless SetPrecision).
  absl::Status Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, Operand a,
                    int lda, Operand b, int ldb, float beta, float* c, int ldc);
  // The same into a C stored in bfloat16 (kBf16 only, else INVALID_ARGUMENT): the FP32 sum
  // alpha * op(A) * op(B) + beta * C, rounded once to nearest even.
  absl::Status Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, Operand a,
                    int lda, Operand b, int ldb, float beta, Bf16* c, int ldc);

  // One layer's forward: z = x * w^T + bias, a = act(z); x is rows x in, w is out x in (as
  // stored by the CPU model), z and a are rows x out. Identity and ReLU run entirely in the
  // matmul's epilogue and write only `a` (pass z == a: for ReLU the output stands in for the
  // pre-activation in ActivationBackward, as on the CPU). GELU (exact, erf form) needs the
  // pre-activation: the epilogue adds the bias into z and a kernel writes a; z != a.
  absl::Status LinearForward(const float* x, const float* w, const float* bias, int rows, int in,
                             int out, Activation act, float* z, float* a);

  // kBf16's product with its bias in cuBLASLt's epilogue, for the GPT's layers (row-major, W
  // stored k x n as the CPU model keeps it): c (m x n) = a (m x k) . w + bias (n, per column,
  // of c's type: bf16 or FP32, as cuBLASLt wants it), in FP32 sums, then
  //  - c_bf16 and pre == null: c in bfloat16 (q/k/v);
  //  - c_bf16 and pre: c = GELU(the sum) in bfloat16 (GPT-2's tanh form, the epilogue's) and
  //    the sum itself into pre (m x n, bf16), what the GELU's backward reads;
  //  - residual (m x n, FP32, may not be c): c = residual + the sum, in FP32 (the stream).
  // Returns false, having done nothing, where the epilogue does not apply (a bias or
  // pre-activation not 16-byte aligned, n not a multiple of 8 with a pre-activation, or no
  // cuBLASLt algorithm for it): the caller then adds the bias itself. INVALID_ARGUMENT outside
  // kBf16 or for a residual with a bf16 result or a pre-activation with an FP32 one.
  absl::StatusOr<bool> GemmBiasBf16(int m, int n, int k, const Bf16* a, const Bf16* w,
                                    const void* bias, const float* residual, void* c, bool c_bf16,
                                    Bf16* pre);

 private:
  Blas() = default;
  cudaStream_t stream_ = nullptr;
  void* blas_ = nullptr;  // cublasHandle_t
  void* lt_ = nullptr;    // cublasLtHandle_t
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  bool tf32_ = false;
  bool bf16_ = false;
  // kBf16's product of two bf16 operands (rounded into the scratch when FP32) into c of
  // c_type (CUDA_R_32F or CUDA_R_16BF, a cudaDataType_t).
  absl::Status GemmBf16(bool trans_a, bool trans_b, int m, int n, int k, float alpha, Operand a,
                        int lda, Operand b, int ldb, float beta, void* c, int c_type, int ldc);
  // One cuBLASLt product, column-major as cuBLASLt sees it: D (rows x cols) = op(W) (rows x k)
  // . X (k x cols) + beta C, with an epilogue (a cublasLtEpilogue_t) and its bias (and its
  // auxiliary output); C (null: D) has D's layout and type. W and X are of `type` (a
  // cudaDataType_t), D of d_type. False when cuBLASLt has no algorithm for it (nothing ran).
  struct LtProduct {
    bool trans_w = false;
    int rows = 0, cols = 0, k = 0;
    int type = 0, d_type = 0;
    const void* w = nullptr;
    int ld_w = 0;
    const void* x = nullptr;
    int ld_x = 0;
    const void* c = nullptr;
    float beta = 0.0f;
    void* d = nullptr;
    int ld_d = 0;
    int epilogue = 1;  // CUBLASLT_EPILOGUE_DEFAULT
    const void* bias = nullptr;
    void* aux = nullptr;
    int ld_aux = 0;
  };
  absl::StatusOr<bool> LtMatmul(const LtProduct& p);
  // kBf16: the two operands of a product rounded to bfloat16 (uint16 storage), grown on use.
  absl::StatusOr<const void*> ToBf16(int slot, const float* values, size_t count);
  absl::Status GrowBf16(int slot, size_t count);
  void* bf16_scratch_[2] = {nullptr, nullptr};
  size_t bf16_capacity_[2] = {0, 0};
};

absl::Status BiasActivationForward(const float* bias, int rows, int cols, Activation act, float* z,
                                   float* a, cudaStream_t stream);
absl::Status ActivationBackward(Activation act, const float* z, const float* da, float* dz,
                                size_t n, cudaStream_t stream);
// db[c] = sum over r of dz[r][c], accumulated in double in a fixed order (32 groups of rows,
// then the groups: deterministic, and the CPU's float but in rare near-ties); with
// `accumulate` the float sum is added to db (as the CPU twin does).
absl::Status BiasGradient(const float* dz, int rows, int cols, float* db, bool accumulate,
                          cudaStream_t stream);

// Twin of kernels::SoftmaxCrossEntropy. Per-row results go to device arrays: row_loss[r]
// (double), and if row_correct != nullptr, row_correct[r] = 1 when the first argmax equals the
// label, else 0. *loss_sum (device double) receives the sum of row_loss in row order, the same
// every run; with `accumulate_loss` that sum is added to it instead (micro-batches). dlogits may
// be null (forward only).
absl::Status SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int rows, int classes,
                                 float grad_scale, float* dlogits, double* row_loss,
                                 int32_t* row_correct, double* loss_sum, bool accumulate_loss,
                                 cudaStream_t stream);

absl::Status SgdMomentumUpdate(float* p, const float* g, float* buf, size_t n, float lr,
                               float momentum, float weight_decay, cudaStream_t stream);
absl::Status AdamWUpdate(float* p, const float* g, float* m, float* v, size_t n, float lr,
                         float beta1, float beta2, float eps, float weight_decay, int64_t step,
                         cudaStream_t stream);

// Gradient clipping by the global norm, as the CPU optimizer (and
// torch.nn.utils.clip_grad_norm_) does it: norm = sqrt(sum of g^2) in double, and when
// clip_norm / (norm + 1e-6) < 1 every g is scaled by that factor, all without leaving the
// device. The sum runs in a fixed order (kClipWorkspace partial sums, each over a fixed range,
// added in order), so every rank holding the same gradient gets the same bits; the CPU adds in
// index order, so the norms agree to double rounding, not bit for bit. `workspace`: device
// doubles, kClipWorkspace + 1 of them; workspace[0] holds the norm afterwards (before clipping).
inline constexpr int kClipWorkspace = 1024;
absl::Status ClipByGlobalNorm(float* g, size_t n, float clip_norm, double* workspace,
                              cudaStream_t stream);

// out[i] = values[i] rounded to bfloat16, to nearest even (what Blas does to an FP32 operand
// under kBf16): a caller that uses the same FP32 values in several products rounds them once.
absl::Status RoundToBf16(const float* values, size_t n, Bf16* out, cudaStream_t stream);

// Twins of StoreFixedPoint / AccumulateFixedPoint / FromFixedPoint: bit-identical results
// (round half to even, the same 2^51 limit). The number of rejected values is ADDED to the
// device counter *rejected (unsigned long long; integer atomics, so the total is exact).
absl::Status StoreFixedPoint(const float* g, size_t n, int frac_bits, int64_t* out,
                             unsigned long long* rejected, cudaStream_t stream);
absl::Status AccumulateFixedPoint(const float* g, size_t n, int frac_bits, int64_t* acc,
                                  unsigned long long* rejected, cudaStream_t stream);
// Twin of AccumulateLossFixedPoint for a loss sum on the device; a rejection is added to
// *rejected instead of returned.
absl::Status AccumulateLossFixedPoint(const double* loss_sum, float grad_scale, int frac_bits,
                                      int64_t* acc, unsigned long long* rejected,
                                      cudaStream_t stream);
absl::Status FromFixedPoint(const int64_t* in, size_t n, int frac_bits, float* out,
                            cudaStream_t stream);

// A bucket made of (offset, count) ranges of a flat gradient: Pack gathers them into one
// contiguous buffer (in order), Unpack scatters it back. Device-to-device copies on `stream`.
using Segments = std::vector<std::pair<size_t, size_t>>;
absl::Status PackBucket(const float* flat, const Segments& segments, float* bucket,
                        cudaStream_t stream);
absl::Status UnpackBucket(const float* bucket, const Segments& segments, float* flat,
                          cudaStream_t stream);

}  // namespace lockstep::kernels::cuda

#endif  // LOCKSTEP_KERNELS_CUDA_KERNELS_H_
