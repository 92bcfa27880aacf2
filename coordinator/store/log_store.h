// Program jobs' output as the coordinator keeps it for `lockstepctl logs`, the Python client
// and the dashboard: per job a window of its latest lines, bounded in bytes, for a bounded
// number of jobs (the ones that wrote last). Not persisted: a restarted coordinator starts
// with none. No gRPC here: the services read and append through it.
#pragma once

#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "lockstep/v1/job.pb.h"
#include "lockstep/v1/worker.pb.h"

namespace lockstep::coordinator {

struct LogLimits {
  size_t bytes_per_job = 2 << 20;  // text of the lines kept per job
  size_t jobs = 64;                // jobs whose lines are kept
};

// Thread-safe.
class LogStore {
 public:
  explicit LogStore(LogLimits limits = {}) : limits_(limits) {}

  // The lines of (job, generation) that `rank` on `worker` wrote. The oldest lines of the job
  // go when it holds more than bytes_per_job; the job that wrote longest ago goes when more
  // than `jobs` have lines.
  void Append(const std::string& job_id, int64_t generation, int32_t rank,
              const std::string& worker, const v1::ProgramOutput& output) ABSL_LOCKS_EXCLUDED(mu_);
  // The job's lines from request.from_sequence() on that match its rank and generation, at
  // most max_lines (0 = 1000, at most 10000). A job without lines answers empty.
  v1::JobLogs Read(const v1::GetJobLogsRequest& request) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct JobLog {
    std::deque<v1::LogLine> lines;
    size_t bytes = 0;
    int64_t next_sequence = 0;
    std::list<std::string>::iterator recency;
  };
  const LogLimits limits_;
  mutable absl::Mutex mu_;
  std::map<std::string, JobLog> jobs_ ABSL_GUARDED_BY(mu_);
  std::list<std::string> recency_ ABSL_GUARDED_BY(mu_);  // front: wrote last
};

}  // namespace lockstep::coordinator
