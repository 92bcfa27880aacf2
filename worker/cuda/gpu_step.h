// A GPU worker's step engine (worker/step/step_engine.h). The trainer gathers the batch into
// pinned host buffers; each micro-batch is copied to the GPU on a copy stream (the next one's
// copy overlaps this one's compute, in two device slots), the model (the GpuModel of the job's
// family) runs forward and backward on the compute stream, accumulating gradients over
// micro-batches, and in the last micro-batch NCCL sums each bucket of the gradient on its own stream as soon as an event says backward has
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
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "lockstep/v1/job.pb.h"
#include "kernels/cuda_kernels.h"
#include "worker/cuda/gpu_model.h"
#include "worker/cuda/nccl_communicator.h"
#include "worker/step/bucket_plan.h"
#include "worker/step/optimizer.h"
#include "worker/step/step_engine.h"

namespace lockstep::worker {

class GpuStep final : public StepEngine {
 public:
  // The engine for `model` and `optimizer` (a trainer's: the state it mirrors, not owned), on
  // the current device, with the device model of the model's family (CreateGpuModel); `layout`:
  // what a sample holds. Frozen tensors are trained as the CPU does: their gradients are
  // zero, and neither the update nor the optimizer's state covers them. UNIMPLEMENTED for a
  // family the GPU does not train; INVALID_ARGUMENT for a shape its kernels do not take.
  static absl::StatusOr<std::unique_ptr<GpuStep>> Create(const v1::JobSpec& spec,
                                                         const SampleLayout& layout, Model* model,
                                                         Optimizer* optimizer);
  ~GpuStep() override;

  // StepEngine. The device's state outlives a generation (the trainer keeps the engine):
  // Begin uploads the host's state only when the device does not hold it (StateMirror), Sync
  // and End download it when the device's is newer. The group's sums go through the device
  // group (NCCL) that Begin is given, until End; none for a group of one. The update follows
  // the optimizer's segments (weight decay where it applies).
  const char* device() const override { return "cuda"; }
  absl::Status Begin(const StepGroup& group) override;
  absl::Status Sync() override;
  absl::Status End() override;
  absl::StatusOr<HostBatch> HostBuffers(int n) override;
  absl::StatusOr<StepResult> TakeStep(const StepArgs& args) override;
  absl::StatusOr<double> Evaluate(const Batch& batch, int64_t* correct) override {
    return Evaluate(batch.features, layout_.labels() ? batch.labels : batch.tokens, batch.n,
                    correct);
  }
  // In a group, by NCCL between the devices: the root sends from its device state when that
  // is the host's (else it uploads `host`'s piece first), a member that takes the state
  // receives into its device state and downloads the piece into `host` once the watchdog saw
  // the broadcast finish, the others receive into a scratch buffer. UNIMPLEMENTED without a
  // device group of two or more.
  absl::Status BroadcastState(const StepGroup& group, StatePart part, size_t offset, size_t count,
                              float* host, int root, bool take) override;
  void HostStateChanged(bool engine_has_it) override {
    engine_has_it ? mirror_.Copied() : mirror_.Diverged();
  }

  // Whole-state uploads so far (Begin's, when the device did not hold the host's state).
  int64_t uploads() const { return uploads_; }
  bool pinned() const { return pinned_; }
  // Benchmarks: time the model's phases and the update on `timer` (not owned; null: off),
  // which must be on this engine's compute stream (compute_stream()).
  void set_phase_timer(kernels::cuda::PhaseTimer* timer) {
    timer_ = timer;
    model_->set_phase_timer(timer);
  }
  cudaStream_t compute_stream() const { return stream_; }

  // For tests, which look inside. The device's state as it is (parameters and optimizer
  // state), whatever the mirror says.
  absl::Status DownloadState(float* params, std::vector<float>* optimizer_state);
  // Deterministic mode's first half on this GPU alone, over the device's state (Begin first):
  // the fixed-point sum of the n / shard micro-shards' gradients of `batch` (host memory),
  // then the loss, then the rejection count (num_params() + 2 values), as a step hands it to
  // NCCL. A group's sum is the integer sum of its members' results.
  absl::StatusOr<std::vector<int64_t>> FixedPointGradient(const Batch& batch, int shard,
                                                          float grad_scale, int frac_bits);

 private:
  GpuStep() = default;
  struct DeterministicResult {
    double loss = 0;
    int64_t rejected = 0;
  };
  // The steps on explicit host buffers: x holds n x feature_stride floats (none for a language
  // model), y the n labels or the n windows of token_stride tokens.
  absl::Status Upload(const float* params, const std::vector<float>& optimizer_state);
  absl::StatusOr<double> Step(const float* x, const int32_t* y, int n, int micro_batch,
                              float grad_scale, float lr, int64_t step);
  absl::StatusOr<DeterministicResult> StepDeterministic(const float* x, const int32_t* y, int n,
                                                        int shard, float grad_scale,
                                                        int frac_bits, float lr, int64_t step);
  absl::StatusOr<double> Evaluate(const float* x, const int32_t* y, int n, int64_t* correct);
  // The NCCL communicator of `group` (null: none); INTERNAL for a device group of another kind.
  static absl::StatusOr<NcclCommunicator*> Nccl(const StepGroup& group);
  // Per sample: the labels' or tokens' int32 values.
  size_t IntsPerSample() const {
    return layout_.labels() ? 1 : static_cast<size_t>(layout_.token_stride);
  }
  // Sample `first` of host buffers in the layout.
  const float* Features(const float* x, int first) const {
    return x == nullptr ? nullptr : x + static_cast<size_t>(first) * layout_.feature_stride;
  }
  const int32_t* Ints(const int32_t* y, int first) const {
    return y + static_cast<size_t>(first) * IntsPerSample();
  }
  const int32_t* HostInts() const {
    return layout_.labels() ? last_batch_.labels : last_batch_.tokens;
  }
  // The device batch of n samples in upload slot `slot`.
  Batch SlotBatch(int slot, int n) const;
  // Device room for n samples in both micro-batch slots.
  absl::Status Reserve(int n);
  // Queues the copy of micro-batch `pass` (n samples) into its slot on the copy stream, behind
  // the compute that last used the slot, and makes the compute stream wait for it. Returns the
  // slot.
  absl::StatusOr<int> UploadPass(int pass, const float* x, const int32_t* y, int n);
  // Marks the slot's data as used by everything queued on the compute stream so far.
  absl::Status ReleaseSlot(int slot);
  // Zeroes the frozen tensors' gradients in [begin, end) (parameter offsets), on the stream.
  absl::Status ZeroFrozen(size_t begin, size_t end);
  // One micro-batch: upload, forward and backward (see GpuModel::ForwardBackward), the frozen
  // tensors' gradients zeroed piece by piece, release.
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
  absl::Status Update(float lr, int64_t step);  // UpdateSegments, timed as one phase
  absl::Status UpdateSegments(float lr, int64_t step);

  v1::OptimizerSpec optimizer_;
  // What the update trains and where weight decay applies: the host optimizer's segments.
  // Frozen tensors' parameter ranges [first, second), ascending.
  std::vector<std::pair<size_t, size_t>> frozen_;
  size_t num_grads_ = 0;  // the trainable values: the optimizer's state per moment
  std::vector<Model::Segment> segments_;
  size_t bucket_floats_ = 0;
  // NCCL's buckets: at least bucket_floats_, the loss sent on its own (default mode) or with
  // the rejection count in the last bucket (deterministic mode).
  std::unique_ptr<BucketPlan> plan_;
  Model* host_model_ = nullptr;
  Optimizer* host_optimizer_ = nullptr;
  // Whether the device's state is the host's, or newer (a step ran since the last download).
  StateMirror mirror_;
  // A step failed after its update was queued: the device's state is neither the last
  // completed step's nor known; End says so, and the trainer goes back to the host's.
  bool state_unknown_ = false;
  bool updating_ = false;  // RunStep / RunDeterministic reached the update
  int64_t uploads_ = 0;
  int device_ = 0;  // the CUDA device it was made on (the destructor may run on any thread)
  HostBatch last_batch_;
  NcclCommunicator* comm_ = nullptr;  // Begin's device group, until End
  cudaStream_t stream_ = nullptr;       // compute
  cudaStream_t copy_stream_ = nullptr;  // host-to-device copies of micro-batches
  cudaEvent_t grads_ready_ = nullptr;
  cudaEvent_t uploaded_[2] = {nullptr, nullptr};
  cudaEvent_t consumed_[2] = {nullptr, nullptr};
  SampleLayout layout_;
  std::unique_ptr<GpuModel> model_;
  kernels::cuda::PhaseTimer* timer_ = nullptr;
  size_t state_floats_ = 0;
  float* state_ = nullptr;  // momentum, or AdamW's m then v (Optimizer's layout)
  double* clip_workspace_ = nullptr;  // grad_clip_norm: ClipByGlobalNorm's workspace
  // BroadcastState's scratch (the root's upload, a non-taker's piece): made once, for at
  // least kHealScratchFloats, so that no cudaFree (which waits for the whole device) falls
  // between the broadcasts of a heal, while a peer on the same GPU waits in one.
  static constexpr size_t kHealScratchFloats = size_t{1} << 20;
  float* heal_ = nullptr;
  size_t heal_capacity_ = 0;
  int64_t* fixed_ = nullptr;  // deterministic mode: gradient, loss, rejections (num_params + 2)
  int capacity_ = 0;
  float* x_[2] = {nullptr, nullptr};    // features
  int32_t* y_[2] = {nullptr, nullptr};  // labels or token windows
  // The trainer's batch: pinned when the driver allows, else ordinary memory.
  bool pinned_ = false;
  int host_capacity_ = 0;
  float* host_x_ = nullptr;
  int32_t* host_y_ = nullptr;
  std::vector<float> pageable_x_;
  // Sync's download lands here first and reaches the host model and optimizer only whole: a
  // copy that fails midway leaves them as they were.
  std::vector<float> staged_params_, staged_state_;
  std::vector<int32_t> pageable_y_;
};

}  // namespace lockstep::worker
