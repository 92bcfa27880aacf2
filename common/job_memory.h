// Per-worker memory of a job: what one worker needs at its peak, estimated from the job spec
// alone. The coordinator uses it to refuse a job that fits on no worker (RESOURCE_EXHAUSTED with
// the numbers) and never to hand a worker a job it cannot hold; the worker uses it to choose how
// many samples of its share go through forward and backward at once (gradient accumulation
// over micro-batches, so that a large global batch fits).
#pragma once

#include <cstdint>
#include <string>

#include "common/bytes.h"
#include "lockstep/v1/job.pb.h"

namespace lockstep {

struct MemoryEstimate {
  int64_t parameters = 0;     // model parameters (float32)
  int64_t gradients = 0;      // one gradient buffer
  int64_t optimizer = 0;      // momentum buffer (SGD) or two moments (AdamW)
  int64_t activations = 0;    // forward activations and backward temporaries of one micro-batch
  int64_t communication = 0;  // reduction buffers (int64 fixed point in deterministic mode)
  // GPU workers (device "cuda"): cuBLAS workspaces, NCCL's buffers, the second upload slot
  // of the micro-batch, the LM head's larger chunk of logits (common/gpu_limits.h).
  int64_t device = 0;
  int64_t micro_batch = 0;  // samples processed at once by one worker
  int64_t total() const {
    return parameters + gradients + optimizer + activations + communication + device;
  }
  // "1.2 GiB (parameters 256 MiB, gradients 256 MiB, ...)".
  std::string ToString() const;
};

// Peak memory of one worker that puts `micro_batch` samples through forward and backward at
// once, for `spec` (after ApplyJobSpecDefaults). Data sets are not counted: CPU workers share
// one decoded copy per host (/dev/shm), GPU workers stream batches.
MemoryEstimate EstimateWorkerMemory(const v1::JobSpec& spec, int64_t micro_batch);

// Samples of one step that a worker of a `world`-worker group holds: its micro-shards (the
// largest share, when they do not divide evenly).
int64_t ShareSamples(const v1::JobSpec& spec, int world);

// The fewest samples a worker can put through at once: one micro-shard, or micro_batch_size when
// the spec sets it. What admission compares against a worker's free memory.
int64_t MinMicroBatch(const v1::JobSpec& spec);

// How many samples a worker of a `world`-worker group puts through at once, given `budget`
// bytes of memory (<= 0: no limit):
//   - deterministic mode: one micro-shard (each micro-shard's gradient is computed separately);
//   - micro_batch_size set: that, or the share if it is smaller;
//   - otherwise the whole share if it fits in the budget, else the most whole micro-shards that
//     do (at least one: admission has checked that one fits).
// Always a multiple of the micro-shard size, or the whole share.
int64_t ChooseMicroBatch(const v1::JobSpec& spec, int world, int64_t budget);

}  // namespace lockstep
