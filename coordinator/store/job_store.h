// Durable job state behind an interface: the coordinator saves every job that changed and
// reloads them at start. This release keeps them in memory; the SQLite store plugs in here.
#pragma once

#include <map>
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

}  // namespace lockstep::coordinator
