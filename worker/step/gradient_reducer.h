// Runs gradient allreduces on a thread of their own, in submission order, so communication
// of one bucket overlaps the backward computation of the next.
#pragma once

#include <deque>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "worker/comm/communicator.h"

namespace lockstep::worker {

// Enqueue and Wait are called by the training thread only. The communicator must not be used
// by anyone else while buckets are in flight.
class GradientReducer {
 public:
  explicit GradientReducer(Communicator* comm);
  ~GradientReducer();

  // Starts an in-place sum of data[0, count) over all ranks. The memory must stay valid until
  // Wait returns.
  void Enqueue(float* data, size_t count);
  void Enqueue(int64_t* data, size_t count);
  // Starts Communicator::SumStagedInt64(offset, count).
  void EnqueueStaged(size_t offset, size_t count);
  // Blocks until every enqueued bucket is reduced; returns the first error (later buckets are
  // skipped once one fails).
  absl::Status Wait();

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);

  Communicator* const comm_;
  absl::Mutex mu_;
  struct Op {
    float* floats = nullptr;
    int64_t* ints = nullptr;
    size_t count = 0;
    bool staged = false;
    size_t offset = 0;
  };
  void Push(Op op) ABSL_LOCKS_EXCLUDED(mu_);
  std::deque<Op> queue_ ABSL_GUARDED_BY(mu_);
  size_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace lockstep::worker
