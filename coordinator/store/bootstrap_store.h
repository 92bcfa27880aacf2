// The bootstrap key-value store through which a generation's members form their groups (Gloo
// addresses, NCCL ids). Keys live in scopes, one per (job, generation); a scope exists only
// while its generation is live: the coordinator opens it when the core starts the generation
// and closes it when the core ends it, so a member of an older generation can neither read
// nor write the keys of a newer one. No gRPC here: the StoreService is a thin shell over it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace lockstep::coordinator {

struct StoreScope {
  std::string job_id;
  int64_t generation = 0;
  bool operator<(const StoreScope& o) const {
    return std::tie(job_id, generation) < std::tie(o.job_id, o.generation);
  }
};

// What one scope may hold: a member can spend the coordinator's memory only up to this, and
// the rest of its writes are refused with RESOURCE_EXHAUSTED naming the limit. Scaled by the
// generation's size: Gloo's full-mesh rendezvous stores, for each rank, one address per peer
// (about 136 bytes each), so a group of N needs about 136 N^2 bytes and N keys.
struct ScopeLimits {
  size_t max_keys = 0;
  size_t max_bytes = 0;  // keys and values
  static ScopeLimits ForWorld(int world_size);
};

// Thread-safe. Waits do not block a thread: WaitAsync registers a waiter that the call which
// decides it (a Set, Close, Shutdown, Cancel or Expire) completes, so a generation of 10,000
// members waiting for their peers' keys holds no thread.
class BootstrapStore {
 public:
  // How a wait ends: the value of its first key, or why not.
  using WaitDone = std::function<void(absl::StatusOr<std::string>)>;
  using WaitId = uint64_t;

  // Ended waits whose callbacks have not run yet: Run them once no lock of the caller's is
  // held (a generation's close may end thousands of waits).
  // Also returns the memory of a large closed scope to the system (malloc_trim, which walks
  // the heap: never under a caller's lock).
  class Completions {
   public:
    void Run();
    bool empty() const { return outcomes_.empty() && !trim_; }
   private:
    friend class BootstrapStore;
    std::vector<std::pair<WaitDone, absl::StatusOr<std::string>>> outcomes_;
    bool trim_ = false;
  };

  void Open(const StoreScope& scope, ScopeLimits limits = ScopeLimits::ForWorld(1))
      ABSL_LOCKS_EXCLUDED(mu_);
  // Drops the scope's keys and ends its waits with ABORTED. Unknown scopes are ignored. The
  // memory goes back to the system at once when the scope held much.
  void Close(const StoreScope& scope) ABSL_LOCKS_EXCLUDED(mu_) { CloseDeferred(scope).Run(); }
  // Close, but the ended waits' callbacks are the caller's to run.
  [[nodiscard]] Completions CloseDeferred(const StoreScope& scope) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends every wait with UNAVAILABLE and refuses later calls the same way.
  void Shutdown() ABSL_LOCKS_EXCLUDED(mu_);

  // ABORTED when the scope is not open; RESOURCE_EXHAUSTED, naming the limit, when the write
  // would take the scope past its ScopeLimits (the scope is unchanged).
  absl::Status Set(const StoreScope& scope, const std::string& key, std::string value)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Adds `amount` to the key's value, a decimal integer (missing: 0), and returns the sum, now
  // the value. INVALID_ARGUMENT naming the key when its value is not an integer or the sum
  // overflows; otherwise as Set.
  absl::StatusOr<int64_t> Add(const StoreScope& scope, const std::string& key, int64_t amount)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Waits until every key of `keys` (at least one) exists in the scope, then `done` gets the
  // value of the first. Otherwise `done` gets DEADLINE_EXCEEDED naming a missing key once
  // Expire sees `deadline` pass (nothing else watches the clock), ABORTED when the scope is
  // not open or closes meanwhile, CANCELLED from Cancel, UNAVAILABLE after Shutdown.
  // `done` runs exactly once and never under the store's lock: on this thread when the wait
  // is decided at once, otherwise on the thread of the call that decides it.
  WaitId WaitAsync(const StoreScope& scope, std::vector<std::string> keys, absl::Time deadline,
                   WaitDone done) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends a wait with CANCELLED, unless it has ended already.
  void Cancel(WaitId id) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the waits whose deadline is at or before `now`.
  void Expire(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);

  // WaitAsync for a caller that blocks until the end: expires its own deadline, and ends with
  // CANCELLED as soon as `cancelled` (checked at least every 100 ms) returns true.
  absl::StatusOr<std::string> Wait(const StoreScope& scope, const std::vector<std::string>& keys,
                                   absl::Time deadline,
                                   const std::function<bool()>& cancelled = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);

  size_t open_scopes() const ABSL_LOCKS_EXCLUDED(mu_);
  // Bytes of keys and values held in all scopes.
  size_t bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t pending_waits() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Set's and Add's write: the key's new value from its old one (null: missing).
  absl::Status Update(
      const StoreScope& scope, const std::string& key,
      const std::function<absl::StatusOr<std::string>(const std::string* old)>& value)
      ABSL_LOCKS_EXCLUDED(mu_);
  struct Waiter {
    StoreScope scope;
    std::vector<std::string> keys;
    absl::Time deadline;
    WaitDone done;
    size_t missing = 0;  // keys before this one exist; the waiter is indexed under this one
  };
  using Outcome = std::pair<WaitDone, absl::StatusOr<std::string>>;

  // The outcome if the waiter can be decided now (advancing `missing` past the keys present).
  std::optional<absl::StatusOr<std::string>> Decide(Waiter& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unindexes the waiter and returns it; `keyed`: it is still under its key in by_key_.
  Waiter Remove(WaitId id, bool keyed = true) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void Run(std::vector<Outcome> outcomes);
  // Ends the scope's waits (ABORTED: it is gone), into `ended`.
  void EndWaitsOf(const StoreScope& scope, Completions* ended) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  struct Scope {
    std::map<std::string, std::string> keys;
    size_t bytes = 0;  // of keys and values
    ScopeLimits limits;
  };

  mutable absl::Mutex mu_;
  std::map<StoreScope, Scope> scopes_ ABSL_GUARDED_BY(mu_);
  size_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  WaitId next_wait_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<WaitId, Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  // Each waiter under the key it waits for next, and under its deadline.
  std::multimap<std::pair<StoreScope, std::string>, WaitId> by_key_ ABSL_GUARDED_BY(mu_);
  std::multimap<absl::Time, WaitId> by_deadline_ ABSL_GUARDED_BY(mu_);
};

}  // namespace lockstep::coordinator
