// Communicator over Gloo's TCP transport, formed through a rendezvous store.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/comm/communicator.h"

namespace gloo {
class Context;
namespace rendezvous {
class Store;
}
}  // namespace gloo

namespace lockstep::worker {

class GlooCommunicator final : public Communicator {
 public:
  // Connects `size` ranks through `store` (which must be scoped to one generation: Gloo never
  // deletes keys). `hostname` is the address peers reach this rank on. UNAVAILABLE or
  // DEADLINE_EXCEEDED when the peers do not all show up within `timeout`.
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(
      int rank, int size, gloo::rendezvous::Store& store, const std::string& hostname,
      std::chrono::milliseconds timeout);
  ~GlooCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status AllreduceSum(float* data, size_t count) override;
  absl::Status AllreduceSum(double* data, size_t count) override;
  absl::Status AllreduceSum(int64_t* data, size_t count) override;
  absl::Status Broadcast(void* data, size_t bytes, int root) override;
  absl::Status Barrier() override;

 private:
  GlooCommunicator(int rank, int size, std::shared_ptr<gloo::Context> context,
                   std::chrono::milliseconds timeout);
  template <typename T>
  absl::Status Allreduce(T* data, size_t count);

  const int rank_;
  const int size_;
  std::shared_ptr<gloo::Context> context_;
  const std::chrono::milliseconds timeout_;
};

}  // namespace lockstep::worker
