// Time is injected: cores take `now` as a parameter; shells read it from a Clock.
#pragma once

#include <cstdint>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace lockstep {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() = 0;
};

// Wall clock. Thread-safe.
class RealClock final : public Clock {
 public:
  absl::Time Now() override { return absl::Now(); }
  static RealClock* Get();
};

// Manually advanced clock for tests. Thread-safe.
class FakeClock final : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1'700'000'000)) : now_(start) {}
  absl::Time Now() override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }

 private:
  absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

// The API's times are Unix milliseconds, 0 for "never" (absl::InfinitePast here).
inline int64_t ToUnixMillisOrZero(absl::Time t) {
  return t == absl::InfinitePast() ? 0 : absl::ToUnixMillis(t);
}
inline absl::Time FromUnixMillisOrInfinitePast(int64_t ms) {
  return ms > 0 ? absl::FromUnixMillis(ms) : absl::InfinitePast();
}

}  // namespace lockstep
