// The coordinator's state machine: the clock it observes, the fence of generations, and the
// periodic Tick. The rest of Core is in registry.cc (workers), jobs.cc (admission, history),
// placement.cc (scheduling), reports.cc (members' reports, agreement) and recovery.cc
// (losses and re-formation). Invariants:
//  - a worker is kBusy iff it is a member of the current generation of a non-terminal job, or
//    of a job that succeeded and whose end the shell has not saved yet (JobEndRecorded);
//  - a worker is reserved_for a job iff it is idle and in that job's `reserved`;
//  - a job's `members` always describe its current generation (empty when not running);
//  - every state change of a job appends an event and marks the job changed.
#include "coordinator/core/core.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <string_view>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/clock.h"
#include "common/gpu_limits.h"
#include "common/job_memory.h"
#include "common/model_family.h"
#include "coordinator/core/core_internal.h"
#include "coordinator/core/job_spec.h"

namespace lockstep::coordinator {

using internal::DeviceKind;
using internal::Seconds1;

void FoldAbortsIntoAssignments(std::vector<Decisions::Outgoing>& messages) {
  // Per worker, the index of its latest message so far.
  absl::flat_hash_map<std::string_view, size_t> latest;
  latest.reserve(messages.size());
  std::vector<bool> folded(messages.size(), false);
  bool any = false;
  for (size_t i = 0; i < messages.size(); ++i) {
    auto [it, inserted] = latest.try_emplace(messages[i].worker_id, i);
    if (inserted) continue;
    Decisions::Outgoing& before = messages[it->second];
    v1::CoordinatorMessage& now = messages[i].message;
    // Only an abort of the same job's generation, not one that ends the job: a worker that
    // does not know abort_previous still gets what it needs from the assignment alone, which
    // supersedes its run of the job's previous generation.
    if (before.message.has_abort() && now.has_assignment() &&
        !now.assignment().has_abort_previous() && !before.message.abort().job_ended() &&
        before.message.abort().job_id() == now.assignment().job_id()) {
      *now.mutable_assignment()->mutable_abort_previous() =
          std::move(*before.message.mutable_abort());
      folded[it->second] = true;
      any = true;
    }
    it->second = i;
  }
  if (!any) return;
  size_t kept = 0;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (folded[i]) continue;
    if (kept != i) messages[kept] = std::move(messages[i]);
    ++kept;
  }
  messages.resize(kept);
}

Core::Core(CoreOptions options) : options_(options) {}

Core::Worker* Core::FindWorker(const std::string& worker_id) {
  auto it = workers_.find(worker_id);
  return it == workers_.end() ? nullptr : &it->second;
}

Core::JobRecord* Core::FindJob(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : &it->second;
}

const Core::JobRecord* Core::FencedJob(const std::string& job_id, int64_t generation,
                                       const std::string& worker_id, absl::Status* status) const {
  const Worker* worker = nullptr;
  if (!worker_id.empty()) {
    auto w = workers_.find(worker_id);
    if (w == workers_.end() || w->second.state == WorkerState::kLost) {
      *status = absl::NotFoundError(absl::StrCat("worker ", worker_id, " is not registered"));
      return nullptr;
    }
    worker = &w->second;
  }
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    *status = absl::NotFoundError(absl::StrCat("job ", job_id, " does not exist"));
    return nullptr;
  }
  const JobRecord& job = it->second;
  if (IsTerminal(job.job.state())) {
    *status = absl::AbortedError(
        absl::StrCat("job ", job_id, " has ended (", v1::JobState_Name(job.job.state()), ")"));
    return nullptr;
  }
  if (job.adopt_generation != 0 && generation == job.adopt_generation) {
    // Its group trains on; the restarted coordinator has not decided yet whether it keeps it:
    // nothing is recorded, and nothing aborted.
    *status = absl::UnavailableError(absl::StrCat("job ", job_id, " awaits generation ", generation,
                                                  "'s members after the coordinator restarted"));
    return nullptr;
  }
  if (generation != job.job.generation() || job.job.state() != v1::JOB_STATE_RUNNING) {
    *status = absl::AbortedError(
        absl::StrCat("generation ", generation, " of job ", job_id, " is not live (current ",
                     job.job.generation(),
                     job.job.state() == v1::JOB_STATE_RUNNING ? "" : ", being re-formed", ")"));
    return nullptr;
  }
  if (worker != nullptr && (worker->state != WorkerState::kBusy || worker->job_id != job_id)) {
    // Not this job's at all (a member of an older generation that was dropped is lost, so
    // this is someone else): refused, and nothing is fenced.
    *status = absl::PermissionDeniedError(
        absl::StrCat("worker ", worker_id, " is not a member of job ", job_id));
    return nullptr;
  }
  if (worker != nullptr && worker->generation != generation) {
    *status = absl::AbortedError(absl::StrCat(
        "worker ", worker_id, " is not a member of generation ", generation, " of job ", job_id));
    return nullptr;
  }
  *status = absl::OkStatus();
  return &job;
}

absl::Status Core::Fence(const std::string& job_id, int64_t generation,
                         const std::string& worker_id) const {
  absl::Status status;
  FencedJob(job_id, generation, worker_id, &status);
  return status;
}

absl::StatusOr<Core::JobRecord*> Core::MemberJob(const std::string& worker_id,
                                                 const std::string& job_id, int64_t generation) {
  absl::Status status;
  const JobRecord* job = FencedJob(job_id, generation, worker_id, &status);
  if (job == nullptr) return status;
  // A member that reports takes part in its generation.
  NoteMemberActivity(worker_id, job_id, generation);
  return const_cast<JobRecord*>(job);
}

absl::StatusOr<std::pair<int32_t, std::string>> Core::GenerationMember(
    const std::string& job_id, int64_t generation, const std::string& worker_id) const {
  const auto job = jobs_.find(job_id);
  if (job == jobs_.end())
    return absl::NotFoundError(absl::StrCat("job ", job_id, " does not exist"));
  for (const v1::Generation& g : job->second.job.generations()) {
    if (g.generation() != generation) continue;
    for (int rank = 0; rank < g.member_ids_size(); ++rank) {
      if (g.member_ids(rank) == worker_id) {
        return std::make_pair(static_cast<int32_t>(rank),
                              rank < g.members_size() ? g.members(rank) : worker_id);
      }
    }
    return absl::PermissionDeniedError(absl::StrCat("worker ", worker_id, " was no member of ",
                                                    job_id, " generation ", generation));
  }
  return absl::NotFoundError(
      absl::StrCat(job_id, " generation ", generation, " is not in the job's timeline"));
}

v1::CoordinatorMessage Core::AbortMessage(const std::string& job_id, int64_t generation,
                                          const std::string& reason, bool job_ended,
                                          bool suspended) {
  v1::CoordinatorMessage message;
  v1::Abort* abort = message.mutable_abort();
  abort->set_job_id(job_id);
  abort->set_generation(generation);
  abort->set_reason(reason);
  abort->set_job_ended(job_ended);
  abort->set_suspended(suspended);
  return message;
}

void Core::ObserveTime(absl::Time now) {
  if (options_.tick_interval <= absl::ZeroDuration()) return;
  const absl::Time last = last_input_;
  last_input_ = std::max(last_input_, now);
  // Ticks come every tick_interval and heartbeats every half second per worker: a gap of a
  // second without any input means the whole coordinator was stopped or starved, not just one
  // of its threads.
  if (last == absl::InfinitePast() ||
      now - last <= std::max(options_.tick_interval * 10, absl::Seconds(1))) {
    return;
  }
  const absl::Duration gap = now - last;
  // Nobody could reach the coordinator during the gap, and it could not hear anyone: shift
  // every clock that measures a worker's or a job's silence by it.
  const absl::Duration credit = gap - options_.tick_interval;
  for (auto& [id, w] : workers_) {
    if (w.state != WorkerState::kLost) w.last_heartbeat = std::min(now, w.last_heartbeat + credit);
  }
  // (Every live job: an absence is rare, and this is the one cost that grows with them.)
  const auto credit_job = [&](JobRecord& job) {
    if (job.last_advance != absl::InfinitePast()) {
      job.last_advance = std::min(now, job.last_advance + credit);
    }
    if (job.reconfigure_since != absl::InfinitePast()) {
      job.reconfigure_since = std::min(now, job.reconfigure_since + credit);
    }
    job.pending_since = std::min(now, job.pending_since + credit);
  };
  for (const auto& [seq, id] : active_) credit_job(jobs_.at(id));
  for (const auto& [priority, seq, id] : pending_) credit_job(jobs_.at(id));
  pending_deadlines_.clear();
  aging_deadlines_.clear();
  for (const auto& [priority, seq, id] : pending_) {
    JobRecord& job = jobs_.at(id);
    if (job.next_aging != absl::InfiniteFuture()) {  // nobody waited while nobody could serve
      job.next_aging += credit;
      aging_deadlines_.emplace(job.next_aging, id);
    }
    if (job.pending_deadline == absl::InfiniteFuture()) continue;
    job.pending_deadline =
        job.pending_since + absl::Milliseconds(job.job.spec().rendezvous_timeout_ms());
    pending_deadlines_.emplace(job.pending_deadline, id);
  }
  last_absence_ = gap;
  // Sessions that broke during the absence (their keepalives went unanswered) are heard of
  // within moments of its end; losses until then are the coordinator's doing.
  away_grace_until_ = now + absl::Seconds(2);
}

bool Core::CoordinatorWasAway(absl::Time now) const { return now < away_grace_until_; }

void Core::Tick(absl::Time now, Decisions* out) {
  ObserveTime(now);
  // Heartbeat silence: the job's own timeout applies to its members (looked up once per run
  // of workers of the same job, not once per worker).
  std::string timeout_job;  // a copy: a loss below may re-assign the workers after this one
  absl::Duration job_timeout;
  for (auto& [id, w] : workers_) {
    if (w.state == WorkerState::kLost) continue;
    absl::Duration timeout = options_.heartbeat_timeout;
    if (w.state == WorkerState::kBusy) {
      if (timeout_job.empty() || timeout_job != w.job_id) {
        const JobRecord* job = FindJob(w.job_id);
        job_timeout = job && job->job.spec().heartbeat_timeout_ms() > 0
                          ? absl::Milliseconds(job->job.spec().heartbeat_timeout_ms())
                          : options_.heartbeat_timeout;
        timeout_job = w.job_id;
      }
      timeout = job_timeout;
    }
    if (now - w.last_heartbeat > timeout) {
      MarkWorkerLost(w,
                     absl::StrCat("worker ", w.info.name(), " (", id, ") lost: no heartbeat for ",
                                  Seconds1(now - w.last_heartbeat)),
                     now, out);
    }
  }
  // Running and re-forming jobs (a copy: a job that ends here leaves active_).
  const std::vector<JobKey> active(active_.begin(), active_.end());
  for (const auto& [seq, id] : active) {
    JobRecord& job = jobs_.at(id);
    if (IsTerminal(job.job.state())) continue;
    const v1::JobSpec& spec = job.job.spec();
    if (spec.max_wall_time_ms() > 0 && job.started != absl::InfinitePast() &&
        now - job.started > absl::Milliseconds(spec.max_wall_time_ms()) && !job.finishing &&
        !AtLastStep(job)) {
      FinishJob(
          job, v1::JOB_STATE_FAILED,
          absl::StrCat("ran for ", Seconds1(now - job.started), ", past its max_wall_time_ms ",
                       spec.max_wall_time_ms(), " (at step ", job.job.step(), ")"),
          now, out);
      continue;
    }
    if (job.job.state() == v1::JOB_STATE_RUNNING) {
      const absl::Duration step_timeout = absl::Milliseconds(spec.step_timeout_ms());
      // After the last step no step is left to complete: the evaluation, the sample and the
      // export take what they take (a hung member is found by its heartbeats, a dead one by
      // its peers' collective errors).
      // A program's steps are known only once it reports them (lockstep.torch.report): its
      // timer runs from its first report of the generation.
      const bool timed = !spec.has_program() || job.first_report_of_generation_seen;
      if (timed && now - job.last_advance > step_timeout && !job.finishing && !AtLastStep(job)) {
        // Nobody is known to be at fault (members still heartbeat): abort and re-form the
        // group, which max_restarts bounds like any other recovery.
        HandleMemberLoss(job, /*worker_id=*/"",
                         absl::StrCat("no step completed for ", Seconds1(now - job.last_advance),
                                      " (step_timeout_ms ", spec.step_timeout_ms(), ") at step ",
                                      job.job.step()),
                         /*fatal=*/false, now, out);
      }
    } else if (job.job.state() == v1::JOB_STATE_RECONFIGURING && spec.rendezvous_timeout_ms() > 0 &&
               now - job.reconfigure_since > absl::Milliseconds(spec.rendezvous_timeout_ms())) {
      FinishJob(job, v1::JOB_STATE_FAILED,
                absl::StrCat("waited ", Seconds1(now - job.reconfigure_since), " to re-form with ",
                             spec.min_workers(), " workers (rendezvous_timeout_ms ",
                             spec.rendezvous_timeout_ms(), "); ", job.job.reason()),
                now, out);
    }
  }
  // Queued jobs whose rendezvous_timeout passed: only those, in deadline order.
  while (!pending_deadlines_.empty() && pending_deadlines_.begin()->first < now) {
    JobRecord& job = jobs_.at(pending_deadlines_.begin()->second);
    const v1::JobSpec& spec = job.job.spec();
    FinishJob(job, v1::JOB_STATE_FAILED,
              absl::StrCat("waited ", Seconds1(now - job.pending_since), " for ",
                           spec.min_workers(), " workers (rendezvous_timeout_ms ",
                           spec.rendezvous_timeout_ms(), "); ", View(job).reason()),
              now, out);
  }
  PruneLostWorkers();
  AgeQueue(now);
  Schedule(now, out);
}

}  // namespace lockstep::coordinator
