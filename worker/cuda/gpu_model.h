// What GpuStep (worker/cuda/gpu_step.h) trains: a model's parameters and gradients in one flat
// device buffer each, laid out as its host twin's (worker/model/model.h), and its forward and
// backward on micro-batches already on the device. The base owns what every model has (the
// cuBLAS handle on the model's stream, the parameters, the gradients, the loss sum) and their
// copies; a family's device model (GpuMlp in gpu_mlp.h, GpuGpt in gpu_gpt.h) adds its
// activations and passes, and its line in CreateGpuModel's table (gpu_model.cc).
//
// Not thread-safe; all work is enqueued on the stream the model was created with.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda_kernels.h"
#include "kernels/phase_timer.h"
#include "worker/model/model.h"

namespace lockstep::worker {

class GpuModel {
 public:
  virtual ~GpuModel();
  GpuModel(const GpuModel&) = delete;
  GpuModel& operator=(const GpuModel&) = delete;

  size_t num_params() const { return num_params_; }
  float* params() { return params_; }  // device, num_params()
  float* grads() { return grads_; }    // device, num_params()
  kernels::cuda::Blas& blas() { return *blas_; }

  // Host <-> device copies of the whole parameter (or gradient) buffer; synchronous.
  absl::Status UploadParams(const float* host);
  absl::Status DownloadParams(float* host) const;
  absl::Status DownloadGrads(float* host) const;

  // The ends of backward's pieces, ascending, the last num_params(): where ForwardBackward
  // calls on_ready when pieces are about chunk_floats values (a model may cut coarser).
  virtual std::vector<size_t> ReadyPoints(size_t chunk_floats) const = 0;

  // Forward and backward on `batch`, whose pointers are DEVICE memory (the fields of the
  // model's kind of input, as in Model::ForwardBackward). Overwrites grads() with
  // grad_scale * d(sum of the samples' losses)/d(params), or with `accumulate` adds to it;
  // the sum of the samples' losses is written to (or with `accumulate` added to) the device
  // double at loss_sum_device(). on_ready(end) is called on the host after the work that
  // finishes grads()[0, end) has been ENQUEUED (not run), at ReadyPoints(chunk_floats): a
  // caller that reduces gradients on another stream records an event then and waits on it.
  virtual absl::Status ForwardBackward(const Batch& batch, float grad_scale, size_t chunk_floats,
                                       const std::function<void(size_t)>& on_ready,
                                       bool accumulate) = 0;
  // That loss sum (waits for the stream).
  absl::StatusOr<double> LossSum();
  double* loss_sum_device() { return loss_sum_; }
  // Forward only on `batch` (device memory): the loss sum over its samples; adds the correct
  // predictions to *correct. Waits for the stream; may overwrite loss_sum_device().
  virtual absl::StatusOr<double> Evaluate(const Batch& batch, int64_t* correct) = 0;

  // Benchmarks: mark the model's phases on this timer (not owned; null: none, the default).
  void set_phase_timer(kernels::cuda::PhaseTimer* timer) { timer_ = timer; }

 protected:
  GpuModel() = default;
  // Makes what every model has, for num_params parameters, on `stream` (the current device):
  // the cuBLAS handle, the parameters, the gradients and the loss sum (zero).
  absl::Status Init(size_t num_params, cudaStream_t stream);
  // The phase that starts now on the model's stream, when a benchmark times them.
  void Phase(const char* phase) const {
    if (timer_ != nullptr) timer_->Mark(phase);
  }
  // `bytes` from `from` to `to` on the model's stream, then waits for it.
  absl::Status CopyAndWait(void* to, const void* from, size_t bytes, cudaMemcpyKind kind) const;

  size_t num_params_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<kernels::cuda::Blas> blas_;
  float* params_ = nullptr;
  float* grads_ = nullptr;
  double* loss_sum_ = nullptr;

 private:
  kernels::cuda::PhaseTimer* timer_ = nullptr;
};

// The device model of `host`'s family (the job's model.type), on `stream`, its parameters not
// yet uploaded. UNIMPLEMENTED for a family without one (it does not train on GPU workers);
// INVALID_ARGUMENT for a shape its kernels do not take.
absl::StatusOr<std::unique_ptr<GpuModel>> CreateGpuModel(const v1::JobSpec& spec,
                                                         const Model& host, cudaStream_t stream);

// The families' device models (gpu_mlp.cc, gpu_gpt.cc): INTERNAL when `host` is not the
// family's host model.
absl::StatusOr<std::unique_ptr<GpuModel>> CreateGpuMlp(const v1::JobSpec& spec,
                                                       const Model& host, cudaStream_t stream);
absl::StatusOr<std::unique_ptr<GpuModel>> CreateGpuGpt(const v1::JobSpec& spec,
                                                       const Model& host, cudaStream_t stream);

}  // namespace lockstep::worker
