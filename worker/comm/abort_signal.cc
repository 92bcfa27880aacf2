// AbortSignal: an atomic flag plus callbacks run under the signal's mutex.
#include "worker/comm/abort_signal.h"

namespace lockstep::worker {

void AbortSignal::Raise() {
  absl::MutexLock lock(&mu_);
  if (raised_.exchange(true, std::memory_order_acq_rel)) return;
  for (auto& [id, fn] : callbacks_) fn();
  callbacks_.clear();
}

void AbortSignal::RaiseJobEnded() {
  job_ended_.store(true, std::memory_order_release);
  Raise();
}

AbortSignal::Subscription AbortSignal::OnRaise(std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  if (raised_.load(std::memory_order_acquire)) {
    fn();
    return Subscription();
  }
  const uint64_t id = next_id_++;
  callbacks_.emplace(id, std::move(fn));
  return Subscription(this, id);
}

void AbortSignal::Unsubscribe(uint64_t id) {
  absl::MutexLock lock(&mu_);
  callbacks_.erase(id);
}

AbortSignal::Subscription& AbortSignal::Subscription::operator=(Subscription&& other) noexcept {
  if (this != &other) {
    Reset();
    signal_ = other.signal_;
    id_ = other.id_;
    other.signal_ = nullptr;
  }
  return *this;
}

void AbortSignal::Subscription::Reset() {
  if (signal_ != nullptr) signal_->Unsubscribe(id_);
  signal_ = nullptr;
}

}  // namespace lockstep::worker
