// CUDA twins of cpu_transformer.h for the GPT's GPU step engine: LayerNorm forward and
// backward, the tanh GELU, tiled causal attention forward and backward, the embedding gradient
// without atomics, column sums (a bias's gradient), and the fused in-place LM-head softmax
// cross-entropy.
//
// Same conventions as the CPU twins (row-major, FP32 values, same formulas and argument
// meanings) and as cuda_kernels.h: non-owning device pointers, everything enqueued on `stream`,
// a Status for launch errors (kernels/gpu_check.h), never a crash. Every reduction that feeds
// the training state runs in a fixed order, so a rank gets the same bits on every run (what
// deterministic mode needs): row statistics as fixed warp/block trees in double, the gradients
// summed over rows (dw, db, column sums) by fixed groups of rows added in a fixed order, and
// the embedding table row by row in row order, as the CPU twin does. No atomics anywhere.
// tests/gpu/cuda_kernels_test.cc compares every function with its CPU twin on random data.
#ifndef LOCKSTEP_KERNELS_CUDA_TRANSFORMER_H_
#define LOCKSTEP_KERNELS_CUDA_TRANSFORMER_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "common/gpu_limits.h"
#include "kernels/bf16.h"

namespace lockstep::kernels::cuda {

// Twin of kernels::LayerNormForward: out = (x - mean) * rstd * w + b per row of c, the biased
// variance, statistics in double; saves mean and rstd (rows each) for the backward pass.
absl::Status LayerNormForward(const float* x, const float* w, const float* b, int rows, int c,
                              float eps, float* out, float* mean, float* rstd, cudaStream_t stream);

// Twin of kernels::LayerNormBackward: ADDS to dx (rows x c), dw and db (c each; null when that
// gradient is not wanted). dw and db are summed over rows in a fixed order (see ColumnSums).
absl::Status LayerNormBackward(const float* dout, const float* x, const float* w, const float* mean,
                               const float* rstd, int rows, int c, float* dx, float* dw, float* db,
                               cudaStream_t stream);
// The same with dx = base + the input gradient (base: rows x c, may be dx), the LayerNorm of a
// residual block writing the stream's gradient onto the residual's without a copy first.
absl::Status LayerNormBackward(const float* dout, const float* x, const float* w, const float* mean,
                               const float* rstd, int rows, int c, const float* base, float* dx,
                               float* dw, float* db, cudaStream_t stream);

// Twins of kernels::GeluTanhForward / GeluTanhBackward (GPT-2's tanh approximation; dx may
// alias dout). The device's tanhf stands in for the CPU's polynomial: results agree to a few
// FP32 ulps, not bit for bit.
absl::Status GeluTanhForward(const float* x, size_t n, float* out, cudaStream_t stream);
absl::Status GeluTanhBackward(const float* x, const float* dout, size_t n, float* dx,
                              cudaStream_t stream);

// Twin of kernels::EmbeddingBackward: dtable[ids[r]] += dx[r] for every row r, in row order
// per column, with no atomics: the same bits on every run and on the CPU. A block per 256
// columns and class of ids (id mod 128) walks all the rows and adds those of its class, so
// 128 times as many threads as columns take part. ids must be valid rows of dtable (the
// trainer checks tokens against the vocabulary when it loads them).
absl::Status EmbeddingBackward(const int32_t* ids, const float* dx, int rows, int c, float* dtable,
                               cudaStream_t stream);

// Twin of kernels::ColumnSums: out (cols) = (or += with `accumulate`) the column sums of d
// (rows x cols), in float. A block of 32 columns by 32 groups of rows: group g sums rows g,
// g + 32, ... in order, then the groups' sums are added in order (and onto out when
// accumulating). The same bits every run; not the CPU's row-order bits (FP32 rounding apart).
absl::Status ColumnSums(const float* d, int rows, int cols, float* out, bool accumulate,
                        cudaStream_t stream);
// The same, and d rounded to bfloat16 into `rounded` (rows x cols) in the same pass: a linear
// layer's output gradient as the operand of its products under precision "bf16".
absl::Status ColumnSums(const float* d, int rows, int cols, float* out, bool accumulate,
                        Bf16* rounded, cudaStream_t stream);

// Twin of kernels::CausalAttentionForward (same qkv layout, out and lse): tiled, as flash
// attention, so the T x T scores never exist in memory. A block of 64 query rows of one
// (sequence, head) walks the keys up to its last row in tiles of 32 held in shared memory; each
// thread keeps its query's running maximum, sum and output (the online softmax). Head sizes up
// to kMaxAttentionHead; INVALID_ARGUMENT otherwise or when heads does not divide c.
inline constexpr int kMaxAttentionHead = ::lockstep::kMaxGpuAttentionHead;
absl::Status CausalAttentionForward(const float* qkv, int batch, int T, int c, int heads,
                                    float* out, float* lse, cudaStream_t stream);

// Twin of kernels::CausalAttentionBackward: writes dqkv (rows x 3c). The probabilities are
// recomputed from lse, in two passes with no atomics (each gradient element is summed by one
// thread in a fixed order, so the same bits every run): one pass per tile of keys for dK and
// dV, walking the queries that see them; one per tile of queries for dQ.
absl::Status CausalAttentionBackward(const float* dout, const float* qkv, const float* out,
                                     const float* lse, int batch, int T, int c, int heads,
                                     float* dqkv, cudaStream_t stream);

// Precision "bf16" stores the GPT's activations but the residual stream in bfloat16, as
// PyTorch's autocast does: q/k/v, the attention output, both LayerNorms' outputs, the MLP's
// pre-activation and the GELU's output. These variants read and write them so. LayerNorm, the
// GELU and StartWith write the FP32 value the FP32 variant computes from the same (bf16)
// inputs, rounded to nearest even, bit for bit. Attention runs on bf16 tensor cores instead
// (kernels/cuda_flash_attention.h): FP32 sums and softmax, with the probabilities rounded to
// bf16 before they multiply V, and dO and dS rounded for the backward's products, as
// PyTorch's flash kernels do; it agrees with the FP32 kernels to bf16's precision. The
// statistics, lse, the residual stream and every gradient stay FP32. For the GELU the stored
// (rounded) pre-activation is what it is applied to, as its backward reads it. (The GPT's
// bf16 forward uses these where cuBLASLt's epilogue does not apply: Blas::GemmBiasBf16 adds
// the bf16 bias and applies the GELU to the FP32 sum before either is rounded.)
absl::Status LayerNormForward(const float* x, const float* w, const float* b, int rows, int c,
                              float eps, Bf16* out, float* mean, float* rstd, cudaStream_t stream);
absl::Status BiasGeluTanhForward(const float* bias, int rows, int cols, Bf16* pre, Bf16* out,
                                 cudaStream_t stream);
absl::Status GeluTanhBackward(const Bf16* x, const float* dout, size_t n, float* dx,
                              cudaStream_t stream);
absl::Status CausalAttentionForward(const Bf16* qkv, int batch, int T, int c, int heads,
                                    Bf16* out, float* lse, cudaStream_t stream);
absl::Status CausalAttentionBackward(const float* dout, const Bf16* qkv, const Bf16* out,
                                     const float* lse, int batch, int T, int c, int heads,
                                     float* dqkv, cudaStream_t stream);
absl::Status StartWith(const float* residual, const float* bias, int rows, int cols, Bf16* out,
                       cudaStream_t stream);

// *out = *value * scale, or with `accumulate` *out += *value * scale (device doubles).
absl::Status AddScaled(const double* value, double scale, bool accumulate, double* out,
                       cudaStream_t stream);

// Twin of kernels::SoftmaxCrossEntropyInPlace, for the LM head: over `rows` rows of `v` logits,
// leaves grad_scale * (softmax - onehot(target)) in place (the full-vocabulary gradient exists
// once, where the logits were), writes each row's -log softmax[target] to row_loss (device
// doubles, rows), and sets *loss_sum (a device double) to their sum in row order, or adds it
// with `accumulate` (micro-batches). row_correct (device, rows; null to skip) gets 1 for each
// row whose first maximum is the target, else 0; with `correct` (a device int64; it needs
// row_correct, else INVALID_ARGUMENT) their count is added to *correct. Targets must be in
// [0, v).
absl::Status SoftmaxCrossEntropyInPlace(float* logits, const int32_t* targets, int rows, int v,
                                        float grad_scale, double* row_loss, double* loss_sum,
                                        bool accumulate, int32_t* row_correct, int64_t* correct,
                                        cudaStream_t stream);
// The same with the logits left as they are and the gradient written in bfloat16 to grad
// (rows x v, rounded to nearest even: the LM head's operand under precision "bf16"), or not
// at all when grad is null (a forward only). The exponentials' sum is taken online (each
// thread's rescaled to the row's maximum), so the loss agrees with the CPU's to double
// rounding, not bit for bit; so does the in-place variant.
absl::Status SoftmaxCrossEntropyInto(const float* logits, const int32_t* targets, int rows, int v,
                                     float grad_scale, Bf16* grad, double* row_loss,
                                     double* loss_sum, bool accumulate, int32_t* row_correct,
                                     int64_t* correct, cudaStream_t stream);

// Twin of kernels::BiasGeluTanhForward: pre += bias (per column), then out = GELU(pre).
absl::Status BiasGeluTanhForward(const float* bias, int rows, int cols, float* pre, float* out,
                                 cudaStream_t stream);

// The GPT's pieces around the kernels above (the CPU's are in worker/model/gpt.cc):
// - GatherTokens: ids[r] = tokens[(r / t) * token_stride + r % t + offset] for r < n * t, the
//   rows' tokens (offset 0) or their next tokens (offset 1, the targets), from n windows;
// - Positions: ids[r] = r % t;
// - EmbeddingForward: out[r] = wte[ids[r]] + wpe[r % t] (rows of c);
// - StartWith: out[r] = residual[r] + bias in every row (residual null: the bias), for a
//   product to add onto.
absl::Status GatherTokens(const int32_t* tokens, int token_stride, int n, int t, int offset,
                          int32_t* ids, cudaStream_t stream);
absl::Status Positions(int rows, int t, int32_t* ids, cudaStream_t stream);
absl::Status EmbeddingForward(const int32_t* ids, const float* wte, const float* wpe, int rows,
                              int t, int c, float* out, cudaStream_t stream);
absl::Status StartWith(const float* residual, const float* bias, int rows, int cols, float* out,
                       cudaStream_t stream);

}  // namespace lockstep::kernels::cuda

#endif  // LOCKSTEP_KERNELS_CUDA_TRANSFORMER_H_
