#include "worker/train/gpu_step.h"

#include <algorithm>
#include <functional>

#include "kernels/gpu_check.h"

namespace lockstep::worker {

absl::StatusOr<std::unique_ptr<GpuStep>> GpuStep::Create(const v1::JobSpec& spec,
                                                         std::vector<int> dims,
                                                         kernels::Activation activation,
                                                         NcclCommunicator* comm) {
  std::unique_ptr<GpuStep> step(new GpuStep());
  step->optimizer_ = spec.optimizer();
  // NCCL wants large messages: at least 16 MiB per bucket (the CPU's 256 KiB default would be
  // hundreds of tiny allreduces for a large model), or the job's bucket size if larger.
  step->bucket_floats_ =
      std::max<size_t>(size_t{4} << 20, static_cast<size_t>(spec.bucket_size_kib()) * 256);
  step->comm_ = comm;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&step->stream_, cudaStreamNonBlocking));
  LOCKSTEP_GPU_RETURN_IF_ERROR(
      cudaEventCreateWithFlags(&step->grads_ready_, cudaEventDisableTiming));
  auto mlp = GpuMlp::Create(std::move(dims), activation, step->stream_);
  if (!mlp.ok()) return mlp.status();
  step->mlp_ = *std::move(mlp);
  const size_t params = step->mlp_->num_params();
  step->state_floats_ = (spec.optimizer().type() == "adamw" ? 2 : 1) * params;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMalloc(&step->state_, step->state_floats_ * sizeof(float)));
  // On the step's stream (non-blocking, so a plain cudaMemset on the legacy stream could land
  // after an Upload and wipe the healed state).
  LOCKSTEP_GPU_RETURN_IF_ERROR(
      cudaMemsetAsync(step->state_, 0, step->state_floats_ * sizeof(float), step->stream_));
  return step;
}

GpuStep::~GpuStep() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  mlp_.reset();
  cudaFree(state_);
  cudaFree(x_);
  cudaFree(y_);
  if (grads_ready_ != nullptr) cudaEventDestroy(grads_ready_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status GpuStep::Upload(const float* params, const std::vector<float>& optimizer_state) {
  if (optimizer_state.size() != state_floats_) {
    return absl::InternalError("optimizer state size differs between host and device");
  }
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemcpyAsync(state_, optimizer_state.data(),
                                               state_floats_ * sizeof(float),
                                               cudaMemcpyHostToDevice, stream_));
  return mlp_->UploadParams(params);  // synchronizes the stream
}

absl::Status GpuStep::Download(float* params, std::vector<float>* optimizer_state) {
  optimizer_state->resize(state_floats_);
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemcpyAsync(optimizer_state->data(), state_,
                                               state_floats_ * sizeof(float),
                                               cudaMemcpyDeviceToHost, stream_));
  return mlp_->DownloadParams(params);  // synchronizes the stream
}

absl::Status GpuStep::Reserve(int n, int input) {
  if (n <= capacity_) return absl::OkStatus();
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  capacity_ = 0;  // nothing usable until both buffers exist again
  cudaFree(x_);
  cudaFree(y_);
  x_ = nullptr;
  y_ = nullptr;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMalloc(&x_, static_cast<size_t>(n) * input * sizeof(float)));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMalloc(&y_, static_cast<size_t>(n) * sizeof(int32_t)));
  capacity_ = n;
  return absl::OkStatus();
}

absl::Status GpuStep::UploadBatch(const float* x, const int32_t* y, int n) {
  const int input = mlp_->layers().front().in;
  if (absl::Status s = Reserve(n, input); !s.ok()) return s;
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemcpyAsync(
      x_, x, static_cast<size_t>(n) * input * sizeof(float), cudaMemcpyHostToDevice, stream_));
  LOCKSTEP_GPU_RETURN_IF_ERROR(cudaMemcpyAsync(y_, y, static_cast<size_t>(n) * sizeof(int32_t),
                                               cudaMemcpyHostToDevice, stream_));
  return absl::OkStatus();
}

absl::StatusOr<double> GpuStep::Evaluate(const float* x, const int32_t* y, int n,
                                         int64_t* correct) {
  if (absl::Status s = UploadBatch(x, y, n); !s.ok()) return s;
  return mlp_->Evaluate(x_, y_, n, correct);
}

absl::StatusOr<double> GpuStep::Step(const float* x, const int32_t* y, int n, float grad_scale,
                                     float lr, int64_t step) {
  absl::StatusOr<double> result = RunStep(x, y, n, grad_scale, lr, step);
  if (!result.ok() && comm_ != nullptr && comm_->size() > 1) {
    // Buckets may be in flight, and NCCL kernels never time out: abort the communicator so
    // that nothing on the device waits for peers that gave up (freeing memory would hang).
    comm_->Abort();
    (void)comm_->Wait();
  }
  return result;
}

absl::StatusOr<double> GpuStep::RunStep(const float* x, const int32_t* y, int n, float grad_scale,
                                        float lr, int64_t step) {
  if (absl::Status s = UploadBatch(x, y, n); !s.ok()) return s;
  const size_t params = mlp_->num_params();
  const bool group = comm_ != nullptr && comm_->size() > 1;
  // Buckets: each finished piece of the gradient is summed on the NCCL stream, after an event
  // that orders it behind the GEMM that wrote it, while backward goes on with the next piece.
  size_t sent = 0;
  absl::Status bucket_status;
  auto send = [&](size_t end) {
    if (!bucket_status.ok() || end <= sent) return;
    bucket_status = [&]() -> absl::Status {
      LOCKSTEP_GPU_RETURN_IF_ERROR(cudaEventRecord(grads_ready_, stream_));
      LOCKSTEP_GPU_RETURN_IF_ERROR(cudaStreamWaitEvent(comm_->stream(), grads_ready_, 0));
      return comm_->AllreduceSum(mlp_->grads() + sent, end - sent);
    }();
    sent = end;
  };
  auto on_ready = [&](size_t ready) {
    if (ready - sent >= bucket_floats_) send(ready);
  };
  if (absl::Status s = mlp_->ForwardBackward(
          x_, y_, n, grad_scale, bucket_floats_,
          group ? std::function<void(size_t)>(on_ready) : std::function<void(size_t)>());
      !s.ok()) {
    return s;
  }
  if (group) {
    send(params);  // the rest, then the loss (ready with the forward pass, sent last)
    if (!bucket_status.ok()) return bucket_status;
    if (absl::Status s = comm_->AllreduceSum(mlp_->loss_sum_device(), 1); !s.ok()) return s;
    // The watchdog: a dead or hung peer ends here with the communicator aborted.
    if (absl::Status s = comm_->Wait(); !s.ok()) return s;
  }
  const float weight_decay = static_cast<float>(optimizer_.weight_decay());
  absl::Status updated =
      optimizer_.type() == "adamw"
          ? kernels::cuda::AdamWUpdate(
                mlp_->params(), mlp_->grads(), state_, state_ + params, params, lr,
                static_cast<float>(optimizer_.beta1()), static_cast<float>(optimizer_.beta2()),
                static_cast<float>(optimizer_.epsilon()), weight_decay, step, stream_)
          : kernels::cuda::SgdMomentumUpdate(mlp_->params(), mlp_->grads(), state_, params, lr,
                                             static_cast<float>(optimizer_.momentum()),
                                             weight_decay, stream_);
  if (!updated.ok()) return updated;
  absl::StatusOr<double> loss_sum = mlp_->LossSum();  // waits for the update too
  if (!loss_sum.ok()) return loss_sum.status();
  return *loss_sum * grad_scale;
}

}  // namespace lockstep::worker
