// The coordinators' state in etcd (--state_backend=etcd), under one prefix:
//   PREFIX/leader       the leading coordinator's address, on its lease (leadership.h)
//   PREFIX/cluster_id   six hex digits, the suffix of every job id
//   PREFIX/jobs/JOB_ID  the Job in protobuf's binary form
// Every job write is one transaction fenced on the writer's leadership: a coordinator that no
// longer leads cannot write, and is told so (Leadership::Refused).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/store/etcd_client.h"
#include "coordinator/store/job_store.h"
#include "coordinator/store/leadership.h"

namespace lockstep::coordinator {

// Thread-safe.
class EtcdJobStore final : public JobStore {
 public:
  EtcdJobStore(EtcdClient* etcd, std::string prefix, Leadership* leadership)
      : etcd_(etcd), prefix_(std::move(prefix)), leadership_(leadership) {}

  // One fenced transaction. FAILED_PRECONDITION when this coordinator no longer leads, and
  // UNAVAILABLE when etcd cannot be reached, RESOURCE_EXHAUSTED when its quota is full: these
  // give the leadership up (the leadership is told). Other refusals (a request too large)
  // carry etcd's words.
  absl::Status Save(const v1::Job& job) override;
  // Every job under the prefix, read in pages. A value that does not parse is skipped with a
  // logged reason (it is left in place).
  absl::StatusOr<std::vector<v1::Job>> LoadAll() override;

 private:
  EtcdClient* const etcd_;
  const std::string prefix_;
  Leadership* const leadership_;
};

// The cluster's id kept at PREFIX/cluster_id, created at random by the first coordinator (one
// transaction: two starting at once agree). A prefix that holds keys but no cluster id is some
// other program's: refused, naming one of its keys.
absl::StatusOr<std::string> EtcdClusterId(EtcdClient* etcd, const std::string& prefix);

}  // namespace lockstep::coordinator
