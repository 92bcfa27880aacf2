// A GPU worker's step engine (worker/train/step_engine.h). The trainer gathers the batch into
// pinned host buffers; each micro-batch is copied to the GPU on a copy stream (the next one's
// copy overlaps this one's compute, in two device slots), GpuMlp runs forward and backward on
// the compute stream, accumulating gradients over micro-batches, and in the last micro-batch
// NCCL sums each bucket of the gradient on its own stream as soon as an event says backward has
// written it (overlapping the rest of backward); then the loss; the optimizer update runs on the
// GPU over all parameters at once.
//
// Deterministic mode computes one micro-shard at a time, always in the same device buffers (so
// cuBLAS sees the same shapes and alignments whichever rank computes it), adds each shard's
// gradient and loss in 64-bit fixed point on the GPU, sums the integers over the group with
// NCCL (exact, so in any order), and updates with the float of the sum: the same bits for any
// world size, on GPUs of one model.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "lockstep/v1/job.pb.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/train/bucket_plan.h"
#include "worker/train/gpu_mlp.h"
#include "worker/train/optimizer.h"
#include "worker/train/step_engine.h"

namespace lockstep::worker {

class GpuStep final : public StepEngine {
 public:
  // `comm` may be null for a group of one (nothing to sum). Allocates on the current device.
  static absl::StatusOr<std::unique_ptr<GpuStep>> Create(const v1::JobSpec& spec,
                                                         std::vector<int> dims,
                                                         kernels::Activation activation,
                                                         NcclCommunicator* comm);
  // The engine for a trainer's host model and optimizer, attached (see AttachHost).
  // UNIMPLEMENTED for a model the GPU does not train yet (only the MLP so far).
  static absl::StatusOr<std::unique_ptr<GpuStep>> ForHost(const v1::JobSpec& spec, Model* model,
                                                          Optimizer* optimizer,
                                                          NcclCommunicator* comm);
  ~GpuStep() override;

  // StepEngine, over the host model and optimizer it mirrors (AttachHost first; not owned).
  // Begin uploads their state, Sync and End download it when the device's is newer; the
  // group's sums go through the NCCL communicator given at Create, not `comm`.
  void AttachHost(Model* model, Optimizer* optimizer) {
    host_model_ = model;
    host_optimizer_ = optimizer;
  }
  absl::Status Begin(Communicator* comm) override;
  absl::Status Sync() override;
  absl::Status End() override;
  absl::StatusOr<HostBatch> HostBuffers(int n) override;
  absl::StatusOr<StepResult> TakeStep(const StepArgs& args) override;
  absl::StatusOr<double> Evaluate(const Batch& batch, int64_t* correct) override {
    return Evaluate(batch.features, batch.labels, batch.n, correct);
  }

  // The same steps on explicit buffers (the benchmark and the GPU tests drive these).
  absl::Status Upload(const float* params, const std::vector<float>& optimizer_state);
  absl::Status Download(float* params, std::vector<float>* optimizer_state);
  absl::StatusOr<double> Step(const float* x, const int32_t* y, int n, int micro_batch,
                              float grad_scale, float lr, int64_t step);
  struct DeterministicResult {
    double loss = 0;
    int64_t rejected = 0;
  };
  absl::StatusOr<DeterministicResult> StepDeterministic(const float* x, const int32_t* y, int n,
                                                        int shard, float grad_scale,
                                                        int frac_bits, float lr, int64_t step);
  absl::StatusOr<double> Evaluate(const float* x, const int32_t* y, int n, int64_t* correct);

  // Deterministic mode's first half on this GPU alone: the fixed-point sum of the n / shard
  // micro-shards' gradients, then the loss, then the rejection count (num_params() + 2 values),
  // as StepDeterministic hands it to NCCL. For tests: a group's sum is the integer sum of its
  // members' results.
  absl::StatusOr<std::vector<int64_t>> FixedPointGradient(const float* x, const int32_t* y, int n,
                                                          int shard, float grad_scale,
                                                          int frac_bits);
  bool pinned() const { return pinned_; }

 private:
  GpuStep() = default;
  // Device room for n samples in both micro-batch slots.
  absl::Status Reserve(int n);
  // Queues the copy of micro-batch `pass` (n samples) into its slot on the copy stream, behind
  // the compute that last used the slot, and makes the compute stream wait for it. Returns the
  // slot.
  absl::StatusOr<int> UploadPass(int pass, const float* x, const int32_t* y, int n);
  // Marks the slot's data as used by everything queued on the compute stream so far.
  absl::Status ReleaseSlot(int slot);
  // One micro-batch: upload, forward and backward (see GpuMlp::ForwardBackward), release.
  absl::Status RunPass(int pass, const float* x, const int32_t* y, int n, float grad_scale,
                       const std::function<void(size_t)>& on_ready, bool accumulate);
  // Aborts the communicator after a failed step (buckets may be in flight, and NCCL kernels never
  // time out: nothing on the device may wait for peers that gave up, or freeing memory hangs).
  void AbortAfterFailure();
  absl::StatusOr<double> RunStep(const float* x, const int32_t* y, int n, int micro_batch,
                                 float grad_scale, float lr, int64_t step);
  // The fixed-point sum over the shards into fixed_; with `group`, buckets of the last shard's
  // sum go to NCCL as backward produces them and the whole sum is in flight on return.
  absl::Status AccumulateFixedPoint(const float* x, const int32_t* y, int n, int shard,
                                    float grad_scale, int frac_bits, bool group);
  absl::StatusOr<DeterministicResult> RunDeterministic(const float* x, const int32_t* y, int n,
                                                       int shard, float grad_scale,
                                                       int frac_bits, float lr, int64_t step);
  absl::Status Update(float lr, int64_t step);

  v1::OptimizerSpec optimizer_;
  size_t bucket_floats_ = 0;
  // NCCL's buckets: at least bucket_floats_, the loss sent on its own (default mode) or with
  // the rejection count in the last bucket (deterministic mode).
  std::unique_ptr<BucketPlan> plan_;
  Model* host_model_ = nullptr;
  Optimizer* host_optimizer_ = nullptr;
  bool device_newer_ = false;  // a step ran since the host was last synced
  HostBatch last_batch_;
  NcclCommunicator* comm_ = nullptr;
  cudaStream_t stream_ = nullptr;       // compute
  cudaStream_t copy_stream_ = nullptr;  // host-to-device copies of micro-batches
  cudaEvent_t grads_ready_ = nullptr;
  cudaEvent_t uploaded_[2] = {nullptr, nullptr};
  cudaEvent_t consumed_[2] = {nullptr, nullptr};
  std::unique_ptr<GpuMlp> mlp_;
  size_t state_floats_ = 0;
  float* state_ = nullptr;  // momentum, or AdamW's m then v (Optimizer's layout)
  double* clip_workspace_ = nullptr;  // grad_clip_norm: ClipByGlobalNorm's workspace
  int64_t* fixed_ = nullptr;  // deterministic mode: gradient, loss, rejections (num_params + 2)
  int capacity_ = 0;
  float* x_[2] = {nullptr, nullptr};
  int32_t* y_[2] = {nullptr, nullptr};
  // The trainer's batch: pinned when the driver allows, else ordinary memory.
  bool pinned_ = false;
  int host_capacity_ = 0;
  float* host_x_ = nullptr;
  int32_t* host_y_ = nullptr;
  std::vector<float> pageable_x_;
  std::vector<int32_t> pageable_y_;
};

}  // namespace lockstep::worker
