// Where a training step runs: forward and backward in micro-batches, the sum of the gradient
// over the group in buckets (overlapping backward), and the optimizer update, on one device.
// The trainer around it owns the data, the sampler, healing, checkpoints, progress and the
// evaluation's reduction, and hands each step's batch to the engine; the host model and
// optimizer state are the engine's state (CPU) or its mirror (GPU). Engines: CpuStep
// (worker/step/cpu_step.h) and GpuStep (worker/cuda/gpu_step.h); the trainer holds one.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"
#include "worker/model/model.h"

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

// What an engine sums over in one generation: the generation's host communicator (Gloo, or
// shared memory over it), and the device's own group when its backend attached one (a GPU's
// NCCL communicator; null on a CPU and in a group of one).
struct StepGroup {
  Communicator* host = nullptr;
  DeviceGroup* device = nullptr;
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

// For an engine that keeps a copy of the state of its own (a GPU's memory) across
// generations: whether that copy is the host's, and whether it is newer. The one place that
// decides when Begin uploads, when Sync downloads and when a heal's source may send its copy.
class StateMirror {
 public:
  // Begin: the host's state must go to the engine (never there, or changed since).
  bool upload_needed() const { return !descends_; }
  // A step ran since the host's state was last brought up to date.
  bool download_needed() const { return descends_ && stepped_; }
  // The engine's copy is the host's, bit for bit.
  bool holds_host() const { return descends_ && !stepped_; }
  // After an upload or a download: the two are equal.
  void Copied() { descends_ = true, stepped_ = false; }
  void Stepped() { stepped_ = descends_; }
  // The engine's copy is no longer the host's, nor newer: a failed download (the trainer goes
  // back to the host's state), a heal being received into it, the host's state rewritten.
  void Diverged() { descends_ = false, stepped_ = false; }

 private:
  bool descends_ = false;  // the engine's copy is the host's, or the host's trained on
  bool stepped_ = false;
};

// Driven by one thread.
class StepEngine {
 public:
  virtual ~StepEngine() = default;
  // Where the steps run: "cpu" or "cuda".
  virtual const char* device() const = 0;
  // Start of training in a generation: the engine takes the host model's and optimizer's state
  // (a device uploads it, unless the copy it kept from an earlier generation is that state)
  // and sums over `group` until End (a CPU over its host communicator, a GPU over its device
  // group).
  virtual absl::Status Begin(const StepGroup& group) = 0;
  // The host model and optimizer hold the state of the last step taken (a device downloads it
  // if it is newer).
  virtual absl::Status Sync() = 0;
  // End of training in the generation, after Begin whatever happened: Sync, and let go of the
  // group. On error the host holds the state of the last successful Sync or Begin.
  virtual absl::Status End() = 0;
  virtual absl::StatusOr<HostBatch> HostBuffers(int n) = 0;
  // The step on the last HostBuffers' samples. Errors: the communicator's (the generation is
  // over; nothing was updated).
  virtual absl::StatusOr<StepResult> TakeStep(const StepArgs& args) = 0;
  // Forward only on `batch` (host memory): the loss sum; adds the correct predictions.
  virtual absl::StatusOr<double> Evaluate(const Batch& batch, int64_t* correct) = 0;
  // Healing's bulk transfer (Trainer::Heal, before Begin): floats [offset, offset + count) of
  // `part` of the state, from rank `root` to the other members over `group`'s device group
  // (between device memories). The root sends the engine's own copy when it holds the host's
  // state (StateMirror::holds_host: a device sends from device memory), else `host`. A member
  // that takes the state (`take`) receives it into the engine's copy, which from then on is
  // not the host's until HostStateChanged(true), and into `host` (the trainer's staging, for
  // the checksum); the others only take part. UNIMPLEMENTED when the engine has no transport
  // of its own (a CPU, a group of one): the trainer then broadcasts `host` over its
  // communicator. Errors: the transport's (the generation is over).
  enum class StatePart { kParams, kOptimizer };
  virtual absl::Status BroadcastState(const StepGroup& group, StatePart part, size_t offset,
                                      size_t count, float* host, int root, bool take) {
    return absl::UnimplementedError("no transport of its own");
  }
  // The trainer wrote the host's state outside the engine: a heal's commit (`engine_has_it`:
  // every piece of it came through BroadcastState with `take`) or a checkpoint read from disk.
  // An engine with a copy of its own uploads the host's at the next Begin unless it has it.
  virtual void HostStateChanged(bool engine_has_it) {}
};

}  // namespace lockstep::worker
