// The bootstrap store as the members of one generation see it: keys scoped by (job,
// generation) on the coordinator, through which groups form (Gloo addresses, NCCL ids). Calls
// return absl::Status with the coordinator's codes intact; gloo_store.h adapts this to Gloo's
// exception-throwing interface at Gloo's boundary only.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "lockstep/v1/store.grpc.pb.h"
#include "worker/comm/abort_signal.h"

namespace lockstep::worker {

// Thread-safe. Errors: ABORTED when the generation is over (the coordinator fenced it, or the
// session or membership it was asked under is no longer live) or this client's abort signal was
// raised; DEADLINE_EXCEEDED naming the key when a wait ran out; UNAVAILABLE when the
// coordinator cannot be reached or the generation's scope is full; INVALID_ARGUMENT for a bad
// key or value.
class StoreClient {
 public:
  virtual ~StoreClient() = default;
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Blocks until `key` exists (a long poll on the coordinator, never a client-side loop), up to
  // `timeout`; returns its value.
  virtual absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) = 0;
  // Blocks until every key exists, up to `timeout`.
  virtual absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) = 0;
  // Adds `amount` to the key's decimal value (missing: 0) and returns the sum.
  virtual absl::StatusOr<int64_t> Add(const std::string& key, int64_t amount) = 0;
};

// Over the coordinator's StoreService, as the session whose key is `session_key` (the store
// serves a generation only to its members' sessions). A raised `abort` cancels a call in
// flight at once.
class CoordinatorStoreClient final : public StoreClient {
 public:
  CoordinatorStoreClient(std::shared_ptr<v1::StoreService::StubInterface> stub,
                         std::string session_key, std::string job_id, int64_t generation,
                         std::shared_ptr<AbortSignal> abort);
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override;
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(const std::string& key, int64_t amount) override;

 private:
  // Runs `call` with a context that `abort_` cancels; turns the result into a Status whose
  // message names the operation and the scope.
  template <typename Call>
  absl::Status Run(const char* op, const std::string& key, absl::Duration timeout, Call&& call);

  const std::shared_ptr<v1::StoreService::StubInterface> stub_;
  const std::string session_key_;
  const std::string job_id_;
  const int64_t generation_;
  const std::shared_ptr<AbortSignal> abort_;
};

}  // namespace lockstep::worker
