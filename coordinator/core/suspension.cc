// Suspension: a job stopped whole, to give its workers to a job of a higher priority
// (PreemptFor) or because a user asked (SuspendJob). Its members keep its state in memory while
// they serve other jobs (the worker parks it: lifecycle rule 7); they are its holders. It
// resumes from them: by itself when it reaches the queue's head and one of them is idle, or,
// suspended by a user, once ResumeJob queues it again.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/clock.h"
#include "common/job_state.h"
#include "coordinator/core/core.h"
#include "coordinator/core/core_internal.h"

namespace lockstep::coordinator {

using internal::Seconds1;

namespace {

std::string Holders(const v1::Suspension& s) {
  return s.holders().empty() ? std::string("nobody")
                             : absl::StrJoin(s.holders().begin(), s.holders().end(), ", ");
}

// What a suspended job's reason says after why it was suspended.
std::string Outlook(const v1::Suspension& s) {
  const std::string from =
      s.holders().empty()
          ? std::string(
                "nobody keeps its state: it resumes from its last checkpoint, else from "
                "its first step")
          : absl::StrCat("its state of step ", s.step(), " is kept by ", Holders(s));
  return s.by_user() ? absl::StrCat(from, "; `lockstepctl resume` queues it again")
                     : absl::StrCat(from, "; it resumes when workers free up");
}

}  // namespace

void Core::Suspend(JobRecord& job, const std::string& reason, const std::string& by_job,
                   bool by_user, absl::Time now, Decisions* out) {
  v1::Suspension s;
  s.set_reason(reason);
  s.set_by_user(by_user);
  s.set_step(job.job.step());
  s.set_since_unix_ms(ToUnixMillisOrZero(now));
  s.set_by_job(by_job);
  absl::flat_hash_set<std::string> named;
  for (const MemberState& m : job.members) {
    Worker* w = FindWorker(m.worker_id);
    if (w == nullptr || w->state != WorkerState::kBusy || w->job_id != job.job.job_id()) continue;
    PushAbort(job, w->id, reason, out, /*job_ended=*/false, /*suspended=*/true);
    w->state = WorkerState::kIdle;
    w->job_id.clear();
    w->generation = 0;
    if (named.insert(w->info.name()).second) s.add_holders(w->info.name());
  }
  // Workers kept for it (back with its state after a coordinator restart) keep it too.
  for (const std::string& id : job.reserved) {
    const Worker* w = FindWorker(id);
    if (w == nullptr || w->state != WorkerState::kIdle || w->reserved_for != job.job.job_id() ||
        w->held_step < 0) {
      continue;
    }
    // A member back training the generation a restarted coordinator awaits stops it too.
    int64_t generation = 0;
    for (const auto& [rank, adopter] : job.adopters) {
      if (adopter == id) generation = job.adopt_generation;
    }
    out->messages.push_back({id, AbortMessage(job.job.job_id(), generation, reason,
                                              /*job_ended=*/false, /*suspended=*/true)});
    if (named.insert(w->info.name()).second) s.add_holders(w->info.name());
  }
  const bool awaited = job.adopt_generation > 0;  // its generation may still train
  ReleaseReserved(job, /*job_ended=*/false, reason, out);
  // A worker parks one suspended job's state: this one's replaces any other's.
  for (const std::string& name : s.holders()) {
    ForgetHolder(name, job.job.job_id(), by_job, now, out);
  }
  if (job.job.state() == v1::JOB_STATE_RUNNING || awaited) {
    out->ended_generations.emplace_back(job.job.job_id(), job.job.generation());
    EndGeneration(job, reason, now);
  }
  job.members.clear();
  job.job.set_eta_ms(0);  // nothing trains until it resumes
  job.finishing = false;
  job.benched.clear();
  *job.job.mutable_suspension() = std::move(s);
  SetState(job, v1::JOB_STATE_SUSPENDED);
  job.job.set_reason(absl::StrCat(reason, "; ", Outlook(job.job.suspension())));
  RefreshMembers(job);
  AddEvent(job, v1::JobEvent::STATE, job.job.reason(), now, out);
}

void Core::ForgetHolder(const std::string& name, const std::string& except, const std::string& keep,
                        absl::Time now, Decisions* out) {
  for (const std::string& id : suspended_) {
    if (id == except || id == keep) continue;
    JobRecord& job = jobs_.at(id);
    auto* holders = job.job.mutable_suspension()->mutable_holders();
    auto it = std::find(holders->begin(), holders->end(), name);
    if (it == holders->end()) continue;
    holders->erase(it);
    AddEvent(job, v1::JobEvent::MEMBERSHIP,
             absl::StrCat(name, " no longer keeps its state (it keeps ", except, "'s instead); ",
                          Outlook(job.job.suspension())),
             now, out);
  }
}

void Core::NoteHolder(const Worker& worker, absl::Time now, Decisions* out) {
  const v1::HeldState& parked = worker.info.parked();
  if (!parked.job_id().empty()) {
    const JobRecord* job = FindJob(parked.job_id());
    if (job == nullptr || IsTerminal(job->job.state())) {
      out->messages.push_back(
          {worker.id,
           AbortMessage(parked.job_id(), 0,
                        job == nullptr ? "this coordinator does not know the job"
                                       : absl::StrCat("the job has ended (",
                                                      v1::JobState_Name(job->job.state()), ")"),
                        /*job_ended=*/true)});
    }
  }
  const std::string& name = worker.info.name();
  for (const std::string& id : suspended_) {
    JobRecord& job = jobs_.at(id);
    // A program job's saves are in the worker's checkpoint memory, a tmpfs that outlives the
    // worker's process: its holders stay. An excluded worker's state is dropped
    // (ReserveOrRelease): it is no holder.
    const bool program = job.job.spec().has_program();
    const bool keeps = program || ((parked.job_id() == id || worker.info.held().job_id() == id) &&
                                   !Excluded(job, worker.id, name));
    auto* holders = job.job.mutable_suspension()->mutable_holders();
    auto it = std::find(holders->begin(), holders->end(), name);
    if (keeps == (it != holders->end()) || (program && it == holders->end())) continue;
    if (keeps) {
      holders->Add(std::string(name));
    } else {
      holders->erase(it);
    }
    AddEvent(
        job, v1::JobEvent::MEMBERSHIP,
        absl::StrCat(
            name, keeps ? " registered keeping its state" : " registered again without its state",
            "; ", Outlook(job.job.suspension())),
        now, out);
  }
}

bool Core::Holds(const JobRecord& job, const RankCandidate& c) const {
  const auto& holders = job.job.suspension().holders();
  return std::find(holders.begin(), holders.end(), workers_.at(c.worker_id).info.name()) !=
         holders.end();
}

void Core::HoldersFirst(const JobRecord& job, std::vector<RankCandidate>& idle) const {
  std::stable_partition(idle.begin(), idle.end(),
                        [&](const RankCandidate& c) { return Holds(job, c); });
}

bool Core::WaitsForHolder(const JobRecord& job, const std::vector<RankCandidate>& idle,
                          absl::Time now, std::string* why) const {
  const auto& holders = job.job.suspension().holders();
  if (!idle.empty() && Holds(job, idle.front())) return false;
  // Worth waiting for: a holder busy with another job, or kept for one that is about to start.
  // (An idle holder this job cannot use, excluded or short of memory, is not.)
  std::vector<std::string> alive;
  for (const std::string& name : holders) {
    const auto live = live_names_.find(name);
    if (live == live_names_.end()) continue;
    const Worker& w = workers_.at(live->second);
    if (w.state == WorkerState::kBusy ||
        (!w.reserved_for.empty() && w.reserved_for != job.job.job_id())) {
      alive.push_back(name);
    }
  }
  if (alive.empty() && now < job.restart_grace_until && !holders.empty()) {
    *why = absl::StrCat("waiting up to ", Seconds1(options_.restart_grace),
                        " for the workers that keep its state (",
                        absl::StrJoin(holders.begin(), holders.end(), ", "),
                        ") to register again after the coordinator restarted");
    return true;
  }
  if (alive.empty()) return false;  // nobody to wait for: it resumes from what it can
  *why = absl::StrCat("waiting for a worker that keeps its state of step ",
                      job.job.suspension().step(), " (", absl::StrJoin(alive, ", "),
                      alive.size() == 1 ? " is" : " are", " busy)");
  return true;
}

void Core::Resume(JobRecord& job, std::vector<std::string> worker_ids, absl::Time now,
                  Decisions* out) {
  const v1::Suspension suspension = job.job.suspension();
  const absl::Time since = absl::FromUnixMillis(suspension.since_unix_ms());
  const absl::Duration suspended = since <= now ? now - since : absl::ZeroDuration();
  const int64_t from_generation = job.job.generation();
  job.job.clear_suspension();
  job.job.set_suspended_ms(job.job.suspended_ms() + absl::ToInt64Milliseconds(suspended));
  if (job.started != absl::InfinitePast()) job.started += suspended;  // max_wall_time_ms
  const std::string reason =
      absl::StrCat("resumed after ", Seconds1(suspended), " suspended (", suspension.reason(), ")");
  // Recorded as a re-formation (not counted against max_restarts): the new generation's first
  // step says which state it resumed from and what, if anything, was trained again.
  if (job.open_recovery < 0) {
    v1::Recovery* r = job.job.add_recovery_history();
    r->set_from_generation(from_generation);
    r->set_reason(reason);
    r->set_detect_unix_ms(ToUnixMillisOrZero(now));
    r->set_step_at_detection(job.job.step());
    r->set_source_rank(-1);
    r->set_counted(false);
    job.open_recovery = job.job.recovery_history_size() - 1;
  }
  job.reconfigure_since = now;
  // Holders it resumes without (busy elsewhere, or beyond max_workers) may drop its state once
  // the resumed generation has trained a step (CloseRecovery): until then they are its
  // fallback, should the holder it resumes from be lost while it heals the others.
  absl::flat_hash_set<std::string> chosen(worker_ids.begin(), worker_ids.end());
  job.parked_elsewhere.clear();
  for (const std::string& name : suspension.holders()) {
    const auto live = live_names_.find(name);
    if (live == live_names_.end() || chosen.count(live->second) == 0) {
      job.parked_elsewhere.push_back(name);
    }
  }
  StartGeneration(job, std::move(worker_ids), now, out);
  v1::Recovery* r = job.job.mutable_recovery_history(job.open_recovery);
  r->set_to_generation(job.job.generation());
  r->set_reformed_unix_ms(ToUnixMillisOrZero(now));
  AddEvent(job, v1::JobEvent::MEMBERSHIP,
           absl::StrCat(reason, "; its state was kept by ", Holders(suspension)), now, out);
}

absl::StatusOr<v1::Job> Core::SuspendJob(const std::string& job_id, absl::Time now,
                                         Decisions* out) {
  ObserveTime(now);
  JobRecord* job = FindJob(job_id);
  if (job == nullptr) return absl::NotFoundError(absl::StrCat("job ", job_id, " does not exist"));
  const v1::JobState state = job->job.state();
  if (IsTerminal(state)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id, " has already ended (", v1::JobState_Name(state), "): nothing to suspend"));
  }
  if (state == v1::JOB_STATE_SUSPENDED && job->job.suspension().by_user()) {
    return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " is already suspended"));
  }
  if (job->finishing || AnyMemberAtLastStep(*job)) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " has trained its last step and is finishing"));
  }
  const std::string reason = "suspended by a user";
  if (state == v1::JOB_STATE_SUSPENDED) {
    // Suspended for another job: now it also waits for ResumeJob.
    pending_.erase(QueueKeyOf(*job));
    v1::Suspension* s = job->job.mutable_suspension();
    s->set_by_user(true);
    s->set_reason(absl::StrCat(s->reason(), "; ", reason));
    job->job.set_reason(absl::StrCat(s->reason(), "; ", Outlook(*s)));
    AddEvent(*job, v1::JobEvent::STATE, job->job.reason(), now, out);
  } else if (state == v1::JOB_STATE_PENDING) {
    ReleaseReserved(*job, /*job_ended=*/false, reason, out);
    v1::Suspension* s = job->job.mutable_suspension();
    s->set_reason(absl::StrCat(reason, " before it started"));
    s->set_by_user(true);
    s->set_since_unix_ms(ToUnixMillisOrZero(now));
    SetState(*job, v1::JOB_STATE_SUSPENDED);
    job->job.set_reason(absl::StrCat(s->reason(), "; `lockstepctl resume` queues it again"));
    AddEvent(*job, v1::JobEvent::STATE, job->job.reason(), now, out);
  } else {
    Suspend(*job, reason, /*by_job=*/"", /*by_user=*/true, now, out);
  }
  Schedule(now, out);
  return View(*job);
}

absl::StatusOr<v1::Job> Core::ResumeJob(const std::string& job_id, absl::Time now, Decisions* out) {
  ObserveTime(now);
  JobRecord* job = FindJob(job_id);
  if (job == nullptr) return absl::NotFoundError(absl::StrCat("job ", job_id, " does not exist"));
  if (job->job.state() != v1::JOB_STATE_SUSPENDED) {
    return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " is not suspended (",
                                                      v1::JobState_Name(job->job.state()), ")"));
  }
  if (!job->job.suspension().by_user()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " was suspended for ", job->job.suspension().by_job(),
                     ", not by a user: it resumes by itself when workers free up"));
  }
  if (job->job.generation() == 0) {
    // It never started: it is pending again, its rendezvous_timeout counted from now.
    job->job.clear_suspension();
    job->pending_since = now;
    SetState(*job, v1::JOB_STATE_PENDING);
    job->job.set_reason("resumed by a user: queued");
    AddEvent(*job, v1::JobEvent::STATE, job->job.reason(), now, out);
    Schedule(now, out);
    return View(*job);
  }
  job->job.mutable_suspension()->set_by_user(false);
  SetState(*job, v1::JOB_STATE_SUSPENDED);  // queued
  const std::string queued =
      absl::StrCat("resumed by a user: queued; ", Outlook(job->job.suspension()));
  job->job.set_reason(queued);
  AddEvent(*job, v1::JobEvent::STATE, queued, now, out);
  Schedule(now, out);
  return View(*job);
}

}  // namespace lockstep::coordinator
