// Job spec validation and defaults: everything refused at submit is decided here, with the
// offending field named in the INVALID_ARGUMENT message.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "common/path_roots.h"
#include "lockstep/v1/job.pb.h"

namespace lockstep::coordinator {

// Bounds on what a spec may hold, checked first (and documented in docs/job_spec_example.md):
// past them a spec is refused, so no one spec can bloat every ListJobs answer or a log.
inline constexpr size_t kMaxJobSpecBytes = 64 << 10;  // the encoded spec
inline constexpr size_t kMaxJobNameBytes = 256;
inline constexpr size_t kMaxPathBytes = 4096;
inline constexpr size_t kMaxPromptBytes = 4096;  // sample.prompt bytes or prompt_tokens
inline constexpr int kMaxHiddenLayers = 64;
inline constexpr int kMaxFrozenPatterns = 256;
inline constexpr int kMaxRestartsLimit = 1000;
// JobSpec.priority's range (a queued job's aged priority stops at kMaxPriority too).
inline constexpr int kMinPriority = -1000;
inline constexpr int kMaxPriority = 1000;

// Text a spec carries into logs, status, command lines and file systems: no NUL or other
// control bytes (they would cut paths short or forge log lines), and at most `limit` bytes.
// INVALID_ARGUMENT naming `field`.
absl::Status CheckText(const std::string& field, const std::string& value, size_t limit);

// Fills the fields left at zero/empty with their documented defaults, and moves a model of the
// form before the family messages into its family's message (NormalizeModelSpec). Idempotent.
void ApplyJobSpecDefaults(v1::JobSpec* spec);

// The spec's paths against the directories jobs may use: dataset.path and
// dataset.validation_path in `data`, checkpoint_dir and output_dir in `checkpoints`,
// init_from_checkpoint.path in either. INVALID_ARGUMENT naming the field.
absl::Status CheckJobPaths(const v1::JobSpec& spec, const PathRoots& data,
                           const PathRoots& checkpoints);

// Checks a spec after ApplyJobSpecDefaults. Returns INVALID_ARGUMENT naming the first bad
// field (e.g. "global_batch_size: must be > 0, got -4"), or UNIMPLEMENTED for features that
// exist in the schema but not yet in this build.
absl::Status ValidateJobSpec(const v1::JobSpec& spec);

// Program jobs (JobSpec.program; coordinator/core/program_spec.cc): the defaults of the fields a
// program job has, and its validation (a training field set beside a program is refused,
// naming it). ApplyJobSpecDefaults and ValidateJobSpec call them for a program job.
void ApplyProgramSpecDefaults(v1::JobSpec* spec);
absl::Status ValidateProgramJob(const v1::JobSpec& spec);

}  // namespace lockstep::coordinator
