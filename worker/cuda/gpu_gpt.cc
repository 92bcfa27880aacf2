// GPT forward and backward on one GPU, step for step as Gpt's (worker/model/gpt.cc).
#include "worker/cuda/gpu_gpt.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda_transformer.h"
#include "kernels/device_memory.h"
#include "kernels/gpu_check.h"

namespace lockstep::worker {

using kernels::cuda::DeviceFree;
using kernels::cuda::DeviceMalloc;
namespace {

namespace cuda = kernels::cuda;

constexpr float kLayerNormEps = 1e-5f;  // as Gpt's
// Every activation starts on a 256-byte boundary (what cuBLAS likes best).
constexpr size_t kAlignFloats = 64;

size_t Aligned(size_t floats) { return (floats + kAlignFloats - 1) / kAlignFloats * kAlignFloats; }

template <typename T>
absl::Status Allocate(T** ptr, size_t count) {
  LOCKSTEP_GPU_RETURN_IF_ERROR(
      DeviceMalloc(reinterpret_cast<void**>(ptr), std::max<size_t>(1, count) * sizeof(T)));
  return absl::OkStatus();
}

template <typename T>
void Free(T** ptr) {
  DeviceFree(*ptr);
  *ptr = nullptr;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GpuGpt>> GpuGpt::Create(const Gpt& host, cudaStream_t stream,
                                                       size_t head_chunk_values) {
  const GptConfig& c = host.config();
  if (c.vocab <= 0 || c.context <= 0 || c.layers < 0 || c.heads <= 0 || c.d_model <= 0 ||
      c.d_model % c.heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("GpuGpt: no model of vocab ", c.vocab, ", context ", c.context, ", ", c.layers,
                     " layers, ", c.heads, " heads of d_model ", c.d_model));
  }
  if (c.d_model / c.heads > cuda::kMaxAttentionHead) {
    return absl::InvalidArgumentError(absl::StrCat("GpuGpt: heads of ", c.d_model / c.heads,
                                                   " channels; the attention kernel takes up to ",
                                                   cuda::kMaxAttentionHead));
  }
  std::unique_ptr<GpuGpt> gpt(new GpuGpt());
  gpt->config_ = c;
  gpt->layout_ = host.layout();
  gpt->ready_points_ = host.ready_points();
  gpt->head_chunk_values_ = std::max<size_t>(1, head_chunk_values);
  LOCKSTEP_RETURN_IF_ERROR(gpt->Init(host.num_params(), stream));
  LOCKSTEP_RETURN_IF_ERROR(Allocate(&gpt->head_loss_, 1));
  LOCKSTEP_RETURN_IF_ERROR(Allocate(&gpt->eval_loss_sum_, 1));
  LOCKSTEP_RETURN_IF_ERROR(Allocate(&gpt->correct_, 1));
  return gpt;
}

GpuGpt::~GpuGpt() {
  Free(&params16_);
  Free(&head_loss_);
  Free(&eval_loss_sum_);
  Free(&correct_);
  Free(&arena_);
  Free(&ids_);
  Free(&targets_);
  Free(&positions_);
  Free(&row_correct_);
  Free(&row_loss_);
}

absl::Status GpuGpt::Reserve(int rows) {
  const bool bf16 = blas_->bf16();
  if (rows <= capacity_rows_ && bf16 == arena_bf16_) return absl::OkStatus();
  // Growing frees the old buffers first: the stream must be idle before they go.
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  capacity_rows_ = 0;
  Free(&arena_);
  Free(&ids_);
  Free(&targets_);
  Free(&positions_);
  Free(&row_correct_);
  Free(&row_loss_);
  const size_t R = static_cast<size_t>(rows), C = config_.d_model, L = config_.layers,
               H = config_.heads, V = config_.vocab;
  const int chunk = static_cast<int>(
      std::min<size_t>(std::max<size_t>(1, head_chunk_values_ / V), static_cast<size_t>(rows)));
  head_chunk_rows_ = std::min(chunk, rows);
  // Two passes over the same pieces: the first only counts (aligned), the second hands them
  // out of one allocation.
  for (int pass = 0; pass < 2; ++pass) {
    size_t used = 0;
    auto take = [&](size_t count) {
      float* p = pass == 0 ? nullptr : arena_ + used;
      used += Aligned(count);
      return p;
    };
    // A Stored activation: half the floats in bfloat16.
    auto take_input = [&](size_t count) {
      Stored in;
      if (bf16) {
        in.bf16 = reinterpret_cast<cuda::Bf16*>(take((count + 1) / 2));
      } else {
        in.f32 = take(count);
      }
      return in;
    };
    resid_.assign(L + 1, nullptr);
    for (auto& p : resid_) p = take(R * C);
    for (auto* v : {&ln1_mean_, &ln1_rstd_, &lse_, &mid_, &ln2_mean_, &ln2_rstd_}) {
      v->assign(L, nullptr);
    }
    for (auto* v : {&ln1_, &qkv_, &atty_, &ln2_, &fch_, &fch_gelu_}) v->assign(L, Stored{});
    for (size_t l = 0; l < L; ++l) {
      ln1_[l] = take_input(R * C);
      ln1_mean_[l] = take(R);
      ln1_rstd_[l] = take(R);
      qkv_[l] = take_input(3 * R * C);
      atty_[l] = take_input(R * C);
      lse_[l] = take(R * H);
      mid_[l] = take(R * C);
      ln2_[l] = take_input(R * C);
      ln2_mean_[l] = take(R);
      ln2_rstd_[l] = take(R);
      fch_[l] = take_input(4 * R * C);
      fch_gelu_[l] = take_input(4 * R * C);
    }
    lnf_ = take_input(R * C);
    lnf_mean_ = take(R);
    lnf_rstd_ = take(R);
    logits_ = take(static_cast<size_t>(head_chunk_rows_) * V);
    scratch_ = take(R * C);
    scratch4_ = take(4 * R * C);
    dresid_ = take(R * C);
    dmid_ = take(R * C);
    dqkv_ = take(3 * R * C);
    dlnf_ = take(R * C);
    d16_ = bf16 ? take_input(4 * R * C).bf16 : nullptr;
    dlogits16_ = bf16 ? take_input(static_cast<size_t>(head_chunk_rows_) * V).bf16 : nullptr;
    if (pass == 0) LOCKSTEP_RETURN_IF_ERROR(Allocate(&arena_, used));
  }
  LOCKSTEP_RETURN_IF_ERROR(Allocate(&ids_, R));
  LOCKSTEP_RETURN_IF_ERROR(Allocate(&targets_, R));
  LOCKSTEP_RETURN_IF_ERROR(Allocate(&positions_, R));
  LOCKSTEP_RETURN_IF_ERROR(Allocate(&row_correct_, head_chunk_rows_));
  LOCKSTEP_RETURN_IF_ERROR(Allocate(&row_loss_, head_chunk_rows_));
  capacity_rows_ = rows;
  arena_bf16_ = bf16;
  return absl::OkStatus();
}

cuda::Blas::Operand GpuGpt::Weight(size_t offset) const {
  if (params16_ != nullptr && blas_->bf16()) return cuda::Blas::Operand(params16_ + offset);
  return cuda::Blas::Operand(params_ + offset);
}

absl::Status GpuGpt::LayerNormInto(const float* x, size_t w, size_t b, int rows,
                                   const Stored& out, float* mean, float* rstd) {
  const int C = config_.d_model;
  if (out.bf16 != nullptr) {
    return cuda::LayerNormForward(x, params_ + w, params_ + b, rows, C, kLayerNormEps, out.bf16,
                                  mean, rstd, stream_);
  }
  return cuda::LayerNormForward(x, params_ + w, params_ + b, rows, C, kLayerNormEps, out.f32, mean,
                                rstd, stream_);
}

absl::Status GpuGpt::StartWithBias(size_t bias, int rows, int cols, const Stored& out) {
  if (out.bf16 != nullptr) {
    return cuda::StartWith(nullptr, params_ + bias, rows, cols, out.bf16, stream_);
  }
  return cuda::StartWith(nullptr, params_ + bias, rows, cols, out.f32, stream_);
}

absl::Status GpuGpt::GemmInto(int m, int n, int k, cuda::Blas::Operand a, size_t w, float beta,
                              const Stored& c) {
  // c (m x n) = a (m x k) . W (k x n) + beta c, W a parameter as the CPU stores it.
  if (c.bf16 != nullptr) {
    return blas_->Gemm(false, false, m, n, k, 1.0f, a, k, Weight(w), n, beta, c.bf16, n);
  }
  return blas_->Gemm(false, false, m, n, k, 1.0f, a, k, Weight(w), n, beta, c.f32, n);
}

absl::StatusOr<bool> GpuGpt::Fused(int rows, int n, int k, const Stored& in, size_t w,
                                   size_t bias, const float* residual, void* out, cuda::Bf16* pre) {
  if (!blas_->bf16() || params16_ == nullptr || in.bf16 == nullptr) return false;
  // A bf16 result takes the bias in bf16, the FP32 stream in FP32 (cuBLASLt's rule: the bias
  // has the result's type).
  const bool out_bf16 = residual == nullptr;
  const void* b = out_bf16 ? static_cast<const void*>(params16_ + bias)
                           : static_cast<const void*>(params_ + bias);
  return blas_->GemmBiasBf16(rows, n, k, in.bf16, params16_ + w, b, residual, out, out_bf16, pre);
}

absl::Status GpuGpt::BiasGeluInto(size_t bias, int rows, int cols, const Stored& pre,
                                  const Stored& out) {
  if (pre.bf16 != nullptr) {
    return cuda::BiasGeluTanhForward(params_ + bias, rows, cols, pre.bf16, out.bf16, stream_);
  }
  return cuda::BiasGeluTanhForward(params_ + bias, rows, cols, pre.f32, out.f32, stream_);
}

absl::Status GpuGpt::GeluBackward(const Stored& pre, size_t count, float* d) {
  if (pre.bf16 != nullptr) return cuda::GeluTanhBackward(pre.bf16, d, count, d, stream_);
  return cuda::GeluTanhBackward(pre.f32, d, count, d, stream_);
}

absl::Status GpuGpt::AttentionForward(const Stored& qkv, int n, const Stored& out, float* lse) {
  const int t = config_.context, C = config_.d_model, H = config_.heads;
  if (out.bf16 != nullptr) {
    return cuda::CausalAttentionForward(qkv.bf16, n, t, C, H, out.bf16, lse, stream_);
  }
  return cuda::CausalAttentionForward(qkv.f32, n, t, C, H, out.f32, lse, stream_);
}

absl::Status GpuGpt::AttentionBackward(const float* dout, const Stored& qkv, const Stored& out,
                                       const float* lse, int n, float* dqkv) {
  const int t = config_.context, C = config_.d_model, H = config_.heads;
  if (out.bf16 != nullptr) {
    return cuda::CausalAttentionBackward(dout, qkv.bf16, out.bf16, lse, n, t, C, H, dqkv,
                                         stream_);
  }
  return cuda::CausalAttentionBackward(dout, qkv.f32, out.f32, lse, n, t, C, H, dqkv, stream_);
}

absl::Status GpuGpt::CheckWindows(int token_stride) const {
  if (token_stride < config_.context + 1) {
    return absl::InvalidArgumentError(absl::StrCat("GpuGpt: windows of ", token_stride,
                                                   " tokens; the model reads ", config_.context,
                                                   " and predicts the next"));
  }
  return absl::OkStatus();
}

absl::Status GpuGpt::Forward(const int32_t* tokens, int token_stride, int n) {
  const int t = config_.context, C = config_.d_model;
  const int rows = n * t;
  LOCKSTEP_RETURN_IF_ERROR(Reserve(rows));
  const float* P = params_;
  const Gpt::Layout& g = layout_;
  if (blas_->bf16()) {
    Phase("weights to bf16");
    if (params16_ == nullptr) LOCKSTEP_RETURN_IF_ERROR(Allocate(&params16_, num_params_));
    LOCKSTEP_RETURN_IF_ERROR(cuda::RoundToBf16(params_, num_params_, params16_, stream_));
  }
  Phase("embedding");
  LOCKSTEP_RETURN_IF_ERROR(cuda::GatherTokens(tokens, token_stride, n, t, 0, ids_, stream_));
  LOCKSTEP_RETURN_IF_ERROR(cuda::GatherTokens(tokens, token_stride, n, t, 1, targets_, stream_));
  LOCKSTEP_RETURN_IF_ERROR(cuda::Positions(rows, t, positions_, stream_));
  // The residual stream starts as token embedding + position embedding.
  LOCKSTEP_RETURN_IF_ERROR(
      cuda::EmbeddingForward(ids_, P + g.wte, P + g.wpe, rows, t, C, resid_[0], stream_));
  cuda::Blas& blas = *blas_;
  for (int l = 0; l < config_.layers; ++l) {
    const Gpt::Block& b = g.blocks[l];
    Phase("layernorm");
    LOCKSTEP_RETURN_IF_ERROR(
        LayerNormInto(resid_[l], b.ln1_w, b.ln1_b, rows, ln1_[l], ln1_mean_[l], ln1_rstd_[l]));
    Phase("products forward");
    // Under bf16 each product adds its bias (and residual, or applies the GELU) in cuBLASLt's
    // epilogue (Fused: true when it ran). Otherwise each product adds onto its bias (and
    // residual) already in place, as on the CPU, and a kernel adds the MLP's bias and GELU.
    absl::StatusOr<bool> fused = Fused(rows, 3 * C, C, ln1_[l], b.attn_w, b.attn_b, nullptr,
                                       qkv_[l].bf16, nullptr);
    if (!fused.ok()) return fused.status();
    if (!*fused) {
      LOCKSTEP_RETURN_IF_ERROR(StartWithBias(b.attn_b, rows, 3 * C, qkv_[l]));
      LOCKSTEP_RETURN_IF_ERROR(
          GemmInto(rows, 3 * C, C, ln1_[l].operand(), b.attn_w, 1.0f, qkv_[l]));
    }
    Phase("attention forward");
    LOCKSTEP_RETURN_IF_ERROR(AttentionForward(qkv_[l], n, atty_[l], lse_[l]));
    Phase("products forward");
    fused = Fused(rows, C, C, atty_[l], b.proj_w, b.proj_b, resid_[l], mid_[l], nullptr);
    if (!fused.ok()) return fused.status();
    if (!*fused) {
      LOCKSTEP_RETURN_IF_ERROR(
          cuda::StartWith(resid_[l], P + b.proj_b, rows, C, mid_[l], stream_));
      LOCKSTEP_RETURN_IF_ERROR(blas.Gemm(false, false, rows, C, C, 1.0f, atty_[l].operand(), C,
                                         Weight(b.proj_w), C, 1.0f, mid_[l], C));
    }
    Phase("layernorm");
    LOCKSTEP_RETURN_IF_ERROR(
        LayerNormInto(mid_[l], b.ln2_w, b.ln2_b, rows, ln2_[l], ln2_mean_[l], ln2_rstd_[l]));
    Phase("products forward");
    fused = Fused(rows, 4 * C, C, ln2_[l], b.fc_w, b.fc_b, nullptr, fch_gelu_[l].bf16,
                  fch_[l].bf16);
    if (!fused.ok()) return fused.status();
    if (!*fused) {
      LOCKSTEP_RETURN_IF_ERROR(
          GemmInto(rows, 4 * C, C, ln2_[l].operand(), b.fc_w, 0.0f, fch_[l]));
      LOCKSTEP_RETURN_IF_ERROR(BiasGeluInto(b.fc_b, rows, 4 * C, fch_[l], fch_gelu_[l]));
    }
    fused = Fused(rows, C, 4 * C, fch_gelu_[l], b.fcproj_w, b.fcproj_b, mid_[l], resid_[l + 1],
                  nullptr);
    if (!fused.ok()) return fused.status();
    if (!*fused) {
      LOCKSTEP_RETURN_IF_ERROR(
          cuda::StartWith(mid_[l], P + b.fcproj_b, rows, C, resid_[l + 1], stream_));
      LOCKSTEP_RETURN_IF_ERROR(blas.Gemm(false, false, rows, C, 4 * C, 1.0f,
                                         fch_gelu_[l].operand(), 4 * C, Weight(b.fcproj_w), C,
                                         1.0f, resid_[l + 1], C));
    }
  }
  Phase("layernorm");
  return LayerNormInto(resid_[config_.layers], g.lnf_w, g.lnf_b, rows, lnf_, lnf_mean_,
                       lnf_rstd_);
}

absl::Status GpuGpt::Head(int rows, float scale, bool backward, bool count, double* loss_sum) {
  const int C = config_.d_model, V = config_.vocab;
  Phase("LM head");
  const cuda::Blas::Operand wte = Weight(layout_.wte);
  for (int r0 = 0; r0 < rows; r0 += head_chunk_rows_) {
    const int m = std::min(head_chunk_rows_, rows - r0);
    const cuda::Blas::Operand in = lnf_.operand(static_cast<size_t>(r0) * C);
    LOCKSTEP_RETURN_IF_ERROR(
        blas_->Gemm(false, true, m, V, C, 1.0f, in, C, wte, C, 0.0f, logits_, V));
    // The loss's gradient for these rows: in place of the logits, or under bf16 into its bf16
    // buffer (the operand of both products below); none for a forward only.
    int32_t* row_correct = count ? row_correct_ : nullptr;
    int64_t* correct = count ? correct_ : nullptr;
    cuda::Blas::Operand dlogits = logits_;
    if (backward && dlogits16_ == nullptr) {
      LOCKSTEP_RETURN_IF_ERROR(cuda::SoftmaxCrossEntropyInPlace(
          logits_, targets_ + r0, m, V, scale, row_loss_, loss_sum, /*accumulate=*/r0 > 0,
          row_correct, correct, stream_));
    } else {
      cuda::Bf16* grad = backward ? dlogits16_ : nullptr;
      LOCKSTEP_RETURN_IF_ERROR(cuda::SoftmaxCrossEntropyInto(
          logits_, targets_ + r0, m, V, scale, grad, row_loss_, loss_sum, /*accumulate=*/r0 > 0,
          row_correct, correct, stream_));
      dlogits = grad;
    }
    if (!backward) continue;
    // Through the tied head into lnf's output, and into wte (added: ForwardBackward zeroed or
    // kept wte's gradient before).
    LOCKSTEP_RETURN_IF_ERROR(blas_->Gemm(false, false, m, C, V, 1.0f, dlogits, V, wte, C, 0.0f,
                                         dlnf_ + static_cast<size_t>(r0) * C, C));
    LOCKSTEP_RETURN_IF_ERROR(
        blas_->Gemm(true, false, V, C, m, 1.0f, dlogits, V, in, C, 1.0f, grads_ + layout_.wte, C));
  }
  return absl::OkStatus();
}

absl::Status GpuGpt::ForwardBackward(const int32_t* tokens, int token_stride, int n,
                                     float grad_scale, const std::function<void(size_t)>& on_ready,
                                     bool accumulate) {
  if (n <= 0) return absl::InvalidArgumentError("GpuGpt::ForwardBackward: no samples");
  LOCKSTEP_RETURN_IF_ERROR(CheckWindows(token_stride));
  const int t = config_.context, C = config_.d_model;
  const int rows = n * t;
  const size_t RC = static_cast<size_t>(rows) * C;
  const float* P = params_;
  float* G = grads_;
  const Gpt::Layout& g = layout_;
  const float beta = accumulate ? 1.0f : 0.0f;
  size_t next_ready = 0;
  auto ready = [&] {
    const size_t end = ready_points_[next_ready++];
    if (on_ready) on_ready(end);
  };
  // Without accumulation every gradient is overwritten; the ones only ever added to start at 0.
  if (!accumulate) {
    LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemsetAsync(G, 0, num_params_ * sizeof(float), stream_));
  }
  LOCKSTEP_RETURN_IF_ERROR(Forward(tokens, token_stride, n));
  // A sample's loss is the mean over its t predictions.
  LOCKSTEP_RETURN_IF_ERROR(
      Head(rows, grad_scale / t, /*backward=*/true, /*count=*/false, head_loss_));
  LOCKSTEP_RETURN_IF_ERROR(cuda::AddScaled(head_loss_, 1.0 / t, accumulate, loss_sum_, stream_));
  Phase("layernorm backward");
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemsetAsync(dresid_, 0, RC * sizeof(float), stream_));
  LOCKSTEP_RETURN_IF_ERROR(cuda::LayerNormBackward(dlnf_, resid_[config_.layers], P + g.lnf_w,
                                                   lnf_mean_, lnf_rstd_, rows, C, dresid_,
                                                   G + g.lnf_w, G + g.lnf_b, stream_));
  ready();
  // A linear layer out = in . W + bias over the rows, backward from its output's gradient d:
  // W's gradient (beta: added or overwritten), the bias's (column sums), and dx = d . W^T.
  // Under bf16, d is rounded once for both products, in the pass that sums it for the bias (in
  // FP32).
  auto linear_backward = [&](const Stored& in, int in_cols, const float* d, int out_cols,
                             size_t w, size_t bias, float* dx) -> absl::Status {
    LOCKSTEP_RETURN_IF_ERROR(
        cuda::ColumnSums(d, rows, out_cols, G + bias, accumulate, d16_, stream_));
    const cuda::Blas::Operand d_in =
        d16_ != nullptr ? cuda::Blas::Operand(d16_) : cuda::Blas::Operand(d);
    LOCKSTEP_RETURN_IF_ERROR(blas_->Gemm(true, false, in_cols, out_cols, rows, 1.0f, in.operand(),
                                         in_cols, d_in, out_cols, beta, G + w, out_cols));
    return blas_->Gemm(false, true, rows, in_cols, out_cols, 1.0f, d_in, out_cols, Weight(w),
                       out_cols, 0.0f, dx, in_cols);
  };
  // A LayerNorm over the stream x, whose output's gradient is in scratch_, inside a residual
  // block: the stream's gradient `dx` is the residual's (`d_residual`) plus the LayerNorm's;
  // its weight and bias gradients at w and bias.
  auto residual_layer_norm_backward = [&](const float* d_residual, const float* x, size_t w,
                                          size_t bias, const float* mean, const float* rstd,
                                          float* dx) -> absl::Status {
    return cuda::LayerNormBackward(scratch_, x, P + w, mean, rstd, rows, C, d_residual, dx,
                                   G + w, G + bias, stream_);
  };
  for (int l = config_.layers - 1; l >= 0; --l) {
    const Gpt::Block& b = g.blocks[l];
    // mlp.c_proj: out = fch_gelu . W + b (+ the residual, whose gradient passes through).
    Phase("products backward");
    LOCKSTEP_RETURN_IF_ERROR(
        linear_backward(fch_gelu_[l], 4 * C, dresid_, C, b.fcproj_w, b.fcproj_b, scratch4_));
    ready();
    // GELU, then mlp.c_fc.
    Phase("GELU backward");
    LOCKSTEP_RETURN_IF_ERROR(GeluBackward(fch_[l], 4 * RC, scratch4_));
    Phase("products backward");
    LOCKSTEP_RETURN_IF_ERROR(
        linear_backward(ln2_[l], C, scratch4_, 4 * C, b.fc_w, b.fc_b, scratch_));
    ready();
    // ln_2: into the gradient of the stream after attention, which also gets the residual's.
    Phase("layernorm backward");
    LOCKSTEP_RETURN_IF_ERROR(residual_layer_norm_backward(dresid_, mid_[l], b.ln2_w, b.ln2_b,
                                                          ln2_mean_[l], ln2_rstd_[l], dmid_));
    ready();
    // attn.c_proj.
    Phase("products backward");
    LOCKSTEP_RETURN_IF_ERROR(linear_backward(atty_[l], C, dmid_, C, b.proj_w, b.proj_b, scratch_));
    ready();
    // Attention, then attn.c_attn.
    Phase("attention backward");
    LOCKSTEP_RETURN_IF_ERROR(AttentionBackward(scratch_, qkv_[l], atty_[l], lse_[l], n, dqkv_));
    Phase("products backward");
    LOCKSTEP_RETURN_IF_ERROR(
        linear_backward(ln1_[l], C, dqkv_, 3 * C, b.attn_w, b.attn_b, scratch_));
    ready();
    // ln_1: into the gradient of the stream entering the block.
    Phase("layernorm backward");
    LOCKSTEP_RETURN_IF_ERROR(residual_layer_norm_backward(dmid_, resid_[l], b.ln1_w, b.ln1_b,
                                                          ln1_mean_[l], ln1_rstd_[l], dresid_));
    ready();
  }
  // The embeddings, in row order (deterministic): positions, then tokens (wte's gradient also
  // holds the LM head's share by now).
  Phase("embedding backward");
  LOCKSTEP_RETURN_IF_ERROR(
      cuda::EmbeddingBackward(positions_, dresid_, rows, C, G + g.wpe, stream_));
  ready();
  LOCKSTEP_RETURN_IF_ERROR(cuda::EmbeddingBackward(ids_, dresid_, rows, C, G + g.wte, stream_));
  Phase(nullptr);
  ready();
  return absl::OkStatus();
}

absl::StatusOr<double> GpuGpt::MeanOverContext(const double* sum) {
  double value = 0;
  LOCKSTEP_RETURN_IF_ERROR(
      CopyAndWait(&value, sum, sizeof(double), cudaMemcpyDeviceToHost));
  return value / config_.context;
}

absl::StatusOr<double> GpuGpt::Evaluate(const int32_t* tokens, int token_stride, int n,
                                        int64_t* correct) {
  if (n <= 0) return 0.0;
  LOCKSTEP_RETURN_IF_ERROR(CheckWindows(token_stride));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemsetAsync(correct_, 0, sizeof(int64_t), stream_));
  LOCKSTEP_RETURN_IF_ERROR(Forward(tokens, token_stride, n));
  LOCKSTEP_RETURN_IF_ERROR(
      Head(n * config_.context, 0.0f, /*backward=*/false, /*count=*/true, eval_loss_sum_));
  Phase(nullptr);
  int64_t hits = 0;
  LOCKSTEP_GPU_RETURN_IF_ERROR(
      cudaMemcpyAsync(&hits, correct_, sizeof(int64_t), cudaMemcpyDeviceToHost, stream_));
  absl::StatusOr<double> loss = MeanOverContext(eval_loss_sum_);  // synchronizes: hits is in
  if (!loss.ok()) return loss.status();
  if (correct != nullptr) *correct += hits;
  return *loss;
}

absl::StatusOr<std::unique_ptr<GpuModel>> CreateGpuGpt(const v1::JobSpec& /*spec*/,
                                                       const Model& host, cudaStream_t stream) {
  const auto* gpt = dynamic_cast<const Gpt*>(&host);
  if (gpt == nullptr) return absl::InternalError("CreateGpuGpt: the host model is not a GPT");
  absl::StatusOr<std::unique_ptr<GpuGpt>> created = GpuGpt::Create(*gpt, stream);
  if (!created.ok()) return created.status();
  return std::unique_ptr<GpuModel>(*std::move(created));
}

}  // namespace lockstep::worker
