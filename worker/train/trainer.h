// One member's training of one job generation: the step loop of DESIGN.md sections 4-5
// (fixed global batch, world-size-independent data order, bucketed gradient allreduce
// overlapped with backward, optimizer update) and the sharded evaluation at the end.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lockstep/v1/job.pb.h"
#include "lockstep/v1/worker.pb.h"
#include "worker/comm/communicator.h"
#include "worker/train/dataset.h"
#include "worker/train/gradient_reducer.h"
#include "worker/train/mlp.h"
#include "worker/train/optimizer.h"
#include "worker/train/sampler.h"

namespace lockstep::worker {

// Where a GPU worker's training step runs (worker/train/gpu_step.h). The trainer keeps its
// host model and optimizer state as the mirror that healing, checkpoints, evaluation and the
// parameter checksum use; it uploads them before training and downloads them when it needs
// them (a checkpoint is due, Train ends).
class DeviceStep {
 public:
  virtual ~DeviceStep() = default;
  // Parameters and optimizer state in the layouts of Mlp and Optimizer.
  virtual absl::Status Upload(const float* params, const std::vector<float>& optimizer_state) = 0;
  virtual absl::Status Download(float* params, std::vector<float>* optimizer_state) = 0;
  // Host buffers for n samples and labels that the trainer fills for the next Step (pinned
  // memory on a GPU, so the copies run asynchronously). Valid until the next call.
  struct HostBatch {
    float* x = nullptr;
    int32_t* y = nullptr;
  };
  virtual absl::StatusOr<HostBatch> HostBuffers(int n) = 0;
  // One step for the n samples x (n x input), y (host memory): forward and backward in
  // micro-batches of at most `micro_batch` samples (gradients accumulated), the sum of the
  // gradients over the group, the optimizer update with learning rate `lr`. Returns the group's
  // mean loss.
  virtual absl::StatusOr<double> Step(const float* x, const int32_t* y, int n, int micro_batch,
                                      float grad_scale, float lr, int64_t step) = 0;
  // Deterministic mode (Trainer::TrainStepDeterministic on the device): n = shards * shard
  // samples; each shard's gradient (scaled by grad_scale) and loss go to 64-bit fixed point with
  // `frac_bits` fraction bits and are summed as integers, over the shards and then over the
  // group; the update uses the float of the sum. Returns the group's mean loss and the number
  // of values that were not finite or out of range (the update is skipped then).
  struct DeterministicResult {
    double loss = 0;
    int64_t rejected = 0;
  };
  virtual absl::StatusOr<DeterministicResult> StepDeterministic(const float* x, const int32_t* y,
                                                                int n, int shard,
                                                                float grad_scale, int frac_bits,
                                                                float lr, int64_t step) = 0;
  // Forward only on the device's parameters: the loss sum over the n samples; adds the number
  // of correct predictions to *correct.
  virtual absl::StatusOr<double> Evaluate(const float* x, const int32_t* y, int n,
                                          int64_t* correct) = 0;
};

// Not thread-safe: one training thread drives it. `abort` may be set from any thread; the
// loop checks it between steps.
//
// Errors of Heal, Train and Evaluate: the communicator's (UNAVAILABLE, DEADLINE_EXCEEDED,
// ABORTED: the generation is over, another may succeed); DATA_LOSS when healed state failed
// its checksum (the member keeps its previous state); and errors no other group can avoid,
// which fail the job (IsFatal): FAILED_PRECONDITION (the members hold different data, a
// checkpoint write failed under checkpoint_failure_policy "fail", init_from_checkpoint cannot
// be read), OUT_OF_RANGE (deterministic mode's range), UNIMPLEMENTED (a mode this device lacks).
class Trainer {
 public:
  // FAILED_PRECONDITION when the data cannot serve the spec (batch larger than the data set,
  // labels beyond the model's classes), INVALID_ARGUMENT for a bad model spec. `job_id` names
  // the job's checkpoints.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const std::string& job_id,
                                                         const v1::JobSpec& spec,
                                                         std::shared_ptr<const Dataset> data,
                                                         Communicator* comm);
  // Whether an error of Heal, Train or Evaluate fails the job (see the class comment).
  static bool IsFatal(const absl::Status& status);

  int64_t total_steps() const { return total_steps_; }
  // The largest sum this trainer asks of its communicator in one call, in bytes (a gradient
  // bucket, or in deterministic mode the whole fixed-point gradient).
  size_t largest_collective_bytes() const;

  // Deterministic mode: each micro-shard's gradient is converted to 64-bit fixed point with
  // this many fraction bits and summed as integers, exactly and in any order. Accepted range
  // |g| < 2^(51-40) = 2048 per micro-shard gradient value, resolution 2^-40 (9.1e-13); a value
  // outside it (or not finite) fails the step with OUT_OF_RANGE instead of being clipped.
  static constexpr int kFixedPointFracBits = 40;
  // Runs the steps on a device (GPU workers); nullptr: on the CPU. Not owned; set per
  // generation, like the communicator, and not during Train.
  void set_device_step(DeviceStep* device_step) { device_step_ = device_step; }
  // Memory this worker may use for the job (0: no limit), which decides how many samples go
  // through forward and backward at once (ChooseMicroBatch of common/job_memory.h). Not during
  // Train.
  void set_memory_budget(int64_t bytes);
  // Samples per forward/backward pass: the whole share, or less with gradient accumulation.
  int64_t micro_batch() const { return micro_batch_; }
  // Swaps in another communicator, e.g. a faster transport formed after the model size is
  // known, or the group of a new generation (rank and size may differ: the micro-shards are
  // re-divided). Not during Train.
  void set_communicator(Communicator* comm);

  // Brings every member of a (new) group to the same state, all or nothing:
  //  1. With checkpoints configured, rank 0 loads the job's newest valid checkpoint if it is
  //     newer than its own state; in a fresh job with init_from_checkpoint, rank 0 loads that.
  //  2. Members exchange the step of the state they hold and a hash of each part of their data;
  //     different data fail the job (FAILED_PRECONDITION naming the members and the file).
  //  3. When the steps differ, or members at the top step hold other bits (a step trained
  //     again after a rollback, in another world size), the most advanced member (lowest rank
  //     among equals) broadcasts its step, parameters and optimizer state with a checksum, in
  //     pieces. The others receive into staging memory and commit only once everything arrived
  //     and the checksum holds: a source lost midway leaves them with their previous state,
  //     never a mixture.
  // Nothing is sent when all members hold the same state (same step, same hash), the usual case
  // after a loss. `member_names` (rank order) name members in errors.
  struct HealInfo {
    int64_t resumed_from_step = 0;  // training continues at this step + 1
    int source_rank = -1;           // -1: nobody held state (all start from the seed)
    bool from_checkpoint = false;   // rank 0 read the state from one of the job's checkpoints
    absl::Duration took;
  };
  absl::StatusOr<HealInfo> Heal(const std::vector<std::string>& member_names = {});
  int64_t steps_per_epoch() const { return sampler_.steps_per_epoch(); }
  Mlp& model() { return model_; }

  using ProgressFn = std::function<void(const v1::ProgressReport&)>;
  // Called after every checkpoint rank 0 tried to write (job_id and generation left empty).
  using CheckpointFn = std::function<void(const v1::CheckpointReport&)>;
  // Trains 1-based steps [start_step, total_steps]. Reports progress at most every
  // `report_interval` (and always for the first and last step). ABORTED when `abort` was set;
  // the communicator's error when a collective failed.
  absl::Status Train(int64_t start_step, const std::atomic<bool>& abort, const ProgressFn& progress,
                     const CheckpointFn& checkpoint = nullptr,
                     absl::Duration report_interval = absl::Milliseconds(100));

  // Loss and accuracy on the whole test set, each rank taking a contiguous share.
  absl::StatusOr<v1::EvalResult> Evaluate();

  // FNV-1a 64 of the parameter bytes, as 16 hex digits.
  std::string ParameterChecksum() const;
  // The model's and optimizer's shapes: what a checkpoint must match to initialize this one.
  uint64_t ModelFingerprint() const;
  int64_t completed_step() const { return completed_step_; }
  // Samples per second from the end of the first step trained to the end of the last.
  double TrainSamplesPerSecond() const;

  // Where the step time went, summed over the steps trained so far.
  struct Timing {
    int64_t steps = 0;
    absl::Duration compute;       // forward + backward (communication overlaps it)
    absl::Duration exposed_comm;  // waiting for the allreduce after backward
    absl::Duration update;        // optimizer
    absl::Duration after_first;   // wall time from the end of the first step to the last
  };
  const Timing& timing() const { return timing_; }

 private:
  Trainer(const std::string& job_id, const v1::JobSpec& spec, std::shared_ptr<const Dataset> data,
          Communicator* comm, std::vector<int> dims, kernels::Activation activation);
  // Fills batch_x_ / batch_y_ with the training samples indices[0, n), or with a device step
  // its host buffers; returns where they are.
  absl::StatusOr<DeviceStep::HostBatch> LoadBatch(const int64_t* indices, int n);
  // The error of a deterministic step with `rejected` values out of the fixed-point range.
  static absl::Status FixedPointOutOfRange(int64_t rejected, int64_t step);
  absl::Status TrainStep(int64_t step);
  absl::Status TrainStepDeterministic(int64_t step);
  absl::Status TrainStepOnDevice(int64_t step);
  // Copies the device's parameters and optimizer state into the host mirror if it is stale.
  absl::Status SyncFromDevice();

  // Writes a checkpoint (rank 0) when `step` is due and reports it. A failed write is an error
  // only under checkpoint_failure_policy "fail".
  absl::Status MaybeCheckpoint(int64_t step, const CheckpointFn& report);
  // Step 1 of Heal; returns whether rank 0 took a checkpoint of this job.
  absl::StatusOr<bool> LoadStateFromDisk();
  // Step 3 of Heal: `source` sends its state in pieces; the others receive it, and those that
  // `take` it commit it once it is complete and its checksum holds.
  absl::Status ReceiveState(int source, bool take);

  const std::string job_id_;
  const v1::JobSpec spec_;
  const uint64_t training_fingerprint_;
  std::shared_ptr<const Dataset> data_;
  Communicator* comm_;
  DeviceStep* device_step_ = nullptr;
  bool host_stale_ = false;  // the device holds newer parameters than model_
  int64_t host_step_ = 0;    // the step model_ and the optimizer state belong to
  Mlp model_;
  Sampler sampler_;
  int64_t total_steps_ = 0;
  std::unique_ptr<Optimizer> optimizer_;
  ShardRange shards_;
  int64_t memory_budget_ = 0;
  int64_t micro_batch_ = 0;
  // Gradient buckets in backward order, each a contiguous range of the flat buffer; a
  // bucket is sent once backward has produced gradients up to its end.
  struct Bucket {
    size_t offset;
    size_t count;
  };
  size_t chunk_floats_ = 0;
  std::vector<Bucket> buckets_;
  std::unique_ptr<GradientReducer> reducer_;  // lives for one Train call
  std::vector<int64_t> indices_;
  std::vector<int64_t> fixed_sum_;  // deterministic mode: gradients, loss, overflow count
  std::vector<float> batch_x_;
  std::vector<int32_t> batch_y_;
  double last_loss_ = 0;
  int64_t completed_step_ = 0;
  // The state descends from init_from_checkpoint's parameters rather than the seed (at step 0
  // that tells the two apart).
  bool initialized_from_checkpoint_ = false;
  Timing timing_;
};

}  // namespace lockstep::worker
