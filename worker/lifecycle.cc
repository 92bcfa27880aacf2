// The worker lifecycle's rules (numbered as in the header).
#include "worker/lifecycle.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace lockstep::worker {
namespace {

constexpr size_t kRecentJobs = 16;

void Remember(std::deque<std::string>& list, const std::string& id) {
  if (std::find(list.begin(), list.end(), id) != list.end()) return;
  list.push_back(id);
  while (list.size() > kRecentJobs) list.pop_front();
}

}  // namespace

bool WorkerLifecycle::JobEnded(const std::string& job_id) const {
  return std::find(ended_jobs_.begin(), ended_jobs_.end(), job_id) != ended_jobs_.end();
}

bool WorkerLifecycle::Suspended(const std::string& job_id) const {
  return std::find(suspended_jobs_.begin(), suspended_jobs_.end(), job_id) != suspended_jobs_.end();
}

void WorkerLifecycle::Park(const JobKey& key, LifecycleActions* out) {
  if (parked_.has_value()) {
    out->log.push_back(absl::StrCat("dropping the state parked for ", parked_->job_id, ": ",
                                    key.job_id, "'s takes its place"));
    out->drop_parked_state = true;
  }
  parked_ = key;
  out->log.push_back(
      absl::StrCat("parking the state of ", key.job_id, " (suspended) while other jobs run"));
}

void WorkerLifecycle::AbortRun(RunId id, Run& run, const std::string& reason, LifecycleActions* out,
                               bool job_ended) {
  if (run.phase == Phase::kRunning || (run.phase == Phase::kStopping && job_ended)) {
    run.phase = Phase::kStopping;
    out->abort.push_back({id, reason, job_ended});
  }
}

void WorkerLifecycle::AbortOthers(RunId except, const std::string& reason, LifecycleActions* out) {
  for (auto it = runs_.begin(); it != runs_.end();) {
    if (it->first == except) {
      ++it;
      continue;
    }
    if (it->second.phase == Phase::kWaiting) {
      out->log.push_back(absl::StrCat(it->second.assignment.job_id(), " generation ",
                                      it->second.assignment.generation(),
                                      " never started: ", reason));
      it = runs_.erase(it);
      continue;
    }
    AbortRun(it->first, it->second, reason, out);
    ++it;
  }
}

LifecycleActions WorkerLifecycle::OnAssignment(const v1::Assignment& a, absl::Time now) {
  LifecycleActions out;
  // Rule 2: stale assignments change nothing.
  auto newest = newest_generation_.find(a.job_id());
  if (newest != newest_generation_.end() && newest->second >= a.generation()) {
    out.log.push_back(absl::StrCat("ignoring assignment to ", a.job_id(), " generation ",
                                   a.generation(), ": generation ", newest->second,
                                   " was already assigned"));
    return out;
  }
  newest_generation_[a.job_id()] = a.generation();
  Remember(recent_jobs_, a.job_id());
  for (auto it = newest_generation_.begin(); it != newest_generation_.end();) {
    it = std::find(recent_jobs_.begin(), recent_jobs_.end(), it->first) == recent_jobs_.end()
             ? newest_generation_.erase(it)
             : std::next(it);
  }

  const RunId id = next_run_++;
  Run run;
  run.assignment = a;
  run.key = JobKey::Of(a.job_id(), a.spec());
  run.assigned = now;
  // Rule 7: a suspended job assigned again is resumed.
  suspended_jobs_.erase(std::remove(suspended_jobs_.begin(), suspended_jobs_.end(), a.job_id()),
                        suspended_jobs_.end());
  // Rule 1: this assignment supersedes everything else.
  AbortOthers(id, absl::StrCat("superseded by ", a.job_id(), " generation ", a.generation()), &out);
  // Rule 7: the job's own parked state is used now; a suspended job's kept state takes its
  // place.
  if (parked_.has_value() && *parked_ == run.key && kept_.has_value() && *kept_ != run.key &&
      Suspended(kept_->job_id)) {
    out.log.push_back(absl::StrCat("parking the state of ", kept_->job_id, " (suspended); ",
                                   a.job_id(), " resumes from its parked state"));
    std::swap(kept_, parked_);
    out.swap_kept_and_parked = true;
  }
  // Rule 3: state of another job (or of this id with another spec) is never used.
  if (kept_.has_value() && *kept_ != run.key && Suspended(kept_->job_id)) {
    Park(*kept_, &out);  // rule 7
    kept_.reset();
    out.park_kept_state = true;
  } else if (kept_.has_value() && *kept_ != run.key) {
    out.log.push_back(absl::StrCat(
        "dropping the state kept for ", kept_->job_id, ": ",
        kept_->job_id == a.job_id() ? "the job's spec differs" : "another job was assigned"));
    kept_.reset();
    out.drop_kept_state = true;
  }
  if (parked_.has_value() && parked_->job_id == a.job_id() && *parked_ != run.key) {
    out.log.push_back(
        absl::StrCat("dropping the state parked for ", a.job_id(), ": the job's spec differs"));
    parked_.reset();
    out.drop_parked_state = true;
  }
  runs_.emplace(id, std::move(run));
  StartReady(now, &out);
  return out;
}

void WorkerLifecycle::StartReady(absl::Time now, LifecycleActions* out) {
  for (auto& [id, run] : runs_) {
    if (run.phase != Phase::kWaiting) continue;
    bool others_active = false;
    bool same_job_active = false;
    for (const auto& [other_id, other] : runs_) {
      if (other_id == id || other.phase == Phase::kWaiting) continue;
      others_active = true;
      same_job_active = same_job_active || other.key == run.key;
    }
    const bool timed_out = now - run.assigned >= handover_timeout_;
    if (others_active && !timed_out) continue;
    if (others_active) {
      out->log.push_back(absl::StrCat(
          run.assignment.job_id(), " generation ", run.assignment.generation(),
          ": the previous run did not stop within ", absl::FormatDuration(handover_timeout_),
          same_job_active ? "; starting without its state" : "; starting anyway"));
      for (auto& [other_id, other] : runs_) {
        if (other_id != id && other.phase != Phase::kWaiting && other.key == run.key) {
          other.stale = true;
        }
      }
    }
    run.phase = Phase::kRunning;
    const bool with_state = kept_.has_value() && *kept_ == run.key && !same_job_active;
    if (with_state) kept_.reset();
    const bool with_parked =
        !with_state && parked_.has_value() && *parked_ == run.key && !same_job_active;
    if (with_parked) parked_.reset();
    out->start.push_back({id, run.assignment, with_state, with_parked});
  }
}

LifecycleActions WorkerLifecycle::OnAbort(const std::string& job_id, int64_t generation,
                                          const std::string& reason, bool job_ended, absl::Time now,
                                          bool suspended, bool drop_parked) {
  LifecycleActions out;
  if (suspended && !job_ended) Remember(suspended_jobs_, job_id);
  if (drop_parked && !job_ended) {
    // Rule 7: it resumed on other workers.
    suspended_jobs_.erase(std::remove(suspended_jobs_.begin(), suspended_jobs_.end(), job_id),
                          suspended_jobs_.end());
    if (parked_.has_value() && parked_->job_id == job_id) {
      out.log.push_back(absl::StrCat("dropping the state parked for ", job_id, ": ", reason));
      parked_.reset();
      out.drop_parked_state = true;
    }
    bool running = false;
    for (const auto& [id, run] : runs_) running = running || run.key.job_id == job_id;
    if (!running && kept_.has_value() && kept_->job_id == job_id) {
      out.log.push_back(absl::StrCat("dropping the state kept for ", job_id, ": ", reason));
      kept_.reset();
      out.drop_kept_state = true;
    }
  }
  for (auto it = runs_.begin(); it != runs_.end();) {
    const v1::Assignment& a = it->second.assignment;
    if (a.job_id() != job_id || (a.generation() != generation && !job_ended)) {
      ++it;
      continue;
    }
    if (it->second.phase == Phase::kWaiting) {
      out.log.push_back(
          absl::StrCat(job_id, " generation ", a.generation(), " never started: ", reason));
      it = runs_.erase(it);
      continue;
    }
    AbortRun(it->first, it->second, reason, &out, job_ended);
    ++it;
  }
  if (job_ended) {
    Remember(ended_jobs_, job_id);
    if (kept_.has_value() && kept_->job_id == job_id) {
      kept_.reset();
      out.drop_kept_state = true;
    }
    if (parked_.has_value() && parked_->job_id == job_id) {
      parked_.reset();
      out.drop_parked_state = true;
    }
    suspended_jobs_.erase(std::remove(suspended_jobs_.begin(), suspended_jobs_.end(), job_id),
                          suspended_jobs_.end());
  }
  StartReady(now, &out);
  return out;
}

LifecycleActions WorkerLifecycle::OnSessionEnded(const std::string& reason, absl::Time now,
                                                 bool keep_training) {
  LifecycleActions out;
  // Rule 6: a group that trains goes on without the coordinator, for a while.
  const std::optional<Training> trains =
      keep_training && keep_training_for_ > absl::ZeroDuration() ? training() : std::nullopt;
  if (trains.has_value() && unregistered_since_ == absl::InfiniteFuture()) {
    unregistered_since_ = now;
  }
  AbortOthers(/*except=*/trains.has_value() ? trains->run : 0, reason, &out);
  if (trains.has_value()) {
    out.log.push_back(absl::StrCat(trains->assignment.job_id(), " generation ",
                                   trains->assignment.generation(),
                                   " trains on without the coordinator (", reason, ")"));
  }
  newest_generation_.clear();
  return out;
}

LifecycleActions WorkerLifecycle::OnTraining(RunId id, absl::Time now) {
  auto it = runs_.find(id);
  if (it != runs_.end() && it->second.phase == Phase::kRunning) it->second.training = true;
  return {};
}

LifecycleActions WorkerLifecycle::OnRegistered(absl::Time now) {
  unregistered_since_ = absl::InfiniteFuture();
  return {};
}

std::optional<WorkerLifecycle::Training> WorkerLifecycle::training() const {
  std::optional<Training> newest;
  for (const auto& [id, run] : runs_) {
    if (run.phase != Phase::kRunning || !run.training || run.stale ||
        run.assignment.spec().has_program()) {
      continue;
    }
    if (!newest.has_value() || newest->run < id) newest = Training{id, run.assignment};
  }
  return newest;
}

LifecycleActions WorkerLifecycle::OnHealed(RunId id, const v1::ResumedReport& report,
                                           absl::Time now) {
  LifecycleActions out;
  auto it = runs_.find(id);
  if (it == runs_.end() || it->second.phase != Phase::kRunning) return out;  // rule 5
  v1::WorkerMessage m;
  *m.mutable_resumed() = report;
  m.mutable_resumed()->set_job_id(it->second.assignment.job_id());
  m.mutable_resumed()->set_generation(it->second.assignment.generation());
  out.send.push_back(std::move(m));
  return out;
}

LifecycleActions WorkerLifecycle::OnRunEnded(RunId id, const RunResult& result, absl::Time now) {
  LifecycleActions out;
  auto it = runs_.find(id);
  if (it == runs_.end()) return out;
  const Run run = std::move(it->second);
  runs_.erase(it);
  const v1::Assignment& a = run.assignment;

  // Rule 5: a failure the coordinator does not know of yet is reported.
  if ((result.kind == RunResult::kFailed || result.kind == RunResult::kFatal) &&
      run.phase != Phase::kStopping) {
    v1::WorkerMessage m;
    v1::FailureReport* f = m.mutable_failure();
    f->set_job_id(a.job_id());
    f->set_generation(a.generation());
    f->set_message(result.message);
    f->set_fatal(result.kind == RunResult::kFatal);
    if (result.holds_state) f->set_step(result.step);
    if (result.program_exit.has_value()) *f->mutable_program_exit() = *result.program_exit;
    out.send.push_back(std::move(m));
  }

  // Rule 4: where the run's state goes.
  std::string drop_why;
  bool park = false;
  if (!result.holds_state) {
    drop_why = "";
  } else if (result.kind == RunResult::kFatal) {
    drop_why = "the failure is fatal";
  } else if (JobEnded(a.job_id())) {
    drop_why = "the job ended";
  } else if (run.stale) {
    drop_why = "a newer generation started without it";
  } else {
    for (const auto& [other_id, other] : runs_) {
      // Another job's run that is itself stopping is on its way out; one that waits or runs
      // was assigned after this one.
      if (other.key != run.key && other.phase != Phase::kStopping) {
        drop_why = absl::StrCat(other.assignment.job_id(), " was assigned since");
        park = Suspended(a.job_id());  // rule 7
        break;
      }
    }
  }
  bool claimed = false;  // the parked state is a waiting run's (rule 7)
  for (const auto& [other_id, other] : runs_) {
    claimed = claimed ||
              (parked_.has_value() && other.key == *parked_ && other.phase != Phase::kStopping);
  }
  const bool park_after_start = result.holds_state && park && claimed;
  if (park_after_start) {
    // Parked once the waiting run has taken the parked state (below).
  } else if (result.holds_state && park) {
    Park(run.key, &out);
    out.park_state_of = id;
  } else if (result.holds_state && drop_why.empty()) {
    if (kept_.has_value()) out.drop_kept_state = true;
    kept_ = run.key;
    out.keep_state_of = id;
    out.log.push_back(absl::StrCat("keeping the state of ", a.job_id(), " at step ", result.step,
                                   result.kind == RunResult::kFinished
                                       ? " until the coordinator has recorded the job's end"
                                       : " for its next generation"));
  } else if (result.holds_state) {
    out.log.push_back(absl::StrCat("dropping the state of ", a.job_id(), " generation ",
                                   a.generation(), ": ", drop_why));
  }
  StartReady(now, &out);
  if (park_after_start && !parked_.has_value()) {
    Park(run.key, &out);
    out.park_state_after_start_of = id;
  } else if (park_after_start) {
    out.log.push_back(absl::StrCat("dropping the state of ", a.job_id(), " (suspended): ",
                                   parked_->job_id, " waits to resume from the parked state"));
  }
  return out;
}

LifecycleActions WorkerLifecycle::Tick(absl::Time now) {
  LifecycleActions out;
  // Rule 6: no coordinator has kept the group that trained on; it stops (its state is kept).
  if (now - unregistered_since_ >= keep_training_for_) {
    unregistered_since_ = absl::InfiniteFuture();
    AbortOthers(/*except=*/0,
                absl::StrCat("no coordinator for ", absl::FormatDuration(keep_training_for_),
                             " (--keep_training_without_coordinator)"),
                &out);
  }
  StartReady(now, &out);
  return out;
}

}  // namespace lockstep::worker
