// The bootstrap store in-process, for unit tests of groups formed by threads: a StoreClient
// over the coordinator's own BootstrapStore (the same scoping and fencing), without gRPC.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "coordinator/store/bootstrap_store.h"
#include "worker/comm/abort_signal.h"
#include "worker/comm/store_client.h"

namespace lockstep::testing {

class LocalStoreClient final : public worker::StoreClient {
 public:
  // The scope must be open in `store` (store->Open(scope)) for calls to succeed.
  LocalStoreClient(coordinator::BootstrapStore* store, coordinator::StoreScope scope,
                   std::shared_ptr<worker::AbortSignal> abort = nullptr)
      : store_(store), scope_(std::move(scope)), abort_(std::move(abort)) {}

  absl::Status Set(const std::string& key, const std::string& value) override {
    if (abort_ != nullptr && abort_->raised()) return absl::AbortedError("aborted");
    return store_->Set(scope_, key, value);
  }
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    return Wait1({key}, timeout);
  }
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override {
    return Wait1(keys, timeout).status();
  }
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t amount) override {
    if (abort_ != nullptr && abort_->raised()) return absl::AbortedError("aborted");
    return store_->Add(scope_, key, amount);
  }

 private:
  absl::StatusOr<std::string> Wait1(const std::vector<std::string>& keys, absl::Duration timeout) {
    absl::StatusOr<std::string> value =
        store_->Wait(scope_, keys, absl::Now() + timeout,
                     [this] { return abort_ != nullptr && abort_->raised(); });
    if (absl::IsCancelled(value.status())) return absl::AbortedError("aborted");
    return value;
  }

  coordinator::BootstrapStore* const store_;
  const coordinator::StoreScope scope_;
  const std::shared_ptr<worker::AbortSignal> abort_;
};

}  // namespace lockstep::testing
