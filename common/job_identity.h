// What makes state belong to a job: its id (unique across coordinator incarnations) and a
// fingerprint of every spec field that affects the trained bits. A worker reuses kept state,
// and reads a checkpoint, only when both match.
#pragma once

#include <cstdint>
#include <string>

#include "lockstep/v1/job.pb.h"

namespace lockstep {

// FNV-1a 64 of the spec's deterministic serialization with the operational fields cleared:
// name, min/max_workers, the timeouts, max_restarts, the checkpoint cadence, directory, count
// and failure policy, skip_evaluation and threads_per_worker. Every other field (model, data,
// optimizer, batch and shards, steps, seeds, deterministic, buckets, device, micro-batch,
// precision, init_from_checkpoint), including any added later, is part of it.
uint64_t TrainingFingerprint(const v1::JobSpec& spec);

struct JobKey {
  std::string job_id;
  uint64_t fingerprint = 0;
  static JobKey Of(const std::string& job_id, const v1::JobSpec& spec) {
    return {job_id, TrainingFingerprint(spec)};
  }
  bool operator==(const JobKey& o) const {
    return job_id == o.job_id && fingerprint == o.fingerprint;
  }
  bool operator!=(const JobKey& o) const { return !(*this == o); }
};

}  // namespace lockstep
