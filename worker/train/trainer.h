// One member's training of one job: the step loop (fixed global batch, world-size-independent
// data order, each step handed to a step engine), healing, checkpoints, progress and the
// sharded evaluation at the end. The model (worker/model/model.h) and the engine
// (worker/step/step_engine.h) are behind interfaces: a new model or device touches neither
// this class nor the communicators.
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
#include "worker/data/dataset.h"
#include "worker/model/model.h"
#include "worker/step/optimizer.h"
#include "worker/data/sampler.h"
#include "worker/step/step_engine.h"

namespace lockstep::worker {

class CpuStep;

// Not thread-safe: one training thread drives it. `abort` may be set from any thread; the
// loop checks it between steps.
//
// Errors of Heal, Train and Evaluate: the communicator's (UNAVAILABLE, DEADLINE_EXCEEDED,
// ABORTED: the generation is over, another may succeed); DATA_LOSS when healed state failed
// its checksum (the member keeps its previous state); and errors no other group can avoid,
// whose codes fail the job (the worker's IsFatal rule, worker/generation.h):
// FAILED_PRECONDITION (the members hold different data, a checkpoint write failed under
// checkpoint_failure_policy "fail", init_from_checkpoint cannot be read), OUT_OF_RANGE
// (deterministic mode's range), UNIMPLEMENTED (a mode this device lacks).
class Trainer {
 public:
  // FAILED_PRECONDITION when the data cannot serve the spec (batch larger than the data set,
  // labels beyond the model's classes), INVALID_ARGUMENT for a bad model spec. `job_id` names
  // the job's checkpoints.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const std::string& job_id,
                                                         const v1::JobSpec& spec,
                                                         std::shared_ptr<const Dataset> data,
                                                         Communicator* comm);

  int64_t total_steps() const { return total_steps_; }
  // The largest sum this trainer asks of its communicator in one call, in bytes (a gradient
  // bucket, or in deterministic mode the whole fixed-point gradient).
  size_t largest_collective_bytes() const;

  // Deterministic mode: each micro-shard's gradient is converted to 64-bit fixed point with
  // this many fraction bits and summed as integers, exactly and in any order. Accepted range
  // |g| < 2^(51-40) = 2048 per micro-shard gradient value, resolution 2^-40 (9.1e-13); a value
  // outside it (or not finite) fails the step with OUT_OF_RANGE instead of being clipped.
  static constexpr int kFixedPointFracBits = 40;
  // The engine the steps run on, made for this trainer's model and optimizer (it points into
  // them): a device's (a GPU's GpuStep), which the trainer keeps across generations as it keeps
  // its state, so that a survivor uploads nothing when the group re-forms and a heal's source
  // sends from device memory; nullptr: a CPU engine (the default). Not during Train.
  void set_engine(std::unique_ptr<StepEngine> engine);
  StepEngine& engine() const { return *engine_; }
  // What one sample of this job holds (what an engine's host buffers are laid out as).
  const SampleLayout& sample_layout() const { return layout_; }
  // Memory this worker may use for the job (0: no limit), which decides how many samples go
  // through forward and backward at once (ChooseMicroBatch of common/job_memory.h). Not during
  // Train.
  void set_memory_budget(int64_t bytes);
  // Called after every step this trainer takes (for metrics), on the training thread. Not
  // during Train.
  using StepObserver = std::function<void(const StepResult&)>;
  void set_step_observer(StepObserver observer) { step_observer_ = std::move(observer); }
  // Bytes this rank hands to the group's sum each step: the trainable gradient and the loss
  // (deterministic mode: as 64-bit integers, with the out-of-range count); 0 alone.
  int64_t ReducedBytesPerStep() const;
  // Samples per forward/backward pass: the whole share, or less with gradient accumulation.
  int64_t micro_batch() const { return micro_batch_; }
  // Swaps in another communicator, e.g. a faster transport formed after the model size is
  // known, or the group of a new generation (rank and size may differ: the micro-shards are
  // re-divided); the device group is then none until set_device_group. Not during Train.
  void set_communicator(Communicator* comm);
  // The generation's device group (a GPU's NCCL communicator, which its backend attached), that
  // the engine heals and sums over; not owned, and not kept past the generation. Not during
  // Train.
  void set_device_group(DeviceGroup* group) { device_group_ = group; }

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
  Model& model() { return *model_; }
  Optimizer& optimizer() { return *optimizer_; }

  using ProgressFn = std::function<void(const v1::ProgressReport&)>;
  // Called after every checkpoint rank 0 tried to write (job_id and generation left empty).
  using CheckpointFn = std::function<void(const v1::CheckpointReport&)>;
  // Trains 1-based steps [start_step, total_steps]. Reports progress at most every
  // `report_interval` (and always for the first and last step). ABORTED when `abort` was set;
  // the communicator's error when a collective failed.
  absl::Status Train(int64_t start_step, const std::atomic<bool>& abort, const ProgressFn& progress,
                     const CheckpointFn& checkpoint = nullptr,
                     absl::Duration report_interval = absl::Milliseconds(100));

  ~Trainer();
  // Loss and accuracy on the whole test set, each rank taking a contiguous share.
  absl::StatusOr<v1::EvalResult> Evaluate();

  // FNV-1a 64 of the parameter bytes, as 16 hex digits.
  std::string ParameterChecksum() const;
  // The model's and optimizer's shapes: what a checkpoint must match to initialize this one.
  uint64_t ModelFingerprint() const;
  int64_t completed_step() const { return completed_step_; }
  // Samples per second from the end of the first step trained to the end of the last
  // (evaluations in between left out); language models also in tokens (samples x context).
  double TrainSamplesPerSecond() const;
  double TrainTokensPerSecond() const;

  // Language models: spec.sample()'s text, from this member's parameters (rank 0 calls it).
  absl::StatusOr<v1::Sample> GenerateSample();
  // Writes model.safetensors and config.json into spec.output_dir(); returns the safetensors
  // path. Errors name the file and the system's reason.
  absl::StatusOr<std::string> Export();

  // Where the step time went, summed over the steps trained so far.
  struct Timing {
    int64_t steps = 0;
    absl::Duration compute;       // forward + backward (communication overlaps it)
    absl::Duration exposed_comm;  // waiting for the allreduce after backward
    absl::Duration update;        // optimizer
    absl::Duration after_first;   // wall time from the end of the first step to the last,
                                  // less the evaluations in between
    absl::Duration evaluation;    // eval_every_steps' evaluations
  };
  const Timing& timing() const { return timing_; }

 private:
  Trainer(const std::string& job_id, const v1::JobSpec& spec, std::shared_ptr<const Dataset> data,
          Communicator* comm, std::unique_ptr<Model> model);
  // Fills the engine's host buffers with the training samples indices[0, n).
  absl::StatusOr<HostBatch> LoadBatch(const int64_t* indices, int n);
  // The error of a deterministic step with `rejected` values out of the fixed-point range.
  static absl::Status FixedPointOutOfRange(int64_t rejected, int64_t step);
  absl::Status TrainStep(int64_t step);
  // Train's steps, between the engine's Begin and End.
  absl::Status TrainSteps(int64_t start_step, const std::atomic<bool>& abort,
                          const ProgressFn& progress, const CheckpointFn& checkpoint,
                          absl::Duration report_interval);
  // The host model and optimizer hold the last completed step (the engine's Sync).
  absl::Status SyncHost();
  // The host's state was rewritten outside the engine (a checkpoint, a heal's commit): an
  // engine that keeps a copy learns it; `engine_has_it`: it received the same state
  // (BroadcastState with take).
  void HostStateWritten(bool engine_has_it) { engine_->HostStateChanged(engine_has_it); }
  StepGroup group() const { return {comm_, device_group_}; }

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
  DeviceGroup* device_group_ = nullptr;
  std::unique_ptr<Model> model_;
  Sampler sampler_;
  int64_t total_steps_ = 0;
  std::unique_ptr<Optimizer> optimizer_;
  // It points into model_ and optimizer_, so it goes before them.
  std::unique_ptr<StepEngine> engine_;
  // The step the host model and optimizer state belong to (a device's engine may be ahead).
  int64_t host_step_ = 0;
  ShardRange shards_;
  SampleLayout layout_;
  int64_t memory_budget_ = 0;
  int64_t micro_batch_ = 0;
  std::vector<int64_t> indices_;
  double last_loss_ = 0;
  int64_t completed_step_ = 0;
  // The state descends from init_from_checkpoint's parameters rather than the seed (at step 0
  // that tells the two apart).
  bool initialized_from_checkpoint_ = false;
  Timing timing_;
  StepObserver step_observer_;
};

}  // namespace lockstep::worker
