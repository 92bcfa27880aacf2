// Bootstrap store: scoped maps under one mutex; waiters indexed by the key they wait for next
// and by their deadline, completed by whichever call decides them.
#include "coordinator/store/bootstrap_store.h"

#include <malloc.h>

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace lockstep::coordinator {
namespace {

std::string Describe(const StoreScope& scope) {
  return absl::StrCat("job ", scope.job_id, " generation ", scope.generation);
}

// A closed scope that held more than this gives its memory back to the system at once: its
// values came from the heap (glibc raises its mmap threshold after freeing a large block), and
// a flood's gigabyte would otherwise stay resident after the job.
constexpr size_t kTrimAfterBytes = size_t{1} << 20;

}  // namespace

ScopeLimits ScopeLimits::ForWorld(int world_size) {
  const size_t n = static_cast<size_t>(std::max(world_size, 1));
  // Beyond the full mesh's addresses (136 bytes per pair; NCCL's id and the heal's few keys are
  // small): 16 MiB and 1,024 keys for the group, 64 KiB and 16 keys per member.
  return {1024 + 16 * n, (size_t{16} << 20) + n * (size_t{64} << 10) + n * n * 256};
}

void BootstrapStore::Open(const StoreScope& scope, ScopeLimits limits) {
  absl::MutexLock lock(&mu_);
  scopes_.try_emplace(scope).first->second.limits = limits;
}

size_t BootstrapStore::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

void BootstrapStore::Run(std::vector<Outcome> outcomes) {
  for (auto& [done, result] : outcomes) done(std::move(result));
}

void BootstrapStore::Completions::Run() {
  BootstrapStore::Run(std::move(outcomes_));
  outcomes_.clear();
  if (trim_) malloc_trim(0);
  trim_ = false;
}

std::optional<absl::StatusOr<std::string>> BootstrapStore::Decide(Waiter& w) {
  if (shutdown_) return absl::UnavailableError("the coordinator is shutting down");
  auto it = scopes_.find(w.scope);
  if (it == scopes_.end()) {
    return absl::AbortedError(absl::StrCat(Describe(w.scope), " ended while waiting for key \"",
                                           w.keys.front(), "\""));
  }
  while (w.missing < w.keys.size() && it->second.keys.count(w.keys[w.missing]) > 0) ++w.missing;
  if (w.missing < w.keys.size()) return std::nullopt;
  return it->second.keys.at(w.keys.front());
}

BootstrapStore::Waiter BootstrapStore::Remove(WaitId id, bool keyed) {
  auto it = waiters_.find(id);
  Waiter w = std::move(it->second);
  waiters_.erase(it);
  auto [first, last] = keyed ? by_key_.equal_range({w.scope, w.keys[w.missing]})
                              : std::make_pair(by_key_.end(), by_key_.end());
  for (auto k = first; k != last; ++k) {
    if (k->second == id) {
      by_key_.erase(k);
      break;
    }
  }
  auto [from, to] = by_deadline_.equal_range(w.deadline);
  for (auto d = from; d != to; ++d) {
    if (d->second == id) {
      by_deadline_.erase(d);
      break;
    }
  }
  return w;
}

BootstrapStore::Completions BootstrapStore::CloseDeferred(const StoreScope& scope) {
  Completions ended;
  size_t freed = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = scopes_.find(scope);
    if (it == scopes_.end()) return ended;
    freed = it->second.bytes;
    bytes_ -= freed;
    scopes_.erase(it);
    EndWaitsOf(scope, &ended);
  }
  ended.trim_ = freed > kTrimAfterBytes;
  return ended;
}

void BootstrapStore::EndWaitsOf(const StoreScope& scope, Completions* ended) {
  // The scope's waiters are together in by_key_, which sorts by scope first.
  std::vector<WaitId> ids;
  for (auto k = by_key_.lower_bound({scope, ""});
       k != by_key_.end() && !(scope < k->first.first); ++k) {
    ids.push_back(k->second);
  }
  for (WaitId id : ids) {
    Waiter w = Remove(id);
    absl::StatusOr<std::string> result = *Decide(w);  // ABORTED: the scope is gone
    ended->outcomes_.emplace_back(std::move(w.done), std::move(result));
  }
}

void BootstrapStore::Shutdown() {
  std::vector<Outcome> outcomes;
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
    while (!waiters_.empty()) {
      Waiter w = Remove(waiters_.begin()->first);
      outcomes.emplace_back(std::move(w.done),
                            absl::UnavailableError("the coordinator is shutting down"));
    }
  }
  Run(std::move(outcomes));
}

size_t BootstrapStore::open_scopes() const {
  absl::MutexLock lock(&mu_);
  return scopes_.size();
}

size_t BootstrapStore::pending_waits() const {
  absl::MutexLock lock(&mu_);
  return waiters_.size();
}

absl::Status BootstrapStore::Set(const StoreScope& scope, const std::string& key,
                                 std::string value) {
  return Update(scope, key, [&](const std::string*) -> absl::StatusOr<std::string> {
    return std::move(value);
  });
}

absl::StatusOr<int64_t> BootstrapStore::Add(const StoreScope& scope, const std::string& key,
                                            int64_t amount) {
  int64_t sum = 0;
  LOCKSTEP_RETURN_IF_ERROR(
      Update(scope, key, [&](const std::string* old) -> absl::StatusOr<std::string> {
        int64_t value = 0;
        if (old != nullptr && !absl::SimpleAtoi(*old, &value)) {
          return absl::InvalidArgumentError(absl::StrCat(
              "key \"", key.substr(0, 64), "\": its value is not an integer; cannot add to it"));
        }
        if (__builtin_add_overflow(value, amount, &sum)) {
          return absl::InvalidArgumentError(
              absl::StrCat("key \"", key.substr(0, 64), "\": ", value, " + ", amount, " overflows"));
        }
        return absl::StrCat(sum);
      }));
  return sum;
}

absl::Status BootstrapStore::Update(
    const StoreScope& scope, const std::string& key,
    const std::function<absl::StatusOr<std::string>(const std::string* old)>& compute) {
  std::vector<Outcome> outcomes;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return absl::UnavailableError("the coordinator is shutting down");
    auto it = scopes_.find(scope);
    if (it == scopes_.end()) {
      return absl::AbortedError(absl::StrCat(Describe(scope), " is not live"));
    }
    Scope& held = it->second;
    const auto old = held.keys.find(key);
    absl::StatusOr<std::string> computed =
        compute(old == held.keys.end() ? nullptr : &old->second);
    if (!computed.ok()) return computed.status();
    std::string value = *std::move(computed);
    const size_t before = old == held.keys.end() ? 0 : key.size() + old->second.size();
    const size_t after = held.bytes - before + key.size() + value.size();
    if (old == held.keys.end() && held.keys.size() >= held.limits.max_keys) {
      return absl::ResourceExhaustedError(
          absl::StrCat(Describe(scope), " holds its limit of ", held.limits.max_keys,
                       " store keys; key \"", key.substr(0, 64), "\" is refused"));
    }
    if (after > held.limits.max_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          Describe(scope), " may hold at most ", held.limits.max_bytes,
          " bytes in the store (", held.bytes, " held); a value of ", value.size(),
          " bytes for key \"", key.substr(0, 64), "\" is refused"));
    }
    bytes_ = bytes_ - held.bytes + after;
    held.bytes = after;
    held.keys[key] = std::move(value);
    // Only the waiters waiting for this key can change; each moves on to its next missing
    // key or is done, so a waiter is looked at once per key it waits for.
    auto [first, last] = by_key_.equal_range({scope, key});
    std::vector<WaitId> woken;
    for (auto k = first; k != last; ++k) woken.push_back(k->second);
    by_key_.erase(first, last);
    for (WaitId id : woken) {
      Waiter& w = waiters_.at(id);
      if (std::optional<absl::StatusOr<std::string>> result = Decide(w)) {
        Waiter done = Remove(id, /*keyed=*/false);  // its key entry went with the range
        outcomes.emplace_back(std::move(done.done), *std::move(result));
      } else {
        by_key_.emplace(std::make_pair(w.scope, w.keys[w.missing]), id);
      }
    }
  }
  Run(std::move(outcomes));
  return absl::OkStatus();
}

BootstrapStore::WaitId BootstrapStore::WaitAsync(const StoreScope& scope,
                                                 std::vector<std::string> keys,
                                                 absl::Time deadline, WaitDone done) {
  if (keys.empty()) {
    done(absl::InvalidArgumentError("keys: at least one key is required"));
    return 0;
  }
  Waiter w{scope, std::move(keys), deadline, std::move(done)};
  std::optional<absl::StatusOr<std::string>> result;
  WaitId id = 0;
  {
    absl::MutexLock lock(&mu_);
    result = Decide(w);
    if (!result.has_value()) {
      id = next_wait_++;
      by_key_.emplace(std::make_pair(w.scope, w.keys[w.missing]), id);
      by_deadline_.emplace(w.deadline, id);
      waiters_.emplace(id, std::move(w));
    }
  }
  if (result.has_value()) w.done(*std::move(result));
  return id;
}

void BootstrapStore::Cancel(WaitId id) {
  WaitDone done;
  {
    absl::MutexLock lock(&mu_);
    if (waiters_.count(id) == 0) return;
    done = Remove(id).done;
  }
  done(absl::CancelledError("the call was cancelled"));
}

void BootstrapStore::Expire(absl::Time now) {
  std::vector<Outcome> outcomes;
  {
    absl::MutexLock lock(&mu_);
    while (!by_deadline_.empty() && by_deadline_.begin()->first <= now) {
      Waiter w = Remove(by_deadline_.begin()->second);
      outcomes.emplace_back(
          std::move(w.done),
          absl::DeadlineExceededError(absl::StrCat("key \"", w.keys[w.missing], "\" of ",
                                                   Describe(w.scope), " was not set in time")));
    }
  }
  Run(std::move(outcomes));
}

absl::StatusOr<std::string> BootstrapStore::Wait(const StoreScope& scope,
                                                 const std::vector<std::string>& keys,
                                                 absl::Time deadline,
                                                 const std::function<bool()>& cancelled) {
  struct Result {
    absl::Notification ended;
    absl::StatusOr<std::string> value;
  };
  auto result = std::make_shared<Result>();
  const WaitId id = WaitAsync(scope, keys, deadline, [result](absl::StatusOr<std::string> v) {
    result->value = std::move(v);
    result->ended.Notify();
  });
  while (!result->ended.WaitForNotificationWithTimeout(absl::Milliseconds(100))) {
    if (cancelled && cancelled()) Cancel(id);
    // Ends every wait past its deadline, other callers' too (their callbacks run here).
    if (absl::Now() >= deadline) Expire(absl::Now());
  }
  return std::move(result->value);
}

}  // namespace lockstep::coordinator
