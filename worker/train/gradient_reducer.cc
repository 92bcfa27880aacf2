// The reducer thread: a queue and one communicator.
#include "worker/train/gradient_reducer.h"

namespace lockstep::worker {

GradientReducer::GradientReducer(Communicator* comm) : comm_(comm), thread_([this] { Loop(); }) {}

GradientReducer::~GradientReducer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void GradientReducer::Enqueue(float* data, size_t count) { Push({data, nullptr, count}); }
void GradientReducer::Enqueue(int64_t* data, size_t count) { Push({nullptr, data, count}); }
void GradientReducer::EnqueueStaged(size_t offset, size_t count) {
  Push({nullptr, nullptr, count, /*staged=*/true, offset});
}

void GradientReducer::Push(Op op) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(op);
    ++in_flight_;
  }
  cv_.notify_all();
}

absl::Status GradientReducer::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return in_flight_ == 0; });
  return error_;
}

void GradientReducer::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and drained
    const Op op = queue_.front();
    queue_.pop_front();
    const bool skip = !error_.ok();
    lock.unlock();
    absl::Status status = skip                   ? absl::OkStatus()
                          : op.staged            ? comm_->SumStagedInt64(op.offset, op.count)
                          : op.floats != nullptr ? comm_->AllreduceSum(op.floats, op.count)
                                                 : comm_->AllreduceSum(op.ints, op.count);
    lock.lock();
    if (!status.ok() && error_.ok()) error_ = status;
    --in_flight_;
    cv_.notify_all();
  }
}

}  // namespace lockstep::worker
