// Shell state of the coordinator: applies the core's decisions outside the lock.
#include "coordinator/service/coordinator.h"

#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/auth.h"
#include "common/status_macros.h"
#include "common/test_hooks.h"
#include "glog/logging.h"

namespace lockstep::coordinator {
namespace {

// How often workers send heartbeats (told to each at registration); the core declares one lost
// after its heartbeat timeout of silence.
constexpr int64_t kHeartbeatIntervalMs = 500;

}  // namespace

Coordinator::Coordinator(CoreOptions options, Clock* clock, JobStore* store, std::string token,
                         std::string worker_token)
    : clock_(clock),
      job_store_(store),
      gate_(std::move(token), clock, std::move(worker_token)),
      core_(options) {}

absl::StatusOr<int> Coordinator::Restore() {
  absl::StatusOr<std::vector<v1::Job>> jobs = job_store_->LoadAll();
  if (!jobs.ok()) return jobs.status();
  return Call([&](Core& core, absl::Time now, Decisions* d) {
    return core.RestoreJobs(*std::move(jobs), now, d);
  });
}

absl::StatusOr<std::string> Coordinator::Register(const v1::RegisterRequest& request,
                                                  std::shared_ptr<SessionOutbox> outbox) {
  return Call([&](Core& core, absl::Time now, Decisions* d) -> absl::StatusOr<std::string> {
    mu_.AssertHeld();
    if (shutdown_) return absl::UnavailableError("coordinator is shutting down");
    // Attach first so that an assignment produced by this registration finds the session.
    absl::StatusOr<std::string> id = core.RegisterWorker(request, now, d);
    if (!id.ok()) return id;
    v1::CoordinatorMessage registered;
    registered.mutable_registered()->set_worker_id(*id);
    registered.mutable_registered()->set_heartbeat_interval_ms(kHeartbeatIntervalMs);
    const std::string key = RandomSecret();
    registered.mutable_registered()->set_session_key(key);
    registered.mutable_registered()->set_term(term_);
    session_keys_[key] = *id;
    outbox->Push(std::move(registered));
    sessions_[*id] = std::move(outbox);
    LOG(INFO) << "worker " << request.name() << " registered as " << *id << " (host "
              << request.host() << ", device " << request.device() << ")";
    return id;
  });
}

void Coordinator::Disconnect(const std::string& worker_id, const std::string& reason) {
  Call([&](Core& core, absl::Time now, Decisions* d) {
    mu_.AssertHeld();
    sessions_.erase(worker_id);
    for (auto it = session_keys_.begin(); it != session_keys_.end();) {
      it = it->second == worker_id ? session_keys_.erase(it) : std::next(it);
    }
    core.WorkerDisconnected(worker_id, reason, now, d);
    return 0;
  });
}

void Coordinator::QueueMessages(Decisions& decisions,
                                std::vector<BootstrapStore::Completions>* ended_waits) {
  // Opened first: one decision may start a generation and end it again (a second loss while
  // re-forming), and its scope must not stay open.
  for (const Decisions::StartedGeneration& g : decisions.started_generations) {
    store_.Open({g.job_id, g.generation}, ScopeLimits::ForWorld(g.world_size));
  }
  for (const auto& [job, generation] : decisions.ended_generations) {
    ended_waits->push_back(store_.CloseDeferred({job, generation}));
  }
  // An abort and the assignment that replaces it travel as one message (half the writes of a
  // re-formation).
  FoldAbortsIntoAssignments(decisions.messages);
  // A program job's generation: one secret for its members' checkpoint copies to each other
  // (random, so outside the pure core; it travels only on the members' sessions).
  std::map<std::pair<std::string, int64_t>, std::string> secrets;
  for (auto& m : decisions.messages) {
    if (!m.message.has_assignment()) continue;
    v1::Assignment* a = m.message.mutable_assignment();
    if (!a->spec().has_program() || a->world_size() < 2) continue;
    std::string& secret = secrets[{a->job_id(), a->generation()}];
    if (secret.empty()) secret = RandomSecret();
    a->set_checkpoint_secret(secret);
  }
  for (auto& m : decisions.messages) {
    auto it = sessions_.find(m.worker_id);
    if (it != sessions_.end()) it->second->Push(std::move(m.message));
  }
  decisions.messages.clear();
}

void Coordinator::Apply(const Decisions& decisions) {
  if (decisions.close_sessions.empty() && decisions.changed_jobs.empty() &&
      decisions.ended_generations.empty() && decisions.ends_to_record.empty()) {
    return;  // a read, or a report that changed nothing durable: no second lock
  }
  std::vector<std::shared_ptr<SessionOutbox>> closes;
  std::vector<std::pair<uint64_t, v1::Job>> changed;  // (snapshot version, job)
  {
    absl::MutexLock lock(&mu_);
    for (const std::string& id : decisions.close_sessions) {
      auto it = sessions_.find(id);
      if (it != sessions_.end()) {
        closes.push_back(it->second);
        sessions_.erase(it);
      }
    }
    for (const std::string& id : decisions.changed_jobs) {
      if (auto job = core_.GetJob(id); job.ok()) {
        changed.emplace_back(++snapshot_version_, *std::move(job));
      }
    }
    if (!decisions.changed_jobs.empty() || !decisions.ended_generations.empty()) {
      changed_.SignalAll();
    }
  }
  for (auto& outbox : closes) outbox->Close();
  if (!decisions.changed_jobs.empty()) {
    absl::ReaderMutexLock lock(&watch_mu_);
    for (const auto& [id, changed] : job_watchers_) {
      for (const std::string& job : decisions.changed_jobs) changed(job);
    }
  }
  // The window between a job's end in memory and on disk: tests hold the coordinator here
  // (save_end@N: the end of job-N).
  for (const std::string& id : decisions.ends_to_record) {
    int64_t seq = -1;
    if (!absl::StartsWith(id, "job-") ||
        !absl::SimpleAtoi(id.substr(4, id.find('-', 4) - 4), &seq)) {  // "job-N-SUFFIX"
      seq = -1;
    }
    test_hooks::Reach("save_end", seq);
  }
  // A call that changed no job (a read, most reports) never waits for another's save: a slow
  // disk (fsync) holds up only what it must make durable.
  if (!changed.empty()) {
    // Snapshots are taken in decision order under mu_ but saved after it, by whichever threads
    // decided: a slower thread must never overwrite a job's newer snapshot with its older one
    // (a restarted coordinator would then resume from stale state).
    absl::MutexLock lock(&save_mu_);
    for (const auto& [version, job] : changed) {
      uint64_t& saved = saved_versions_[job.job_id()];
      if (version < saved) continue;
      saved = version;
      if (metrics_ != nullptr) metrics_->ObserveJob(job);
      if (absl::Status s = job_store_->Save(job); !s.ok()) {
        LOG(ERROR) << "saving job " << job.job_id() << ": " << s;
      }
    }
  }
  // Only now may the members of a job that succeeded drop its state: before, a restarted
  // coordinator would find the job running and nobody holding what it trained. (A save that
  // failed was logged; holding the members would not make it durable.)
  for (const std::string& id : decisions.ends_to_record) {
    Call([&](Core& core, absl::Time now, Decisions* d) {
      core.JobEndRecorded(id, now, d);
      return 0;
    });
  }
}

absl::Status Coordinator::StoreFence(const std::string& session_key, const std::string& job_id,
                                     int64_t generation) {
  auto it = session_key.empty() ? session_keys_.end() : session_keys_.find(session_key);
  if (it == session_keys_.end()) {
    return absl::PermissionDeniedError(
        "the store serves only the workers of a generation: this call carries no live "
        "session's key (x-lockstep-session)");
  }
  return core_.Fence(job_id, generation, it->second);
}

absl::Status Coordinator::AppendProgramOutput(const std::string& worker_id,
                                              const v1::ProgramOutput& output) {
  absl::StatusOr<std::pair<int32_t, std::string>> member;
  {
    absl::MutexLock lock(&mu_);
    member = core_.GenerationMember(output.job_id(), output.generation(), worker_id);
  }
  if (!member.ok()) return member.status();
  logs_.Append(output.job_id(), output.generation(), member->first, member->second, output);
  return absl::OkStatus();
}

absl::StatusOr<v1::JobLogs> Coordinator::JobLogs(const v1::GetJobLogsRequest& request) {
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = core_.GetJob(request.job_id()).status(); !s.ok()) return s;
  }
  return logs_.Read(request);
}

absl::Status Coordinator::StoreSet(const std::string& session_key, const std::string& job_id,
                                   int64_t generation, const std::string& key, std::string value) {
  {
    absl::MutexLock lock(&mu_);
    LOCKSTEP_RETURN_IF_ERROR(StoreFence(session_key, job_id, generation));
    // Writing to its generation's store is taking part in it (Core::NoteMemberActivity).
    core_.NoteMemberActivity(session_keys_.at(session_key), job_id, generation);
  }
  // Outside mu_: the Set may finish thousands of waits. The fence held just now; a generation
  // that ended since has its scope closed, and the Set is refused with ABORTED.
  return store_.Set({job_id, generation}, key, std::move(value));
}

absl::StatusOr<int64_t> Coordinator::StoreAdd(const std::string& session_key,
                                              const std::string& job_id, int64_t generation,
                                              const std::string& key, int64_t amount) {
  {
    absl::MutexLock lock(&mu_);
    LOCKSTEP_RETURN_IF_ERROR(StoreFence(session_key, job_id, generation));
    core_.NoteMemberActivity(session_keys_.at(session_key), job_id, generation);
  }
  return store_.Add({job_id, generation}, key, amount);
}

BootstrapStore::WaitId Coordinator::StoreWaitAsync(const std::string& session_key,
                                                   const std::string& job_id, int64_t generation,
                                                   std::vector<std::string> keys,
                                                   absl::Duration timeout,
                                                   BootstrapStore::WaitDone done) {
  absl::Status fenced;
  {
    absl::MutexLock lock(&mu_);
    fenced = StoreFence(session_key, job_id, generation);
  }
  if (!fenced.ok()) {
    done(std::move(fenced));
    return 0;
  }
  // The scope was open under mu_ just now; if the generation ends from here on, the store
  // closes the scope and the wait ends with ABORTED.
  return store_.WaitAsync({job_id, generation}, std::move(keys), absl::Now() + timeout,
                          std::move(done));
}

absl::StatusOr<std::vector<v1::JobEvent>> Coordinator::WaitEvents(const std::string& job_id,
                                                                  int64_t from,
                                                                  absl::Duration timeout,
                                                                  bool* finished) {
  const absl::Time deadline = clock_->Now() + timeout;
  absl::MutexLock lock(&mu_);
  while (true) {
    absl::StatusOr<std::vector<v1::JobEvent>> events = core_.EventsSince(job_id, from);
    if (!events.ok()) return events.status();
    const absl::StatusOr<v1::Job> job = core_.GetJob(job_id);
    *finished = job.ok() && IsTerminal(job->state());
    if (!events->empty() || *finished || shutdown_) return events;
    const absl::Time now = clock_->Now();
    if (now >= deadline) return events;
    changed_.WaitWithTimeout(&mu_, deadline - now);
  }
}

Coordinator::JobWatchId Coordinator::WatchJobs(
    std::function<void(const std::string& job_id)> changed) {
  absl::MutexLock lock(&watch_mu_);
  const JobWatchId id = next_watch_id_++;
  job_watchers_.emplace(id, std::move(changed));
  return id;
}

void Coordinator::UnwatchJobs(JobWatchId id) {
  absl::MutexLock lock(&watch_mu_);  // waits for the calls in progress (reader locks)
  job_watchers_.erase(id);
}

void Coordinator::TickSoon() {
  absl::MutexLock lock(&tick_mu_);
  tick_requested_ = true;
}

void Coordinator::WaitForTick(absl::Duration interval) {
  absl::MutexLock lock(&tick_mu_);
  tick_mu_.AwaitWithTimeout(absl::Condition(&tick_requested_), interval);
  tick_requested_ = false;
}

void Coordinator::Tick() {
  Call([this](Core& core, absl::Time now, Decisions* d) {
    mu_.AssertHeld();  // Call runs this under mu_
    for (const auto& [worker_id, outbox] : sessions_) {
      const absl::Time beat = outbox->report_pending() ? now : outbox->last_beat();
      if (beat != absl::InfinitePast()) core.NoteHeartbeat(worker_id, beat);
    }
    core.Tick(now, d);
    return 0;
  });
  store_.Expire(absl::Now());
}

ClusterCounts Coordinator::Counts() {
  ClusterCounts counts;
  std::tie(counts.rejected_calls, counts.rejected_clients) = gate_.RejectedCounts();
  absl::MutexLock lock(&mu_);
  counts.jobs = core_.JobCounts();
  for (const v1::WorkerInfo& w : core_.ListWorkers()) ++counts.workers[{w.state(), w.device()}];
  return counts;
}

v1::ListWorkersResponse Coordinator::Workers() {
  v1::ListWorkersResponse response;
  std::vector<v1::WorkerInfo> workers =
      Call([&](Core& core, absl::Time, Decisions*) { return core.ListWorkers(); });
  for (v1::WorkerInfo& w : workers) *response.add_workers() = std::move(w);
  for (v1::RejectedClient& r : gate_.Rejected()) *response.add_rejected_clients() = std::move(r);
  return response;
}

void Coordinator::Shutdown() {
  std::vector<std::shared_ptr<SessionOutbox>> sessions;
  store_.Shutdown();
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
    // Released here: a session must not outlive the service that runs it.
    for (auto& [id, outbox] : sessions_) sessions.push_back(std::move(outbox));
    sessions_.clear();
    session_keys_.clear();
    changed_.SignalAll();
  }
  for (auto& outbox : sessions) outbox->Close();
}

}  // namespace lockstep::coordinator
