// What every part of the system says about a job's state.
#pragma once

#include "lockstep/v1/job.pb.h"

namespace lockstep {

// SUCCEEDED, FAILED or CANCELLED: the job will never run again.
inline bool IsTerminal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

}  // namespace lockstep
