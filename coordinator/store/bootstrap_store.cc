// Bootstrap store: scoped maps under one mutex, waits on one condition variable.
#include "coordinator/store/bootstrap_store.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace lockstep::coordinator {
namespace {

std::string Describe(const StoreScope& scope) {
  return absl::StrCat("job ", scope.job_id, " generation ", scope.generation);
}

}  // namespace

void BootstrapStore::Open(const StoreScope& scope) {
  absl::MutexLock lock(&mu_);
  scopes_.try_emplace(scope);
}

void BootstrapStore::Close(const StoreScope& scope) {
  absl::MutexLock lock(&mu_);
  if (scopes_.erase(scope) > 0) changed_.SignalAll();
}

void BootstrapStore::Shutdown() {
  absl::MutexLock lock(&mu_);
  shutdown_ = true;
  changed_.SignalAll();
}

size_t BootstrapStore::open_scopes() const {
  absl::MutexLock lock(&mu_);
  return scopes_.size();
}

absl::Status BootstrapStore::Set(const StoreScope& scope, const std::string& key,
                                 std::string value) {
  absl::MutexLock lock(&mu_);
  if (shutdown_) return absl::UnavailableError("the coordinator is shutting down");
  auto it = scopes_.find(scope);
  if (it == scopes_.end()) {
    return absl::AbortedError(absl::StrCat(Describe(scope), " is not live"));
  }
  it->second[key] = std::move(value);
  changed_.SignalAll();
  return absl::OkStatus();
}

absl::StatusOr<std::string> BootstrapStore::Wait(const StoreScope& scope,
                                                 const std::vector<std::string>& keys,
                                                 absl::Time deadline,
                                                 const std::function<bool()>& cancelled) {
  if (keys.empty()) return absl::InvalidArgumentError("keys: at least one key is required");
  absl::MutexLock lock(&mu_);
  while (true) {
    if (shutdown_) return absl::UnavailableError("the coordinator is shutting down");
    auto it = scopes_.find(scope);
    if (it == scopes_.end()) {
      return absl::AbortedError(absl::StrCat(Describe(scope), " ended while waiting for key \"",
                                             keys.front(), "\""));
    }
    const std::string* missing = nullptr;
    for (const std::string& k : keys) {
      if (it->second.count(k) == 0) {
        missing = &k;
        break;
      }
    }
    if (missing == nullptr) return it->second.at(keys.front());
    if (cancelled && cancelled()) return absl::CancelledError("the call was cancelled");
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("key \"", *missing, "\" of ",
                                                      Describe(scope), " was not set in time"));
    }
    changed_.WaitWithDeadline(&mu_, std::min(deadline, now + absl::Milliseconds(100)));
  }
}

}  // namespace lockstep::coordinator
