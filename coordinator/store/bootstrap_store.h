// The bootstrap key-value store through which a generation's members form their groups (Gloo
// addresses, NCCL ids). Keys live in scopes, one per (job, generation); a scope exists only
// while its generation is live: the coordinator opens it when the core starts the generation
// and closes it when the core ends it, so a member of an older generation can neither read
// nor write the keys of a newer one. No gRPC here: the StoreService is a thin shell over it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace lockstep::coordinator {

struct StoreScope {
  std::string job_id;
  int64_t generation = 0;
  bool operator<(const StoreScope& o) const {
    return std::tie(job_id, generation) < std::tie(o.job_id, o.generation);
  }
};

// Thread-safe.
class BootstrapStore {
 public:
  void Open(const StoreScope& scope) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops the scope's keys and ends its waits with ABORTED. Unknown scopes are ignored.
  void Close(const StoreScope& scope) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends every wait with UNAVAILABLE and refuses later calls the same way.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

  // ABORTED when the scope is not open.
  absl::Status Set(const StoreScope& scope, const std::string& key, std::string value)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until every key of `keys` (at least one) exists in the scope; returns the value of
  // the first. DEADLINE_EXCEEDED naming the missing key at `deadline`, ABORTED when the scope
  // is not open or closes meanwhile, CANCELLED as soon as `cancelled` (checked at least every
  // 100 ms) returns true, UNAVAILABLE after Shutdown.
  absl::StatusOr<std::string> Wait(const StoreScope& scope, const std::vector<std::string>& keys,
                                   absl::Time deadline,
                                   const std::function<bool()>& cancelled = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);

  size_t open_scopes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  absl::CondVar changed_;  // signalled on every Set, Close and Shutdown
  std::map<StoreScope, std::map<std::string, std::string>> scopes_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace lockstep::coordinator
