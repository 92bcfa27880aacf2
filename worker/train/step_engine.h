// Where a training step runs: forward and backward in micro-batches, the sum of the gradient
// over the group in buckets (overlapping backward), and the optimizer update, on one device.
// The trainer around it owns the data, the sampler, healing, checkpoints, progress and the
// evaluation's reduction, and hands each step's batch to the engine; the host model and
// optimizer state are the engine's state (CPU) or its mirror (GPU). Engines: CpuStep
// (worker/train/cpu_step.h) and GpuStep (worker/train/gpu_step.h).
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"
#include "worker/train/model.h"

namespace lockstep::worker {

// What one sample of a job holds: a classifier's `feature_stride` floats and a label, or a
// language model's `token_stride` token ids (a window of context_length + 1).
struct SampleLayout {
  int feature_stride = 0;
  int token_stride = 0;
  bool labels() const { return token_stride == 0; }
};

// Host memory the trainer fills with the samples of the next step (pinned memory on a GPU, so
// the copies run asynchronously). Valid until the next HostBuffers call.
struct HostBatch {
  float* features = nullptr;
  int feature_stride = 0;
  int32_t* labels = nullptr;
  int32_t* tokens = nullptr;
  int token_stride = 0;
  Batch View(int n) const {
    return {n, features, feature_stride, labels, tokens, token_stride};
  }
};

// One step of this rank's share.
struct StepArgs {
  int n = 0;                   // samples of the share, in the last HostBuffers
  int micro_batch = 0;         // default mode: at most this many through forward/backward at once
  bool deterministic = false;  // one micro-shard at a time, summed in fixed point
  int micro_shard = 0;         // deterministic mode: samples per micro-shard
  int frac_bits = 0;           // deterministic mode: fixed-point fraction bits
  float grad_scale = 0;        // 1 / global batch
  float lr = 0;
  int64_t step = 0;  // 1-based
};

struct StepResult {
  double loss = 0;       // the group's mean loss
  int64_t rejected = 0;  // deterministic mode: values not finite or out of range (no update)
  // Where the time went: forward and backward (communication overlaps it), waiting for the
  // sums after backward, the update. A device that times the step as one puts it in compute.
  absl::Duration compute, exposed_comm, update;
};

// Driven by one thread.
class StepEngine {
 public:
  virtual ~StepEngine() = default;
  // Start of training in a generation: the engine takes the host model's and optimizer's state
  // (a device uploads it) and will sum over `comm` (a device may use its own transport).
  virtual absl::Status Begin(Communicator* comm) = 0;
  // The host model and optimizer hold the state of the last step taken (a device downloads it
  // if it is newer).
  virtual absl::Status Sync() = 0;
  // End of training in the generation, after Begin whatever happened: Sync, and let go of the
  // communicator. On error the host holds the state of the last successful Sync or Begin.
  virtual absl::Status End() = 0;
  virtual absl::StatusOr<HostBatch> HostBuffers(int n) = 0;
  // The step on the last HostBuffers' samples. Errors: the communicator's (the generation is
  // over; nothing was updated).
  virtual absl::StatusOr<StepResult> TakeStep(const StepArgs& args) = 0;
  // Forward only on `batch` (host memory): the loss sum; adds the correct predictions.
  virtual absl::StatusOr<double> Evaluate(const Batch& batch, int64_t* correct) = 0;
  // Healing's bulk transfer (Trainer::Heal): `count` floats of host memory from rank `root`'s
  // `data` into every other member's `data`, over the engine's own transport (a device's,
  // between device memories). UNIMPLEMENTED when it has none: the trainer then broadcasts
  // over its communicator. Errors: the transport's (the generation is over).
  virtual absl::Status BroadcastHost(float* data, size_t count, int root) {
    return absl::UnimplementedError("no transport of its own");
  }
};

}  // namespace lockstep::worker
