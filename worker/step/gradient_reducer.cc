// The reducer thread: a queue and one communicator.
#include "worker/step/gradient_reducer.h"

namespace lockstep::worker {

GradientReducer::GradientReducer(Communicator* comm) : comm_(comm), thread_([this] { Loop(); }) {}

GradientReducer::~GradientReducer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void GradientReducer::Enqueue(float* data, size_t count) { Push({data, nullptr, count}); }
void GradientReducer::Enqueue(int64_t* data, size_t count) { Push({nullptr, data, count}); }
void GradientReducer::EnqueueStaged(size_t offset, size_t count) {
  Push({nullptr, nullptr, count, /*staged=*/true, offset});
}

void GradientReducer::Push(Op op) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(op);
  ++in_flight_;
}

absl::Status GradientReducer::Wait() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](GradientReducer* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu_) { return r->in_flight_ == 0; },
      this));
  return error_;
}

void GradientReducer::Loop() {
  while (true) {
    Op op;
    bool skip = false;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](GradientReducer* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu_) {
            return r->stop_ || !r->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stop_ and drained
      op = queue_.front();
      queue_.pop_front();
      skip = !error_.ok();
    }
    absl::Status status = skip                   ? absl::OkStatus()
                          : op.staged            ? comm_->SumStagedInt64(op.offset, op.count)
                          : op.floats != nullptr ? comm_->AllreduceSum(op.floats, op.count)
                                                 : comm_->AllreduceSum(op.ints, op.count);
    absl::MutexLock lock(&mu_);
    if (!status.ok() && error_.ok()) error_ = status;
    --in_flight_;
  }
}

}  // namespace lockstep::worker
