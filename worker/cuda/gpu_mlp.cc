#include "worker/cuda/gpu_mlp.h"

#include <algorithm>
#include <vector>

#include "common/status_macros.h"
#include "kernels/device_memory.h"
#include "kernels/gpu_check.h"

namespace lockstep::worker {

using kernels::cuda::DeviceFree;
using kernels::cuda::DeviceMalloc;
namespace {

template <typename T>
absl::Status Allocate(T** ptr, size_t count) {
  LOCKSTEP_GPU_RETURN_IF_ERROR(DeviceMalloc(reinterpret_cast<void**>(ptr), count * sizeof(T)));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<GpuMlp>> GpuMlp::Create(std::vector<int> dims,
                                                       kernels::Activation activation,
                                                       cudaStream_t stream) {
  if (dims.size() < 2) return absl::InvalidArgumentError("GpuMlp: dims needs input and classes");
  std::unique_ptr<GpuMlp> mlp(new GpuMlp());
  mlp->dims_ = std::move(dims);
  mlp->activation_ = activation;
  size_t num_params = 0;
  mlp->layers_ = Mlp::Layout(mlp->dims_, &num_params);
  LOCKSTEP_RETURN_IF_ERROR(mlp->Init(num_params, stream));
  mlp->z_.assign(mlp->layers_.size(), nullptr);
  mlp->a_.assign(mlp->layers_.size(), nullptr);
  return mlp;
}

GpuMlp::~GpuMlp() {
  for (size_t l = 0; l < z_.size(); ++l) {
    if (a_[l] != nullptr && a_[l] != z_[l]) DeviceFree(a_[l]);
    DeviceFree(z_[l]);
  }
  for (void* p : {static_cast<void*>(dz_), static_cast<void*>(da_), static_cast<void*>(row_loss_),
                  static_cast<void*>(row_correct_)}) {
    DeviceFree(p);
  }
}

absl::Status GpuMlp::Reserve(int n) {
  // bf16's operand slots, for the largest of a forward's and a backward's products of n rows
  // (a weight, an activation or its gradient), before the first: none grows inside a
  // backward, while NCCL sums its buckets (Blas::ReserveBf16).
  size_t bf16_span = 0;
  for (const Mlp::LayerSlice& s : layers_) {
    bf16_span = std::max({bf16_span, static_cast<size_t>(s.in) * s.out,
                          static_cast<size_t>(n) * std::max(s.in, s.out)});
  }
  LOCKSTEP_RETURN_IF_ERROR(blas_->ReserveBf16(bf16_span));
  if (n <= capacity_) return absl::OkStatus();
  // Growing frees the old buffers first: the stream must be idle before they go. Every freed
  // pointer is cleared at once, so a failed allocation leaves nothing dangling.
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  capacity_ = 0;
  int widest = 0;
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (a_[l] != nullptr && a_[l] != z_[l]) DeviceFree(a_[l]);
    DeviceFree(z_[l]);
    a_[l] = z_[l] = nullptr;
    const size_t size = static_cast<size_t>(n) * layers_[l].out;
    LOCKSTEP_RETURN_IF_ERROR(Allocate(&z_[l], size));
    a_[l] = z_[l];
    if (activation_ == kernels::Activation::kGelu && l + 1 < layers_.size()) {
      LOCKSTEP_RETURN_IF_ERROR(Allocate(&a_[l], size));
    }
    widest = std::max({widest, layers_[l].out, layers_[l].in});
  }
  DeviceFree(dz_);
  DeviceFree(da_);
  DeviceFree(row_loss_);
  DeviceFree(row_correct_);
  dz_ = da_ = nullptr;
  row_loss_ = nullptr;
  row_correct_ = nullptr;
  LOCKSTEP_RETURN_IF_ERROR(Allocate(&dz_, static_cast<size_t>(n) * widest));
  LOCKSTEP_RETURN_IF_ERROR(Allocate(&da_, static_cast<size_t>(n) * widest));
  LOCKSTEP_RETURN_IF_ERROR(Allocate(&row_loss_, static_cast<size_t>(n)));
  LOCKSTEP_RETURN_IF_ERROR(Allocate(&row_correct_, static_cast<size_t>(n)));
  capacity_ = n;
  return absl::OkStatus();
}

absl::Status GpuMlp::Forward(const float* x, int n) {
  LOCKSTEP_RETURN_IF_ERROR(Reserve(n));
  const int last = static_cast<int>(layers_.size()) - 1;
  const float* in = x;
  for (int l = 0; l <= last; ++l) {
    const Mlp::LayerSlice& s = layers_[l];
    const float* w = params_ + s.offset;
    const float* b = w + static_cast<size_t>(s.in) * s.out;
    const kernels::Activation act = l == last ? kernels::Activation::kIdentity : activation_;
    LOCKSTEP_RETURN_IF_ERROR(blas_->LinearForward(in, w, b, n, s.in, s.out, act, z_[l], a_[l]));
    in = a_[l];
  }
  return absl::OkStatus();
}

absl::StatusOr<double> GpuMlp::Evaluate(const float* x, const int32_t* y, int n, int64_t* correct) {
  if (n == 0) return 0.0;
  LOCKSTEP_RETURN_IF_ERROR(Forward(x, n));
  LOCKSTEP_RETURN_IF_ERROR(kernels::cuda::SoftmaxCrossEntropy(
      z_.back(), y, n, layers_.back().out, 0.0f, nullptr, row_loss_, row_correct_, loss_sum_,
      /*accumulate_loss=*/false, stream_));
  std::vector<int32_t> flags(static_cast<size_t>(n));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemcpyAsync(
      flags.data(), row_correct_, flags.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream_));
  absl::StatusOr<double> loss = LossSum();  // synchronizes the stream
  if (!loss.ok()) return loss;
  if (correct != nullptr) {
    for (int32_t f : flags) *correct += f;
  }
  return loss;
}

absl::Status GpuMlp::ForwardBackward(const float* x, const int32_t* y, int n, float grad_scale,
                                     size_t chunk_floats,
                                     const std::function<void(size_t)>& on_ready, bool accumulate) {
  LOCKSTEP_RETURN_IF_ERROR(Forward(x, n));
  const int last = static_cast<int>(layers_.size()) - 1;
  LOCKSTEP_RETURN_IF_ERROR(kernels::cuda::SoftmaxCrossEntropy(z_[last], y, n, layers_[last].out,
                                                              grad_scale, dz_, row_loss_, nullptr,
                                                              loss_sum_, accumulate, stream_));
  for (int l = last; l >= 0; --l) {
    const Mlp::LayerSlice& s = layers_[l];
    const float* layer_in = l == 0 ? x : a_[l - 1];
    float* dw = grads_ + s.offset;
    float* db = dw + static_cast<size_t>(s.in) * s.out;
    const int rows = Mlp::RowsPerChunk(s, chunk_floats);
    for (int r = 0; r < s.out; r += rows) {
      const int m = std::min(rows, s.out - r);
      LOCKSTEP_RETURN_IF_ERROR(blas_->Gemm(true, false, m, s.in, n, 1.0f, dz_ + r, s.out, layer_in,
                                           s.in, accumulate ? 1.0f : 0.0f,
                                           dw + static_cast<size_t>(r) * s.in, s.in));
      if (on_ready) on_ready(s.offset + static_cast<size_t>(r + m) * s.in);
    }
    LOCKSTEP_RETURN_IF_ERROR(kernels::cuda::BiasGradient(dz_, n, s.out, db, accumulate, stream_));
    if (on_ready) on_ready(s.offset + s.count);
    if (l == 0) break;
    const float* w = params_ + s.offset;
    LOCKSTEP_RETURN_IF_ERROR(
        blas_->Gemm(false, false, n, s.in, s.out, 1.0f, dz_, s.out, w, s.in, 0.0f, da_, s.in));
    // ReLU's output stands in for its pre-activation (z_ == a_ then); GELU keeps both.
    LOCKSTEP_RETURN_IF_ERROR(kernels::cuda::ActivationBackward(
        activation_, z_[l - 1], da_, dz_, static_cast<size_t>(n) * s.in, stream_));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<GpuModel>> CreateGpuMlp(const v1::JobSpec& /*spec*/,
                                                       const Model& host, cudaStream_t stream) {
  const auto* mlp = dynamic_cast<const Mlp*>(&host);
  if (mlp == nullptr) return absl::InternalError("CreateGpuMlp: the host model is not an MLP");
  absl::StatusOr<std::unique_ptr<GpuMlp>> created =
      GpuMlp::Create(mlp->dims(), mlp->activation(), stream);
  if (!created.ok()) return created.status();
  return std::unique_ptr<GpuModel>(*std::move(created));
}

}  // namespace lockstep::worker
