// A GPU worker's training step (DeviceStep of trainer.h): the batch goes to the GPU, GpuMlp
// runs forward and backward on the compute stream, NCCL sums each bucket of the gradient on its
// own stream as soon as an event says backward has written it (overlapping the rest of
// backward), then the loss; the optimizer update runs on the GPU over all parameters at once.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "lockstep/v1/job.pb.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/train/gpu_mlp.h"
#include "worker/train/trainer.h"

namespace lockstep::worker {

class GpuStep final : public DeviceStep {
 public:
  // `comm` may be null for a group of one (nothing to sum). Allocates on the current device.
  static absl::StatusOr<std::unique_ptr<GpuStep>> Create(const v1::JobSpec& spec,
                                                         std::vector<int> dims,
                                                         kernels::Activation activation,
                                                         NcclCommunicator* comm);
  ~GpuStep() override;

  absl::Status Upload(const float* params, const std::vector<float>& optimizer_state) override;
  absl::Status Download(float* params, std::vector<float>* optimizer_state) override;
  absl::StatusOr<double> Step(const float* x, const int32_t* y, int n, float grad_scale, float lr,
                              int64_t step) override;
  absl::StatusOr<double> Evaluate(const float* x, const int32_t* y, int n,
                                  int64_t* correct) override;

 private:
  GpuStep() = default;
  absl::Status Reserve(int n, int input);
  // Copies n samples and labels to the device buffers (growing them as needed).
  absl::Status UploadBatch(const float* x, const int32_t* y, int n);
  absl::StatusOr<double> RunStep(const float* x, const int32_t* y, int n, float grad_scale,
                                 float lr, int64_t step);

  v1::OptimizerSpec optimizer_;
  size_t bucket_floats_ = 0;
  NcclCommunicator* comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t grads_ready_ = nullptr;
  std::unique_ptr<GpuMlp> mlp_;
  size_t state_floats_ = 0;
  float* state_ = nullptr;  // momentum, or AdamW's m then v (Optimizer's layout)
  int capacity_ = 0;
  float* x_ = nullptr;
  int32_t* y_ = nullptr;
};

}  // namespace lockstep::worker
