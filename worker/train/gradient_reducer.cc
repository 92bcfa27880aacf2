// The reducer thread: a queue and one communicator.
#include "worker/train/gradient_reducer.h"

namespace lockstep::worker {

GradientReducer::GradientReducer(Communicator* comm)
    : comm_(comm), thread_([this] { Loop(); }) {}

GradientReducer::~GradientReducer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void GradientReducer::Enqueue(float* data, size_t count) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.emplace_back(data, count);
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
    auto [data, count] = queue_.front();
    queue_.pop_front();
    const bool skip = !error_.ok();
    lock.unlock();
    absl::Status status = skip ? absl::OkStatus() : comm_->AllreduceSum(data, count);
    lock.lock();
    if (!status.ok() && error_.ok()) error_ = status;
    --in_flight_;
    cv_.notify_all();
  }
}

}  // namespace lockstep::worker
