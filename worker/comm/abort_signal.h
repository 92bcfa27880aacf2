// One generation's abort. The agent raises it (the coordinator aborted the generation, a newer
// assignment superseded it, the session ended); everything that blocks on the generation's
// peers watches it, so that an abort releases the worker at once whatever the transport: store
// calls are cancelled, Gloo waits abandoned, shared-memory futex waits woken, NCCL aborted.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace lockstep::worker {

// Thread-safe. Shared (std::shared_ptr) by whatever may outlive the generation's thread: an
// abandoned Gloo operation's thread still holds the store client that watches this signal.
class AbortSignal {
 public:
  AbortSignal() = default;
  AbortSignal(const AbortSignal&) = delete;
  AbortSignal& operator=(const AbortSignal&) = delete;

  // Idempotent. Runs every subscribed callback (on this thread) before returning.
  void Raise() ABSL_LOCKS_EXCLUDED(mu_);
  bool raised() const { return raised_.load(std::memory_order_acquire); }
  // For code that polls a flag (the training loop between steps, NCCL's init poll).
  const std::atomic<bool>& flag() const { return raised_; }
  // Raise, saying that the job itself is over, not only this generation: work that the job's
  // next generation would have reused (loading its data) may stop too.
  void RaiseJobEnded() ABSL_LOCKS_EXCLUDED(mu_);
  const std::atomic<bool>& job_ended() const { return job_ended_; }

  // While the returned subscription lives, `fn` runs once when the signal is raised (at once,
  // on this thread, if it already is). `fn` must be quick and must not subscribe or raise.
  // Destroying the subscription waits for a running `fn` to return, so `fn` may reference
  // objects that die right after the subscription.
  class Subscription {
   public:
    Subscription() = default;
    Subscription(Subscription&& other) noexcept { *this = std::move(other); }
    Subscription& operator=(Subscription&& other) noexcept;
    ~Subscription() { Reset(); }
    void Reset();

   private:
    friend class AbortSignal;
    Subscription(AbortSignal* signal, uint64_t id) : signal_(signal), id_(id) {}
    AbortSignal* signal_ = nullptr;
    uint64_t id_ = 0;
  };
  [[nodiscard]] Subscription OnRaise(std::function<void()> fn) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Unsubscribe(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);

  std::atomic<bool> raised_{false};
  std::atomic<bool> job_ended_{false};
  absl::Mutex mu_;  // held while callbacks run, so Unsubscribe waits for a running one
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, std::function<void()>> callbacks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lockstep::worker
