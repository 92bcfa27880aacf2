// The coordinator's shell state: the pure Core under one mutex, the live worker sessions, and
// the bootstrap store whose scopes follow the core's generations. The three gRPC services
// (jobs, workers, store) are thin wrappers over this class.
//
// Thread safety: every public method may be called from any thread. Core calls run under mu_;
// their messages are queued on the sessions' outboxes before mu_ is released (so each worker
// receives them in decision order); a push only queues or starts an asynchronous write, so no
// gRPC write ever waits under mu_. The rest of the Decisions is applied after unlocking.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "coordinator/core/core.h"
#include "coordinator/service/client_gate.h"
#include "coordinator/service/metrics.h"
#include "coordinator/store/bootstrap_store.h"
#include "coordinator/store/job_store.h"
#include "coordinator/store/log_store.h"
#include "grpcpp/server_context.h"
#include "lockstep/v1/worker.pb.h"

namespace lockstep::coordinator {

// Outbound side of one worker's Session stream, as the coordinator sees it. The session
// (worker_service.cc) implements it on a completion queue: Push starts a write when none is in
// flight, and never blocks.
class SessionOutbox {
 public:
  virtual ~SessionOutbox() = default;
  // Queues a message for the worker; dropped once the session is closed.
  virtual void Push(v1::CoordinatorMessage message) = 0;
  // Ends the session: queued messages are dropped, and the call finishes (cancelled, if a write
  // is still in flight).
  virtual void Close() = 0;
  // The worker's latest heartbeat, kept here without any lock: the tick hands it to the core
  // (Coordinator::Tick), so heartbeats never wait for the core, and a core busy for a while
  // (a large re-formation) still sees every beat that arrived meanwhile.
  void Beat(absl::Time at) {
    beat_unix_ms_.store(absl::ToUnixMillis(at), std::memory_order_relaxed);
  }
  // InfinitePast before the first.
  absl::Time last_beat() const {
    const int64_t ms = beat_unix_ms_.load(std::memory_order_relaxed);
    return ms == 0 ? absl::InfinitePast() : absl::FromUnixMillis(ms);
  }
  // While a report of the worker waits for the core, the session reads nothing (flow control),
  // so the worker's heartbeats wait too: the tick counts such a worker as heard from now.
  void set_report_pending(bool pending) {
    report_pending_.store(pending, std::memory_order_relaxed);
  }
  bool report_pending() const { return report_pending_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> beat_unix_ms_{0};
  std::atomic<bool> report_pending_{false};
};

class Coordinator {
 public:
  // `token`: the shared token every RPC must carry; empty accepts every caller. With a
  // `worker_token`, workers use that one and `token` is the operators' (ClientGate's roles).
  Coordinator(CoreOptions options, Clock* clock, JobStore* store, std::string token = "",
              std::string worker_token = "");

  // Coordinators on etcd: the term this one leads (Registered.term). Call before serving.
  void set_term(int64_t term) {
    term_ = term;
    gate_.set_term(term);
  }

  // Loads the job store's jobs into the core (Core::RestoreJobs). Call once, before serving.
  // Returns how many jobs will run again.
  absl::StatusOr<int> Restore();

  // Every RPC handler admits its caller here first.
  ClientGate& gate() { return gate_; }

  // Runs fn(core, now, decisions) under the lock and applies the decisions afterwards.
  template <typename Fn>
  auto Call(Fn&& fn)
      -> decltype(fn(std::declval<Core&>(), absl::Time(), std::declval<Decisions*>())) {
    Decisions decisions;
    std::vector<BootstrapStore::Completions> ended_waits;  // of the generations that ended
    auto apply = [&] {
      for (BootstrapStore::Completions& c : ended_waits) c.Run();
      Apply(decisions);
    };
    struct Finally {
      std::function<void()> f;
      ~Finally() { f(); }
    } finally{apply};
    absl::MutexLock lock(&mu_);
    // The lock is released before `finally` runs (declared after it).
    auto result = fn(core_, clock_->Now(), &decisions);
    QueueMessages(decisions, &ended_waits);
    return result;
  }

  // Registers a worker and attaches its outbox in one step, so the Registered reply is queued
  // before any assignment the registration triggers.
  absl::StatusOr<std::string> Register(const v1::RegisterRequest& request,
                                       std::shared_ptr<SessionOutbox> outbox);
  // Detaches the session and tells the core the worker is gone.
  void Disconnect(const std::string& worker_id, const std::string& reason);

  // A program's output lines from `worker_id`, kept when it was a member of that generation
  // (Core::GenerationMember); and the lines of a job (NOT_FOUND for an unknown job).
  absl::Status AppendProgramOutput(const std::string& worker_id, const v1::ProgramOutput& output)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<v1::JobLogs> JobLogs(const v1::GetJobLogsRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Bootstrap store, behind the core's generation fence (Core::Fence) for the worker whose
  // session holds `session_key` (Registered.session_key): PERMISSION_DENIED for a key of no
  // live session, or a worker that is not a member of the job.
  absl::Status StoreSet(const std::string& session_key, const std::string& job_id,
                        int64_t generation, const std::string& key, std::string value);
  absl::StatusOr<int64_t> StoreAdd(const std::string& session_key, const std::string& job_id,
                                   int64_t generation, const std::string& key, int64_t amount);
  // Waits until every key exists, behind the same fence, without holding a thread: `done` gets
  // the value of the first key (or why not, as BootstrapStore::WaitAsync) exactly once,
  // possibly on this thread before the call returns. The tick expires the deadline. Returns the
  // id for CancelStoreWait (0 when the wait ended at once).
  BootstrapStore::WaitId StoreWaitAsync(const std::string& session_key, const std::string& job_id,
                                        int64_t generation, std::vector<std::string> keys,
                                        absl::Duration timeout, BootstrapStore::WaitDone done);
  void CancelStoreWait(BootstrapStore::WaitId id) { store_.Cancel(id); }

  // Events with sequence >= from; blocks up to `timeout` when there are none yet. Sets
  // *finished when the job has ended and every event has been returned.
  absl::StatusOr<std::vector<v1::JobEvent>> WaitEvents(const std::string& job_id, int64_t from,
                                                       absl::Duration timeout, bool* finished);

  // Job-change notifications, so that a watcher (WatchJob) need not hold a thread in
  // WaitEvents: `changed(job_id)` is called once per job that a decision changed (its state, or
  // new events), after mu_ is released, on the thread that decided. It must return at once (queue
  // the work; never wait, never call back into this class). UnwatchJobs returns once no call
  // to `changed` is in progress, and none is made after it.
  using JobWatchId = uint64_t;
  JobWatchId WatchJobs(std::function<void(const std::string& job_id)> changed);
  void UnwatchJobs(JobWatchId id);

  // Hands the sessions' heartbeats to the core, then runs its timers and the store's deadlines.
  void Tick();
  // Wakes the tick loop (WaitForTick) at once: a submitted job is started there.
  void TickSoon();
  // The tick loop's pause: `interval`, or less when TickSoon was called.
  void WaitForTick(absl::Duration interval);
  // A session's heartbeat: recorded on its outbox, no lock taken.
  void Heartbeat(SessionOutbox& outbox) { outbox.Beat(clock_->Now()); }
  // The registry's workers and the clients turned away (ListWorkers).
  v1::ListWorkersResponse Workers();
  // Counts every job snapshot the coordinator saves from now on (call before serving).
  void set_metrics(CoordinatorMetrics* metrics) { metrics_ = metrics; }
  // Jobs and workers by state, rejected clients: read when Prometheus scrapes.
  ClusterCounts Counts();
  // Closes every session and wakes every waiter; later calls still work but nothing blocks.
  void Shutdown();

 private:
  // Opens and closes the store scopes of the generations that started and ended, then queues
  // the decisions' messages on the sessions' outboxes. Runs under mu_ so that messages to one
  // worker keep the order in which the core decided them, whichever threads decided, and a
  // scope is open before any member can read its assignment.
  // The messages are moved out of `decisions`. The store waits that the closes end are left in
  // `ended_waits`, for after mu_ is released.
  void QueueMessages(Decisions& decisions, std::vector<BootstrapStore::Completions>* ended_waits)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Everything else (closing sessions, saving jobs), after mu_ is released.
  void Apply(const Decisions& decisions) ABSL_LOCKS_EXCLUDED(mu_);
  // The fence for a store call: the session's worker must be a member of (job, generation).
  absl::Status StoreFence(const std::string& session_key, const std::string& job_id,
                          int64_t generation) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Clock* const clock_;
  int64_t term_ = 0;  // set before serving, then only read
  JobStore* const job_store_;
  absl::Mutex tick_mu_;
  bool tick_requested_ ABSL_GUARDED_BY(tick_mu_) = false;
  ClientGate gate_;
  absl::Mutex mu_;
  absl::CondVar changed_;  // signalled on every store write and job change
  Core core_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<SessionOutbox>> sessions_ ABSL_GUARDED_BY(mu_);
  // Session key -> worker id, for the live sessions.
  std::map<std::string, std::string> session_keys_ ABSL_GUARDED_BY(mu_);
  BootstrapStore store_;  // has its own lock; taken after mu_, never before
  LogStore logs_;         // likewise
  uint64_t snapshot_version_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Mutex save_mu_ ABSL_ACQUIRED_AFTER(mu_);
  // Per job, the version of the snapshot saved last.
  std::map<std::string, uint64_t> saved_versions_ ABSL_GUARDED_BY(save_mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  CoordinatorMetrics* metrics_ = nullptr;
  // WatchJobs' callbacks, called under a reader lock (never with mu_ held).
  absl::Mutex watch_mu_;
  std::map<JobWatchId, std::function<void(const std::string&)>> job_watchers_
      ABSL_GUARDED_BY(watch_mu_);
  JobWatchId next_watch_id_ ABSL_GUARDED_BY(watch_mu_) = 1;
};

}  // namespace lockstep::coordinator
