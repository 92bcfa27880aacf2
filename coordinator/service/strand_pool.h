// A fixed pool of threads for work that must not run on gRPC's callback threads (it takes the
// coordinator's lock), kept in order per strand: the tasks posted to one strand run one at a
// time, in the order posted, on whichever pool thread is free. The worker sessions use one
// strand each, so a session's reports reach the core in the order the worker sent them.
//
// Thread safety: Post and NewStrand may be called from any thread, including from a task.
// The destructor runs every task posted before it, and every task those post, then joins the
// threads; other threads must stop posting before it starts. Tasks must not throw.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace lockstep::coordinator {

class StrandPool {
 public:
  class Strand;

  // At least one thread.
  explicit StrandPool(int threads);
  ~StrandPool();
  StrandPool(const StrandPool&) = delete;
  StrandPool& operator=(const StrandPool&) = delete;

  std::shared_ptr<Strand> NewStrand();
  void Post(const std::shared_ptr<Strand>& strand, std::function<void()> task)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run() ABSL_LOCKS_EXCLUDED(mu_);

  absl::Mutex mu_;
  // Strands with tasks and no thread on them yet, oldest first. A strand is here at most once,
  // and never while one of its tasks runs (Strand::scheduled).
  std::deque<std::shared_ptr<Strand>> ready_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

class StrandPool::Strand {
 private:
  friend class StrandPool;
  // Both guarded by the pool's mu_.
  std::deque<std::function<void()>> tasks_;
  bool scheduled_ = false;  // in ready_ or running on a thread
};

}  // namespace lockstep::coordinator
