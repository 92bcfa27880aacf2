// Durable job state behind an interface: the coordinator saves every job that changed and
// reloads them at start (Core::RestoreJobs). FileJobStore keeps one file per job in the
// coordinator's --state_dir; InMemoryJobStore (no --state_dir) forgets them on exit.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "lockstep/v1/job.pb.h"

namespace lockstep::coordinator {

// Thread-safe.
class JobStore {
 public:
  virtual ~JobStore() = default;
  virtual absl::Status Save(const v1::Job& job) = 0;
  virtual absl::StatusOr<std::vector<v1::Job>> LoadAll() = 0;
};

class InMemoryJobStore final : public JobStore {
 public:
  absl::Status Save(const v1::Job& job) override;
  absl::StatusOr<std::vector<v1::Job>> LoadAll() override;

 private:
  absl::Mutex mu_;
  std::map<std::string, v1::Job> jobs_ ABSL_GUARDED_BY(mu_);
};

// DIR/jobs/JOB_ID.pb, the Job in protobuf's binary form, replaced atomically (temporary file,
// fsync, rename, fsync of the directory) on every save. A file that does not parse (a disk
// error, a foreign file) is skipped with a logged reason and renamed to *.corrupt.
class FileJobStore final : public JobStore {
 public:
  // Creates DIR/jobs if missing; errors name the path.
  static absl::StatusOr<std::unique_ptr<FileJobStore>> Open(const std::string& dir);
  absl::Status Save(const v1::Job& job) override;
  absl::StatusOr<std::vector<v1::Job>> LoadAll() override;

 private:
  explicit FileJobStore(std::string jobs_dir) : jobs_dir_(std::move(jobs_dir)) {}
  const std::string jobs_dir_;
  absl::Mutex mu_;  // one writer at a time per store (saves of one job must not interleave)
};

// The cluster's id, six hex digits appended to every job id (CoreOptions::job_id_suffix):
// read from DIR/cluster_id, or created there at random on first use, so a coordinator that
// keeps its --state_dir keeps its ids; with no directory (`dir` empty) a new random id, so a
// coordinator without state never hands out the ids of an earlier one. Errors name the file.
absl::StatusOr<std::string> ClusterId(const std::string& dir);

}  // namespace lockstep::coordinator
