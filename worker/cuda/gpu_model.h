// What GpuStep (worker/train/gpu_step.h) trains: a model's parameters and gradients in one
// flat device buffer each, laid out as its host twin's (worker/train/model.h), and its forward
// and backward on micro-batches already on the device. Implementations: GpuMlp
// (worker/train/gpu_mlp.h) and GpuGpt (worker/train/gpu_gpt.h).
//
// Not thread-safe; all work is enqueued on the stream the model was created with.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cuda_kernels.h"
#include "kernels/phase_timer.h"
#include "worker/model/model.h"

namespace lockstep::worker {

class GpuModel {
 public:
  virtual ~GpuModel() = default;

  virtual size_t num_params() const = 0;
  virtual float* params() = 0;  // device, num_params()
  virtual float* grads() = 0;   // device, num_params()
  virtual kernels::cuda::Blas& blas() = 0;

  // Host <-> device copies of the whole parameter buffer; synchronous.
  virtual absl::Status UploadParams(const float* host) = 0;
  virtual absl::Status DownloadParams(float* host) const = 0;

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
  virtual absl::StatusOr<double> LossSum() = 0;
  virtual double* loss_sum_device() = 0;
  // Forward only on `batch` (device memory): the loss sum over its samples; adds the correct
  // predictions to *correct. Waits for the stream; may overwrite loss_sum_device().
  virtual absl::StatusOr<double> Evaluate(const Batch& batch, int64_t* correct) = 0;

  // Benchmarks: mark the model's phases on this timer (not owned; null: none, the default).
  void set_phase_timer(kernels::cuda::PhaseTimer* timer) { timer_ = timer; }

 protected:
  // The phase that starts now on the model's stream, when a benchmark times them.
  void Phase(const char* phase) const {
    if (timer_ != nullptr) timer_->Mark(phase);
  }
  kernels::cuda::PhaseTimer* timer_ = nullptr;
  // `bytes` from `from` to `to` on `stream`, then waits for the stream (the models' host <->
  // device copies of whole buffers).
  static absl::Status CopyAndWait(void* to, const void* from, size_t bytes, cudaMemcpyKind kind,
                                  cudaStream_t stream);
};

}  // namespace lockstep::worker
