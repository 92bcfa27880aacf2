// Disk checkpoints: parameters, optimizer state and data position (the step), written
// atomically (temporary file, fsync, rename) with a checksum, the last N kept. They are read
// only when no member of a group holds newer state in memory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace lockstep::worker {

struct CheckpointData {
  int64_t step = 0;
  // Identifies the model and optimizer shapes the state belongs to; a checkpoint of another
  // model in the same directory is skipped, never loaded.
  uint64_t fingerprint = 0;
  std::vector<float> params;
  std::vector<float> optimizer_state;
};

// Writes DIR/step-<step>.ckpt atomically and deletes all but the newest `keep` checkpoints.
absl::Status WriteCheckpoint(const std::string& dir, const CheckpointData& data, int keep);

// The newest checkpoint in `dir` that is complete, uncorrupted and matches `fingerprint` and
// the sizes, with a step greater than `after_step`. Corrupt or mismatched files are skipped
// with a logged reason (and listed in *skipped when given). NOT_FOUND when there is none.
absl::StatusOr<CheckpointData> LoadLatestCheckpoint(const std::string& dir, uint64_t fingerprint,
                                                    size_t num_params, size_t optimizer_floats,
                                                    int64_t after_step,
                                                    std::vector<std::string>* skipped = nullptr);

}  // namespace lockstep::worker
