// CUDA twins of the CPU kernels; see cuda_kernels.h. Elementwise kernels use grid-stride loops
// of 256 threads; none of them needs shared memory. Reductions that feed the training state
// (bias gradients, the loss sum) run in a fixed order, so a rank gets the same bits every run.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/gpu_limits.h"
#include "common/status_macros.h"
#include "kernels/cuda_kernels.h"
#include "kernels/cuda_launch.h"
#include "kernels/cuda_reduce.h"
#include "kernels/device_memory.h"
#include "kernels/gpu_check.h"

namespace lockstep::kernels::cuda {
namespace {

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

// Same forms as the CPU's (erfc keeps precision for negative x).
__device__ float Gelu(float x) { return 0.5f * x * erfcf(-x * kInvSqrt2); }
__device__ float GeluDerivative(float x) {
  return 0.5f * erfcf(-x * kInvSqrt2) + x * kInvSqrt2Pi * expf(-0.5f * x * x);
}

__global__ void BiasActivationKernel(const float* bias, int rows, int cols, Activation act,
                                     float* z, float* a) {
  const size_t n = static_cast<size_t>(rows) * cols;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float v = z[i] + bias[i % cols];
    z[i] = v;
    // The CPU's forms: NaN passes through ReLU (and its gradient), as in PyTorch.
    a[i] = act == Activation::kRelu   ? (v < 0.0f ? 0.0f : v)
           : act == Activation::kGelu ? Gelu(v)
                                      : v;
  }
}

__global__ void GeluKernel(const float* z, float* a, size_t n) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    a[i] = Gelu(z[i]);
  }
}

__global__ void ActivationBackwardKernel(Activation act, const float* z, const float* da, float* dz,
                                         size_t n) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float d = da[i];
    dz[i] = act == Activation::kRelu   ? (z[i] <= 0.0f ? 0.0f : d)
            : act == Activation::kGelu ? d * GeluDerivative(z[i])
                                       : d;
  }
}

// One thread per column; consecutive threads read consecutive addresses of each row.
// In double, by kernels/cuda_reduce.h's fixed groups of rows: the double sum differs from the
// CPU's row-order one by about rows * 1e-16 relative, far below a float ulp, so the float is
// the same but in rare near-ties.
__global__ void __launch_bounds__(kSumColumns * kSumGroups)
    BiasGradientKernel(const float* dz, int rows, int cols, float* db, bool accumulate) {
  const int c = blockIdx.x * kSumColumns + threadIdx.x;
  double sum = 0.0;
  if (c < cols) {
#pragma unroll 8
    for (int r = threadIdx.y; r < rows; r += kSumGroups) {
      sum = AddRounded(sum, static_cast<double>(dz[static_cast<size_t>(r) * cols + c]));
    }
  }
  sum = AddGroups(sum);
  if (threadIdx.y != 0 || c >= cols) return;
  db[c] = accumulate ? db[c] + static_cast<float>(sum) : static_cast<float>(sum);
}

// One thread per row: the classifier has few classes (10 for the MLPs here), so a row is a
// few dozen bytes and a warp per row would idle most of its lanes.
__global__ void SoftmaxCrossEntropyKernel(const float* logits, const int32_t* labels, int rows,
                                          int classes, float grad_scale, float* dlogits,
                                          double* row_loss, int32_t* row_correct) {
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const float* x = logits + static_cast<size_t>(r) * classes;
  const int label = labels[r];
  int argmax = 0;
  float max = x[0];
  for (int c = 1; c < classes; ++c) {
    if (x[c] > max) {
      max = x[c];
      argmax = c;
    }
  }
  double sum = 0.0;
  if (dlogits != nullptr) {
    float* e = dlogits + static_cast<size_t>(r) * classes;
    for (int c = 0; c < classes; ++c) {
      e[c] = expf(x[c] - max);
      sum += e[c];
    }
    const float scale = static_cast<float>(static_cast<double>(grad_scale) / sum);
    for (int c = 0; c < classes; ++c) e[c] *= scale;
    e[label] -= grad_scale;
  } else {
    for (int c = 0; c < classes; ++c) sum += expf(x[c] - max);
  }
  row_loss[r] = log(sum) - (static_cast<double>(x[label]) - static_cast<double>(max));
  if (row_correct != nullptr) row_correct[r] = argmax == label ? 1 : 0;
}

// A single thread adds the rows in order: deterministic, and a few microseconds for the batch
// sizes a worker sees (thousands of rows), which is not worth a tree.
__global__ void SumInOrderKernel(const double* values, int n, double* out, bool accumulate) {
  double sum = 0.0;
  for (int i = 0; i < n; ++i) sum += values[i];
  *out = accumulate ? *out + sum : sum;
}

__global__ void SgdKernel(float* p, const float* g, float* buf, size_t n, float lr, float momentum,
                          float weight_decay) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float gi = g[i] + weight_decay * p[i];
    const float bi = momentum * buf[i] + gi;
    buf[i] = bi;
    p[i] -= lr * bi;
  }
}

__global__ void AdamWKernel(float* p, const float* g, float* m, float* v, size_t n, float beta1,
                            float beta2, float one_minus_b1, float one_minus_b2, float decay,
                            float step_size, float bc2_sqrt, float eps) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float gi = g[i];
    const float mi = beta1 * m[i] + one_minus_b1 * gi;
    const float vi = beta2 * v[i] + one_minus_b2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float denom = sqrtf(vi) / bc2_sqrt + eps;
    p[i] = p[i] * decay - step_size * (mi / denom);
  }
}

// round(g * 2^frac_bits), ties to even (__double2ll_rn), exactly the CPU's magic-number
// rounding; |x| >= 2^51, NaN and inf contribute 0 and are counted.
template <bool kAccumulate>
__global__ void FixedPointKernel(const float* g, size_t n, double scale, int64_t* out,
                                 unsigned long long* rejected) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const double x = static_cast<double>(g[i]) * scale;
    const bool ok = fabs(x) < 2251799813685248.0;  // 2^51; false for NaN and +-inf
    const int64_t q = ok ? __double2ll_rn(x) : 0;
    if (kAccumulate) {
      out[i] += q;
    } else {
      out[i] = q;
    }
    local += ok ? 0 : 1;
  }
  // Rejections are rare (they fail the step), so one atomic per thread that saw any is cheap.
  if (local != 0) atomicAdd(rejected, local);
}

__global__ void LossFixedPointKernel(const double* loss_sum, double grad_scale, double scale,
                                     int64_t* acc, unsigned long long* rejected) {
  const double scaled = *loss_sum * grad_scale * scale;  // the CPU's order of operations
  if (isfinite(scaled) && fabs(scaled) < 2251799813685248.0) {
    *acc += llround(scaled);
  } else {
    atomicAdd(rejected, 1ULL);
  }
}

__global__ void FromFixedPointKernel(const int64_t* in, size_t n, double scale, float* out) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    out[i] = static_cast<float>(__ll2double_rn(in[i]) * scale);
  }
}

absl::Status CheckFracBits(int frac_bits) {
  if (frac_bits < 0 || frac_bits > 62) return absl::InvalidArgumentError("frac_bits: 0..62");
  return absl::OkStatus();
}

// StoreFixedPoint (kAccumulate false) and AccumulateFixedPoint (true).
template <bool kAccumulate>
absl::Status LaunchFixedPoint(const float* g, size_t n, int frac_bits, int64_t* out,
                              unsigned long long* rejected, cudaStream_t stream) {
  LOCKSTEP_RETURN_IF_ERROR(CheckFracBits(frac_bits));
  if (n == 0) return absl::OkStatus();
  FixedPointKernel<kAccumulate>
      <<<Blocks(n), kThreads, 0, stream>>>(g, n, std::ldexp(1.0, frac_bits), out, rejected);
  return LaunchStatus(kAccumulate ? "FixedPointKernel<accumulate>" : "FixedPointKernel<store>");
}

// The largest power of two (up to 256) that divides the address.
uint32_t Alignment(const void* p) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

cublasHandle_t BlasHandle(void* h) { return static_cast<cublasHandle_t>(h); }
cublasLtHandle_t LtHandle(void* h) { return static_cast<cublasLtHandle_t>(h); }

// Owns the cuBLASLt descriptors of one matmul call.
__global__ void ToBf16Kernel(const float* in, size_t n, __nv_bfloat16* out) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    out[i] = __float2bfloat16_rn(in[i]);
  }
}

// Values a row-major operand of `rows` x `cols` with leading dimension `ld` spans.
size_t Span(int rows, int cols, int ld) {
  return rows <= 0 || cols <= 0 ? 0 : static_cast<size_t>(rows - 1) * ld + cols;
}

struct LtDescriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  ~LtDescriptors() {
    if (preference != nullptr) cublasLtMatmulPreferenceDestroy(preference);
    if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<Blas>> Blas::Create(cudaStream_t stream) {
  std::unique_ptr<Blas> blas(new Blas());
  blas->stream_ = stream;
  cublasHandle_t handle = nullptr;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasCreate(&handle));
  blas->blas_ = handle;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasSetStream(handle, stream));
  // FP32 products stay FP32 (no TF32) so that CPU and GPU workers agree to FP32 rounding.
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH));
  cublasLtHandle_t lt = nullptr;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasLtCreate(&lt));
  blas->lt_ = lt;
  // 32 MiB: what NVIDIA recommends for Hopper's cuBLASLt kernels.
  blas->workspace_bytes_ = static_cast<size_t>(kGpuBlasWorkspaceBytes);
  LOCKSTEP_GPU_RETURN_IF_ERROR(DeviceMalloc(&blas->workspace_, blas->workspace_bytes_));
  return blas;
}

Blas::~Blas() {
  for (void* p : bf16_scratch_) {
    if (p != nullptr) DeviceFree(p);
  }
  if (workspace_ != nullptr) DeviceFree(workspace_);
  if (lt_ != nullptr) cublasLtDestroy(LtHandle(lt_));
  if (blas_ != nullptr) cublasDestroy(BlasHandle(blas_));
}

absl::Status Blas::SetPrecision(Precision precision) {
  const bool tf32 = precision == Precision::kTf32;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasSetMathMode(
      BlasHandle(blas_), tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
  tf32_ = tf32;
  bf16_ = precision == Precision::kBf16;
  return absl::OkStatus();
}

absl::StatusOr<Blas::Precision> Blas::ParsePrecision(const std::string& name) {
  if (name.empty() || name == "fp32") return Precision::kFp32;
  if (name == "tf32") return Precision::kTf32;
  if (name == "bf16") return Precision::kBf16;
  return absl::InvalidArgumentError(
      absl::StrCat("precision: \"fp32\", \"tf32\" or \"bf16\", got \"", name, "\""));
}

absl::Status Blas::GrowBf16(int slot, size_t count) {
  if (count <= bf16_capacity_[slot]) return absl::OkStatus();
  // The old buffer may still feed a product in flight on the stream.
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  DeviceFree(bf16_scratch_[slot]);
  bf16_scratch_[slot] = nullptr;
  bf16_capacity_[slot] = 0;
  LOCKSTEP_GPU_RETURN_IF_ERROR(DeviceMalloc(&bf16_scratch_[slot], count * sizeof(__nv_bfloat16)));
  bf16_capacity_[slot] = count;
  return absl::OkStatus();
}

absl::Status Blas::ReserveBf16(size_t count) {
  if (!bf16_) return absl::OkStatus();
  for (int slot : {0, 1}) LOCKSTEP_RETURN_IF_ERROR(GrowBf16(slot, count));
  return absl::OkStatus();
}

absl::StatusOr<const void*> Blas::ToBf16(int slot, const float* values, size_t count) {
  LOCKSTEP_RETURN_IF_ERROR(GrowBf16(slot, count));
  Bf16* out = static_cast<Bf16*>(bf16_scratch_[slot]);
  LOCKSTEP_RETURN_IF_ERROR(RoundToBf16(values, count, out, stream_));
  return static_cast<const void*>(out);
}

absl::Status Blas::Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, Operand a,
                        int lda, Operand b, int ldb, float beta, float* c, int ldc) {
  if (m == 0 || n == 0) return absl::OkStatus();
  if (bf16_) {
    return GemmBf16(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, CUDA_R_32F, ldc);
  }
  // Row-major C (m x n) is column-major C^T (n x m) = op(B)^T * op(A)^T: swap the operands
  // and keep each one's transpose flag.
  if (a.bf16 != nullptr || b.bf16 != nullptr) {
    return absl::InvalidArgumentError("Gemm: a bfloat16 operand needs precision bf16");
  }
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasSgemm(BlasHandle(blas_), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                           trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k, &alpha,
                                           b.f32, ldb, a.f32, lda, &beta, c, ldc));
  return absl::OkStatus();
}

absl::Status Blas::Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, Operand a,
                        int lda, Operand b, int ldb, float beta, Bf16* c, int ldc) {
  if (!bf16_) return absl::InvalidArgumentError("Gemm: a bfloat16 result needs precision bf16");
  if (m == 0 || n == 0) return absl::OkStatus();
  return GemmBf16(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, CUDA_R_16BF, ldc);
}

absl::Status Blas::GemmBf16(bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                            Operand a, int lda, Operand b, int ldb, float beta, void* c,
                            int c_type, int ldc) {
  // An operand already in bfloat16 goes as it is; an FP32 one is rounded into its slot.
  auto as_bf16 = [&](int slot, Operand o, size_t span) -> absl::StatusOr<const void*> {
    if (o.bf16 != nullptr) return static_cast<const void*>(o.bf16);
    return ToBf16(slot, o.f32, span);
  };
  absl::StatusOr<const void*> a16 = as_bf16(0, a, trans_a ? Span(k, m, lda) : Span(m, k, lda));
  if (!a16.ok()) return a16.status();
  absl::StatusOr<const void*> b16 = as_bf16(1, b, trans_b ? Span(n, k, ldb) : Span(k, n, ldb));
  if (!b16.ok()) return b16.status();
  // Row-major C (m x n) is column-major C^T (n x m) = op(B)^T * op(A)^T, as in Gemm.
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasGemmEx(
      BlasHandle(blas_), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
      n, m, k, &alpha, *b16, CUDA_R_16BF, ldb, *a16, CUDA_R_16BF, lda, &beta, c,
      static_cast<cudaDataType_t>(c_type), ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return absl::OkStatus();
}

absl::StatusOr<bool> Blas::LtMatmul(const LtProduct& p) {
  LtDescriptors desc;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasLtMatmulDescCreate(
      &desc.op, tf32_ && p.type == CUDA_R_32F ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
      CUDA_R_32F));
  const cublasOperation_t trans_w = p.trans_w ? CUBLAS_OP_T : CUBLAS_OP_N, keep = CUBLAS_OP_N;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSA,
                                                              &trans_w, sizeof(trans_w)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(
      cublasLtMatmulDescSetAttribute(desc.op, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep)));
  const cublasLtEpilogue_t epilogue = static_cast<cublasLtEpilogue_t>(p.epilogue);
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
      desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  if (p.bias != nullptr) {
    LOCKSTEP_GPU_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
        desc.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias, sizeof(p.bias)));
  }
  if (p.aux != nullptr) {
    const int64_t ld_aux = p.ld_aux;
    LOCKSTEP_GPU_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
        desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &p.aux, sizeof(p.aux)));
    LOCKSTEP_GPU_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
        desc.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld_aux, sizeof(ld_aux)));
  }
  const cudaDataType_t type = static_cast<cudaDataType_t>(p.type);
  const cudaDataType_t d_type = static_cast<cudaDataType_t>(p.d_type);
  // op(W) is rows x k, X is k x cols, C and D rows x cols (column-major).
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(
      &desc.a, type, p.trans_w ? p.k : p.rows, p.trans_w ? p.rows : p.k, p.ld_w));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(&desc.b, type, p.k, p.cols, p.ld_x));
  LOCKSTEP_GPU_RETURN_IF_ERROR(
      cublasLtMatrixLayoutCreate(&desc.d, d_type, p.rows, p.cols, p.ld_d));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&desc.preference));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      desc.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_,
      sizeof(workspace_bytes_)));
  // Parameters sit back to back in one flat buffer, so weights are not always 16-byte
  // aligned: tell the heuristic what the pointers really are, or it may pick a kernel that
  // needs more and the matmul fails.
  const void* c = p.c != nullptr ? p.c : p.d;
  const uint32_t align_w = Alignment(p.w), align_x = Alignment(p.x),
                 align_c = std::min(Alignment(c), Alignment(p.d)), align_d = Alignment(p.d);
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      desc.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_w, sizeof(align_w)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      desc.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_x, sizeof(align_x)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      desc.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof(align_c)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
      desc.preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof(align_d)));
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  // C shares D's layout (and type).
  // "Not supported" (from the heuristic, or the matmul refusing what it chose) means nothing
  // ran: the caller's fallback, not an error.
  const cublasStatus_t searched =
      cublasLtMatmulAlgoGetHeuristic(LtHandle(lt_), desc.op, desc.a, desc.b, desc.d, desc.d,
                                     desc.preference, 1, &heuristic, &found);
  const bool none = searched == CUBLAS_STATUS_SUCCESS &&
                    (found == 0 || heuristic.state != CUBLAS_STATUS_SUCCESS);
  if (searched == CUBLAS_STATUS_NOT_SUPPORTED || none) return false;
  LOCKSTEP_GPU_RETURN_IF_ERROR(searched);
  const float alpha = 1.0f;
  const cublasStatus_t ran = cublasLtMatmul(LtHandle(lt_), desc.op, &alpha, p.w, desc.a, p.x,
                                            desc.b, &p.beta, c, desc.d, p.d, desc.d,
                                            &heuristic.algo, workspace_, workspace_bytes_, stream_);
  if (ran == CUBLAS_STATUS_NOT_SUPPORTED) return false;
  LOCKSTEP_GPU_RETURN_IF_ERROR(ran);
  return true;
}

absl::Status Blas::LinearForward(const float* x, const float* w, const float* bias, int rows,
                                 int in, int out, Activation act, float* z, float* a) {
  if (rows == 0 || out == 0) return absl::OkStatus();
  if (act != Activation::kGelu && z != a) {
    return absl::InvalidArgumentError("LinearForward: identity and ReLU write a only (z == a)");
  }
  // Column-major view: W is stored (in x out), X (in x rows), the output (out x rows). The
  // output's "rows" are the layer's features, which is what cuBLASLt's bias runs along.
  // The bias epilogue wants a 16-byte aligned bias, which layers packed back to back in one
  // flat buffer do not always have (and there is no preference attribute to say so): then the
  // matmul runs plain and a kernel adds bias and activation.
  bool fused = Alignment(bias) >= 16;
  // kBf16: the weights and the input rounded to bfloat16 (FP32 sums, bias and output).
  const void* w_in = w;
  const void* x_in = x;
  if (bf16_) {
    absl::StatusOr<const void*> w16 = ToBf16(0, w, static_cast<size_t>(in) * out);
    if (!w16.ok()) return w16.status();
    absl::StatusOr<const void*> x16 = ToBf16(1, x, static_cast<size_t>(in) * rows);
    if (!x16.ok()) return x16.status();
    w_in = *w16;
    x_in = *x16;
  }
  float* d = act == Activation::kGelu ? z : a;
  LtProduct p;
  p.trans_w = true;
  p.rows = out;
  p.cols = rows;
  p.k = in;
  p.type = bf16_ ? CUDA_R_16BF : CUDA_R_32F;
  p.w = w_in;
  p.ld_w = in;
  p.x = x_in;
  p.ld_x = in;
  p.d = d;
  p.d_type = CUDA_R_32F;
  p.ld_d = out;
  p.epilogue = !fused                     ? CUBLASLT_EPILOGUE_DEFAULT
               : act == Activation::kRelu ? CUBLASLT_EPILOGUE_RELU_BIAS
                                          : CUBLASLT_EPILOGUE_BIAS;
  p.bias = fused ? bias : nullptr;
  absl::StatusOr<bool> fused_ran = LtMatmul(p);
  if (!fused_ran.ok()) return fused_ran.status();
  bool ran = *fused_ran;
  if (!ran && fused) {
    // No kernel with the fused epilogue for these shapes and alignments: the plain product,
    // then the bias kernel.
    fused = false;
    p.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    p.bias = nullptr;
    absl::StatusOr<bool> plain_ran = LtMatmul(p);
    if (!plain_ran.ok()) return plain_ran.status();
    ran = *plain_ran;
  }
  if (!ran) {
    return absl::InternalError(absl::StrCat("cuBLASLt has no algorithm for a ", rows, "x", in,
                                            " by ", in, "x", out, " product"));
  }
  if (!fused) return BiasActivationForward(bias, rows, out, act, d, a, stream_);
  if (act == Activation::kGelu) {
    const size_t n = static_cast<size_t>(rows) * out;
    GeluKernel<<<Blocks(n), kThreads, 0, stream_>>>(z, a, n);
    return LaunchStatus("GeluKernel");
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Blas::GemmBiasBf16(int m, int n, int k, const Bf16* a, const Bf16* w,
                                        const void* bias, const float* residual, void* c,
                                        bool c_bf16, Bf16* pre) {
  if (!bf16_) return absl::InvalidArgumentError("GemmBiasBf16: needs precision bf16");
  if (m == 0 || n == 0) return true;
  if (c_bf16 == (residual != nullptr) || (pre != nullptr && !c_bf16)) {
    return absl::InvalidArgumentError(
        "GemmBiasBf16: a residual goes with an FP32 result, a pre-activation with a bf16 one");
  }
  // The epilogue's bias and pre-activation want 16-byte alignment and the pre-activation a
  // leading dimension of a multiple of 8: otherwise the caller's unfused path.
  if (Alignment(bias) < 16 || (pre != nullptr && (Alignment(pre) < 16 || n % 8 != 0))) {
    return false;
  }
  // Row-major C (m x n) = A (m x k) W (k x n) is column-major C^T (n x m) = W' (n x k) A'
  // (k x m), where W' and A' are the row-major W and A read column-major, as they are.
  LtProduct p;
  p.trans_w = false;
  p.rows = n;
  p.cols = m;
  p.k = k;
  p.type = CUDA_R_16BF;
  p.w = w;
  p.ld_w = n;
  p.x = a;
  p.ld_x = k;
  p.c = residual;
  p.beta = residual != nullptr ? 1.0f : 0.0f;
  p.d = c;
  p.d_type = c_bf16 ? CUDA_R_16BF : CUDA_R_32F;
  p.ld_d = n;
  p.epilogue = pre != nullptr ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_BIAS;
  p.bias = bias;
  p.aux = pre;
  p.ld_aux = n;
  return LtMatmul(p);
}

absl::Status RoundToBf16(const float* values, size_t n, Bf16* out, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  ToBf16Kernel<<<Blocks(n), kThreads, 0, stream>>>(values, n,
                                                   reinterpret_cast<__nv_bfloat16*>(out));
  return LaunchStatus("ToBf16Kernel");
}

absl::Status BiasActivationForward(const float* bias, int rows, int cols, Activation act, float* z,
                                   float* a, cudaStream_t stream) {
  const size_t n = static_cast<size_t>(rows) * cols;
  if (n == 0) return absl::OkStatus();
  BiasActivationKernel<<<Blocks(n), kThreads, 0, stream>>>(bias, rows, cols, act, z, a);
  return LaunchStatus("BiasActivationKernel");
}

absl::Status ActivationBackward(Activation act, const float* z, const float* da, float* dz,
                                size_t n, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  ActivationBackwardKernel<<<Blocks(n), kThreads, 0, stream>>>(act, z, da, dz, n);
  return LaunchStatus("ActivationBackwardKernel");
}

absl::Status BiasGradient(const float* dz, int rows, int cols, float* db, bool accumulate,
                          cudaStream_t stream) {
  if (cols == 0) return absl::OkStatus();
  BiasGradientKernel<<<(cols + kSumColumns - 1) / kSumColumns, dim3(kSumColumns, kSumGroups), 0,
                       stream>>>(dz, std::max(rows, 0), cols, db, accumulate);
  return LaunchStatus("BiasGradientKernel");
}

absl::Status SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int rows, int classes,
                                 float grad_scale, float* dlogits, double* row_loss,
                                 int32_t* row_correct, double* loss_sum, bool accumulate_loss,
                                 cudaStream_t stream) {
  if (classes < 1) return absl::InvalidArgumentError("SoftmaxCrossEntropy: classes must be >= 1");
  if (rows > 0) {
    SoftmaxCrossEntropyKernel<<<(rows + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
        logits, labels, rows, classes, grad_scale, dlogits, row_loss, row_correct);
    LOCKSTEP_RETURN_IF_ERROR(LaunchStatus("SoftmaxCrossEntropyKernel"));
  }
  SumInOrderKernel<<<1, 1, 0, stream>>>(row_loss, rows, loss_sum, accumulate_loss);
  return LaunchStatus("SumInOrderKernel");
}

absl::Status SgdMomentumUpdate(float* p, const float* g, float* buf, size_t n, float lr,
                               float momentum, float weight_decay, cudaStream_t stream) {
  if (n == 0) return absl::OkStatus();
  SgdKernel<<<Blocks(n), kThreads, 0, stream>>>(p, g, buf, n, lr, momentum, weight_decay);
  return LaunchStatus("SgdKernel");
}

absl::Status AdamWUpdate(float* p, const float* g, float* m, float* v, size_t n, float lr,
                         float beta1, float beta2, float eps, float weight_decay, int64_t step,
                         cudaStream_t stream) {
  if (step < 1) return absl::InvalidArgumentError("AdamWUpdate: step is 1-based");
  if (n == 0) return absl::OkStatus();
  // The scalars exactly as the CPU twin computes them.
  const AdamWScalars k = ComputeAdamWScalars(lr, beta1, beta2, weight_decay, step);
  AdamWKernel<<<Blocks(n), kThreads, 0, stream>>>(p, g, m, v, n, beta1, beta2, k.one_minus_b1,
                                                  k.one_minus_b2, k.decay, k.step_size, k.bc2_sqrt,
                                                  eps);
  return LaunchStatus("AdamWKernel");
}

namespace {

// Partial sums of squares: block b of kClipWorkspace covers [b * chunk, (b + 1) * chunk), its
// threads stride the range, and a fixed tree adds them. partial[1 + b].
__global__ void SquaresKernel(const float* g, size_t n, size_t chunk, double* partial) {
  __shared__ double sums[kThreads];
  const size_t begin = blockIdx.x * chunk;
  const size_t end = begin + chunk < n ? begin + chunk : n;
  double sum = 0;
  for (size_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const double x = g[i];
    sum += x * x;
  }
  sums[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) sums[threadIdx.x] += sums[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[1 + blockIdx.x] = sums[0];
}

// One thread: the partials in order, the norm into workspace[0], the factor after it.
__global__ void ClipNormKernel(double* workspace, float clip_norm) {
  double sum = 0;
  for (int b = 0; b < kClipWorkspace; ++b) sum += workspace[1 + b];
  const double norm = sqrt(sum);
  workspace[0] = norm;
  // The factor goes where partial 0 was (read above, no longer needed).
  workspace[1] = fmin(1.0, static_cast<double>(clip_norm) / (norm + 1e-6));
}

__global__ void ScaleKernel(float* g, size_t n, const double* factor) {
  const double f = *factor;
  if (f >= 1.0) return;
  const float s = static_cast<float>(f);
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    g[i] *= s;
  }
}

}  // namespace

absl::Status ClipByGlobalNorm(float* g, size_t n, float clip_norm, double* workspace,
                              cudaStream_t stream) {
  if (!(clip_norm > 0)) {
    return absl::InvalidArgumentError("ClipByGlobalNorm: clip_norm must be > 0");
  }
  const size_t chunk = (n + kClipWorkspace - 1) / kClipWorkspace;
  SquaresKernel<<<kClipWorkspace, kThreads, 0, stream>>>(g, n, chunk, workspace);
  LOCKSTEP_RETURN_IF_ERROR(LaunchStatus("SquaresKernel"));
  ClipNormKernel<<<1, 1, 0, stream>>>(workspace, clip_norm);
  LOCKSTEP_RETURN_IF_ERROR(LaunchStatus("ClipNormKernel"));
  if (n == 0) return absl::OkStatus();
  ScaleKernel<<<Blocks(n), kThreads, 0, stream>>>(g, n, workspace + 1);
  return LaunchStatus("ScaleKernel");
}

absl::Status StoreFixedPoint(const float* g, size_t n, int frac_bits, int64_t* out,
                             unsigned long long* rejected, cudaStream_t stream) {
  return LaunchFixedPoint<false>(g, n, frac_bits, out, rejected, stream);
}

absl::Status AccumulateFixedPoint(const float* g, size_t n, int frac_bits, int64_t* acc,
                                  unsigned long long* rejected, cudaStream_t stream) {
  return LaunchFixedPoint<true>(g, n, frac_bits, acc, rejected, stream);
}

absl::Status AccumulateLossFixedPoint(const double* loss_sum, float grad_scale, int frac_bits,
                                      int64_t* acc, unsigned long long* rejected,
                                      cudaStream_t stream) {
  LOCKSTEP_RETURN_IF_ERROR(CheckFracBits(frac_bits));
  LossFixedPointKernel<<<1, 1, 0, stream>>>(loss_sum, static_cast<double>(grad_scale),
                                            std::ldexp(1.0, frac_bits), acc, rejected);
  return LaunchStatus("LossFixedPointKernel");
}

absl::Status FromFixedPoint(const int64_t* in, size_t n, int frac_bits, float* out,
                            cudaStream_t stream) {
  LOCKSTEP_RETURN_IF_ERROR(CheckFracBits(frac_bits));
  if (n == 0) return absl::OkStatus();
  FromFixedPointKernel<<<Blocks(n), kThreads, 0, stream>>>(in, n, std::ldexp(1.0, -frac_bits), out);
  return LaunchStatus("FromFixedPointKernel");
}

namespace {

// Copies each segment between the flat buffer and its place in the packed bucket.
absl::Status CopySegments(float* flat, const Segments& segments, float* bucket, bool pack,
                          cudaStream_t stream) {
  size_t at = 0;
  for (const auto& [offset, count] : segments) {
    float* dst = pack ? bucket + at : flat + offset;
    const float* src = pack ? flat + offset : bucket + at;
    LOCKSTEP_GPU_RETURN_IF_ERROR(
        cudaMemcpyAsync(dst, src, count * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    at += count;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status PackBucket(const float* flat, const Segments& segments, float* bucket,
                        cudaStream_t stream) {
  return CopySegments(const_cast<float*>(flat), segments, bucket, /*pack=*/true, stream);
}

absl::Status UnpackBucket(const float* bucket, const Segments& segments, float* flat,
                          cudaStream_t stream) {
  return CopySegments(flat, segments, const_cast<float*>(bucket), /*pack=*/false, stream);
}

}  // namespace lockstep::kernels::cuda
