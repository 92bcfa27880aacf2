// Disk checkpoints: parameters, optimizer state and data position (the step) of one job,
// written atomically and durably (temporary file, fsync, rename, fsync of the directory) with a
// checksum, the job's newest N kept. A checkpoint belongs to the job that wrote it: its file is
// named after the job, and its header carries the job's id and training fingerprint
// (worker/job_identity.h), so a job never loads, nor prunes, another job's checkpoints in a
// shared directory. Starting from another job's weights is explicit (LoadCheckpointForInit).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace lockstep {

struct CheckpointData {
  int64_t step = 0;
  std::string job_id;                 // at most 63 bytes
  uint64_t training_fingerprint = 0;  // TrainingFingerprint of the job's spec
  // The model's and optimizer's shapes (Trainer::ModelFingerprint): what init_from_checkpoint
  // must match.
  uint64_t model_fingerprint = 0;
  // A serialized lockstep.v1.ModelManifest: the tensors' names and shapes and the model's
  // configuration, so that `lockstepctl export` converts the file alone (empty in files of
  // the previous format).
  std::string manifest;
  std::vector<float> params;
  std::vector<float> optimizer_state;
};

// Writes DIR/JOB.step-STEP.ckpt and then deletes all but the job's newest `keep` checkpoints.
// Returns the path. Errors name the file and carry the system's reason (RESOURCE_EXHAUSTED for
// a full disk, PERMISSION_DENIED, NOT_FOUND, INTERNAL); nothing is left half-written.
absl::StatusOr<std::string> WriteCheckpoint(const std::string& dir, const CheckpointData& data,
                                            int keep);

// The job's newest checkpoint in `dir` that is complete, uncorrupted, of this training
// fingerprint and these sizes, with after_step < step <= max_step. Anything else is skipped
// with a logged reason (and listed in *skipped when given). NOT_FOUND when there is none.
absl::StatusOr<CheckpointData> LoadLatestCheckpoint(const std::string& dir,
                                                    const std::string& job_id,
                                                    uint64_t training_fingerprint,
                                                    size_t num_params, size_t optimizer_floats,
                                                    int64_t after_step, int64_t max_step,
                                                    std::vector<std::string>* skipped = nullptr);

// Reads and verifies one checkpoint file: NOT_FOUND when it cannot be opened, DATA_LOSS naming
// the file and what is wrong (not a regular file, not a checkpoint, truncated, trailing bytes,
// an implausible length, checksum mismatch). Safe on untrusted files: every length in the file
// is checked against the file's size before anything is allocated for it. The manifest comes
// back unparsed and unchecked (CheckManifest in common/safetensors.h checks it).
absl::StatusOr<CheckpointData> ReadCheckpoint(const std::string& path);

// For LoadCheckpointForInit: any optimizer state will do (it is not loaded).
inline constexpr size_t kAnyOptimizerState = ~size_t{0};

// For init_from_checkpoint: the checkpoint file `path`, or the newest valid checkpoint of any
// job in directory `path`, whose model fingerprint and sizes match. NOT_FOUND when there is
// none, naming the path; FAILED_PRECONDITION when the file is a checkpoint of another model.
absl::StatusOr<CheckpointData> LoadCheckpointForInit(const std::string& path,
                                                     uint64_t model_fingerprint, size_t num_params,
                                                     size_t optimizer_floats);

}  // namespace lockstep
