// In-memory job store.
#include "coordinator/store/job_store.h"

namespace lockstep::coordinator {

absl::Status InMemoryJobStore::Save(const v1::Job& job) {
  absl::MutexLock lock(&mu_);
  jobs_[job.job_id()] = job;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::Job>> InMemoryJobStore::LoadAll() {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Job> jobs;
  for (const auto& [id, job] : jobs_) jobs.push_back(job);
  return jobs;
}

}  // namespace lockstep::coordinator
