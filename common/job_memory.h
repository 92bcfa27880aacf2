// Per-worker memory preflight: what one worker of a job needs at its peak, estimated from the
// job spec alone, so that the coordinator can refuse a job that fits on no worker
// (RESOURCE_EXHAUSTED with the numbers) and never hands a worker a job it cannot hold.
#pragma once

#include <cstdint>
#include <string>

#include "lockstep/v1/job.pb.h"

namespace lockstep::coordinator {

struct MemoryEstimate {
  int64_t parameters = 0;     // model parameters (float32)
  int64_t gradients = 0;      // one gradient buffer
  int64_t optimizer = 0;      // momentum buffer (SGD) or two moments (AdamW)
  int64_t activations = 0;    // forward activations and backward temporaries of one micro-batch
  int64_t communication = 0;  // reduction buffers (int64 fixed point in deterministic mode)
  int64_t micro_batch = 0;    // samples processed at once by one worker
  int64_t total() const { return parameters + gradients + optimizer + activations + communication; }
  // "1.2 GiB (parameters 256 MiB, gradients 256 MiB, ...)".
  std::string ToString() const;
};

// Peak memory of one worker in a group of `world` workers running `spec` (after
// ApplyJobSpecDefaults). The worst case is the smallest group, whose workers take the largest
// share of the batch: call with min_workers for admission. Data sets are not counted: CPU
// workers share one decoded copy per host (/dev/shm), GPU workers stream batches.
MemoryEstimate EstimateWorkerMemory(const v1::JobSpec& spec, int world);

// "1.5 GiB", "640 MiB", "12 KiB".
std::string HumanBytes(int64_t bytes);

}  // namespace lockstep::coordinator
