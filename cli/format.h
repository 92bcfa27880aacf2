// Text rendering for lockstepctl: durations, numbers, tables and the human-readable views of
// jobs, workers and watch events. Pure functions of their inputs (the current time and time zone
// are parameters), so every view is unit-testable.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/bytes.h"
#include "common/job_state.h"
#include "lockstep/v1/job.pb.h"

namespace lockstep::cli {

enum class OutputFormat { kTable, kJson };

// "850ms", "1.2s" (under 10 s), "12s", "1m02s", "2h05m", "3d04h". Truncates rather than rounds,
// so an ETA never reads as done early; negative durations (clock skew) read as "0s".
std::string ShortDuration(absl::Duration d);

// A duration held in integer milliseconds, as in the protocol.
std::string ShortMillis(int64_t ms);

// Digits grouped by thousands: 29345 -> "29,345", -1234 -> "-1,234".
std::string FormatThousands(int64_t n);

// "RUNNING" for JOB_STATE_RUNNING; "STATE_7" for a value this build does not know.
std::string JobStateName(v1::JobState state);

// Rows of cells rendered as left-aligned columns separated by two spaces, header first. The
// last column is not padded, so lines carry no trailing blanks.
class Table {
 public:
  explicit Table(std::vector<std::string> header);

  // A row shorter than the header is padded with empty cells; extra cells are dropped.
  void AddRow(std::vector<std::string> row);

  // Every line, each ending in '\n'; `indent` is prepended to each line.
  std::string Render(const std::string& indent = "") const;

 private:
  std::vector<std::vector<std::string>> rows_;  // rows_[0] is the header.
};

// How long the job ran (start to end, or to `now` while it runs), or how long it has existed
// when it never started. Zero when the job carries no timestamps.
absl::Duration JobDuration(const v1::Job& job, absl::Time now);

// "step 120/468 (25.6%)  loss 0.5123  29,345 samples/s  ETA 12s". Parts without data (no total,
// no step yet, no ETA) are left out.
std::string FormatProgress(const v1::Job& job);

// "test accuracy 0.8731 (10000 samples), test loss 0.3512", or "" when the job has no eval.
std::string FormatEval(const v1::Job& job);

// The `list` table: JOB, NAME, STATE, STEP, LOSS, WORKERS, AGE/DURATION. AGE/DURATION is the
// time since submission for a job that is not finished, and the run time for a finished one.
std::string FormatJobList(const v1::ListJobsResponse& response, absl::Time now);
// The queue (ListJobsRequest.queue): position, job, priority, workers asked for, time waited
// and why it waits.
std::string FormatQueue(const v1::ListJobsResponse& queue, absl::Time now);

// The `status` block: identity, state and reason, generation and its members, progress, timing,
// evaluation and recoveries. Absolute times are shown in `tz`.
std::string FormatJobDetail(const v1::Job& job, absl::Time now, absl::TimeZone tz);

// The `workers` table: WORKER, NAME, HOST, DEVICE, STATE, JOB, LAST HEARTBEAT (an age); then,
// if any, the rejected clients: ADDRESS, CLIENT, CALLS, LAST (an age), REASON.
std::string FormatWorkerList(const v1::ListWorkersResponse& response, absl::Time now);

// One watch line for a STATE or MEMBERSHIP event, without a newline:
// "[12:01:02] job-1 RUNNING: generation 1 formed: w0, w1" (time of day in `tz`).
std::string FormatEventLine(const v1::JobEvent& event, absl::TimeZone tz);

// The lines printed when a watch ends: "job-1 SUCCEEDED in 1m02s" and the evaluation, or
// "job-1 FAILED after 12s: <reason>". Each line ends in '\n'.
std::string FormatFinalSummary(const v1::Job& job, absl::Time now);

}  // namespace lockstep::cli
