// Gloo's rendezvous store over a StoreClient. Gloo expects exceptions from a store, so this is
// the one place where a store's Status becomes a gloo::IoException; the Status itself is kept,
// so the code that formed the group reports it with its code intact (never by reading the
// exception's text).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gloo/rendezvous/store.h"
#include "worker/comm/store_client.h"

namespace lockstep::worker {

// Thread-safe.
class GlooStore final : public gloo::rendezvous::Store {
 public:
  // Waits without a timeout of their own use `timeout`.
  GlooStore(std::shared_ptr<StoreClient> client, absl::Duration timeout);

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  // The first error a call threw (OK if none did).
  absl::Status failure() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  [[noreturn]] void Throw(absl::Status status) ABSL_LOCKS_EXCLUDED(mu_);

  const std::shared_ptr<StoreClient> client_;
  const absl::Duration timeout_;
  mutable absl::Mutex mu_;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lockstep::worker
