// Job spec validation and defaults: everything refused at submit is decided here, with the
// offending field named in the INVALID_ARGUMENT message.
#pragma once

#include "absl/status/status.h"
#include "lockstep/v1/job.pb.h"

namespace lockstep::coordinator {

// Default directory of Debian's dataset-fashion-mnist package.
inline constexpr char kDefaultFashionMnistPath[] = "/usr/share/datasets/fashion-mnist";

// Fills the fields left at zero/empty with their documented defaults. Idempotent.
void ApplyJobSpecDefaults(v1::JobSpec* spec);

// Checks a spec after ApplyJobSpecDefaults. Returns INVALID_ARGUMENT naming the first bad
// field (e.g. "global_batch_size: must be > 0, got -4"), or UNIMPLEMENTED for features that
// exist in the schema but not yet in this build.
absl::Status ValidateJobSpec(const v1::JobSpec& spec);

}  // namespace lockstep::coordinator
