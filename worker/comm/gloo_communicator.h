// Communicator over Gloo's TCP transport, formed through the bootstrap store.
//
// Gloo cannot be interrupted: a collective (or the connect that forms the group) blocked on a
// dead or frozen peer returns only at its own timeout, and closing its connections from another
// thread does not wake it. So each communicator runs every Gloo call on a thread of its own,
// and a caller waits for that thread OR the generation's abort signal: on abort the caller
// returns ABORTED at once, and the thread is abandoned with everything its call uses (context,
// device, store client, and a private copy of the caller's buffer) until Gloo gives up. The
// caller's memory is copied in before a call and out after it, so an abandoned call never
// writes into memory the worker uses again (a frozen peer that wakes up later may still send).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/comm/abort_signal.h"
#include "worker/comm/communicator.h"
#include "worker/comm/store_client.h"

namespace gloo {
class Context;
}  // namespace gloo

namespace lockstep::worker {

// Calls from one thread at a time (Communicator's contract); Abort() from any thread.
class GlooCommunicator final : public Communicator {
 public:
  // Connects `size` ranks through `store` (scoped to one generation: Gloo never deletes keys).
  // `hostname` is the address peers reach this rank on; `timeout` bounds the connect and every
  // collective. Errors: the store's status with its code (ABORTED when the generation ended,
  // DEADLINE_EXCEEDED when a peer never showed up, UNAVAILABLE), UNAVAILABLE when a connect
  // failed, ABORTED at once when `abort` (may be null) is raised.
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(
      int rank, int size, std::shared_ptr<StoreClient> store, const std::string& hostname,
      std::chrono::milliseconds timeout, std::shared_ptr<AbortSignal> abort = nullptr);
  ~GlooCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status AllreduceSum(float* data, size_t count) override;
  absl::Status AllreduceSum(double* data, size_t count) override;
  absl::Status AllreduceSum(int64_t* data, size_t count) override;
  absl::Status Broadcast(void* data, size_t bytes, int root) override;
  absl::Status Barrier() override;
  // Makes the call in progress, and every later one, return ABORTED at once.
  void Abort() override;

  // Threads of abandoned calls that have not finished yet, in this process.
  static int AbandonedThreads();

 private:
  struct Thread;
  GlooCommunicator(int rank, int size, std::chrono::milliseconds timeout,
                   std::shared_ptr<AbortSignal> abort);
  // Runs `op` on the communicator's thread and waits for it or an abort.
  absl::Status Run(const char* what, std::function<absl::Status()> op);
  template <typename T>
  absl::Status Allreduce(T* data, size_t count);
  // The private copy of the caller's memory a call works on, at least `bytes` large.
  std::shared_ptr<std::vector<uint8_t>> Buffer(size_t bytes);

  const int rank_;
  const int size_;
  const std::chrono::milliseconds timeout_;
  std::shared_ptr<Thread> thread_;
  std::shared_ptr<gloo::Context> context_;  // used on thread_ only
  std::shared_ptr<std::vector<uint8_t>> buffer_;
  // Keeps the signal alive for the subscription's lifetime.
  std::shared_ptr<AbortSignal> abort_;
  AbortSignal::Subscription on_abort_;
};

}  // namespace lockstep::worker
