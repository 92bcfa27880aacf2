// Threads take a strand off the ready queue, run one of its tasks, and put it back at the end
// of the queue when it has more: strands share the threads fairly, and one busy session cannot
// hold a thread while others wait.
#include "coordinator/service/strand_pool.h"

#include <algorithm>
#include <utility>

namespace lockstep::coordinator {

StrandPool::StrandPool(int threads) {
  for (int i = 0; i < std::max(1, threads); ++i) threads_.emplace_back([this] { Run(); });
}

StrandPool::~StrandPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

std::shared_ptr<StrandPool::Strand> StrandPool::NewStrand() { return std::make_shared<Strand>(); }

void StrandPool::Post(const std::shared_ptr<Strand>& strand, std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  strand->tasks_.push_back(std::move(task));
  if (!strand->scheduled_) {
    strand->scheduled_ = true;
    ready_.push_back(strand);
  }
}

void StrandPool::Run() {
  absl::MutexLock lock(&mu_);
  while (true) {
    mu_.Await(absl::Condition(
        +[](StrandPool* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
          return self->stopping_ || !self->ready_.empty();
        },
        this));
    if (ready_.empty()) return;  // stopping, and every posted task has run
    std::shared_ptr<Strand> strand = std::move(ready_.front());
    ready_.pop_front();
    std::function<void()> task = std::move(strand->tasks_.front());
    strand->tasks_.pop_front();
    mu_.Unlock();
    task();
    task = nullptr;  // whatever it holds goes before the lock is taken again
    mu_.Lock();
    if (strand->tasks_.empty()) {
      strand->scheduled_ = false;
    } else {
      ready_.push_back(std::move(strand));
    }
  }
}

}  // namespace lockstep::coordinator
