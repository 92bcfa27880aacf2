// gloo::rendezvous::Store over the coordinator's StoreService, scoped to one (job, generation).
// Gloo expects exceptions from a store, so failures are thrown as gloo::IoException.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "gloo/rendezvous/store.h"
#include "lockstep/v1/store.grpc.pb.h"

namespace lockstep::worker {

// Thread-safe (each call is its own RPC).
class CoordinatorStore final : public gloo::rendezvous::Store {
 public:
  CoordinatorStore(std::shared_ptr<v1::StoreService::StubInterface> stub, std::string job_id,
                   int64_t generation, std::chrono::milliseconds timeout);

  void set(const std::string& key, const std::vector<char>& data) override;
  // Blocks until the key exists (long-poll on the coordinator, never a client loop).
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  std::shared_ptr<v1::StoreService::StubInterface> stub_;
  const std::string job_id_;
  const int64_t generation_;
  const std::chrono::milliseconds timeout_;
};

}  // namespace lockstep::worker
