// The GPT of gpt.h on one GPU: the same flat parameter layout (Gpt::layout(): backward fills a
// growing prefix of the gradient) and the same forward and backward passes, step for step,
// built from cuBLAS (kernels/cuda_kernels.h) and the CUDA twins of the transformer kernels
// (kernels/cuda_transformer.h). Parameters move between Gpt and GpuGpt as they are, so a GPU
// worker can heal from a CPU worker's state and write the same checkpoints.
//
// FP32 values, but for precision "bf16" (its Blas's): the products' operands in bfloat16, and
// the activations but the residual stream stored in bfloat16 as their kernels and products
// write them (q/k/v, the attention output, the LayerNorms' outputs, the MLP's pre-activation
// and the GELU's output, as PyTorch's autocast keeps them), so they take half the memory and
// no pass rounds them again. The residual stream, the statistics and every gradient stay
// FP32. GpuStep trains it as a GpuModel. Not thread-safe; all work is enqueued on the stream
// given at creation.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/gpu_limits.h"
#include "kernels/cuda_kernels.h"
#include "worker/cuda/gpu_model.h"
#include "worker/model/gpt.h"

namespace lockstep::worker {

class GpuGpt final : public GpuModel {
 public:
  // The LM head's logits at once, at most (256 MiB), whatever the vocabulary.
  static constexpr size_t kHeadChunkValues = static_cast<size_t>(kGpuHeadChunkValues);

  // Takes the shape and layout of `host` (not its parameters: UploadParams) and allocates
  // parameters and gradients on the current device; activations grow on first use. The head
  // runs over at most `head_chunk_values` logits at a time. INVALID_ARGUMENT for an empty
  // shape, or heads over cuda::kMaxAttentionHead. Frozen tensors get gradients like the others
  // (the buffer is laid out as the parameters); GpuStep zeroes them.
  static absl::StatusOr<std::unique_ptr<GpuGpt>> Create(
      const Gpt& host, cudaStream_t stream, size_t head_chunk_values = kHeadChunkValues);
  ~GpuGpt() override;

  // GpuModel: a Batch's tokens. The pieces are Gpt's (a tensor or a layer's group of
  // tensors), whatever chunk_floats.
  std::vector<size_t> ReadyPoints(size_t /*chunk_floats*/) const override {
    return ready_points_;
  }
  absl::Status ForwardBackward(const Batch& batch, float grad_scale, size_t /*chunk_floats*/,
                               const std::function<void(size_t)>& on_ready,
                               bool accumulate) override {
    return ForwardBackward(batch.tokens, batch.token_stride, batch.n, grad_scale, on_ready,
                           accumulate);
  }
  absl::StatusOr<double> Evaluate(const Batch& batch, int64_t* correct) override {
    return Evaluate(batch.tokens, batch.token_stride, batch.n, correct);
  }

  // Forward and backward on n windows of tokens already on the device (n x token_stride ids,
  // token_stride >= context + 1; every id in the vocabulary). Overwrites grads() with
  // grad_scale * d(sum of the samples' losses)/d(params), or with `accumulate` adds to it
  // (micro-batches), as Gpt::ForwardBackward. on_ready(end) is called on the host after the
  // work that finishes grads()[0, end) has been ENQUEUED (not run), at Gpt::ready_points().
  absl::Status ForwardBackward(const int32_t* tokens, int token_stride, int n, float grad_scale,
                               const std::function<void(size_t)>& on_ready, bool accumulate);
  // LossSum(): the sum over the last ForwardBackward's samples of each one's mean
  // cross-entropy, added to the ones before since the last without `accumulate` (0 before the
  // first).
  // Forward only: that loss sum over the n windows, and the predicted tokens that were the next
  // token added to *correct (if given). Waits for the stream.
  absl::StatusOr<double> Evaluate(const int32_t* tokens, int token_stride, int n, int64_t* correct);

 private:
  GpuGpt() = default;
  // An activation stored in FP32, or in bfloat16 under precision "bf16".
  struct Stored {
    float* f32 = nullptr;
    kernels::cuda::Bf16* bf16 = nullptr;
    // The values from `offset` on, as an operand of Blas::Gemm.
    kernels::cuda::Blas::Operand operand(size_t offset = 0) const {
      if (bf16 != nullptr) return kernels::cuda::Blas::Operand(bf16 + offset);
      return kernels::cuda::Blas::Operand(f32 + offset);
    }
  };
  absl::Status Reserve(int rows);
  // Parameter `offset` as an operand of a product: the bf16 copy under precision "bf16"
  // (rounded once per Forward), else the FP32 values.
  kernels::cuda::Blas::Operand Weight(size_t offset) const;
  // The kernels and products that write (or read) Stored activations, in their storage; `w`,
  // `b` and `bias` are offsets of parameters.
  absl::Status LayerNormInto(const float* x, size_t w, size_t b, int rows, const Stored& out,
                             float* mean, float* rstd);
  absl::Status StartWithBias(size_t bias, int rows, int cols, const Stored& out);
  absl::Status GemmInto(int m, int n, int k, kernels::cuda::Blas::Operand a, size_t w, float beta,
                        const Stored& c);
  absl::Status BiasGeluInto(size_t bias, int rows, int cols, const Stored& pre, const Stored& out);
  // Under bf16: out (rows x n) = in . W + bias through cuBLASLt's epilogue, in bf16; with
  // `residual` (FP32) out = residual + that, in FP32; with `pre` out = GELU(that) and that
  // into pre. True when it ran; false (nothing done) outside bf16 or where the epilogue does
  // not apply (Blas::GemmBiasBf16), and the caller adds bias, residual and GELU itself.
  absl::StatusOr<bool> Fused(int rows, int n, int k, const Stored& in, size_t w, size_t bias,
                             const float* residual, void* out, kernels::cuda::Bf16* pre);
  absl::Status GeluBackward(const Stored& pre, size_t count, float* d);
  absl::Status AttentionForward(const Stored& qkv, int n, const Stored& out, float* lse);
  absl::Status AttentionBackward(const float* dout, const Stored& qkv, const Stored& out,
                                 const float* lse, int n, float* dqkv);
  // Forward over n windows (their first `context` tokens): lnf's output rows in lnf_, and
  // targets_ holds each row's next token.
  absl::Status Forward(const int32_t* tokens, int token_stride, int n);
  // The LM head over the rows of lnf_: the loss sum into *loss_sum (row order, in chunks of
  // rows); with `backward` the gradient scaled by `scale` (in place of the logits, or in
  // dlogits16_ under bf16), dlnf_ = dlogits . wte and wte's gradient += dlogits^T . lnf; with
  // `count` the correct rows into correct_.
  absl::Status Head(int rows, float scale, bool backward, bool count, double* loss_sum);
  absl::Status CheckWindows(int token_stride) const;
  // A device double's value over the context (waits for the stream).
  absl::StatusOr<double> MeanOverContext(const double* sum);

  GptConfig config_;
  Gpt::Layout layout_;
  std::vector<size_t> ready_points_;
  // bf16: the parameters rounded to bfloat16 at the start of each Forward (they do not change
  // within one), so each product takes its weight as it is instead of rounding it every time.
  kernels::cuda::Bf16* params16_ = nullptr;
  size_t head_chunk_values_ = kHeadChunkValues;
  double* head_loss_ = nullptr;      // the LM head's sum over the rows of one ForwardBackward
  double* eval_loss_sum_ = nullptr;  // Evaluate's
  int64_t* correct_ = nullptr;

  // Activations for backward, for capacity_rows_ rows (n * context), carved from one
  // allocation (arena_); the integer and double buffers are their own.
  int capacity_rows_ = 0;
  bool arena_bf16_ = false;  // the Stored activations were laid out in bfloat16
  int head_chunk_rows_ = 0;
  float* arena_ = nullptr;
  std::vector<float*> resid_;  // layers + 1: the residual stream entering each block
  std::vector<float*> ln1_mean_, ln1_rstd_, lse_, mid_, ln2_mean_, ln2_rstd_;
  std::vector<Stored> ln1_, qkv_, atty_, ln2_, fch_, fch_gelu_;
  Stored lnf_;
  float *lnf_mean_ = nullptr, *lnf_rstd_ = nullptr;
  float* logits_ = nullptr;  // head_chunk_rows_ rows of the LM head
  float *scratch_ = nullptr, *scratch4_ = nullptr, *dresid_ = nullptr, *dmid_ = nullptr,
        *dqkv_ = nullptr, *dlnf_ = nullptr;
  // bf16: a linear layer's output gradient and the LM head's logit gradient rounded once for
  // the two products that take each (null otherwise).
  kernels::cuda::Bf16 *d16_ = nullptr, *dlogits16_ = nullptr;
  int32_t* ids_ = nullptr;        // each row's token
  int32_t* targets_ = nullptr;    // each row's next token
  int32_t* positions_ = nullptr;  // each row's position
  int32_t* row_correct_ = nullptr;
  double* row_loss_ = nullptr;
};

}  // namespace lockstep::worker
