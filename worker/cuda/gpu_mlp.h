// The MLP of mlp.h on one GPU: the same flat parameter layout (last layer first, so backward
// fills a growing prefix of the gradient) and the same forward and backward passes, built from
// the CUDA twins in kernels/cuda_kernels.h. Parameters move between Mlp and GpuMlp as they are,
// so a GPU worker can heal from a CPU worker's state and write the same checkpoints.
//
// Not thread-safe; all work is enqueued on the stream given at creation.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda_kernels.h"
#include "worker/cuda/gpu_model.h"
#include "worker/model/mlp.h"

namespace lockstep::worker {

class GpuMlp final : public GpuModel {
 public:
  // Allocates parameters and gradients on the current device; activations grow on first use.
  static absl::StatusOr<std::unique_ptr<GpuMlp>> Create(std::vector<int> dims,
                                                        kernels::Activation activation,
                                                        cudaStream_t stream);
  ~GpuMlp() override;

  const std::vector<Mlp::LayerSlice>& layers() const { return layers_; }

  // GpuModel: a Batch's features and labels.
  std::vector<size_t> ReadyPoints(size_t chunk_floats) const override {
    return Mlp::LayoutReadyPoints(layers_, chunk_floats);
  }
  absl::Status ForwardBackward(const Batch& batch, float grad_scale, size_t chunk_floats,
                               const std::function<void(size_t)>& on_ready,
                               bool accumulate) override {
    return ForwardBackward(batch.features, batch.labels, batch.n, grad_scale, chunk_floats,
                           on_ready, accumulate);
  }
  absl::StatusOr<double> Evaluate(const Batch& batch, int64_t* correct) override {
    return Evaluate(batch.features, batch.labels, batch.n, correct);
  }

  // Forward and backward on n samples already on the device (x: n x input, y: n labels).
  // Overwrites grads() with grad_scale * d(sum of losses)/d(params), or with `accumulate` adds
  // to it (micro-batches); the loss sum lands in (or is added to) a device double (LossSum).
  // on_ready(end) is called on the host after the work that finishes grads()[0, end) has been
  // ENQUEUED (not run): a caller that reduces gradients on another stream records an event
  // then and makes that stream wait on it. Same pieces as Mlp.
  absl::Status ForwardBackward(const float* x, const int32_t* y, int n, float grad_scale,
                               size_t chunk_floats, const std::function<void(size_t)>& on_ready,
                               bool accumulate);
  // Forward only (evaluation): returns the loss sum over the n samples and adds the number of
  // correct predictions to *correct. Waits for the stream.
  absl::StatusOr<double> Evaluate(const float* x, const int32_t* y, int n, int64_t* correct);

 private:
  GpuMlp() = default;
  absl::Status Reserve(int n);
  // Forward through every layer; the logits end in z_.back().
  absl::Status Forward(const float* x, int n);

  std::vector<int> dims_;
  kernels::Activation activation_ = kernels::Activation::kRelu;
  std::vector<Mlp::LayerSlice> layers_;
  int capacity_ = 0;
  std::vector<float*> z_;  // per layer, n x out: pre-activation (for ReLU: the activation)
  std::vector<float*> a_;  // per hidden layer, n x out: activation (== z_ unless GELU)
  float* dz_ = nullptr;
  float* da_ = nullptr;
  double* row_loss_ = nullptr;
  int32_t* row_correct_ = nullptr;
};

}  // namespace lockstep::worker
